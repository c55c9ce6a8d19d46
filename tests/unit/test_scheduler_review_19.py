"""Cases a review of session 19's diff found (fair step 4, step 0a, the failure memos of
victims), each failing before its fix."""

from __future__ import annotations

from scheduler import Gpu, NodeCapacity, Pending, Running, Snapshot
from scheduler.fair import Fair
from tests.unit.test_scheduler_invariants import settle

NOW = 100_000.0
GPUS = tuple(Gpu(g, "A100", 40960) for g in range(4))
MIXED = (Gpu(0, "A100", 40960), Gpu(1, "A100", 40960), Gpu(2, "V100", 40960),
         Gpu(3, "V100", 40960))  # fmt: skip


def call(i: str, gpus: int, submitted: float, group: str = "a", **kw: object) -> Pending:
    return Pending(i, gpus, "bob", group, submit_time=NOW - submitted, **kw)  # type: ignore[arg-type]


def mixed_cluster() -> tuple[list[NodeCapacity], list[Running]]:
    """Node 0 mixes 2 A100s and 2 V100s; "b" holds everything, one A100 for good."""
    plain = tuple(Gpu(g, "V100", 40960) for g in range(4))
    nodes = [NodeCapacity(0, [], 0, MIXED), NodeCapacity(1, [], 0, plain)]
    running = [Running("keep", 0, (0,), "ann", "b", start_time=NOW - 3_600.0, borrowed=True,
                       preemptible=False)]  # fmt: skip
    running += [Running(f"b{g}", 0, (g,), "ann", "b", start_time=NOW - 3_600.0 + g,
                        borrowed=True) for g in (1, 2, 3)]  # fmt: skip
    running += [Running(f"n{g}", 1, (g,), "ann", "b", start_time=NOW - 3_600.0,
                        borrowed=True) for g in range(4)]  # fmt: skip
    return nodes, running


def test_no_call_is_preempted_for_a_model_its_gpus_are_not() -> None:
    # "a" wants two A100s: node 0 can never give it both (one is kept), so preempting b's
    # calls on its V100s frees nothing it may use; they came back and went again, forever.
    policy = Fair(las_thresholds=(), starve_after_s=None, share_margin=1.0)
    nodes, running = mixed_cluster()
    snap = Snapshot(nodes, [call("want", 2, 10, gpu_model="A100")], running, {}, now=NOW)
    assert not policy.plan(snap).preemptions
    settle(snap, policy)  # (and plans settle)


def test_a_smaller_call_s_failure_does_not_stop_a_node_sized_call_in_step_4() -> None:
    # Sheltered whole-node runs may be taken only by a call as big as their node: a 2-GPU
    # call's failure says nothing of the 4-GPU call after it.
    share = Fair(las_thresholds=(), starve_after_s=None, share_margin=1.0)
    nodes = [NodeCapacity(n, [], 0, GPUS) for n in range(3)]
    running = [Running(f"b{n}", n, (0, 1, 2, 3), "ann", "b", start_time=NOW - 3_600.0,
                       attained_gpu_s=1_000.0, borrowed=True) for n in range(3)]  # fmt: skip
    for first in (call("small", 2, 20), call("one", 1, 20)):
        out = share.plan(Snapshot(nodes, [first, call("big", 4, 10)], running, {}, now=NOW))
        assert out.promised.keys() == {"big"}


