"""First-fit FIFO placement, built as small filter and rank steps.

Calls are taken in queue order; each goes to the first live node (lowest id) that can hold it:
a GPU call needs that many free GPUs on one node (the lowest free indices are taken), a
CPU-only call needs one free CPU slot. A call that fits nowhere now is skipped and later, smaller
calls may still be placed (backfill). Later policies (quotas, fair share, preemption) replace the
ordering and ranking steps behind the same ``plan`` signature.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Pending:
    """A queued call, in queue order."""

    id: str
    gpus: int


@dataclass(slots=True)
class NodeCapacity:
    """What a live node has free right now."""

    node_id: int
    free_gpus: list[int] = field(default_factory=list)
    free_cpu_slots: int = 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    nodes: Sequence[NodeCapacity]
    pending: Sequence[Pending]


@dataclass(frozen=True, slots=True)
class Decision:
    invocation_id: str
    node_id: int
    gpu_indices: tuple[int, ...]


def fits(node: NodeCapacity, call: Pending) -> bool:
    if call.gpus == 0:
        return node.free_cpu_slots > 0
    return len(node.free_gpus) >= call.gpus


def feasible(nodes: Iterable[NodeCapacity], call: Pending) -> list[NodeCapacity]:
    return [n for n in nodes if fits(n, call)]


def rank(candidates: list[NodeCapacity]) -> list[NodeCapacity]:
    return sorted(candidates, key=lambda n: n.node_id)


def take(node: NodeCapacity, call: Pending) -> tuple[int, ...]:
    """Reserve the call's share of ``node`` (mutates the working copy) and return its GPUs."""
    if call.gpus == 0:
        node.free_cpu_slots -= 1
        return ()
    chosen = tuple(sorted(node.free_gpus)[: call.gpus])
    node.free_gpus = [g for g in node.free_gpus if g not in chosen]
    return chosen


def plan(snapshot: Snapshot) -> list[Decision]:
    """Place as many pending calls as fit, in queue order. Never mutates ``snapshot``."""
    nodes = [NodeCapacity(n.node_id, list(n.free_gpus), n.free_cpu_slots) for n in snapshot.nodes]
    decisions = []
    for call in snapshot.pending:
        candidates = rank(feasible(nodes, call))
        if candidates:
            node = candidates[0]
            decisions.append(Decision(call.id, node.node_id, take(node, call)))
    return decisions
