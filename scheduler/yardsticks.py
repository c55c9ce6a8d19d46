"""Replay-only yardsticks: the research policies ``fair`` is measured against.

Neither is offered to a live cluster (the gateway's policies are :mod:`scheduler.policies`):
``srtf`` needs every call's true remaining run time, which only a replay knows, and ``las``
ranks by the service a call received, which the live snapshot does not carry yet. Both are
deliberately small, so that what they measure is the ordering, not tuning.

- ``las``: discretised two-dimensional least attained service, after Tiresias (Gu et al.,
  NSDI 2019). A call's class is how many of the thresholds its attained GPU-seconds (GPUs x
  seconds run, all its runs so far) have passed; lower classes go first, first come first
  served inside a class. Duration-blind. A waiting call may preempt running calls of a
  strictly lower class (never of its own: a class is FIFO), the lowest class and the latest
  started first.
- ``srtf``: shortest remaining time first, an oracle (its ``expected_s`` is the true
  remaining run time in a replay). A waiting call may preempt running calls whose remaining
  time is strictly longer than its own.

Placement is :class:`~scheduler.capacity.Capacity`'s best fit. Preemption frees GPUs on one
node for a call that fits on one node, whole nodes for a gang; a call preempts only when
that frees enough for it, counting GPUs already being given back. Neither reserves or
backfills: every call that fits starts. Calls holding a share of a GPU are never preempted
(a shared GPU frees only when all its calls go, which these small policies do not weigh).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from scheduler.capacity import Capacity
from scheduler.model import (
    Decision,
    Pending,
    Plan,
    Preemption,
    Running,
    Snapshot,
    service_class,
)
from scheduler.queue import Queue, Rank
from scheduler.reasons import Why
from scheduler.victims import Victims


class _Preemptive:
    """Place in rank order (a :data:`~scheduler.queue.Rank`: lower goes first); preempt
    strictly lower classes for a call that does not fit."""

    name = ""
    uses_quotas = False
    preempts: ClassVar[bool] = True  # (what the policy does, not a setting)
    #: What it reads of a replay's queue (scheduler.queue.Queue): its own order only.
    queue_kinds: ClassVar[bool] = False
    queue_tiers: ClassVar[bool] = False

    def rank(self, call: Pending, now: float) -> Rank:
        """A waiting call's standing (neither policy's depends on ``now``)."""
        raise NotImplementedError

    def queue_rank(self, call: Pending) -> Rank:
        """:meth:`rank` for a :class:`~scheduler.queue.Queue` to keep its calls in (the
        replay's: then a round needs no sort)."""
        return self.rank(call, 0.0)

    def running_class(self, run: Running, now: float) -> float:
        """The first element of the rank the call would have if it were waiting; running
        calls of one class give way latest started first."""
        raise NotImplementedError

    def worst(self) -> float:
        """No running call's class is worse than this: a call of this class preempts none."""
        return math.inf

    #: A running call's standing key (see :class:`~scheduler.model.Standing`), for a replay
    #: to keep its running calls in: a policy whose classes change order over time has none.
    standing_key: Callable[[Running], float] | None = None

    def plan(self, snapshot: Snapshot, why: Why | None = None) -> Plan:
        now = snapshot.now
        cap = Capacity(snapshot.nodes, snapshot.share_across_users)
        out = Plan()
        victims: Victims | None = None  # made when first needed
        pending = snapshot.pending
        ranked: Iterable[tuple[Rank, Pending]]
        if isinstance(pending, Queue) and pending.rank == self.queue_rank:
            ranked = pending.ranked()  # (kept in order: no sort, no rank worked out again)
        else:
            ranked = sorted((self.rank(c, now), c) for c in pending)
        worst = self.worst()
        # Kinds of call (GPUs, model, memory) that found neither room nor victims: room only
        # shrinks in a round and later calls are of a class no better, so no later call of
        # the kind finds either (a share of a GPU is never passed over: its room is per user).
        dead: set[tuple[int, str | None, int] | None] = set()
        for (klass, _, _), call in ranked:
            kind = (call.gpus, call.gpu_model, call.min_memory_mib) if call.share == 1.0 else None
            if kind in dead:
                continue
            if cap.exhausted() and (
                klass >= worst or (victims is not None and victims.spent(klass))
            ):
                break  # nothing frees up for this call or any after it
            parts = cap.place(call)
            if parts is not None:
                out.append(Decision.of(call.id, parts))
                continue
            if klass >= worst:
                if kind is not None:  # (nothing is of a worse class: it may only be placed)
                    dead.add(kind)
                continue
            if victims is None:
                # (a partial, not a lambda: one Python call per running call, not two)
                klass_of = functools.partial(self.running_class, now=now)
                standing = snapshot.standing
                if standing is not None and standing.key == self.standing_key:
                    victims = Victims(snapshot.nodes, (), klass_of, standing=standing)
                else:
                    victims = Victims(snapshot.nodes, snapshot.running, klass_of)
            chosen = victims.free_for(call, klass, cap)
            if not chosen and kind is not None:
                dead.add(kind)
            out.preemptions.extend(Preemption(r.id, f"preempted by {self.name}") for r in chosen)
        return out


@dataclass
class Las(_Preemptive):
    """Tiresias-like 2D-LAS: ``thresholds`` in attained GPU-seconds, ascending."""

    thresholds: Sequence[float] = (3_600.0, 36_000.0)
    name: str = "las"
    uses_quotas: bool = False

    def rank(self, call: Pending, now: float) -> Rank:
        return (float(service_class(self.thresholds, call.attained_gpu_s)),
                call.submit_time, call.id)  # fmt: skip

    def running_class(self, run: Running, now: float) -> float:
        if run.share != 1.0 or run.more:
            return float(service_class(self.thresholds, run.attained(now)))
        # (run.attained and service_class inlined: this runs per running call per round)
        ran = now - run.start_time
        got = run.attained_gpu_s + len(run.gpu_indices) * (ran if ran > 0 else 0.0)
        return float(bisect.bisect_right(self.thresholds, got))

    def worst(self) -> float:
        return float(len(self.thresholds))


@dataclass
class Srtf(_Preemptive):
    """Shortest remaining time first (oracle): ``expected_s`` is the remaining run time."""

    name: str = "srtf"
    uses_quotas: bool = False

    def rank(self, call: Pending, now: float) -> Rank:
        remaining = math.inf if call.expected_s is None else call.expected_s
        return (remaining, call.submit_time, call.id)

    def running_class(self, run: Running, now: float) -> float:
        if run.expected_s is None:  # (run.expected_end inlined: this is hot)
            return math.inf
        left = run.start_time + run.expected_s - now
        return left if left > 0 else 0.0

    def standing_key(self, run: Running) -> float:
        """Its expected end: :meth:`running_class` is that minus ``now`` (at least 0), the
        same sum worked out the same way, so it never decreases as the end grows."""
        return math.inf if run.expected_s is None else run.start_time + run.expected_s


#: Name -> factory, as :data:`scheduler.policies.POLICIES`; for the replay only.
YARDSTICKS: dict[str, Callable[..., _Preemptive]] = {"las": Las, "srtf": Srtf}
