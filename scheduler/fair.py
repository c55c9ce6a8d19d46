"""``fair``: quotas with borrowing and reclaim, fair share among borrowers, priorities.

Each round takes the pending calls in fair-share order
(:func:`~scheduler.fairshare.fair_buckets`; from the replay's :class:`~scheduler.queue.Queue`
as it keeps them, split by class of service, without a pass over every call):

0a. Promised rooms: a call the last round preempted others for (reclaim, a swap) starts on
   the nodes freed for it if they have room now, before anything else (unless another
   call's reservation holds them); step 0b deals with the others.
0. Starvation guard (``starve_after_s``, twelve hours by default): per group, the
   *whole-node* call (as many GPUs as the largest node that may take it, or more) that has
   waited longest past the bound and that it may serve (within its ceiling, a model left
   to it), or the one reserved for last round: it keeps its turn;
   these, the reserved ones first then oldest first, each start now if they fit, else
   reclaim room (if within their guarantee), else get a reservation: the earliest room by
   the running calls' expected ends (:mod:`scheduler.backfill`) on nodes no earlier call
   holds; at the first that can get none, the guard stops, so no call is promised room an
   earlier one will take. Starved whole-node
   calls (those it serves, and those running after a wait past the bound) hold about their
   share of the cluster: the share their GPUs make of all GPUs asked for or held by calls that
   waited past the bound. On a cluster that keeps up few other calls wait that long and the
   guard gives them what they need; on an overloaded one, where every call waits that long,
   they take the cluster in proportion to what they ask for, not all of it. Once the share
   is spent (the last call let in may overrun it, else a call bigger than its share would
   never get in), a call waits in fair order (and so do younger ones, as above), except one the
   previous round reserved for (``Snapshot.reserved``): it keeps its reservation. Every
   later call, guaranteed or borrowing, may use reserved GPUs only if it ends before the
   reservation is due. A guaranteed call kept out only by a reservation waits for it
   instead of reclaiming elsewhere, and borrowers may no longer backfill into that one. A
   whole-node call that waited past the bound is never swapped out (steps 3 and 4) once it
   starts, and a gang on whole nodes is never reclaimed either; a whole-node call on one
   node may be reclaimed if it borrows (since session 20: on an overloaded cluster every
   whole-node call waits past the bound, and keeping them all from reclaim left much of
   the cluster out of reach of guarantees), and a smaller call that waited as long may be
   swapped out too (every call waits past the bound there). Without the guard,
   borrowers that need less than a node take every GPU that frees up and a whole-node call
   can wait for days.
1. Guaranteed: calls that keep their group within its guarantee start if they fit; one that
   does not fit reclaims borrowed GPUs from other groups (:mod:`scheduler.reclaim`): the plan
   preempts just enough calls, holds the room back from this round's borrowers, and the call
   starts in a later round once its victims have exited.
2. Borrowers: the other calls start on idle GPUs, up to their group's ceiling, in the same
   order (so the group that used least of its share lately goes first), placed ``borrowed``.
3. Least attained service (``las_thresholds``, Tiresias's 2D-LAS; on by default): a call's
   class is how many thresholds the GPU-seconds it received have passed; lower classes go
   first inside each user's calls and among borrowers (inside a class, a user's calls
   expected to end sooner first: ``shortest_first``), and a call still waiting may take the
   place of running calls of a strictly higher class that have run ``min_run_s``: its own
   group's, or other groups' borrowed ones while those hold more than their guarantee. The
   room is promised to it (``Plan.promised``): the next round places it first (step 0b). A
   call on whole nodes gives way to smaller calls once at most (``shelter_whole_nodes``):
   after it was sent back to the queue, only a call of its nodes' size may take its place,
   for each time it goes back it waits for whole nodes again (without the shelter, 8-GPU
   calls on the Philly trace waited longer than under FIFO).
4. Fair share among borrowers (``share_preemption``, Kueue's fair sharing; on by default):
   a group's weighted borrowing is the GPUs it holds past its guarantee over its weight (the
   guarantee plus one). A call still waiting that would borrow may take the place of other
   groups' borrowed calls (chosen as in step 3) while each of those groups, once they are
   gone, still borrows ``share_margin`` more for its weight than the call's group will with
   it; step 3 never leaves the asking group borrowing more than the margin above a victim's
   group. Neither step can then undo a swap of the other (least attained service unchecked
   and this step with no margin chased each other on the Philly replay: 497,331
   preemptions in its first 8,000 jobs instead of 2,119). Without it a small group that
   started big calls on an idle cluster kept them while others queued (six times its due).

How long a call has waited counts from when it last entered the queue
(:attr:`~scheduler.model.Pending.waiting_since`): a call preempted or requeued starts a new
wait, so reclaim's victims do not take the room straight back.

Groups without a configured quota get ``default_quota`` (nothing guaranteed, no ceiling), so
with no quotas at all the policy is fair share over first-fit backfill. A group's quotas per
GPU model (:mod:`scheduler.quotas`) keep each call to the models its group may still take
(within their guarantees, in step 1), and mark GPUs above a model's guarantee borrowed.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from scheduler import placement
from scheduler.backfill import Horizon, Release, Reservation, releases, reserve
from scheduler.capacity import Capacity
from scheduler.fairshare import bucket_rank, fair_buckets
from scheduler.model import (
    DEFAULT_QUOTA,
    EPSILON,
    Decision,
    NodeCapacity,
    Part,
    Pending,
    Plan,
    Preemption,
    Quota,
    Running,
    Snapshot,
    service_class,
)
from scheduler.queue import Queue, expected
from scheduler.quotas import Book, Released
from scheduler.reasons import Why, ahead, note, shortfall, starting
from scheduler.reclaim import Reclaim, Reclaimer, WholeSizes, starved_whole
from scheduler.victims import Victims

#: A whole-node call that has waited this long gets a reservation (fair's default).
DEFAULT_STARVE_AFTER_S = 43_200.0
#: Tiresias's two thresholds, in GPU-seconds of service received: three classes.
DEFAULT_LAS_THRESHOLDS = (3_600.0, 36_000.0)


@dataclass
class Fair:
    """Quotas with borrowing and reclaim; ``reclaim=False`` only borrows.

    ``max_reclaims`` bounds the calls one round reclaims room for (Kueue likewise preempts for
    one head per queue per cycle): a burst of returning demand is worked off over a few rounds
    instead of one long one, and the plan says so (:attr:`scheduler.model.Plan.more`).
    ``starve_after_s`` is the wait after which a whole-node call gets a reservation (None:
    never). On the Philly trace at 88 x 8 GPUs a one-hour bound, without least attained
    service, cut the average wait of multi-node calls from 32,420 s to 5,077 s (FIFO:
    9,096 s) and of 8-GPU calls from 5,005 s to 3,862 s (FIFO: 7,734 s). With least
    attained service an hour's bound undid its gains (2,923 s average queueing against
    1,130 s with 12 hours, the default; docs/benchmarks.md). ``las_thresholds`` (GPU-seconds,
    ascending; () turns least attained service off) and ``min_run_s`` shape step 3."""

    default_quota: Quota = DEFAULT_QUOTA
    reclaim: bool = True
    max_reclaims: int | None = 128
    starve_after_s: float | None = DEFAULT_STARVE_AFTER_S
    name: str = "fair"
    uses_quotas: bool = True
    preempts: ClassVar[bool] = True  # (what the policy does, not a setting)
    #: Least attained service (Tiresias's 2D-LAS): thresholds in GPU-seconds of service a
    #: call received; () turns it off.
    las_thresholds: tuple[float, ...] = DEFAULT_LAS_THRESHOLDS
    #: A call runs at least this long before the LAS step may preempt it.
    min_run_s: float = 0.0
    #: A call on whole nodes that was sent back to the queue before (preempted, or its node
    #: lost) gives way under least attained service only to calls as big as its nodes.
    shelter_whole_nodes: bool = True
    #: Step 4, fair share among borrowers (Kueue's fair sharing): a waiting call of a group
    #: that borrows less for its weight may take the place of another group's borrowed calls.
    share_preemption: bool = True
    #: How much more a group must borrow for its weight (GPUs past its guarantee per unit of
    #: weight, the guarantee plus one) than the asking call's group, once the swap is done,
    #: for step 4 to take its calls; least attained service never leaves the asking group
    #: borrowing more than this above the other (so neither step undoes the other).
    share_margin: float = 8.0
    #: Inside each (priority, group, user)'s calls of one class of service, those expected
    #: to end sooner (``Pending.expected_s``: a time limit or expected duration) go first;
    #: a user's order among their own calls only, so claiming short durations takes nothing
    #: from anyone else. Calls without one keep queue order, after those with one.
    shortest_first: bool = True

    def plan(self, snapshot: Snapshot, why: Why | None = None) -> Plan:
        return _Round(self, snapshot, why).run()


class _Round:
    """One plan of the fair policy: the working state its three steps share."""

    def __init__(self, policy: Fair, snapshot: Snapshot, why: Why | None) -> None:
        self.policy = policy
        self.snapshot = snapshot
        self.why = why
        self.cap = Capacity(snapshot.nodes, snapshot.share_across_users)
        self.book = Book(snapshot.running, snapshot.quotas, policy.default_quota, snapshot.nodes,
                         snapshot.held)  # fmt: skip
        #: The (priority, group, user) buckets in fair-share order, each as its calls per
        #: class of service received, lowest first, each class in queue order.
        self.tiers: list[list[list[Pending]]] = []
        #: The group of each bucket, and its priority.
        self.groups: list[str] = []
        self.priorities: list[int] = []
        self.split(snapshot.pending)
        #: Whether some pending call has received service (else every class is the first).
        self.served = any(tier for tiers in self.tiers for tier in tiers[1:])
        self.pos: dict[str, int] = {}
        if why is not None:
            self.pos = {c.id: i for i, c in enumerate(self.fair_order(), 1)}
        self.out = Plan()
        self.done: set[str] = set()  # calls this round has dealt with
        #: This round's reservations that still have free GPUs (the others admit nothing: a
        #: reserved node's free GPUs only go down as the round goes on).
        self.held: list[Reservation] = []
        #: Calls started this round, with their expected ends (the guard's later
        #: reservations count them as running).
        self.placed: list[tuple[tuple[Part, ...], float]] = []
        #: The nodes' sizes that make a call a whole-node call (one for the round's steps).
        self.whole_sizes = WholeSizes(snapshot.nodes)
        self.reclaimer = Reclaimer(
            self.snapshot, self.cap, self.book, policy.starve_after_s, self.whole_sizes
        )
        self.reclaims = 0
        self.stuck: set[tuple[str, int, str | None, int]] = set()  # reclaim found nothing
        #: Reservations a guaranteed call waits on: borrowers may not backfill into them (a
        #: borrower reclaim just sent back would take the room again, and be reclaimed again).
        self.claimed: set[str] = set()
        #: Calls this round's swaps preempted (a gang's other nodes stay in other indexes).
        self.swapped_out: set[str] = set()
        #: Kinds of call (group, GPUs, model, memory) that found no room outside reservations.
        self.full: set[tuple[str, int, str | None, int]] = set()

    def run(self) -> Plan:
        if self.snapshot.promised:
            self.promised_rooms()
        if self.policy.starve_after_s is not None:
            self.guard(self.policy.starve_after_s)
        if self.snapshot.promised:
            self.promises()
        self.guaranteed()
        self.borrowers()
        if self.policy.las_thresholds:
            self.swaps()
        if self.policy.share_preemption:
            self.rebalance()
        return self.out

    def promised_rooms(self) -> None:
        """Step 0a: a call the last round preempted others for (a swap, or reclaim) that is
        within its group's guarantee starts on the very nodes freed for it, before anything
        else is placed, if they have room for it now (nodes another call's reservation holds
        aside: that call keeps them); else the guard's reserved calls, placed first, could
        take the room just freed for it, and it reclaimed again. A borrower waits for the
        guard's calls (step 0b). Nodes still being freed for a promised call are withdrawn
        here, before the guard, which would otherwise reserve them for another call."""
        reserved = {n for nodes in self.snapshot.reserved_on.values() for n in nodes}
        leaving = self.leaving
        pending = self.snapshot.pending
        if isinstance(pending, Queue):  # (the promised calls alone, in queue order)
            pending = pending.among(self.snapshot.promised)
        for call in pending:
            nodes = self.snapshot.promised.get(call.id)
            if not nodes or call.id in self.done:
                continue
            kept = self.keep(call)
            if (
                call.share == 1.0  # (a share goes on a shared GPU: step 0b places it)
                and self.book.nominal(call)  # (a borrower waits for the guard's calls)
                and not reserved.intersection(nodes)
                and kept is not None
            ):
                parts = self.place_on(kept, nodes, self.book.limit(call, kept))
                if parts is not None:
                    self.start(call, parts)
                    continue
            # Nodes its victims are still leaving stay its own, from the guard too (which
            # would otherwise reserve them for another call); step 0b does the rest.
            still = [n for n in nodes if n in leaving]
            self.reclaimer.reserved.update(still)
            for node_id in still:
                self.cap.withdraw(node_id)

    def promises(self) -> None:
        """Step 0b: the calls the last round preempted others for start first, on any room;
        one that does not fit yet keeps its promise (and its nodes, withdrawn from everyone
        else this round, reclaim included) while calls are still leaving there."""
        promised, leaving = self.snapshot.promised, self.leaving
        pending = self.snapshot.pending
        if isinstance(pending, Queue):  # (the promised calls alone, in queue order)
            pending = pending.among(promised)
        for call in pending:
            nodes = promised.get(call.id)
            if nodes is None or call.id in self.done:
                continue
            kept = self.keep(call)
            if kept is not None and self.book.within_ceiling(call):
                parts = self.place(call, kept)
                if parts is not None:
                    self.start(call, parts)
                    continue
            still = tuple(n for n in nodes if n in leaving)
            if still:
                self.done.add(call.id)
                self.out.promised[call.id] = still
                self.reclaimer.reserved.update(still)
                for node_id in still:
                    self.cap.withdraw(node_id)

    def split(self, pending: Sequence[Pending]) -> None:
        """Fill :attr:`tiers` and :attr:`groups`: from the replay's queue as it keeps them
        (no pass over every call), or from the calls as read."""
        snapshot, policy, thresholds = self.snapshot, self.policy, self.policy.las_thresholds
        if (
            isinstance(pending, Queue)
            and pending.tiers
            and pending.thresholds == thresholds
            and pending.shortest_first == policy.shortest_first
        ):
            rank = bucket_rank(
                snapshot.usage, snapshot.user_usage, snapshot.quotas, policy.default_quota
            )
            tiered = pending.buckets()
            keys = sorted(tiered, key=rank)
            self.tiers = [tiered[key] for key in keys]
            self.groups = [key[1] for key in keys]
            self.priorities = [key[0] for key in keys]
            return
        buckets = fair_buckets(
            pending, snapshot.usage, snapshot.user_usage, snapshot.quotas, policy.default_quota
        )
        self.groups = [bucket[0].group for bucket in buckets]
        self.priorities = [bucket[0].priority for bucket in buckets]
        first = policy.shortest_first
        if not thresholds or not any(c.attained_gpu_s >= thresholds[0] for c in pending):
            self.tiers = [[_shortest_first(b) if first else b] for b in buckets]
            return
        klass = self.klass
        for bucket in buckets:
            tiers: list[list[Pending]] = [[] for _ in range(len(thresholds) + 1)]
            for call in bucket:
                tiers[klass(call)].append(call)
            self.tiers.append([_shortest_first(t) for t in tiers] if first else tiers)

    def fair_order(self) -> Iterator[Pending]:
        """Every pending call: the buckets in fair-share order, each by class (lowest first)
        then in queue order."""
        return itertools.chain.from_iterable(itertools.chain.from_iterable(self.tiers))

    def class_order(self) -> Iterator[Pending]:
        """Every pending call by priority, then class (lowest first), then fair order."""
        if not self.served:
            return self.fair_order()
        levels: list[list[list[list[Pending]]]] = []  # buckets of one priority, in order
        last = None
        for priority, tiers in zip(self.priorities, self.tiers, strict=True):
            if priority != last:
                levels.append([])
                last = priority
            levels[-1].append(tiers)
        depth = len(self.policy.las_thresholds) + 1
        return (
            call
            for level in levels
            for t in range(depth)
            for tiers in level
            if t < len(tiers)
            for call in tiers[t]
        )

    @functools.cached_property
    def by_id(self) -> dict[int, NodeCapacity]:
        return {n.node_id: n for n in self.snapshot.nodes}

    @functools.cached_property
    def fits(self) -> placement.Fits:
        """The nodes that may ever hold each kind of call (shared by the round's swaps)."""
        return placement.fits_of(self.snapshot.nodes)

    @functools.cached_property
    def leaving(self) -> set[int]:
        """Nodes that calls told to stop are still leaving."""
        return {part.node_id for run in self.snapshot.running if run.preempting
                for part in run.parts}  # fmt: skip

    @functools.cached_property
    def tiers_by_group(self) -> dict[str, list[list[list[Pending]]]]:
        """Each group's buckets (their calls per class), in fair order."""
        out: dict[str, list[list[list[Pending]]]] = {}
        for group, tiers in zip(self.groups, self.tiers, strict=True):
            out.setdefault(group, []).append(tiers)
        return out

    def group_calls(self, group: str) -> Iterator[tuple[int, Pending]]:
        """A group's pending calls with their class, by class (lowest first), in fair order
        inside a class; made as they are asked for."""
        buckets = self.tiers_by_group[group]
        depth = max(len(tiers) for tiers in buckets)
        return (
            (k, call)
            for k in range(depth)
            for tiers in buckets
            if k < len(tiers)
            for call in tiers[k]
        )

    def klass(self, call: Pending) -> int:
        return service_class(self.policy.las_thresholds, call.attained_gpu_s)

    def swaps(self) -> None:
        """Step 3, least attained service (Tiresias's 2D-LAS): a call still waiting may take
        the place of running calls of a higher class (more GPU-seconds of service received,
        by ``las_thresholds``) that have run ``min_run_s`` at least (and did not start in this
        very instant) and are not the guard's (:func:`~scheduler.reclaim.starved_whole`): calls of
        its own group (the group holds what it held), and borrowed calls of other groups that
        leave those groups at least their guarantee; with ``shelter_whole_nodes``, not a call
        on whole nodes that ran before, unless the asking call is as big as its nodes. Lower
        classes ask first, each group's calls in fair order; the room is promised to the call
        (:attr:`Plan.promised`) and withdrawn from this round."""
        policy, now, book = self.policy, self.snapshot.now, self.book
        thresholds, after, min_run = policy.las_thresholds, policy.starve_after_s, policy.min_run_s
        fair_share, margin = policy.share_preemption, policy.share_margin
        limit = policy.max_reclaims  # (swaps share reclaim's bound per round)
        if limit is not None and self.reclaims >= limit:
            return
        done = self.done

        def waits(call: Pending) -> bool:
            return call.id not in done and call.share == 1.0 and call.gpus > 0

        # Per group: the class of its first call still waiting in fair order (groups ask in
        # that class's order, then in fair order).
        first: dict[str, int] = {}
        least = len(thresholds)
        for group, tiers in zip(self.groups, self.tiers, strict=True):
            for k, tier in enumerate(tiers):
                if any(map(waits, tier)):
                    first.setdefault(group, k)
                    least = min(least, k)
                    break
        if least >= len(thresholds):
            return  # nobody waits in a class that may preempt
        bar = thresholds[least]  # (a run of a higher class received this much at least)
        chosen = self.reclaimer.chosen
        ranks: dict[str, int] = {}
        #: Runs on whole nodes that ran before, with the GPUs of their largest node: only a
        #: call of that many GPUs or more may take them.
        sheltered: dict[str, int] = {}
        mine: dict[str, list[Running]] = {}  # per group: its calls that may give way
        lent: list[Running] = []  # borrowed calls of groups above their guarantee
        for run in self.snapshot.running:
            if run.share != 1.0 or not run.preemptible or run.id in chosen:
                continue
            if not run.preempting:
                # (run.attained, run.gpus, starved and service_class inlined, the cheapest
                # tests first: this runs per running call per round)
                ran = now - run.start_time
                if ran < min_run or ran <= 0:
                    continue
                gpus = len(run.gpu_indices) if not run.more else run.gpus
                got = run.attained_gpu_s + gpus * ran
                if got < bar:
                    continue
                queued = run.queued_time
                if (
                    after is not None
                    and queued is not None
                    and run.start_time - queued >= after
                    and starved_whole(run, after, self.by_id, self.whole_sizes)
                ):
                    continue
                ranks[run.id] = bisect.bisect_right(thresholds, got)
                if policy.shelter_whole_nodes and run.attained_gpu_s > 0:
                    size = run.whole_size(self.by_id)
                    if size:
                        sheltered[run.id] = size
                if run.borrowed and book.borrowing(run.group):
                    lent.append(run)
            mine.setdefault(run.group, []).append(run)  # (its own stopping: GPUs coming back)
        if not ranks:
            return
        # The worst class each group's calls could take: its own runs', and other groups'
        # borrowed runs' (a group whose first waiting call is of that class or worse can
        # take nothing: its victims would be spent at once).
        own = {g: max((ranks.get(r.id, 0) for r in runs), default=0) for g, runs in mine.items()}
        lenders: dict[str, int] = {}
        for run in lent:
            lenders[run.group] = max(lenders.get(run.group, 0), ranks[run.id])
        fits = self.fits
        for group, k0 in sorted(first.items(), key=lambda gk: gk[1]):
            others = max((r for g, r in lenders.items() if g != group), default=0)
            if k0 >= max(own.get(group, 0), others):
                continue  # (nothing of a higher class it may take)
            calls = ((k, call) for k, call in self.group_calls(group) if waits(call))

            # The call asking now: whether it may take other groups' calls (it is not at its
            # ceiling), its priority (it never takes the place of a higher one), and its GPUs
            # (it may take sheltered runs on nodes no bigger than that).
            asking: list[float] = [1.0, 0.0, 0.0]

            def may(
                run: Running, taken: Released, group: str = group, a: list[float] = asking
            ) -> bool:
                if run.priority > a[1] or run.id in self.swapped_out:
                    return False
                if sheltered.get(run.id, 0) > a[2]:
                    return False
                if run.group == group:
                    return True
                if not (a[0] and run.borrowed and book.reclaimable(run, taken, keep=True)):
                    return False
                # (with step 4, never leave the other group borrowing less for its weight
                # than this one: step 4 would take the room straight back)
                return not fair_share or book.lent(group, a[2]) <= margin + book.lent(
                    run.group, -taken.get(run.group, 0) - run.amount
                )

            def count(taken: Released, run: Running, group: str = group) -> None:
                if run.group != group:
                    book.count_release(taken, run)

            runs = mine.get(group, []) + [
                r for r in lent if r.group != group and r.id not in self.swapped_out
            ]
            victims = Victims(
                self.snapshot.nodes, runs, lambda r: ranks.get(r.id, 0), may, count, 16, fits
            )
            # (what a call may take depends on its priority and, with sheltered runs, its
            # size: a failure is remembered only for calls that may take no more)
            top = max((r.priority for r in runs), default=0)
            sizes = sorted({sheltered[r.id] for r in runs if r.id in sheltered})
            # Kinds of call (class, GPUs, model, memory, priority) that got nothing since the
            # last swap: another call of the kind would get nothing either.
            tried: set[tuple[int, int, str | None, int, int]] = set()
            for k, call in calls:
                if limit is not None and self.reclaims >= limit:
                    return  # (the next round goes on)
                if victims.spent(k):
                    break
                kind = (k, call.gpus, call.gpu_model, call.min_memory_mib, call.priority)
                if kind in tried:
                    continue
                tried.add(kind)
                kept = self.keep(call)
                if kept is None:
                    continue
                # At its ceiling, a call may still take the place of its group's own calls
                # (GPUs for GPUs: the group holds no more than before).
                inside = book.within_ceiling(call)
                if call.gpus > self.cap.largest_for(call) and (
                    not inside or book.quota(group).ceiling != math.inf
                ):
                    continue  # (a gang takes whole nodes: not past a ceiling, swapped or not)
                asking[:] = [float(inside), float(call.priority), float(call.gpus)]
                level = bisect.bisect_right(sizes, call.gpus)
                widest = call.priority >= top and level == len(sizes) and bool(inside)
                gone = victims.free_for(
                    kept, k, self.cap, not inside, (call.priority, level, inside), widest
                )
                if not gone:
                    continue
                tried.clear()
                held = book.used[group]
                self.swapped(call, kept, gone, victims.freed)
                if fair_share and book.used[group] < held:
                    # (the group now borrows less: step 4's margin lets more through, so
                    # what failed before may not fail now)
                    victims.failed.clear()
                    victims.exhausted = False

    def rebalance(self) -> None:
        """Step 4, fair share among borrowers (Kueue's fair sharing, its "less than or equal
        to the final share" rule): a call still waiting that would borrow (past its group's
        guarantee in all, or of each model it may use) may take the place of other groups'
        borrowed calls while each of those groups, once its calls are gone,
        still borrows at least as much for its weight (:meth:`Book.lent`) as the call's group will
        with the call: so the swap could never be swapped straight back, and a group never
        goes below its guarantee (in all, and of each model) for it. Without it a small group
        that started big calls on an idle cluster keeps them while others wait: on the
        Philly trace one group held six times its due. The victims are as in step 3 (not
        the guard's, run ``min_run_s``, not started in this very instant, a whole node given
        up to smaller calls at most once), youngest first; groups ask least borrowing
        first, each in its own fair order; single-node calls only (the guard serves
        whole-node ones)."""
        policy, now, book, cap = self.policy, self.snapshot.now, self.book, self.cap
        limit, after, min_run = policy.max_reclaims, policy.starve_after_s, policy.min_run_s
        if limit is not None and self.reclaims >= limit:
            return
        margin = policy.share_margin
        most = max((book.lent(g) for g in list(book.used) if book.borrowing(g)), default=None)
        if most is None or min(map(book.lent, self.groups), default=most) >= most - margin:
            return  # (no waiting group borrows the margin less than one that borrows: no pass)
        chosen, done = self.reclaimer.chosen, self.done
        lent: list[Running] = []
        sheltered: dict[str, int] = {}
        for run in self.snapshot.running:
            if run.share != 1.0 or not run.preemptible or run.preempting or not run.borrowed:
                continue
            if run.id in chosen or run.id in self.swapped_out:
                continue
            ran = now - run.start_time
            if ran < min_run or ran <= 0 or not book.borrowing(run.group):
                continue
            if starved_whole(run, after, self.by_id, self.whole_sizes):
                continue
            if policy.shelter_whole_nodes and run.attained_gpu_s > 0:
                size = run.whole_size(self.by_id)
                if size:
                    sheltered[run.id] = size
            lent.append(run)
        if not lent:
            return
        top = max(book.lent(group) for group in {run.group for run in lent}) - margin
        for group in sorted(self.tiers_by_group, key=book.lent):
            if book.lent(group) >= top:
                break  # (nobody borrows more for its weight than this group already does)
            # (the group's weighted borrowing with the call, its GPUs, its priority)
            asking = [0.0, 0.0, 0.0]

            def may(
                run: Running, taken: Released, group: str = group, a: list[float] = asking
            ) -> bool:
                if run.group == group or run.id in self.swapped_out or run.priority > a[2]:
                    return False
                if sheltered.get(run.id, 0) > a[1]:
                    return False
                left = book.lent(run.group, -taken.get(run.group, 0) - run.amount)
                return left >= a[0] + margin and book.reclaimable(run, taken, keep=True)

            runs = [r for r in lent if r.group != group and r.id not in self.swapped_out]
            victims = Victims(
                self.snapshot.nodes, runs, lambda r: 1, may, book.count_release, 16, self.fits
            )
            # (what a call may take depends on its priority and, with sheltered runs, its
            # size: a failure is remembered only for calls that may take no more)
            top_priority = max((r.priority for r in runs), default=0)
            sizes = sorted({sheltered[r.id] for r in runs if r.id in sheltered})
            for _, call in self.group_calls(group):  # (by class, as in step 3)
                if limit is not None and self.reclaims >= limit:
                    return
                if victims.spent(0):
                    break
                if call.id in done or call.share != 1.0 or call.gpus <= 0:
                    continue
                if not book.within_ceiling(call):
                    continue  # (past its ceiling: no)
                nominal = book.nominal(call)
                if nominal and self.keep(call, nominal=True) is not None:
                    continue  # (within its guarantee, of a model it may use too: reclaim's)
                mine = book.lent(group, call.amount)
                if nominal:  # (it borrows a model only: weighed by what it borrows of that
                    # model, else it would pass for the least borrowing group and take
                    # nearly all of the model from a group without a guarantee)
                    mine = max(mine, book.model_lent(call, call.amount))
                if mine >= top:
                    continue
                kept = self.keep(call)
                if kept is None or call.gpus > cap.largest_for(call):
                    continue
                asking[:] = [mine, float(call.gpus), float(call.priority)]
                level = bisect.bisect_right(sizes, call.gpus)
                widest = call.priority >= top_priority and level == len(sizes)
                gone = victims.free_for(kept, 0, cap, False, (call.priority, level), widest)
                if gone:
                    self.swapped(call, kept, gone, victims.freed, sharing=True)

    def swapped(
        self,
        call: Pending,
        kept: Pending,
        gone: list[Running],
        nodes: list[int],
        sharing: bool = False,
    ) -> None:
        """Book a swap (least attained service's, or ``sharing``: fair share among
        borrowers'): the victims' GPUs leave their groups, the room they free is the call's
        (charged to its group now, so that its ceiling holds this round)."""
        book, group = self.book, call.group
        self.done.add(call.id)
        self.reclaims += 1
        self.swapped_out.update(v.id for v in gone)
        nodes = sorted(nodes)
        self.out.promised[call.id] = tuple(nodes)
        for run in gone:
            book.add(run.group, run.parts, sign=-1, share=run.share)
        whole = call.gpus > self.cap.largest_for(call)
        book.add(group, self.promised(kept, nodes, whole), share=kept.share)
        if sharing:
            reason = (
                f"preempted for call {call.id} of group {group}: its group borrowed more GPUs "
                "for its weight (fair share among borrowers)"
            )
        else:
            reason = (
                f"preempted for call {call.id} of group {group}, which received less service "
                f"(least attained service first)"
            )
        self.out.preemptions.extend(Preemption(v.id, reason) for v in gone)
        how = _sharing if sharing else _swapping
        note(self.why, call, self.pos.get(call.id, 0), how, nodes, len(gone))

    def note(self, call: Pending, reason: str) -> None:
        """Record a reason already worded (only done when explaining)."""
        note(self.why, call, self.pos.get(call.id, 0), str, reason)

    def place(
        self, call: Pending, kept: Pending, borrower: bool = False
    ) -> tuple[Part, ...] | None:
        """Room for the call now, ``kept`` to the models :meth:`keep` left it: outside any
        reservation, or inside one if it cannot delay it (for a ``borrower``, not one a
        guaranteed call waits on); never more GPUs than its group may still take (a gang's
        whole nodes may hold more than it asks for), nor more of a model than its quota for
        that model allows."""
        room = self.book.limit(call, kept)
        call = kept
        key = (call.group, call.gpus, call.gpu_model, call.min_memory_mib)
        parts = None
        if call.share != 1.0:  # (a share may find room on a GPU another share just opened)
            parts = self.cap.place(call, room)
        elif key not in self.full:  # free GPUs and a group's room only shrink in a round
            parts = self.cap.place(call, room)
            if parts is None:
                self.full.add(key)
        if parts is None and self.held:
            for held in self.held:
                if borrower and held.call_id in self.claimed:
                    continue
                choice = held.admit(call, self.cap, self.snapshot.now)
                if choice is not None:
                    if not held.open(self.cap):
                        self.held.remove(held)
                    return (Part(choice[0].node.node_id, choice[1]),)
        return parts

    def keep(self, call: Pending, nominal: bool = False) -> Pending | None:
        """The call kept to the models its group may still take (:meth:`Book.restrict`);
        None if none, or if those are too few on any one node for a call that would fit one
        node otherwise (it must not become a gang on whole nodes)."""
        kept = self.book.restrict(call, nominal)
        if kept is None or kept is call:
            return kept
        if kept.gpus > self.cap.largest_for(kept) and call.gpus <= self.cap.largest_for(call):
            return None
        return kept

    def start(self, call: Pending, parts: tuple[Part, ...]) -> None:
        borrowed = self.book.take(call.group, parts, call.share)
        self.out.append(Decision.of(call.id, parts, borrowed))
        self.done.add(call.id)
        end = math.inf if call.expected_s is None else self.snapshot.now + call.expected_s
        self.placed.append((parts, end))
        if self.why is not None:
            self.note(call, starting(parts, " (borrowed)" if borrowed else ""))

    def starving(self, after_s: float) -> tuple[list[Pending], float]:
        """The whole-node calls (as many GPUs as the largest node that may take them, or
        more) that have waited ``after_s`` or longer, oldest first (higher priority first),
        and the GPUs asked by every call, whole-node or not, that has waited that long."""
        cap, largest, since = self.cap, self.cap.largest, self.snapshot.now - after_s
        pending = self.snapshot.pending
        if isinstance(pending, Queue) and pending.kinds:  # (it keeps count: no pass over all)
            waited = pending.waited(since)
            if waited is not None:  # (oldest first, in queue order among equals, as a pass
                # over the queue sorted by age finds them; whether a kind is whole-node is
                # asked once per kind)
                calls = pending.waiting_large(
                    since, largest, lambda c: bool(c.gpus) and c.gpus >= cap.largest_for(c) > 0
                )
                return [call for call in calls if call.id not in self.done], waited
        found, whole, parts = [], 0, []
        for call in pending:  # (waiting_since inlined: this loop is hot)
            queued = call.queued_time
            if (call.submit_time if queued is None else queued) > since:
                continue
            gpus = call.gpus
            if call.share != 1.0:
                parts.append(call.share)
                continue  # part of a GPU: never a whole-node call
            whole += gpus
            if gpus < largest and call.gpu_model is None and not call.min_memory_mib:
                continue  # the common case first: an unconstrained call smaller than a node
            if gpus and gpus >= cap.largest_for(call) > 0 and call.id not in self.done:
                found.append(call)  # (largest_for 0: no node may take it)
        # (shares summed exactly, in any order: the queue's count gives the same figure)
        return sorted(found, key=_age_key), whole + math.fsum(parts)

    def guard(self, after_s: float) -> None:
        """Step 0: the oldest starving whole-node call of each group, oldest first, starts
        now, reclaims room (within its guarantee) or gets a reservation, before anything
        else is placed, until one can be given none (younger ones then wait their turn, so
        that none is promised room an older one will take); later calls of every group,
        guaranteed or not, may use reserved GPUs only if they end before the reservation is
        due (backfill). A group's other starving calls wait for its first to start; a call
        reserved for last round goes before the others (its promise holds)."""
        rel: tuple[int, dict[int, list[Release]]] | None = None  # (len(placed), releases)
        fast = Horizon.serves(self.snapshot.nodes, self.cap)
        horizon: Horizon | None = None
        starving, waited = self.starving(after_s)
        starving, heads = _served(starving, self.snapshot.reserved)
        budget = self.guard_budget(after_s, heads, waited)
        full = False  # the share is spoken for: only calls reserved for last round go on
        turns: set[str] = set()  # groups that had their call served this round
        claims = self.claims(starving)
        for call in starving:
            for node_id in self.snapshot.reserved_on.get(call.id, ()):
                owners = claims.get(node_id)
                if owners is not None and call.id in owners:
                    owners.remove(call.id)  # (its turn: its nodes are no longer another's)
                    if not owners:
                        del claims[node_id]
            if call.group in turns and call.id not in self.snapshot.reserved:
                continue  # (a group's next call waits for its first to start)
            kept = self.keep(call)
            if kept is None or not self.book.within_ceiling(call):
                continue  # (its group's next call may go instead)
            turns.add(call.group)
            if call.id not in self.snapshot.reserved:  # (those keep their reservations)
                full = full or budget <= 0  # (the last one in may overrun it: a call bigger
                if full:  # than the share would never get in)
                    continue  # younger ones wait in line too, as in fair order
            budget -= call.gpus
            room = self.book.limit(call, kept)
            parts = self.place_reserved(kept, room)
            if parts is None:
                parts = self.place_elsewhere(call, kept, claims)
            if parts is not None:
                self.start(call, parts)
                continue
            reclaimed = False
            if self.book.nominal(call) and self.held_for(kept) is None:
                bound = self.policy.max_reclaims
                if bound is not None and self.reclaims >= bound:
                    self.out.more = True  # (it may reclaim next round: reserved meanwhile)
                else:
                    reclaimed = self.try_reclaim(call, avoid=claims)
            if reclaimed:
                self.done.add(call.id)
                due = self.snapshot.reserved.get(call.id)
                if due is not None:  # it keeps its turn (the room it reclaimed is next round's)
                    self.out.reserved[call.id] = due
                continue
            if rel is None or rel[0] != len(self.placed):
                rel = (len(self.placed), releases(self.snapshot, self.placed))
                horizon = Horizon(self.snapshot, rel[1]) if fast else None
            if horizon is not None:
                held = horizon.reserve(kept, self.cap, limit=room, avoid=claims)
            else:
                held = reserve(kept, self.cap, self.snapshot, rel[1], limit=room, avoid=claims)
            if held is None:
                break  # younger calls may not take room it will need (it keeps its turn)
            if held.open(self.cap):
                self.held.append(held)
            self.reclaimer.reserved.update(held.spare)
            self.out.reserved[call.id] = held.start
            self.out.reserved_on[call.id] = tuple(held.spare)
            self.done.add(call.id)
            if self.why is not None:
                wait = held.start - self.snapshot.now
                self.note(call, f"waited over {after_s:.0f} s: {shortfall(call, self.cap)}; "
                          f"GPUs reserved for it from in about {wait:.0f} s")  # fmt: skip

    def claims(self, starving: list[Pending]) -> dict[int, list[str]]:
        """The nodes the calls reserved for last round were reserved on (still waiting, so
        still starving), with those calls: the guard takes them in turn, and until a call's
        turn its nodes are its own. Not those of a call that will not have its turn (its
        group at its ceiling, or no model left to it): its reservation lapses."""
        on = self.snapshot.reserved_on
        claims: dict[int, list[str]] = {}
        if on:
            for call in starving:
                nodes = on.get(call.id, ())
                if not nodes or not self.book.within_ceiling(call) or self.keep(call) is None:
                    continue
                for node_id in nodes:
                    claims.setdefault(node_id, []).append(call.id)
        return claims

    def place_elsewhere(
        self, call: Pending, kept: Pending, claims: Mapping[int, list[str]]
    ) -> tuple[Part, ...] | None:
        """Room for a starving call now, off the nodes the calls reserved for last round
        whose turn has not come were reserved on (``claims``), unless it is expected to end
        before each of them is due (backfill). Placed where it fits best, a call reserved on
        busy nodes could take another's reserved nodes as they free up, and that one, if it
        may use no other (a model only they have), would start late."""
        cap = self.cap
        if not claims or cap.hopeless(kept):
            return self.place(call, kept)
        if kept.gpus > cap.largest_for(kept):
            choices = cap.find_whole(kept)
        else:
            one = cap.find(kept)
            choices = None if one is None else [one]
        if not choices or not any(state.node.node_id in claims for state, _ in choices):
            return self.place(call, kept)  # (where it would go now is nobody's)
        now, due = self.snapshot.now, self.snapshot.reserved
        end = now + expected(kept)
        theirs = [
            node_id
            for node_id, owners in claims.items()
            if any(end > due.get(owner, math.inf) for owner in owners)
        ]
        full = set(self.full)
        with cap.hiding(theirs):
            parts = self.place(call, kept)
        self.full = full  # (what failed without those nodes may fit with them)
        return parts

    def place_reserved(self, call: Pending, room: float) -> tuple[Part, ...] | None:
        """Start a call reserved for last round on the nodes it was reserved on
        (``Snapshot.reserved_on``) if they have room for it now, all of them for a gang:
        placed wherever it fits best, it could take nodes another reservation counts on (on
        nodes of mixed sizes, a 12-GPU gang reserved a 4- and an 8-GPU node would take two
        8-GPU ones, and the call reserved the other 8-GPU node would start late)."""
        nodes = self.snapshot.reserved_on.get(call.id)
        if not nodes:
            return None
        return self.place_on(call, nodes, room)

    def place_on(
        self, call: Pending, nodes: Sequence[int], room: float
    ) -> tuple[Part, ...] | None:
        """Start ``call`` on these nodes if they have room for it now (every one whole, for
        a gang; one node holding all of it, else), within ``room`` GPUs; None if not."""
        cap, parts = self.cap, []
        whole = call.gpus > cap.largest_for(call)
        nodes = list(dict.fromkeys(nodes))  # (a node listed twice is one node)
        for node_id in nodes:
            state = cap.states.get(node_id)
            if state is None or state.withdrawn or state.node.draining:
                return None
            free = placement.usable(state.node, state.free, call)
            if whole:
                if not placement.whole_node_ok(state.node, call):
                    return None
                if len(free) < len(state.node.gpus):
                    return None
                parts.append((state, tuple(free)))
            elif len(nodes) == 1 and len(free) >= call.gpus:
                parts.append((state, placement.choose(state.node, free, call.gpus)[0]))
            else:
                return None
        taking = sum(len(gpus) for _, gpus in parts)
        if (whole and taking < call.gpus) or taking > room + EPSILON:
            return None
        for state, gpus in parts:
            cap.take(state, gpus)
        return tuple(Part(state.node.node_id, gpus) for state, gpus in parts)

    def guard_budget(self, after_s: float, starving: list[Pending], waited: float) -> float:
        """GPUs the guard may give starved calls this round. Starved whole-node calls (those
        it means to serve, ``starving``, and those running after such a wait) may hold their
        share of the GPUs that all such calls ask for or hold, as a share of the cluster's
        GPUs (the GPUs asked by every call that waited that long: ``waited``). On an
        overloaded cluster, where every call waits that long, whole-node calls then take the
        cluster in proportion to what they ask for, not all of it (the small calls starved);
        a cluster that keeps up has few others waiting that long, and gives them what they
        need."""
        asked = sum(call.gpus for call in starving)
        if asked >= waited:
            return math.inf  # nobody else waited that long: nobody to keep room for
        # GPUs of whole-node calls running after a wait past the bound (the guard's calls)
        nodes, sizes = self.by_id, self.whole_sizes
        held = sum(
            r.gpus
            for r in self.snapshot.running
            # (starved's test inlined first: this runs per running call per round)
            if r.queued_time is not None
            and r.start_time - r.queued_time >= after_s
            and starved_whole(r, after_s, nodes, sizes)
        )
        total = sum(len(node.gpus) for node in self.snapshot.nodes)
        return (asked + held) / (waited + held) * total - held

    def held_for(self, call: Pending) -> Reservation | None:
        """The reservation whose idle GPUs would hold ``call`` (with free nodes outside any
        reservation, for a gang), if any: a call kept out only by a reservation waits for it
        rather than preempt elsewhere (else each room it freed would draw the reservation
        there next round, and reclaim again)."""
        if not self.held:
            return None
        if call.gpus > self.cap.largest_for(call):  # a gang: whole free nodes
            have = sum(len(s.node.gpus) for s in self.cap.whole_free(call))
            for held in self.held:
                for node_id in held.spare:
                    state = self.cap.states.get(node_id)
                    if (
                        state is not None
                        and len(state.free) == len(state.node.gpus)
                        and placement.whole_node_ok(state.node, call)
                    ):
                        have += len(state.free)
                        if have >= call.gpus:
                            return held
            return None
        for held in self.held:
            for node_id in held.spare:
                state = self.cap.states.get(node_id)
                if (
                    state is not None
                    and len(state.free) >= call.gpus
                    and len(placement.usable(state.node, state.free, call)) >= call.gpus
                ):
                    return held
        return None

    def try_reclaim(self, call: Pending, avoid: Container[int] = frozenset()) -> bool:
        """Reclaim room for a call within its group's guarantee, off the nodes in ``avoid``
        (the guard's: other reservations' nodes, not renewed yet); whether it was dealt with
        (room found, or the round's reclaim bound reached)."""
        book, limit, group = self.book, self.policy.max_reclaims, call.group
        if limit is not None and self.reclaims >= limit:
            self.out.more = True
            note(self.why, call, self.pos.get(call.id, 0), _later, call, self.cap)
            return True
        shape = (group, call.gpus, call.gpu_model, call.min_memory_mib)
        kept = self.keep(call, nominal=True)  # (only on models it is guaranteed)
        can = self.policy.reclaim and shape not in self.stuck and book.any_borrowing()
        found = None
        if can and kept:
            self.reclaimer.avoid = avoid
            try:
                found = self.reclaimer.reclaim(kept, book.limit(call, kept))
            finally:
                self.reclaimer.avoid = frozenset()
        if found is None or kept is None:
            if not avoid:  # (kept off some nodes, it says nothing of others)
                self.stuck.add(shape)
            return False
        self.reclaims += bool(found.victims)
        self.out.promised[call.id] = tuple(sorted(found.node_ids))  # (step 0a next round)
        room = self.promised(kept, found.node_ids, found.gpus != kept.gpus)
        book.add(group, room, share=kept.share)  # that is spoken for
        reason = (
            f"reclaimed for group {group} (within its guarantee of "
            f"{book.quota(group).guaranteed} GPUs) by call {call.id}"
        )
        self.out.preemptions.extend(Preemption(v.id, reason) for v in found.victims)
        note(self.why, call, self.pos.get(call.id, 0), _reclaiming, found)
        return True

    def promised(self, call: Pending, node_ids: list[int], whole: bool) -> tuple[Part, ...]:
        """The GPUs reclaim or a swap set aside for ``call`` on ``node_ids``: the ``whole``
        nodes for a gang, else as many of the node's GPUs it may use as it asks for (which
        ones is settled when it starts; they count against its group, and against the quota
        of their model)."""
        nodes = self.by_id
        if whole or len(node_ids) > 1:
            return tuple(Part(i, tuple(g.index for g in nodes[i].gpus)) for i in node_ids)
        node = nodes[node_ids[0]]
        mine = [g.index for g in node.gpus if placement.gpu_ok(g, call)][: call.gpus]
        return (Part(node.node_id, tuple(mine) if mine else tuple(range(call.gpus))),)

    def guaranteed(self) -> None:
        """Step 1: place, or reclaim room for, the calls within their group's guarantee."""
        book = self.book
        for group, tiers in zip(self.groups, self.tiers, strict=True):
            guaranteed = book.quota(group).guaranteed
            for call in itertools.chain.from_iterable(tiers):
                used = book.used[group]
                if used >= guaranteed:
                    break  # nothing else of this group is within its guarantee
                if used + call.amount > guaranteed + EPSILON or call.id in self.done:
                    continue  # (not book.nominal(call), inlined: this loop is hot)
                kept = self.keep(call, nominal=True)
                if kept is None:
                    continue  # beyond its guarantee of each model it may use: it borrows
                shape = (group, call.gpus, call.gpu_model, call.min_memory_mib)
                if call.share != 1.0:
                    shape = (*shape[:3], -1)  # (never in self.full: see place)
                if not self.held and shape in self.stuck and shape in self.full:
                    # No room, nothing to reclaim, no reservation to backfill: as the last.
                    self.done.add(call.id)
                    note(self.why, call, self.pos.get(call.id, 0), _unreclaimable, call, self.cap)
                    continue
                parts = self.place(call, kept)
                if parts is not None:
                    self.start(call, parts)
                    continue
                self.done.add(call.id)
                held = self.held_for(kept) if shape not in self.stuck else None
                if held is not None:
                    self.claimed.add(held.call_id)
                    note(self.why, call, self.pos.get(call.id, 0), _reserved, call, self.cap,
                         held)  # fmt: skip
                elif not self.try_reclaim(call):
                    note(self.why, call, self.pos.get(call.id, 0), _unreclaimable, call, self.cap)

    def borrowers(self) -> None:
        """Step 2: lend idle GPUs to the other calls, in fair-share order, up to ceilings."""
        cap, book = self.cap, self.book
        # Kinds of call of a group that did not start while no reservation was open: free
        # GPUs, a group's room and the models it may take only shrink in this step, so later
        # ones of the same kind would not start either (only skipped when not explaining).
        blocked: set[tuple[object, ...]] = set()
        # (borrowers too go by least attained service, within a priority)
        for call in self.class_order():
            if call.id in self.done:
                continue
            kind: tuple[object, ...] = (call.group, call.gpus, call.gpu_model, call.min_memory_mib)
            if call.share != 1.0:  # (a GPU shared by its user may still have room for it)
                kind = (*kind, call.share, call.user)
            if kind in blocked:
                continue
            if not self.held and cap.exhausted():  # (self.held: reservations still open)
                if self.why is None:
                    return
                note(self.why, call, self.pos[call.id], _borrowing, call, cap, self.pos[call.id])
                continue
            if not book.within_ceiling(call):
                note(self.why, call, self.pos.get(call.id, 0), book.ceiling_reason, call)
                if self.why is None:
                    blocked.add(kind)
                continue
            kept = self.keep(call)
            if kept is None:
                note(self.why, call, self.pos.get(call.id, 0), book.model_ceiling_reason, call)
                if self.why is None:
                    blocked.add(kind)
                continue
            parts = self.place(call, kept, borrower=True)
            if parts is None:
                pos = self.pos.get(call.id, 0)
                note(self.why, call, pos, self.waiting, call, pos)
                if self.why is None and not self.held:  # (a reservation admits by duration)
                    blocked.add(kind)
                continue
            self.start(call, parts)

    def waiting(self, call: Pending, pos: int) -> str:
        """Why a borrower did not start: no room, or its gang's whole nodes would take its
        group past the ceiling."""
        if call.gpus > self.cap.largest_for(call):
            taking = self.cap.whole_gpus(call)
            if taking is not None and taking > self.book.room(call.group):
                return self.book.ceiling_reason(call, taking)
        return _borrowing(call, self.cap, pos)


def _served(
    starving: list[Pending], reserved: Mapping[str, float]
) -> tuple[list[Pending], list[Pending]]:
    """The order the guard takes the starving calls in: those it reserved for last round, in
    the order it reserved them (they keep their turn), then the others in the order given
    (a group's first call may be older than another group's reserved call: served first, it
    could take the room promised to that one); and the calls it means to serve, each
    reserved one and each other group's first."""
    order = {call_id: i for i, call_id in enumerate(reserved)}
    kept = sorted((call for call in starving if call.id in order), key=lambda c: order[c.id])
    heads = list(kept)
    seen = {call.group for call in kept}
    for call in starving:
        if call.group not in seen:
            seen.add(call.group)
            heads.append(call)
    return kept + [call for call in starving if call.id not in order], heads


def _shortest_first(calls: list[Pending]) -> list[Pending]:
    """Calls in queue order, re-ordered by expected duration (a stable sort: queue order
    among equals, and calls without one last), as the replay's queue keeps its tiers."""
    return sorted(calls, key=expected)


def _age_key(call: Pending) -> tuple[int, float]:
    return (-call.priority, call.waiting_since)


def _reserved(call: Pending, cap: Capacity, held: Reservation) -> str:
    return (
        f"{shortfall(call, cap)} outside the GPUs reserved for call {held.call_id}, which "
        "waited past the starvation bound; they are idle until it starts, so nothing is "
        "reclaimed"
    )


def _unreclaimable(call: Pending, cap: Capacity) -> str:
    return f"{shortfall(call, cap)}; within its group's guarantee, nothing borrowed to reclaim"


def _later(call: Pending, cap: Capacity) -> str:
    return f"{shortfall(call, cap)}; within its group's guarantee, room is reclaimed next round"


def _reclaiming(found: Reclaim) -> str:
    return (
        f"reclaiming GPUs on node {found.node_ids[0]}: {len(found.victims)} borrowed calls "
        "preempted; starts once they exit"
    )


def _borrowing(call: Pending, cap: Capacity, pos: int) -> str:
    return f"{shortfall(call, cap)}; borrowing, {ahead(pos - 1)} in fair-share order"


def _where(nodes: list[int]) -> str:
    return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {', '.join(map(str, nodes))}"


def _swapping(nodes: list[int], victims: int) -> str:
    return (
        f"least attained service: {victims} calls that received more service preempted on "
        f"{_where(nodes)}; starts once they exit"
    )


def _sharing(nodes: list[int], victims: int) -> str:
    return (
        f"fair share among borrowers: {victims} calls of groups that borrowed more for their "
        f"weight preempted on {_where(nodes)}; starts once they exit"
    )
