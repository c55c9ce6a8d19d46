"""``fair``'s step 4, fair share among borrowers (Kueue's fair sharing): a waiting call of a
group that borrows less for its weight takes the place of another group's borrowed calls
while that group still borrows ``share_margin`` more, never so far that the swap could be
swapped back, and never below a guarantee."""

from __future__ import annotations

import pytest

from scheduler import Gpu, NodeCapacity, Pending, Quota, Running, Snapshot, explain
from scheduler.fair import Fair
from scheduler.replay import Cluster, Simulator
from scheduler.traces import Job

NOW = 100_000.0
GPUS = tuple(Gpu(g, "A100", 40960) for g in range(4))
# (least attained service and the guard off, to see this step alone; a margin of one GPU)
SHARE = Fair(las_thresholds=(), starve_after_s=None, share_margin=1.0)


def run(i: str, gpu: int, group: str, started: float = 3_600.0, **kw: object) -> Running:
    """A one-GPU run (borrowed unless told) that started ``started`` seconds ago."""
    kw = {"borrowed": True, **kw}
    return Running(i, 0, (gpu,), "ann", group, start_time=NOW - started,
                   **kw)  # type: ignore[arg-type]  # fmt: skip


def call(i: str, group: str, gpus: int = 1) -> Pending:
    return Pending(i, gpus, "bob", group, submit_time=NOW - 10)


def snap(running: list[Running], pending: list[Pending], quotas: dict[str, Quota]) -> Snapshot:
    free = [g for g in range(4) if all(g not in r.gpu_indices for r in running)]
    return Snapshot([NodeCapacity(0, free, 0, GPUS)], pending, running, quotas, now=NOW)


def preempted(plan: list) -> list[str]:  # type: ignore[type-arg]
    return sorted(p.invocation_id for p in plan.preemptions)  # type: ignore[attr-defined]


def test_a_group_s_first_call_takes_the_youngest_of_a_group_that_borrows_more() -> None:
    running = [run(f"a{g}", g, "a", started=1_000.0 * (g + 1)) for g in range(4)]
    pending = [call(f"b{i}", "b") for i in range(3)]
    out = SHARE.plan(snap(running, pending, {}))
    assert preempted(out) == ["a0"]  # the youngest (the node's room is b0's this round)
    assert out.promised == {"b0": (0,)} and not list(out)
    assert "fair share among borrowers" in out.preemptions[0].reason
    off = Fair(las_thresholds=(), starve_after_s=None, share_preemption=False)
    assert not off.plan(snap(running, pending, {})).preemptions


def test_two_groups_without_guarantees_end_up_splitting_the_cluster_within_the_margin() -> None:
    # "a" fills three 4-GPU nodes with long jobs; "b" comes later with four. b takes a's
    # youngest, one round at a time, while a still borrows the margin more than b: with a
    # margin of 6, 9 and 3; with the default (8), 10 and 2. a's requeued jobs never take
    # the room back. Without the step b waits for a's jobs.
    jobs = [Job(f"a{i}", float(i), 20_000.0, 1, group="a") for i in range(12)]
    jobs += [Job(f"b{i}", 100.0 + i, 1_000.0, 1, group="b") for i in range(4)]

    def replay(**settings: object) -> Simulator:
        policy = Fair(las_thresholds=(), starve_after_s=None, **settings)  # type: ignore[arg-type]
        sim = Simulator(jobs, policy, Cluster.uniform(3, 4), {})
        sim.run()
        return sim

    close, default, blind = replay(share_margin=6.0), replay(), replay(share_preemption=False)
    assert default.policy.share_margin == 8.0  # type: ignore[attr-defined]
    for sim, taken in ((close, 3), (default, 2)):
        started = sorted(sim.started[i] - jobs[i].submit for i in range(12, 16))
        assert max(started[:taken]) < 60, started  # (at once)
        assert min(started[taken:]) > 900, started  # (once a b job ends)
        assert sum(sim.preempted) == taken and not any(sim.preempted[12:])
    assert min(blind.started[i] - jobs[i].submit for i in range(12, 16)) > 19_000


def test_a_swap_is_never_swapped_back() -> None:
    # After the swap above, a's requeued call would leave b borrowing less than a: it waits.
    running = [run("a2", 2, "a"), run("a3", 3, "a"), run("b0", 0, "b", started=60.0),
               run("b1", 1, "b", started=60.0)]  # fmt: skip
    out = SHARE.plan(snap(running, [call("a0", "a"), call("a1", "a")], {}))
    assert not out.preemptions and not list(out)


