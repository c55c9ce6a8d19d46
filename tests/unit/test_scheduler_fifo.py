"""FIFO with EASY backfill, on static snapshots."""

from __future__ import annotations

import math

from scheduler import Gpu, NodeCapacity, Pending, Running, Snapshot, explain, plan
from scheduler.backfill import releases, reserve
from scheduler.capacity import Capacity


def node(i: int, free: list[int], size: int = 4) -> NodeCapacity:
    return NodeCapacity(i, free, 0, tuple(Gpu(g) for g in range(size)))


def busy(rid: str, node_id: int, gpus: tuple[int, ...], ends_in: float | None) -> Running:
    return Running(rid, node_id, gpus, start_time=0.0, expected_s=ends_in)


def cluster() -> Snapshot:
    """Two 4-GPU nodes: node 1 frees 2 GPUs at t=100, node 2 frees 3 GPUs at t=500."""
    nodes = [node(1, [2, 3]), node(2, [3])]
    running = [busy("r1", 1, (0, 1), 100), busy("r2", 2, (0, 1, 2), 500)]
    return Snapshot(nodes, [], running, now=0.0)


def with_queue(snap: Snapshot, *pending: Pending) -> Snapshot:
    return Snapshot(snap.nodes, list(pending), snap.running, now=snap.now)


def test_the_head_gets_the_earliest_reservation() -> None:
    snap = cluster()
    cap = Capacity(snap.nodes)
    held = reserve(Pending("head", 4), cap, snap, releases(snap, []))
    assert held is not None and held.start == 100 and held.spare == {1: 0}
    assert cap.free_of(1) == [2, 3] and cap.free_gpus == 1  # node 1 is withdrawn


def test_short_calls_backfill_onto_reserved_gpus_long_ones_do_not() -> None:
    head = Pending("head", 4)
    short = Pending("short", 2, expected_s=50)
    long = Pending("long", 2, expected_s=5000)
    out = plan(with_queue(cluster(), head, long, short))
    assert [(d.invocation_id, d.node_id) for d in out] == [("short", 1)]


def test_calls_without_a_limit_may_use_unreserved_nodes() -> None:
    out = plan(with_queue(cluster(), Pending("head", 4), Pending("open", 1)))
    assert [(d.invocation_id, d.node_id) for d in out] == [("open", 2)]


def test_spare_gpus_at_the_reservation_may_be_used_by_anyone() -> None:
    # The head needs 3 on node 1 at t=100, when 4 are free there: 1 spare.
    nodes = [node(1, [2, 3]), node(2, [])]
    running = [busy("r1", 1, (0, 1), 100), busy("r2", 2, (0, 1, 2, 3), 900)]
    queue = [Pending("head", 3), Pending("two", 2), Pending("one", 1), Pending("more", 1)]
    snap = Snapshot(nodes, queue, running)
    assert [d.invocation_id for d in plan(snap)] == ["one"]


def test_no_reservation_is_possible_without_known_ends() -> None:
    nodes = [node(1, [2, 3])]
    snap = Snapshot(nodes, [Pending("head", 4), Pending("b", 2)],
                    [busy("r1", 1, (0, 1), None)])  # fmt: skip
    # The head can only start when r1 ends, which is never as far as planning knows: no
    # reservation can be timed, so nothing is held back.
    assert [d.invocation_id for d in plan(snap)] == ["b"]


def test_a_multi_node_head_reserves_whole_nodes() -> None:
    nodes = [node(1, [3]), node(2, [2, 3]), node(3, [])]
    running = [
        busy("a", 1, (0, 1, 2), 300),
        busy("b", 2, (0, 1), 100),
        busy("c", 3, (0, 1, 2, 3), 200),
    ]
    snap = Snapshot(nodes, [Pending("gang", 8), Pending("x", 1, expected_s=1000)], running)
    cap = Capacity(snap.nodes)
    held = reserve(Pending("gang", 8), cap, snap, releases(snap, []))
    assert held is not None and held.start == 200 and set(held.spare) == {2, 3}
    # x does not end before t=200, so it may only take node 1's GPU.
    assert [(d.invocation_id, d.node_id) for d in plan(snap)] == [("x", 1)]


def test_priority_first_then_the_given_queue_order() -> None:
    nodes = [node(1, [0, 1])]
    queue = [Pending("b", 1), Pending("a", 1), Pending("urgent", 1, priority=9)]
    assert [d.invocation_id for d in plan(Snapshot(nodes, queue))] == ["urgent", "b"]
    assert [d.invocation_id for d in plan(Snapshot(nodes, queue[:2]))] == ["b", "a"]


def test_explain_gives_position_and_reason() -> None:
    snap = with_queue(
        cluster(), Pending("head", 4), Pending("long", 2, expected_s=5000), Pending("ok", 1)
    )
    why = explain(snap)
    assert why["head"][0] == 1 and "first in line" in why["head"][1]
    assert "about 100 s" in why["head"][1]
    assert why["long"][0] == 2 and "reserved for call head" in why["long"][1]
    assert why["ok"] == (3, "starting now on node 2")


def test_explain_when_nothing_is_free_counts_calls_ahead() -> None:
    snap = Snapshot([node(1, [])], [Pending("a", 1), Pending("b", 2)])
    assert explain(snap) == {
        "a": (1, "no free GPU; next in line"),
        "b": (2, "no free GPU; behind 1 earlier call"),
    }


def test_expected_end_is_never_in_the_past_and_inf_without_limit() -> None:
    assert busy("r", 1, (0,), 10).expected_end(now=50) == 50
    assert busy("r", 1, (0,), None).expected_end(now=50) == math.inf
