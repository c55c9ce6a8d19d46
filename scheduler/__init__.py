"""The scheduling policy core: pure Python, no I/O. ``plan(snapshot) -> decisions``.

The gateway builds a :class:`Snapshot` from PostgreSQL, calls :func:`plan`, and commits the
decisions in one transaction that re-checks capacity. The same code runs offline in tests.
"""

from scheduler.core import Decision, NodeCapacity, Pending, Snapshot, plan

__all__ = ["Decision", "NodeCapacity", "Pending", "Snapshot", "plan"]