def test_weights_are_the_guarantees_and_no_group_goes_below_its_guarantee() -> None:
    # "big" is guaranteed 2 GPUs (weight 3) and holds 1; "small" has no guarantee (weight 1)
    # and borrows 3. big's 2-GPU call would borrow 1 (1/3 for its weight); small would keep 1
    # (1 for its weight): with a margin of half a GPU it gives up two calls, with one none.
    half = Fair(las_thresholds=(), starve_after_s=None, share_margin=0.5)
    quotas = {"big": Quota(2), "small": Quota(0)}
    running = [run("big0", 0, "big", borrowed=False)]
    running += [run(f"s{g}", g, "small", started=400.0 - 100 * g) for g in (1, 2, 3)]
    out = half.plan(snap(running, [call("want", "big", 2)], quotas))
    assert preempted(out) == ["s2", "s3"]
    assert not SHARE.plan(snap(running, [call("want", "big", 2)], quotas)).preemptions
    assert out.promised == {"want": (0,)}
    why = explain(snap(running, [call("want", "big", 2)], quotas), half)["want"][1]
    assert "fair share among borrowers" in why
    # A group held at its guarantee keeps it: "small" guaranteed its 3 GPUs gives up none.
    held = {"big": Quota(1), "small": Quota(3)}
    assert not half.plan(snap(running, [call("want", "big", 2)], held)).preemptions


def test_a_fresh_run_or_one_younger_than_min_run_s_is_not_taken() -> None:
    running = [run(f"a{g}", g, "a", started=0.0 if g < 2 else 300.0) for g in range(4)]
    out = SHARE.plan(snap(running, [call("b0", "b")], {}))
    assert preempted(out) == ["a2"] or preempted(out) == ["a3"]  # not the fresh ones
    patient = Fair(las_thresholds=(), starve_after_s=None, min_run_s=600.0)
    assert not patient.plan(snap(running, [call("b0", "b")], {})).preemptions


def test_least_attained_service_never_leaves_a_group_borrowing_past_the_margin() -> None:
    # "g" borrows 7 GPUs of two nodes (its calls of the new call's class), "h" 1 that received
    # far more service. g's new call is of a lower class than h's run, but taking it would
    # leave g borrowing 8 against h's 0: past a margin of 4, so step 4 would take it straight
    # back. It waits; with step 4 off least attained service takes h's place.
    nodes = [NodeCapacity(0, [], 0, GPUS), NodeCapacity(1, [], 0, GPUS)]
    running = [Running(f"g{i}", i // 4, (i % 4,), "ann", "g", start_time=NOW - 1_000.0 - i,
                       borrowed=True) for i in range(7)]  # fmt: skip
    running.append(Running("h", 1, (3,), "ann", "h", start_time=NOW - 3_600.0,
                           attained_gpu_s=50_000.0, borrowed=True))  # fmt: skip
    state = Snapshot(nodes, [call("new", "g")], running, {}, now=NOW)
    assert not Fair(starve_after_s=None, share_margin=4.0).plan(state).preemptions
    blind = Fair(starve_after_s=None, share_preemption=False).plan(state)
    assert preempted(blind) == ["h"]


def test_no_group_goes_below_its_guarantee_of_a_model() -> None:
    # "small" is guaranteed 2 A100s (nothing in all) and holds 3: taking two of them would
    # leave it 1, so big's 2-GPU call gets nothing, though small borrows more in all.
    half = Fair(las_thresholds=(), starve_after_s=None, share_margin=0.5)
    a100 = (("A100", Quota(2)),)
    running = [run("big0", 0, "big", borrowed=False), run("s1", 1, "small"),
               run("s2", 2, "small"), run("s3", 3, "small")]  # fmt: skip
    quotas = {"big": Quota(2), "small": Quota(0, None, a100)}
    assert not half.plan(snap(running, [call("want", "big", 2)], quotas)).preemptions
    quotas["small"] = Quota(0, None, (("A100", Quota(1)),))  # (it may give two of three)
    assert preempted(half.plan(snap(running, [call("want", "big", 2)], quotas))) == ["s2", "s3"]