def test_a_swap_that_lowers_the_group_s_borrowing_lets_a_failed_kind_try_again() -> None:
    # a's 1-GPU call takes a's own 3-GPU run (least attained service): a borrows less, and
    # its second 4-GPU call may now take b's run within the margin, though the first could not.
    policy = Fair(starve_after_s=None, share_margin=2.0)
    nodes = [NodeCapacity(n, [], 0, GPUS) for n in range(3)]
    hot = 50_000.0
    running = [
        Running("a_own", 0, (0, 1, 2), "ann", "a", start_time=NOW - 3_600.0,
                attained_gpu_s=hot, borrowed=True),
        Running("a_new", 0, (3,), "ann", "a", start_time=NOW, borrowed=True),
        Running("b4", 1, (0, 1, 2, 3), "ann", "b", start_time=NOW - 3_600.0,
                attained_gpu_s=hot, borrowed=True),
    ]  # fmt: skip
    running += [Running(f"b_new{g}", 2, (g,), "ann", "b", start_time=NOW, borrowed=True)
                for g in range(4)]  # fmt: skip
    pending = [call("c1", 4, 30), call("c2", 1, 20), call("c3", 4, 10)]
    out = policy.plan(Snapshot(nodes, pending, running, {}, now=NOW))
    assert out.promised.keys() == {"c2", "c3"}


def test_a_model_s_failure_on_one_node_does_not_stop_a_gang_of_that_model() -> None:
    # a's 4-A100 call fits only the mixed node, busy with a fresh run, and finds nothing;
    # its 5-A100 call is a gang of whole 2-A100 nodes that least attained service may free.
    mixed = tuple(Gpu(g, "A100" if g < 4 else "V100", 40960) for g in range(8))
    pair = tuple(Gpu(g, "A100", 40960) for g in range(2))
    nodes = [NodeCapacity(0, [], 0, mixed)] + [NodeCapacity(n, [], 0, pair) for n in (1, 2, 3)]
    running = [Running("fresh", 0, tuple(range(8)), "ann", "c", start_time=NOW, borrowed=True)]
    running += [Running(f"old{n}", n, (0, 1), "ann", "a", start_time=NOW - 7_200.0)
                for n in (1, 2, 3)]  # fmt: skip
    pending = [call("single", 4, 20, gpu_model="A100"), call("gang", 5, 10, gpu_model="A100")]
    out = Fair(starve_after_s=None).plan(Snapshot(nodes, pending, running, {}, now=NOW))
    assert out.promised == {"gang": (1, 2, 3)}


def test_room_still_being_freed_for_a_promised_call_is_not_reserved_for_another() -> None:
    # b's call on node 0 is leaving for a's promised call p; the guard's starving call s
    # may not be given node 0 (it would take p's room next round).
    nodes = [NodeCapacity(0, [], 0, GPUS), NodeCapacity(1, [], 0, GPUS)]
    leaving = Running("v", 0, (0, 1, 2, 3), "ann", "b", start_time=NOW - 1_000.0,
                      expected_s=1_100.0, borrowed=True, preempting=True)  # fmt: skip
    other = Running("w", 1, (0, 1, 2, 3), "ann", "b", start_time=NOW - 1_000.0,
                    expected_s=6_000.0, preemptible=False)  # fmt: skip
    pending = [call("p", 4, 600.0), call("s", 4, 50_000.0, group="c")]
    out = Fair().plan(Snapshot(nodes, pending, [leaving, other], {}, now=NOW,
                               promised={"p": (0,)}))  # fmt: skip
    assert out.promised == {"p": (0,)}
    assert 0 not in out.reserved_on.get("s", ())


def test_a_promised_borrower_does_not_go_before_a_starving_call_that_fits_now() -> None:
    # p, a borrower, was promised node 0 by a swap; r starved and is reserved on node 1, due
    # in an hour. r starts on node 0 now (the guard's calls go before a borrower's promise).
    nodes = [NodeCapacity(0, [0, 1, 2, 3], 0, GPUS), NodeCapacity(1, [], 0, GPUS)]
    w = Running("w", 1, (0, 1, 2, 3), "ann", "b", start_time=NOW - 1_000, expected_s=4_600.0,
                preemptible=False)  # fmt: skip
    pending = [call("r", 4, 50_000.0, group="c"), call("p", 4, 600.0)]
    out = Fair().plan(Snapshot(nodes, pending, [w], {}, now=NOW, promised={"p": (0,)},
                               reserved={"r": NOW + 3_600}, reserved_on={"r": (1,)}))  # fmt: skip
    assert [d.invocation_id for d in out] == ["r"]
