"""The entry points: ``plan(snapshot)`` decides a round, ``explain(snapshot)`` says why each
pending call waits. Both run a policy from :mod:`scheduler.policies`, ``fifo`` unless told
otherwise, which places calls first come first served with backfill, as before policies
existed. Neither does I/O or mutates the snapshot.
"""

from __future__ import annotations

from scheduler import policies
from scheduler.model import Plan, Snapshot
from scheduler.policies import Policy


def resolve(policy: str | Policy) -> Policy:
    return policies.get(policy) if isinstance(policy, str) else policy


def plan(snapshot: Snapshot, policy: str | Policy = "fifo") -> Plan:
    """Placements (the returned list) and preemptions (``.preemptions``) for this round."""
    return resolve(policy).plan(snapshot)


def explain(snapshot: Snapshot, policy: str | Policy = "fifo") -> dict[str, tuple[int, str]]:
    """``call id -> (position, reason)`` for each pending call: its place in the policy's order
    (1 is next) and why it waits, or where it starts this round."""
    why: dict[str, tuple[int, str]] = {}
    resolve(policy).plan(snapshot, why)
    return why