@pytest.mark.parametrize("step", ["share", "las"])
def test_a_whole_node_call_sent_back_before_or_one_the_guard_served_keeps_its_node(
    step: str,
) -> None:
    # "a" holds three nodes: one with a single run, two with one-GPU calls that just started
    # (not to be taken). Sent back to the queue before (it received service), the whole-node
    # run gives way only to a call as big as its node; one that waited past the guard's
    # bound before it started gives way to nobody (reclaim may take it since session 20:
    # test_scheduler_fair).
    # (the guard's 12-hour bound; step 4, fair share among borrowers, or least attained
    # service alone)
    guarded = (Fair(las_thresholds=(), share_margin=1.0) if step == "share"
               else Fair(share_preemption=False))  # fmt: skip
    nodes = [NodeCapacity(i, [], 0, GPUS) for i in range(3)]
    just = [Running(f"a{i}", 1 + i // 4, (i % 4,), "ann", "a", start_time=NOW, borrowed=True)
            for i in range(8)]  # fmt: skip

    def plan(whole: Running, gpus: int) -> list[str]:
        state = Snapshot(nodes, [call("b", "b", gpus)], [whole, *just], {}, now=NOW)
        return preempted(guarded.plan(state))

    def whole(**kw: object) -> Running:
        return Running("whole", 0, (0, 1, 2, 3), "ann", "a", start_time=NOW - 3_600.0,
                       borrowed=True, **kw)  # type: ignore[arg-type]  # fmt: skip

    assert plan(whole(attained_gpu_s=1_000.0), 1) == []
    assert plan(whole(attained_gpu_s=1_000.0), 4) == ["whole"]
    assert plan(whole(), 1) == ["whole"]
    assert plan(whole(queued_time=NOW - 60_000.0), 1) == []
    assert plan(whole(queued_time=NOW - 60_000.0), 4) == []


def test_reclaim_takes_back_from_the_group_borrowing_most_for_its_weight_first() -> None:
    # "vision" wants one of its 4 guaranteed GPUs back. "big" (guaranteed 3) borrows one GPU
    # with its youngest call; "small" (no guarantee) borrows four, started earlier. Reclaim
    # takes small's youngest: small borrows 4 for its weight of 1, big 1/4.
    reclaim_only = Fair(las_thresholds=(), starve_after_s=None, share_preemption=False)
    nodes = [NodeCapacity(0, [], 0, GPUS), NodeCapacity(1, [], 0, GPUS)]
    running = [Running(f"b{g}", 0, (g,), "ann", "big", start_time=NOW - 1_000.0 + g,
                       borrowed=g == 3) for g in range(4)]  # fmt: skip
    running += [Running(f"s{g}", 1, (g,), "ann", "small", start_time=NOW - 5_000.0 + g,
                        borrowed=True) for g in range(4)]  # fmt: skip
    quotas = {"vision": Quota(4), "big": Quota(3), "small": Quota(0)}
    state = Snapshot(nodes, [call("v", "vision")], running, quotas, now=NOW)
    out = reclaim_only.plan(state)
    assert preempted(out) == ["s3"]
    assert out.promised == {"v": (1,)}


def test_a_call_past_its_group_s_guarantee_of_a_model_but_not_in_all_shares_that_model() -> None:
    # "a" is guaranteed 4 GPUs, of them 1 H100, and holds that H100; "b", guaranteed none,
    # borrows the node's 3 others. a's call for an H100 is within a's guarantee in all but
    # past its guarantee of H100s: reclaim cannot serve it (it would take back nothing a is
    # guaranteed), so it borrows, and as a borrower it takes the youngest of b's (b still
    # borrows 2). Before, it was passed over as "within its guarantee" and waited for b.
    h100 = tuple(Gpu(g, "H100", 81920) for g in range(4))
    quotas = {"a": Quota(4, None, (("H100", Quota(1)),)), "b": Quota(0)}
    running = [run("a0", 0, "a", borrowed=False)]
    running += [run(f"b{g}", g, "b", started=4_000.0 - 100 * g) for g in (1, 2, 3)]
    state = Snapshot([NodeCapacity(0, [], 0, h100)],
                     [Pending("want", 1, "bob", "a", gpu_model="H100", submit_time=NOW - 10)],
                     running, quotas, now=NOW)  # fmt: skip
    out = SHARE.plan(state)
    assert preempted(out) == ["b3"] and out.promised == {"want": (0,)}
    assert "fair share among borrowers" in out.preemptions[0].reason
    # Held at its guarantee of H100s in all ("b" guaranteed 3 of them), b gives up none.
    quotas["b"] = Quota(3, None, (("H100", Quota(3)),))
    assert not SHARE.plan(state).preemptions


@pytest.mark.parametrize(("mine", "taken"), [(4, True), (5, False)])
def test_a_group_borrowing_a_model_only_is_weighed_by_what_it_borrows_of_that_model(
    mine: int, taken: bool
) -> None:
    # "a" is guaranteed 100 GPUs in all but 1 H100 (weight 2 for H100s); "b" none (weight 1).
    # On an 8-H100 node a's call weighs what a would borrow of H100s, not of its 100 GPUs
    # (where it would pass for borrowing least and take nearly all): holding 4, with the
    # call it borrows 4 H100s, 2 for its weight, and b keeps 3, one more than the margin;
    # holding 5, it would borrow 2.5 for its weight and b keep 2: a waits.
    h100 = tuple(Gpu(g, "H100", 81920) for g in range(8))
    quotas = {"a": Quota(100, None, (("H100", Quota(1)),)), "b": Quota(0)}
    running = [run(f"a{g}", g, "a", borrowed=g > 0) for g in range(mine)]
    running += [run(f"b{g}", g, "b", started=9_000.0 - 100 * g) for g in range(mine, 8)]
    state = Snapshot([NodeCapacity(0, [], 0, h100)],
                     [Pending("want", 1, "bob", "a", gpu_model="H100", submit_time=NOW - 10)],
                     running, quotas, now=NOW)  # fmt: skip
    assert preempted(SHARE.plan(state)) == (["b7"] if taken else [])
