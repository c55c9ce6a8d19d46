"""What a replay measures.

- Job completion time (JCT): completion minus submit. Queueing delay: JCT minus the job's
  duration, i.e. all the time it was not running (first wait plus any wait after preemption).
- Utilisation: allocated GPU-seconds over capacity times (first submit .. last completion).
  Whole-node gangs count all the GPUs of their nodes.
- Fairness: Jain's index over groups of their normalised share ``x = S / E``: ``S`` the
  GPU-seconds a group held, ``E`` the GPU-seconds it was entitled to, integrating at every
  moment the weighted max-min fair split of the cluster among the groups' demands (GPUs of
  their running and queued jobs), weights from :func:`scheduler.traces.weights`. 1 means every
  group got its fair share of the time it wanted GPUs. ``jain_fairness`` counts a group served
  *above* its due (it borrowed GPUs nobody else wanted) as unfair as one served below, so a
  small group that borrowed a lot can pull it far down; ``jain_due`` is the same index over
  ``min(x, 1)``: 1 when no group got less than its due, whatever others borrowed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (0 for none)."""
    if not values:
        return 0.0
    return values[max(0, math.ceil(p / 100 * len(values)) - 1)]


def jain(xs: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes everything."""
    square = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * square) if square else 1.0


def water_fill(
    demand: Mapping[str, float], weight: Mapping[str, float], capacity: float
) -> dict[str, float]:
    """Weighted max-min fair split of ``capacity`` among ``demand``."""
    if sum(demand.values()) <= capacity:
        return dict(demand)
    out: dict[str, float] = {}
    left, total_w = capacity, sum(weight[g] for g in demand)
    for g in sorted(demand, key=lambda g: demand[g] / weight[g]):
        fair = left * weight[g] / total_w
        out[g] = min(demand[g], fair)
        left -= out[g]
        total_w -= weight[g]
    return out


class Recorder:
    """Integrates the replay's state over virtual time and collects per-job figures. A
    group's GPU-seconds held and due are added up when what it holds or the fair split
    changes (and at the end), not at every event."""

    def __init__(self, capacity: int, weight: Mapping[str, float]) -> None:
        self.capacity = capacity
        self.weight = dict(weight)
        self.clock: float | None = None
        self.busy: float = 0
        self.busy_s = 0.0
        self.held: dict[str, float] = dict.fromkeys(self.weight, 0)
        self.demand: dict[str, float] = dict.fromkeys(self.weight, 0)
        self.got_s: dict[str, float] = dict.fromkeys(self.weight, 0.0)
        self.due_s: dict[str, float] = dict.fromkeys(self.weight, 0.0)
        #: Since when each group holds what it holds (held GPU-seconds counted up to then).
        self._held_at: dict[str, float] = {}
        #: The fair split since ``_fair_at`` (None: demand changed since; worked out when
        #: time next moves on).
        self._fair: dict[str, float] | None = None
        self._fair_at = 0.0
        self.jct: list[float] = []
        self.queue: list[float] = []
        self.first = math.inf
        self.last = 0.0

    def advance(self, now: float) -> None:
        if self.clock is not None and now > self.clock:
            self.busy_s += self.busy * (now - self.clock)
            if self._fair is None:
                wanted = {g: float(d) for g, d in self.demand.items() if d}
                self._fair = water_fill(wanted, self.weight, self.capacity)
                self._fair_at = self.clock
        self.clock = now

    def want(self, group: str, gpus: float) -> None:
        """A job of ``group`` asking for ``gpus`` arrived (negative: one finished)."""
        self.demand[group] += gpus
        self._settle_due()

    def hold(self, group: str, gpus: float) -> None:
        """``group`` holds ``gpus`` more GPUs from now (negative: fewer)."""
        self.busy += gpus
        self._settle_held(group)
        self.held[group] += gpus

    def _settle_due(self) -> None:
        """Count the fair split's GPU-seconds up to now; it changes from now."""
        if self._fair is not None and self.clock is not None:
            dt = self.clock - self._fair_at
            for g, share in self._fair.items():
                self.due_s[g] += share * dt
        self._fair = None

    def _settle_held(self, group: str) -> None:
        clock = 0.0 if self.clock is None else self.clock
        since = self._held_at.get(group, clock)
        if self.held[group] and clock > since:
            self.got_s[group] += self.held[group] * (clock - since)
        self._held_at[group] = clock

    def finished(self, submit: float, duration: float, end: float) -> None:
        self.jct.append(end - submit)
        self.queue.append(end - submit - duration)
        self.last = max(self.last, end)

    def arrived(self, submit: float) -> None:
        self.first = min(self.first, submit)

    def summary(self) -> dict[str, float]:
        if self._fair is not None:
            self._settle_due()
            self._fair = {}  # (nothing wanted after the end)
            self._fair_at = self.clock or 0.0
        for group in self.held:
            self._settle_held(group)
        jct, queue = sorted(self.jct), sorted(self.queue)
        span = self.last - self.first if self.jct else 0.0
        shares = [self.got_s[g] / d for g, d in self.due_s.items() if d > 0]
        return {
            "avg_jct_s": sum(jct) / len(jct) if jct else 0.0,
            "p50_jct_s": percentile(jct, 50),
            "p99_jct_s": percentile(jct, 99),
            "avg_queue_s": sum(queue) / len(queue) if queue else 0.0,
            "p50_queue_s": percentile(queue, 50),
            "p99_queue_s": percentile(queue, 99),
            "utilization": self.busy_s / (self.capacity * span) if span > 0 else 0.0,
            "jain_fairness": jain(shares),
            "jain_due": jain([min(x, 1.0) for x in shares]),
            "makespan_s": span,
        }
