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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
from scheduler.reasons import Why
from scheduler.victims import Victims

#: A call's standing: lower goes first; a call may preempt only strictly higher classes.
Rank = tuple[float, float, str]


class _Preemptive:
    """Place in rank order; preempt strictly lower classes for a call that does not fit."""

    name = ""
    uses_quotas = False
    preempts = True

    def rank(self, call: Pending, now: float) -> Rank:
        raise NotImplementedError

    def running_class(self, run: Running, now: float) -> float:
        """The first element of the rank the call would have if it were waiting; running
        calls of one class give way latest started first."""
        raise NotImplementedError

    def plan(self, snapshot: Snapshot, why: Why | None = None) -> Plan:
        now = snapshot.now
        cap = Capacity(snapshot.nodes, snapshot.share_across_users)
        out = Plan()
        victims: Victims | None = None  # made when first needed
        ranked = sorted((self.rank(c, now), c) for c in snapshot.pending)
        for (klass, _, _), call in ranked:
            if cap.exhausted() and victims is not None and victims.spent(klass):
                break  # nothing frees up for this call or any after it
            parts = cap.place(call)
            if parts is not None:
                out.append(Decision.of(call.id, parts))
                continue
            if victims is None:
                victims = Victims(snapshot.nodes, snapshot.running,
                                  lambda r: self.running_class(r, now))  # fmt: skip
            chosen = victims.free_for(call, klass, cap)
            out.preemptions.extend(Preemption(r.id, f"preempted by {self.name}") for r in chosen)
        return out


@dataclass
class Las(_Preemptive):
    """Tiresias-like 2D-LAS: ``thresholds`` in attained GPU-seconds, ascending."""

    thresholds: Sequence[float] = (3_600.0, 36_000.0)
    name: str = "las"
    uses_quotas: bool = False
    preempts: bool = True

    def rank(self, call: Pending, now: float) -> Rank:
        return (float(service_class(self.thresholds, call.attained_gpu_s)),
                call.submit_time, call.id)  # fmt: skip

    def running_class(self, run: Running, now: float) -> float:
        return float(service_class(self.thresholds, run.attained(now)))


@dataclass
class Srtf(_Preemptive):
    """Shortest remaining time first (oracle): ``expected_s`` is the remaining run time."""

    name: str = "srtf"
    uses_quotas: bool = False
    preempts: bool = True

    def rank(self, call: Pending, now: float) -> Rank:
        remaining = math.inf if call.expected_s is None else call.expected_s
        return (remaining, call.submit_time, call.id)

    def running_class(self, run: Running, now: float) -> float:
        return run.expected_end(now) - now


#: Name -> factory, as :data:`scheduler.policies.POLICIES`; for the replay only.
YARDSTICKS: dict[str, Callable[..., _Preemptive]] = {"las": Las, "srtf": Srtf}
