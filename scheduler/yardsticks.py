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
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduler import placement
from scheduler.capacity import Capacity
from scheduler.model import Decision, Pending, Plan, Preemption, Running, Snapshot
from scheduler.reasons import Why

#: A call's standing: lower goes first; a call may preempt only strictly higher classes.
Rank = tuple[float, float, str]


class _Preemptive:
    """Place in rank order; preempt strictly lower classes for a call that does not fit."""

    name = ""
    uses_quotas = False

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
        victims: _Victims | None = None  # made when first needed
        ranked = sorted((self.rank(c, now), c) for c in snapshot.pending)
        for (klass, _, _), call in ranked:
            if cap.exhausted() and victims is not None and victims.spent(klass):
                break  # nothing frees up for this call or any after it
            parts = cap.place(call)
            if parts is not None:
                out.append(Decision.of(call.id, parts))
                continue
            if victims is None:
                victims = _Victims(snapshot, lambda r: self.running_class(r, now))
            chosen = victims.free_for(call, klass, cap)
            out.preemptions.extend(Preemption(r.id, f"preempted by {self.name}") for r in chosen)
        return out


@dataclass
class Las(_Preemptive):
    """Tiresias-like 2D-LAS: ``thresholds`` in attained GPU-seconds, ascending."""

    thresholds: Sequence[float] = (3_600.0, 36_000.0)
    name: str = "las"
    uses_quotas: bool = False

    def rank(self, call: Pending, now: float) -> Rank:
        return (float(bisect.bisect_right(self.thresholds, call.attained_gpu_s)),
                call.submit_time, call.id)  # fmt: skip

    def running_class(self, run: Running, now: float) -> float:
        return float(bisect.bisect_right(self.thresholds, run.attained(now)))


@dataclass
class Srtf(_Preemptive):
    """Shortest remaining time first (oracle): ``expected_s`` is the remaining run time."""

    name: str = "srtf"
    uses_quotas: bool = False

    def rank(self, call: Pending, now: float) -> Rank:
        remaining = math.inf if call.expected_s is None else call.expected_s
        return (remaining, call.submit_time, call.id)

    def running_class(self, run: Running, now: float) -> float:
        return run.expected_end(now) - now


class _Victims:
    """The running calls a round may still preempt, by node, worst ranked first.

    Calls ask in rank order, so each asks with a class no better than the last one's: once a
    call of ``n`` GPUs found nothing, no later call of ``n`` or more can, and no call of a
    class at or below the worst running one's can either."""

    def __init__(self, snapshot: Snapshot, klass: Callable[[Running], float]) -> None:
        #: Per node: (class, start, id, call), sorted worst first when first looked at.
        self.by_node: dict[int, list[tuple[float, float, str, Running]]] = {}
        self.sorted: set[int] = set()
        #: GPUs per node already on their way back (preempting, or chosen this round).
        self.leaving: dict[int, int] = {}
        self.nodes = {n.node_id: n for n in snapshot.nodes if not n.draining}
        self.worst = -math.inf
        self.failed = math.inf
        by_node = self.by_node
        for run in snapshot.running:
            if run.share != 1.0:
                continue  # (never a victim; its GPU is busy until all its sharers end)
            if run.preempting:
                for part in run.parts:
                    self._leave(part.node_id, len(part.gpu_indices))
            elif run.preemptible:
                k = klass(run)
                if k > self.worst:
                    self.worst = k
                entry = (k, run.start_time, run.id, run)
                for node_id in (run.node_id, *(p.node_id for p in run.more)):
                    if node_id in by_node:
                        by_node[node_id].append(entry)
                    else:
                        by_node[node_id] = [entry]

    def spent(self, klass: float) -> bool:
        """Whether no call of this class or after it can free anything by preempting."""
        return klass >= self.worst or self.failed <= 1

    def free_for(self, call: Pending, klass: float, cap: Capacity) -> list[Running]:
        """Running calls to preempt so that ``call`` fits (none if it cannot be done). The
        nodes they free are withdrawn from ``cap`` for the rest of the round: what they free
        is the call's, not a later one's."""
        if call.gpus <= 0 or klass >= self.worst or call.gpus >= self.failed:
            return []
        chosen = self._free_for(call, klass, cap)
        if not chosen:
            self.failed = call.gpus
        return chosen

    def _free_for(self, call: Pending, klass: float, cap: Capacity) -> list[Running]:
        single = [n for n in self.nodes.values() if placement.node_fits_ever(n, call)]
        if single:
            best: tuple[tuple[int, int], int, list[Running]] | None = None
            for node in single:
                have = len(cap.free_of(node.node_id)) + self.leaving.get(node.node_id, 0)
                runs: list[Running] = []
                for run in self._lower(node.node_id, klass):
                    if have >= call.gpus:
                        break
                    runs.append(run)
                    have += _on(run, node.node_id)
                if have >= call.gpus and runs and (best is None or _cost(runs) < best[0]):
                    best = (_cost(runs), node.node_id, runs)
            return [] if best is None else self._take(best[2], [best[1]], cap)
        # A gang: whole nodes whose every running call is of a lower class.
        whole: list[tuple[int, int, list[Running]]] = []
        for node in self.nodes.values():
            if not placement.whole_node_ok(node, call):
                continue
            runs = self._lower(node.node_id, klass)
            busy = node.size - len(cap.free_of(node.node_id)) - self.leaving.get(node.node_id, 0)
            if sum(_on(r, node.node_id) for r in runs) >= busy:
                whole.append((busy, node.node_id, runs))
        whole.sort(key=lambda w: (w[0], w[1]))
        got, nodes, chosen = 0, [], []
        for _, node_id, runs in whole:
            if got >= call.gpus:
                break
            got += self.nodes[node_id].size
            nodes.append(node_id)
            chosen += [r for r in runs if r not in chosen]
        if got < call.gpus or not chosen:
            return []
        return self._take(chosen, nodes, cap)

    def _lower(self, node: int, klass: float) -> list[Running]:
        held = self.by_node.get(node)
        if not held:
            return []
        if node not in self.sorted:
            held.sort(reverse=True)
            self.sorted.add(node)
        return [e[3] for e in held if e[0] > klass]

    def _leave(self, node: int, gpus: int) -> None:
        self.leaving[node] = self.leaving.get(node, 0) + gpus

    def _take(self, runs: list[Running], nodes: list[int], cap: Capacity) -> list[Running]:
        for run in runs:
            for part in run.parts:
                self._leave(part.node_id, len(part.gpu_indices))
                held = self.by_node[part.node_id]
                held[:] = [e for e in held if e[3] is not run]
        for node_id in nodes:
            cap.withdraw(node_id)
            self.nodes.pop(node_id)
        return runs


def _on(run: Running, node: int) -> int:
    return sum(len(p.gpu_indices) for p in run.parts if p.node_id == node)


def _cost(runs: list[Running]) -> tuple[int, int]:
    return (sum(r.gpus for r in runs), len(runs))


#: Name -> factory, as :data:`scheduler.policies.POLICIES`; for the replay only.
YARDSTICKS: dict[str, Callable[..., _Preemptive]] = {"las": Las, "srtf": Srtf}
