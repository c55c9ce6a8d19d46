"""The scheduling policy core: pure Python, no I/O. ``plan(snapshot) -> decisions``.

The gateway builds a :class:`Snapshot` from PostgreSQL, calls :func:`plan`, and commits the
decisions in one transaction that re-checks capacity. The same code runs offline in tests and
in the trace-replay simulator (``python -m scheduler.replay``).

Modules: ``model`` (the data), ``placement`` (filter and rank steps on one node),
``capacity`` (the round's indexed free capacity), ``backfill`` (EASY reservations),
``quotas`` / ``reclaim`` / ``fairshare`` (guarantees, borrowing, fair share), ``policies``
(``fifo``, ``fair``), ``admission`` (submit-time rejection), ``chunks`` (how far ahead a
node gets the items of a map), ``lookahead`` (how much of a long queue a round is shown),
``core`` (entry points), ``traces`` / ``metrics`` / ``replay`` (the simulator) and
``yardsticks`` (replay-only research policies to measure against).
"""

from scheduler.admission import never_fits
from scheduler.chunks import chunk_size
from scheduler.core import explain, plan
from scheduler.fairshare import UsageMeter, decayed_total
from scheduler.model import (
    DEFAULT_QUOTA,
    Decision,
    Gpu,
    NodeCapacity,
    Part,
    Pending,
    Plan,
    Preemption,
    Quota,
    Running,
    SchedulerError,
    SharedGpu,
    Snapshot,
    UnknownPolicyError,
)
from scheduler.policies import POLICIES, Policy

__all__ = [
    "DEFAULT_QUOTA",
    "POLICIES",
    "Decision",
    "Gpu",
    "NodeCapacity",
    "Part",
    "Pending",
    "Plan",
    "Policy",
    "Preemption",
    "Quota",
    "Running",
    "SchedulerError",
    "SharedGpu",
    "Snapshot",
    "UnknownPolicyError",
    "UsageMeter",
    "chunk_size",
    "decayed_total",
    "explain",
    "never_fits",
    "plan",
]
