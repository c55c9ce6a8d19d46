"""The pure placement core, on static node lists, plus hypothesis invariants."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from scheduler import NodeCapacity, Pending, Snapshot, plan


def test_first_fit_in_queue_order_takes_lowest_free_gpus() -> None:
    nodes = [NodeCapacity(1, [2, 0, 1], 0), NodeCapacity(2, [0, 1, 2, 3], 1)]
    decisions = plan(Snapshot(nodes, [Pending("a", 2), Pending("b", 2), Pending("c", 0)]))
    assert [(d.invocation_id, d.node_id, d.gpu_indices) for d in decisions] == [
        ("a", 1, (0, 1)),
        ("b", 2, (0, 1)),
        ("c", 2, ()),
    ]


def test_a_call_too_big_for_now_is_skipped_and_smaller_ones_backfill() -> None:
    nodes = [NodeCapacity(1, [0, 1], 0)]
    decisions = plan(Snapshot(nodes, [Pending("big", 4), Pending("small", 1)]))
    assert [d.invocation_id for d in decisions] == ["small"]


def test_all_gpus_of_a_call_are_on_one_node() -> None:
    nodes = [NodeCapacity(1, [0], 0), NodeCapacity(2, [0], 0)]
    assert plan(Snapshot(nodes, [Pending("pair", 2)])) == []


def test_plan_does_not_mutate_the_snapshot() -> None:
    nodes = [NodeCapacity(1, [0, 1], 1)]
    plan(Snapshot(nodes, [Pending("a", 1), Pending("b", 0)]))
    assert nodes == [NodeCapacity(1, [0, 1], 1)]


node_lists = st.lists(
    st.builds(
        lambda i, gpus, cpus: NodeCapacity(i, sorted(gpus), cpus),
        st.just(0),
        st.sets(st.integers(0, 7), max_size=8),
        st.integers(0, 4),
    ),
    max_size=5,
).map(lambda ns: [NodeCapacity(i + 1, n.free_gpus, n.free_cpu_slots) for i, n in enumerate(ns)])
queues = st.lists(st.integers(0, 4), max_size=30).map(
    lambda gs: [Pending(f"c{i}", g) for i, g in enumerate(gs)]
)


@given(node_lists, queues)
def test_placement_never_oversubscribes_and_places_each_call_at_most_once(
    nodes: list[NodeCapacity], pending: list[Pending]
) -> None:
    decisions = plan(Snapshot(nodes, pending))
    by_id = {p.id: p for p in pending}
    free = {n.node_id: n for n in nodes}
    assert len({d.invocation_id for d in decisions}) == len(decisions)
    used_gpus: Counter[tuple[int, int]] = Counter()
    used_cpu: Counter[int] = Counter()
    for d in decisions:
        call = by_id[d.invocation_id]
        assert len(d.gpu_indices) == call.gpus
        assert set(d.gpu_indices) <= set(free[d.node_id].free_gpus)
        used_gpus.update((d.node_id, g) for g in d.gpu_indices)
        used_cpu[d.node_id] += call.gpus == 0
    assert all(count == 1 for count in used_gpus.values())
    assert all(used_cpu[n] <= free[n].free_cpu_slots for n in used_cpu)


@given(node_lists, queues)
def test_a_call_left_pending_fits_on_no_node_after_placement(
    nodes: list[NodeCapacity], pending: list[Pending]
) -> None:
    decisions = plan(Snapshot(nodes, pending))
    placed = {d.invocation_id for d in decisions}
    left = {n.node_id: [len(n.free_gpus), n.free_cpu_slots] for n in nodes}
    for d in decisions:
        left[d.node_id][0] -= len(d.gpu_indices)
        left[d.node_id][1] -= not d.gpu_indices
    # Work-conserving: nothing pending could still fit in what is left.
    for call in pending:
        if call.id not in placed:
            assert all(
                (gpus < call.gpus) if call.gpus else (cpus < 1) for gpus, cpus in left.values()
            )
