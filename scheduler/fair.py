"""``fair``: quotas with borrowing and reclaim, fair share among borrowers, priorities.

Each round takes the pending calls in fair-share order
(:func:`~scheduler.fairshare.fair_buckets`):

1. Guaranteed: calls that keep their group within its guarantee start if they fit; one that
   does not fit reclaims borrowed GPUs from other groups (:mod:`scheduler.reclaim`): the plan
   preempts just enough calls, holds the room back from this round's borrowers, and the call
   starts in a later round once its victims have exited.
2. Borrowers: the other calls start on idle GPUs, up to their group's ceiling, in the same
   order (so the group that used least of its share lately goes first), placed ``borrowed``.
   First, though, a starvation guard: the first of them that has waited ``starve_after_s`` or
   longer gets what FIFO's head gets: it starts now if it fits, else the earliest room for it
   is reserved (:mod:`scheduler.backfill`) and other borrowers may use that room only if they
   end before it is due. Without it, a big call (say, bigger than its group's guarantee) could
   wait for ever while smaller borrowers take every GPU that frees up. Guaranteed work is not
   held back by the reservation: guarantees come first.

Groups without a configured quota get ``default_quota`` (nothing guaranteed, no ceiling), so
with no quotas at all the policy is fair share over first-fit backfill.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from scheduler.backfill import Reservation, releases, reserve
from scheduler.capacity import Capacity
from scheduler.fairshare import fair_buckets
from scheduler.model import (
    DEFAULT_QUOTA,
    Decision,
    Part,
    Pending,
    Plan,
    Preemption,
    Quota,
    Snapshot,
)
from scheduler.quotas import Book
from scheduler.reasons import Why, ahead, note, shortfall, starting
from scheduler.reclaim import Reclaim, Reclaimer


@dataclass
class Fair:
    """Quotas with borrowing and reclaim; ``reclaim=False`` only borrows.

    ``max_reclaims`` bounds the calls one round reclaims room for (Kueue likewise preempts for
    one head per queue per cycle): a burst of returning demand is worked off over a few rounds
    instead of one long one, and the plan says so (:attr:`scheduler.model.Plan.more`).
    ``starve_after_s`` (None, the default: never) is the wait after which a borrower gets a
    reservation. It is off by default because holding room idle costs the others: on the
    Philly trace (bench/replay_philly.py) a 1 h to 24 h guard raised the average queueing
    delay by 10 to 35 %. Turn it on where big calls above their group's guarantee must not
    wait without bound."""

    default_quota: Quota = DEFAULT_QUOTA
    reclaim: bool = True
    max_reclaims: int | None = 128
    starve_after_s: float | None = None
    name: str = "fair"
    uses_quotas: bool = True

    def plan(self, snapshot: Snapshot, why: Why | None = None) -> Plan:
        return _Round(self, snapshot, why).run()


class _Round:
    """One plan of the fair policy: the working state its three steps share."""

    def __init__(self, policy: Fair, snapshot: Snapshot, why: Why | None) -> None:
        self.policy = policy
        self.snapshot = snapshot
        self.why = why
        self.cap = Capacity(snapshot.nodes)
        self.book = Book(snapshot.running, snapshot.quotas, policy.default_quota)
        self.buckets = fair_buckets(
            snapshot.pending, snapshot.usage, snapshot.user_usage, snapshot.quotas,
            policy.default_quota,
        )  # fmt: skip
        self.pos: dict[str, int] = {}
        if why is not None:
            self.pos = {c.id: i for i, c in enumerate(itertools.chain(*self.buckets), 1)}
        self.out = Plan()
        self.done: set[str] = set()  # calls this round has dealt with
        self.held: Reservation | None = None

    def run(self) -> Plan:
        self.guaranteed()
        if self.policy.starve_after_s is not None:
            self.guard(self.policy.starve_after_s)
        self.borrowers()
        return self.out

    def note(self, call: Pending, reason: str) -> None:
        """Record a reason already worded (only done when explaining)."""
        note(self.why, call, self.pos.get(call.id, 0), str, reason)

    def place(self, call: Pending) -> tuple[Part, ...] | None:
        """Room for the call now: outside any reservation, or inside if it cannot delay it;
        never more GPUs than its group may still take (a gang's whole nodes may hold more
        than it asks for)."""
        parts = self.cap.place(call, self.book.room(call.group))
        if parts is None and self.held is not None:
            choice = self.held.admit(call, self.cap, self.snapshot.now)
            if choice is not None:
                parts = (Part(choice[0].node.node_id, choice[1]),)
        return parts

    def start(self, call: Pending, parts: tuple[Part, ...]) -> None:
        taken = sum(len(p.gpu_indices) for p in parts)
        quota = self.book.quota(call.group)
        borrowed = taken > 0 and self.book.used[call.group] + taken > quota.guaranteed
        self.book.add(call.group, taken)
        self.out.append(Decision.of(call.id, parts, borrowed))
        self.done.add(call.id)
        if self.why is not None:
            self.note(call, starting(parts, " (borrowed)" if borrowed else ""))

    def guard(self, after_s: float) -> None:
        """Step 2a: the most deserving starving call starts now or gets a reservation."""
        now = self.snapshot.now
        for call in itertools.chain(*self.buckets):
            if call.id in self.done:
                continue
            if now - call.submit_time < after_s or not self.book.within_ceiling(call):
                continue
            room = self.book.room(call.group)
            parts = self.cap.place(call, room)
            if parts is not None:
                self.start(call, parts)
                continue  # the next starving call may need a reservation
            rel = releases(self.snapshot, [])
            self.held = reserve(call, self.cap, self.snapshot, rel, limit=room)
            if self.held is not None:
                self.done.add(call.id)
                if self.why is not None:
                    wait = self.held.start - now
                    self.note(call, f"waited over {after_s:.0f} s: {shortfall(call, self.cap)}; "
                              f"GPUs reserved for it from in about {wait:.0f} s")  # fmt: skip
                return

    def guaranteed(self) -> None:
        """Step 1: place, or reclaim room for, the calls within their group's guarantee."""
        book, limit = self.book, self.policy.max_reclaims
        reclaimer = Reclaimer(self.snapshot, self.cap, book)
        stuck: set[tuple[str, int, str | None, int]] = set()  # reclaim found nothing for these
        reclaims = 0
        for bucket in self.buckets:
            group = bucket[0].group
            guaranteed = book.quota(group).guaranteed
            for call in bucket:
                if book.used[group] >= guaranteed:
                    break  # nothing else of this group is within its guarantee
                if call.id in self.done or not book.nominal(call):
                    continue
                self.done.add(call.id)
                parts = self.place(call)
                if parts is not None:
                    self.start(call, parts)
                    continue
                shape = (group, call.gpus, call.gpu_model, call.min_memory_mib)
                if limit is not None and reclaims >= limit:
                    self.out.more = True
                    note(self.why, call, self.pos.get(call.id, 0), _later, call, self.cap)
                    continue
                can = self.policy.reclaim and shape not in stuck and book.any_borrowing()
                found = reclaimer.reclaim(call, book.room(group)) if can else None
                if found is None:
                    stuck.add(shape)
                    note(self.why, call, self.pos.get(call.id, 0), _unreclaimable, call, self.cap)
                    continue
                reclaims += bool(found.victims)
                book.add(group, found.gpus)  # promised: that much of its quota is spoken for
                reason = (
                    f"reclaimed for group {group} (within its guarantee of {guaranteed} GPUs) "
                    f"by call {call.id}"
                )
                self.out.preemptions.extend(Preemption(v.id, reason) for v in found.victims)
                note(self.why, call, self.pos.get(call.id, 0), _reclaiming, found)

    def borrowers(self) -> None:
        """Step 2: lend idle GPUs to the other calls, in fair-share order, up to ceilings."""
        cap, book = self.cap, self.book
        for call in itertools.chain(*self.buckets):
            if call.id in self.done:
                continue
            if cap.exhausted() and (self.held is None or not self.held.open(cap)):
                if self.why is None:
                    return
                note(self.why, call, self.pos[call.id], _borrowing, call, cap, self.pos[call.id])
                continue
            if not book.within_ceiling(call):
                note(self.why, call, self.pos.get(call.id, 0), book.ceiling_reason, call)
                continue
            parts = self.place(call)
            if parts is None:
                pos = self.pos.get(call.id, 0)
                note(self.why, call, pos, self.waiting, call, pos)
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
