"""When the scheduling leader may expire leases: node faults, not control-plane faults
(DESIGN.md invariant 10; the fencing argument is in docs/architecture.md).

Two things hold expiry back:

- **The database was away.** While it is, no node can renew a lease, and the gateway tells
  every node so (503 ``db_unavailable``); the nodes then keep running their calls. So after
  the database returns, every held lease first gets a full term from then
  (``db.extend_leases``) before anything is expired. The leader knows the database was away
  when it (re)acquires the leader lock (its connection was lost), and when its own gateway
  answered ``db_unavailable`` within the last lease (:class:`Outages`: a database that
  refused new connections but kept the leader's).
- **Most nodes went silent at once** (:func:`allowance`). Then the fault is more likely the
  network's or the control plane's than every node's (Kubernetes stops evicting pods when a
  zone is mostly unhealthy, for the same reason); nothing is expired for ``silent_hold_s``.
  Nodes that come back renew what they hold; a node that restarts takes back its
  predecessor's attempts itself (a new incarnation). Otherwise expiry goes at most
  ``max_expiries_per_round`` a round, so a storm never requeues everything at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


class Outages:
    """When this gateway last answered that its database is unavailable (monotonic)."""

    def __init__(self) -> None:
        self.last: float | None = None

    def note(self) -> None:
        self.last = time.monotonic()

    def within(self, seconds: float) -> bool:
        """Whether the database was unavailable to this gateway in the last ``seconds``."""
        return self.last is not None and time.monotonic() - self.last < seconds


@dataclass(frozen=True, slots=True)
class Silence:
    """What the leader sees of the nodes at an expiry round."""

    #: Nodes that hold attempts (assigned or running).
    holding: int
    #: Of those, how many have not renewed for half a lease (stopped renewing).
    silent: int


@dataclass(frozen=True, slots=True)
class Thresholds:
    #: At least this share of the nodes holding work silent at once (and at least
    #: ``min_nodes`` of them) is a storm.
    fraction: float
    min_nodes: int
    #: How long a storm holds expiry back before it resumes at the capped rate.
    hold_s: float
    #: The most attempts expired in one round.
    per_round: int


def is_storm(silence: Silence, thresholds: Thresholds) -> bool:
    return (
        silence.silent >= thresholds.min_nodes
        and silence.silent >= thresholds.fraction * silence.holding
    )


def allowance(
    silence: Silence, thresholds: Thresholds, storm_since: float | None, now: float
) -> tuple[int, float | None]:
    """How many expired leases this round may take back, and since when a storm has lasted
    (None: no storm). Pure: ``now`` and ``storm_since`` are the caller's clock."""
    if not is_storm(silence, thresholds):
        return thresholds.per_round, None
    since = now if storm_since is None else storm_since
    if now - since < thresholds.hold_s:
        return 0, since
    return thresholds.per_round, since
