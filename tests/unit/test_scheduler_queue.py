"""The pending queue kept in order and by kind of call (scheduler.queue), and FIFO's pass over
a long backlog that skips what cannot start (it must start exactly what a full scan does)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scheduler import Gpu, NodeCapacity, Pending, Snapshot
from scheduler.fair import Fair, _Round
from scheduler.fairshare import fair_buckets
from scheduler.fifo import Fifo
from scheduler.queue import Queue, kind
from scheduler.yardsticks import Las, Srtf
from tests.unit.test_scheduler_invariants import POLICIES, snapshots, starving_snapshots


def call(
    i: int, gpus: int = 1, priority: int = 0, expected: float | None = None, **kw: object
) -> Pending:
    return Pending(str(i), gpus, priority=priority, expected_s=expected, **kw)  # type: ignore[arg-type]


def test_calls_are_kept_by_priority_then_sequence_and_a_requeued_call_keeps_its_place() -> None:
    queue = Queue()
    for i in (0, 1, 3):
        queue.add(call(i), i)
    queue.add(call(9, priority=1), 9)
    assert [c.id for c in queue] == ["9", "0", "1", "3"]
    queue.add(call(2), 2)  # (back after a preemption: its old place, not the end)
    assert [c.id for c in queue] == ["9", "0", "1", "2", "3"]
    assert queue.pop("1").id == "1" and len(queue) == 4 and queue[1].id == "0"
    assert call(1) not in queue and call(2) in queue
    assert [c.id for c in queue.among(["3", "7", "9", "0"])] == ["9", "0", "3"]


def test_a_queue_counts_waiting_gpus_only_while_calls_enter_in_time_order() -> None:
    queue = Queue()
    queue.add(call(0, 2, queued_time=10.0), 0)
    queue.add(call(1, 4, queued_time=20.0), 1)
    queue.add(call(2, 1, queued_time=20.0, share=0.25), 2)
    assert (queue.waited(15.0), queue.waited(20.0)) == (2, 6.25)
    queue.add(call(3, 8, queued_time=5.0), 3)  # (earlier than the last: no count kept)
    assert queue.waited(20.0) is None


def test_a_call_is_queued_once() -> None:
    queue = Queue.of([call(0)])
    with pytest.raises(ValueError, match="queued already"):
        queue.add(call(0), 5)
    with pytest.raises(KeyError):
        queue.pop("7")
    with pytest.raises(ValueError, match="has the place of call 0"):
        queue.add(call(1), 0)  # (one sequence number, one call)


def test_a_queue_keeps_only_the_views_asked_for_and_refuses_to_read_the_others() -> None:
    calls = [Pending(f"c{i}", 1 + i % 3, group="g", user="u") for i in range(6)]
    queue = Queue.of(calls, kinds=False, tiers=False)
    queue.pop("c2")
    queue.add(calls[2], 2)  # (back in its place)
    assert [c.id for c in queue] == [f"c{i}" for i in range(6)]
    assert queue.waited(0.0) is None  # (not counted: a caller counts them itself)
    with pytest.raises(RuntimeError, match="no kinds"):
        list(queue.walk(lambda c: False, lambda c, s: False))
    with pytest.raises(RuntimeError, match="no kinds"):
        queue.waiting_large(0.0, 1, lambda c: True)
    with pytest.raises(RuntimeError, match="no tiers"):
        queue.buckets()
    full = Queue.of(calls)
    assert [c.id for c in full.walk(lambda c: False, lambda c, s: False)] == [c.id for c in full]
    assert sum(len(t) for tiers in full.buckets().values() for t in tiers) == 6


def test_a_walk_passes_over_dead_calls_and_whole_kinds() -> None:
    queue = Queue.of([call(0, 8), call(1, 1, expected=50), call(2, 8), call(3, 2), call(4, 1)])
    seen = [c.id for c in queue.walk(lambda c: c.id == "4", lambda c, _: c.gpus == 8)]
    assert seen == ["1", "3"]
    # A kind is judged by its shortest call: "no 1-GPU call shorter than 60 s can go".
    quick = list(queue.walk(lambda c: False, lambda c, shortest: shortest >= 60))
    assert [c.id for c in quick] == ["1", "4"]  # (the 1-GPU kind lives: call 1 is short)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2), st.sampled_from([1, 2, 8]),
                          st.booleans()), max_size=60), st.booleans())  # fmt: skip
def test_a_queue_agrees_with_sorting_after_any_adds_and_pops(
    steps: list[tuple[int, int, int, bool]], shortest_first: bool
) -> None:
    rank = Las((10.0, 100.0)).queue_rank
    queue, model = Queue((10.0, 100.0), shortest_first, rank), {}
    for step, (seq, priority, gpus, take) in enumerate(steps):
        c = call(seq, gpus, priority, expected=float((seq * 5) % 7), group="ab"[seq % 2],
                 user="xyz"[seq % 3], attained_gpu_s=float(seq % 4 * 40),
                 queued_time=float(step))  # fmt: skip
        if take and str(seq) in model:
            assert queue.pop(str(seq)) == model.pop(str(seq))
        elif str(seq) not in model:
            queue.add(c, seq)
            model[str(seq)] = c
        ordered = sorted(model.values(), key=lambda c: (-c.priority, int(c.id)))
        assert list(queue) == ordered
        assert list(queue.ranked()) == sorted((rank(c), c) for c in model.values())
        # Each kind's run holds that kind's calls in queue order, and its durations sorted.
        runs = queue._runs
        assert set(runs) == {kind(c) for c in ordered}
        for k, run in runs.items():
            assert run.calls == [c for c in ordered if kind(c) == k]
            assert run.expected == sorted(c.expected_s or 0.0 for c in run.calls)
        # The big (or 2-GPU) calls waiting since a time, oldest first: by priority, then since
        # when, then in queue order (each kind's order made when first asked, kept after).
        for since, largest in ((-1.0, 8), (3.0, 2), (20.0, 8), (1e9, 2)):
            aged = sorted((c for c in ordered if c.gpus >= largest and c.waiting_since <= since),
                          key=lambda c: (-c.priority, c.waiting_since, int(c.id)))  # fmt: skip
            assert queue.waiting_large(since, largest, lambda c: True) == aged
            twos = [c for c in aged if c.gpus == 2]
            assert queue.waiting_large(since, largest, lambda c: c.gpus == 2) == twos
        # GPUs waiting since a time: counted as calls entered the queue, in order of that.
        for since in (-1.0, 3.0, 20.0, 1e9):
            want = sum(c.gpus for c in ordered if (c.queued_time or 0.0) <= since)
            assert queue.waited(since) == want
        # Each bucket's calls by tier of service received (0-9, 10-99, 100 and more), each
        # in queue order or, shortest first, by expected duration then queue order.
        buckets = queue.buckets()
        assert set(buckets) == {(c.priority, c.group, c.user) for c in ordered}
        for (priority, group, user), tiers in buckets.items():
            mine = [c for c in ordered if (c.priority, c.group, c.user) == (priority, group, user)]
            if shortest_first:
                mine.sort(key=lambda c: c.expected_s or 0.0)
            assert tiers == [
                [c for c in mine if lo <= c.attained_gpu_s < hi]
                for lo, hi in ((0, 10), (10, 100), (100, float("inf")))
            ]


@st.composite
def backlogs(draw: st.DrawFn) -> Snapshot:
    """A snapshot with a long queue of few kinds of call (and a few priorities): most of it
    fits nowhere, as in a replay of an overloaded cluster."""
    snap = draw(snapshots(shares=False))
    extra = []
    for j in range(draw(st.integers(0, 120))):
        extra.append(Pending(
            f"q{j}", draw(st.sampled_from([1, 1, 2, 4, 8, 16])), "ann", "a",
            priority=draw(st.sampled_from([0, 0, 0, 1])),
            gpu_model=draw(st.sampled_from([None, None, "H100"])),
            expected_s=draw(st.none() | st.floats(1, 200)),
        ))  # fmt: skip
    pending = [*snap.pending, *extra]
    order = draw(st.permutations(range(len(pending))))
    return dataclasses.replace(snap, pending=[pending[i] for i in order])


@settings(max_examples=400, deadline=None)
@given(backlogs())
def test_fifo_passing_over_a_backlog_starts_what_a_full_scan_starts(snap: Snapshot) -> None:
    quick = Fifo().plan(snap)
    queued = Fifo().plan(dataclasses.replace(snap, pending=Queue.of(snap.pending)))
    full = Fifo().plan(snap, why={})  # (explaining: every call in turn)
    # (the replay's queue for fifo keeps no tiers; one without kinds is read in order)
    lean = [Fifo().plan(dataclasses.replace(
                snap, pending=Queue.of(snap.pending, kinds=kinds, tiers=False)))
            for kinds in (True, False)]  # fmt: skip
    for other in (queued, full, *lean):
        assert [(d.invocation_id, d.parts) for d in quick] == [
            (d.invocation_id, d.parts) for d in other
        ]
        assert quick.reserved == other.reserved


@settings(max_examples=300, deadline=None)
@given(st.one_of(snapshots(), starving_snapshots()),
       st.sampled_from([p for p in POLICIES if isinstance(p, Fair)]
                       + [Fair(), Fair(shortest_first=False)]),
       st.data())  # fmt: skip
def test_fair_plans_the_same_from_the_replay_s_queue_as_from_a_list(
    snap: Snapshot, policy: Fair, data: st.DataObject
) -> None:
    # The replay hands fair its queue, split into classes of service as it goes; a live
    # round hands it a list that the round splits itself. (Some calls were promised room.)
    ids = [c.id for c in snap.pending]
    nodes = [n.node_id for n in snap.nodes]
    chosen = data.draw(st.lists(st.sampled_from(ids), unique=True)) if ids else []
    promised = {i: tuple(data.draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=2,
                                            unique=True))) for i in chosen}  # fmt: skip
    snap = dataclasses.replace(snap, promised=promised)
    listed = policy.plan(snap)
    # A queue whose calls entered it in the order they started waiting keeps count of the
    # GPUs waiting (the replay's); one built from a list in queue order cannot.
    timely = Queue(policy.las_thresholds, policy.shortest_first)
    by_wait = sorted(enumerate(snap.pending), key=lambda ic: ic[1].waiting_since)
    for seq, c in by_wait:
        timely.add(c, seq)
    assert timely.waited(snap.now) is not None
    # (a queue without fair's views is read as a list would be)
    bare = Queue.of(snap.pending, policy.las_thresholds, policy.shortest_first, tiers=False)
    for queue in (Queue.of(snap.pending, policy.las_thresholds, policy.shortest_first), timely,
                  bare):  # fmt: skip
        queued = policy.plan(dataclasses.replace(snap, pending=queue))
        assert [(d.invocation_id, d.parts, d.borrowed) for d in listed] == [
            (d.invocation_id, d.parts, d.borrowed) for d in queued
        ]
        assert listed.preemptions == queued.preemptions
        assert listed.reserved == queued.reserved and listed.promised == queued.promised
        assert listed.more == queued.more


@settings(max_examples=300, deadline=None)
@given(st.one_of(snapshots(), starving_snapshots()),
       st.sampled_from([Las((10.0, 100.0)), Las(), Srtf()]))  # fmt: skip
def test_a_yardstick_plans_the_same_from_a_queue_kept_in_its_order(
    snap: Snapshot, policy: Las | Srtf
) -> None:
    # The replay keeps its queue in the yardstick's order (no sort per round), and none of
    # the views the yardsticks do not read.
    listed = policy.plan(snap)
    for kept in (True, False):
        queue = Queue.of(snap.pending, rank=policy.queue_rank, kinds=kept, tiers=kept)
        queued = policy.plan(dataclasses.replace(snap, pending=queue))
        assert [(d.invocation_id, d.parts) for d in listed] == [
            (d.invocation_id, d.parts) for d in queued
        ]
        assert listed.preemptions == queued.preemptions


@settings(max_examples=300, deadline=None)
@given(snapshots(), st.lists(st.sampled_from([0, 0, 1, -1]), min_size=40, max_size=40),
       st.booleans())  # fmt: skip
def test_fair_orders_calls_by_class_without_sorting_them(
    snap: Snapshot, priorities: list[int], queued: bool
) -> None:
    # Inside each bucket by class then queue order; borrowers by priority, then class, then
    # fair order: what a stable sort of the fair order by (-priority, class) gives.
    pairs = zip(snap.pending, priorities, strict=False)  # (more priorities than calls)
    pending = [dataclasses.replace(c, priority=p) for c, p in pairs]
    policy = Fair(las_thresholds=(10.0, 100.0))
    source = Queue.of(pending, policy.las_thresholds, True) if queued else pending
    order = Queue.of(pending) if queued else pending  # (a queue puts priorities first)
    r = _Round(policy, dataclasses.replace(snap, pending=source), None)
    klass = r.klass

    def rank(c: Pending) -> tuple[int, float]:  # (class, then the shortest expected first)
        return (klass(c), math.inf if c.expected_s is None else c.expected_s)

    expected = [c for bucket in fair_buckets(order, snap.usage, snap.user_usage, snap.quotas)
                for c in sorted(bucket, key=rank)]  # fmt: skip
    assert list(r.fair_order()) == expected
    assert list(r.class_order()) == sorted(expected, key=lambda c: (-c.priority, klass(c)))


TIES = Snapshot(
    [NodeCapacity(0, [], 0, tuple(Gpu(g, "A100") for g in range(8)))],
    [Pending("a", 8), Pending("b", 16), Pending("c", 8)],  # (all waiting since 0)
    now=50.0,
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(snapshots(), starving_snapshots()), st.sampled_from([0.0, 10.0, 100.0]))
@example(TIES, 0.0)  # (kinds interleaved, ages equal: queue order, not kind by kind)
def test_the_guard_finds_the_same_starving_calls_in_the_same_order_from_a_queue(
    snap: Snapshot, after: float
) -> None:
    # The replay's queue counts the GPUs waiting and looks only at big or constrained calls;
    # ties in age go in queue order, as in a pass over the queue.
    timely = Queue()
    for seq, c in sorted(enumerate(snap.pending), key=lambda ic: ic[1].waiting_since):
        timely.add(c, seq)
    policy = Fair(starve_after_s=after)
    listed = _Round(policy, snap, None).starving(after)
    queued = _Round(policy, dataclasses.replace(snap, pending=timely), None).starving(after)
    assert [c.id for c in listed[0]] == [c.id for c in queued[0]]
    assert listed[1] == queued[1]


def test_a_walk_passes_over_calls_at_least_as_long_as_a_dead_one_without_asking() -> None:
    # Backfill says a call of a kind is dead when calls of its expected duration cannot end
    # before the reservation: those as long or longer are dead too, and are not asked about.
    durations = [90, 120, 90, 200, 30, 60, 100, 45]
    queue = Queue.of([call(i, 1, expected=d) for i, d in enumerate(durations)])
    asked: list[str] = []

    def dead(c: Pending) -> bool:
        asked.append(c.id)
        return (c.expected_s or math.inf) > 50

    seen = [c.id for c in queue.walk(dead, lambda c, shortest: False)]
    assert seen == ["4", "7"]  # every call of 50 s or less, in queue order
    # 0 (90 s) is dead: 1 (120 s), 2 (90 s) and 3 (200 s) are passed over unasked; so is 6
    # (100 s) after 5 (60 s) was found dead.
    assert set(asked) == {"0", "4", "5", "7"}
