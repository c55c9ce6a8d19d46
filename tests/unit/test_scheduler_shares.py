"""Calls that ask for part of one GPU (``Pending.share``): packing, owners, quotas, reclaim,
reservations, admission, and the replay of traces with fractional ``num_gpus``."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from scheduler import (
    Gpu,
    NodeCapacity,
    Pending,
    Quota,
    Running,
    SharedGpu,
    Snapshot,
    explain,
    never_fits,
    plan,
    replay,
    traces,
)
from scheduler.backfill import releases
from scheduler.fair import Fair
from scheduler.replay import Cluster, Simulator
from scheduler.traces import Job, TraceError

A100 = tuple(Gpu(g, "A100", 40960) for g in range(4))


def node(free: list[int], shared: tuple[SharedGpu, ...] = (), gpus: int = 4) -> NodeCapacity:
    return NodeCapacity(0, free, 0, A100[:gpus], shared=shared)


def share(i: str, part: float, user: str = "ann", group: str = "", **kw: object) -> Pending:
    return Pending(i, 1, user, group, share=part, **kw)  # type: ignore[arg-type]


def placed(out: list) -> dict[str, tuple[int, ...]]:  # type: ignore[type-arg]
    return {d.invocation_id: d.gpu_indices for d in out}


@pytest.mark.parametrize("policy", ["fifo", "fair"])
def test_shares_pack_onto_the_fullest_gpu_their_user_shares(policy: str) -> None:
    shared = (
        SharedGpu(0, 0.5, frozenset({"ann"})),
        SharedGpu(1, 0.75, frozenset({"ann"})),
        SharedGpu(2, 0.25, frozenset({"bob"})),
    )
    pending = [
        share("quarter", 0.25),  # GPU 1 has exactly that left: the fullest that fits
        share("half", 0.5),  # GPU 0 (GPU 1 is full now)
        share("bobs", 0.5, "bob"),  # bob's own GPU 2
        share("fresh", 0.5),  # nothing of ann's has room: the free GPU 3
        share("packed", 0.5),  # onto GPU 3, which the call before opened
    ]
    out = plan(Snapshot([node([3], shared)], pending), policy)
    assert placed(out) == {
        "quarter": (1,), "half": (0,), "bobs": (2,), "fresh": (3,), "packed": (3,)
    }  # fmt: skip


@pytest.mark.parametrize("policy", ["fifo", "fair"])
def test_a_gpu_is_shared_across_users_only_when_the_round_allows_it(policy: str) -> None:
    snap = Snapshot([node([], (SharedGpu(0, 0.25, frozenset({"ann"})),), gpus=1)],
                    [share("bobs", 0.5, "bob")])  # fmt: skip
    assert not plan(snap, policy)
    why = explain(snap, policy)["bobs"][1]
    assert "0.5 of one GPU" in why, why
    allowed = Snapshot(snap.nodes, snap.pending, share_across_users=True)
    assert placed(plan(allowed, policy)) == {"bobs": (0,)}


@pytest.mark.parametrize("policy", ["fifo", "fair"])
def test_whole_gpu_calls_never_take_a_shared_gpu_and_shares_never_overfill_one(
    policy: str,
) -> None:
    shared = (SharedGpu(0, 0.25, frozenset({"ann"})), SharedGpu(1, 0.5, frozenset({"ann"})))
    pending = [Pending("whole", 1, "ann"), share("big", 0.8), share("fits", 0.75)]
    out = plan(Snapshot([node([], shared, gpus=2)], pending), policy)
    assert placed(out) == {"fits": (0,)}


def test_a_model_constrained_share_goes_only_on_its_model() -> None:
    h100 = NodeCapacity(1, [], 0, (Gpu(0, "H100", 81920),),
                        shared=(SharedGpu(0, 0.5, frozenset({"ann"})),))  # fmt: skip
    a100 = NodeCapacity(0, [], 0, A100[:1], shared=(SharedGpu(0, 0.75, frozenset({"ann"})),))
    pending = [share("h", 0.25, gpu_model="H100")]
    out = plan(Snapshot([a100, h100], pending), "fair")
    assert [(d.node_id, d.gpu_indices) for d in out] == [(1, (0,))]


def test_a_share_counts_as_its_fraction_against_the_group_s_quota() -> None:
    pending = [share(f"q{i}", 0.25, group="lab") for i in range(6)]
    quotas = {"lab": Quota(guaranteed=1, borrow_limit=0)}
    snap = Snapshot([node([0, 1])], pending, quotas=quotas)
    out = plan(snap, "fair")
    assert [d.invocation_id for d in out] == ["q0", "q1", "q2", "q3"]  # 4 x 0.25 = 1 GPU
    assert all(d.gpu_indices == (0,) and not d.borrowed for d in out)
    assert "holds 1 of at most 1 GPUs" in explain(snap, "fair")["q4"][1]
    lend = Snapshot(snap.nodes, pending, quotas={"lab": Quota(guaranteed=1)})
    out = plan(lend, "fair")
    assert len(out) == 6 and [d.borrowed for d in out] == [False] * 4 + [True] * 2


def running_share(i: str, part: float, start: float, group: str = "b", **kw: object) -> Running:
    return Running(i, 0, (0,), "bob", group, start_time=start, share=part, borrowed=True,
                   **kw)  # type: ignore[arg-type]  # fmt: skip


def test_reclaim_takes_a_shared_gpu_back_with_all_of_its_calls() -> None:
    # Group b borrows 2 GPUs beyond its guarantee of 0: GPU 0 shared by two of its calls
    # (the youngest), GPU 1 held by one. Group a's guaranteed call needs one GPU.
    running = [
        running_share("s1", 0.5, start=30.0),
        running_share("s2", 0.25, start=20.0),
        Running("w", 0, (1,), "bob", "b", start_time=10.0, borrowed=True),
    ]
    quotas = {"a": Quota(1), "b": Quota(0)}
    snap = Snapshot([node([], (SharedGpu(0, 0.75, frozenset({"bob"})),), gpus=2)],
                    [Pending("mine", 1, "ann", "a")], running, quotas, now=40.0)  # fmt: skip
    out = plan(snap, Fair())
    assert {p.invocation_id for p in out.preemptions} == {"s1", "s2"}
    # One of its calls may not be preempted: the GPU would not come back, so the whole call
    # on the other GPU goes instead, and neither share.
    running[1] = running_share("s2", 0.25, start=20.0, preemptible=False)
    snap = Snapshot(snap.nodes, snap.pending, running, quotas, now=40.0)
    assert {p.invocation_id for p in plan(snap, Fair()).preemptions} == {"w"}


def test_a_shared_gpu_is_expected_back_when_its_last_call_ends() -> None:
    running = [
        running_share("s1", 0.5, start=0.0, expected_s=50.0),
        running_share("s2", 0.25, start=0.0, expected_s=10.0),
        Running("w", 0, (1,), "bob", start_time=0.0, expected_s=20.0),
    ]
    shared = (SharedGpu(0, 0.75, frozenset({"bob"})),)
    snap = Snapshot([node([], shared, gpus=2)], [Pending("pair", 2, "ann")], running, now=5.0)
    assert sorted(releases(snap, [])[0]) == [(20.0, (1,)), (50.0, (0,))]
    assert plan(snap, "fifo").reserved == {"pair": 50.0}


def test_admission_refuses_shares_that_are_not_part_of_one_gpu() -> None:
    nodes = [node([0, 1, 2, 3])]
    tiny = Pending("t", 1, share=0.001)  # a flood of tiny parts would fill a node with processes
    for bad in (Pending("x", 2, share=0.5), Pending("y", 1, share=1.5), Pending("z", 1, share=0),
                tiny):  # fmt: skip
        reason = never_fits(bad, nodes)
        assert reason is not None and "part of one GPU" in reason, reason
    assert never_fits(share("ok", 0.25), nodes) is None
    quota = {"lab": Quota(0, borrow_limit=0)}
    reason = never_fits(share("q", 0.25, group="lab"), nodes, quota)
    assert reason is not None and "needs 0.25 GPUs" in reason and "at most 0" in reason


def test_the_least_share_is_the_one_the_gateway_takes() -> None:
    from bulletin_core import wire
    from scheduler.model import MIN_SHARE

    assert MIN_SHARE == wire.MIN_GPU_SHARE


def test_traces_take_fractional_gpus_below_one(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("submit_time,duration,num_gpus\n0,10,0.25\n1,10,2\n")
    assert [j.gpus for j in traces.read(path)] == [0.25, 2]
    path.write_text("submit_time,duration,num_gpus\n0,10,1.5\n")
    with pytest.raises(TraceError, match="whole GPUs or for part of one"):
        traces.read(path)


def test_the_replay_packs_shares_of_one_user_and_across_users_only_when_told() -> None:
    jobs = [Job(str(i), float(i), 100.0, 0.25, user="ann") for i in range(4)]
    jobs += [Job("bob", 4.0, 100.0, 0.5, user="bob"), Job("whole", 5.0, 10.0, 1, user="ann")]
    sim = Simulator(jobs, Fair(), Cluster.uniform(1, 1), {})
    sim.run()
    assert [sim.started[i] for i in range(4)] == [0.0, 1.0, 2.0, 3.0]  # all four at once
    # bob's share waits for a free GPU (ann's shares end at 100..103), the whole job after
    # the GPU is free of shares again.
    assert sim.started[4] == 103.0 and sim.started[5] == 203.0
    assert sim.record.summary()["utilization"] > 0.5
    shared = Simulator(jobs, Fair(), Cluster.uniform(1, 1), {}, share_across_users=True)
    shared.run()
    assert shared.started[4] == 101.0  # beside ann's last two shares, once half is free


def test_the_replay_command_line_takes_shares_and_writes_them_out(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("submit_time,duration,num_gpus,user\n0,10,0.5,ann\n0,10,0.5,bob\n")
    out = tmp_path / "jobs.csv"
    args = [str(trace), "--nodes", "1", "--gpus-per-node", "1", "--jobs-out", str(out)]
    assert replay.main([*args, "--policy", "fair"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["gpus"], r["start"]) for r in rows] == [("0.5", "0"), ("0.5", "10")]
    assert replay.main([*args, "--policy", "fifo", "--share-across-users"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["start"] for r in rows] == ["0", "0"]


@pytest.mark.parametrize("quota", [Quota(0, 2), Quota(2, 0)])
def test_shares_summing_to_a_hair_over_a_whole_gpu_leave_the_group_its_room(
    quota: Quota,
) -> None:
    # 0.2 + 0.4 + 0.3 + 0.1 is 1.0000000000000002 in floating point: the group holds one GPU
    # and may take one more whole one.
    running = [Running(f"s{k}", 0, (0,), "ann", "a", start_time=0.0, share=part)
               for k, part in enumerate([0.2, 0.4, 0.3, 0.1])]  # fmt: skip
    shared = (SharedGpu(0, 1.0, frozenset({"ann"})),)
    snap = Snapshot([node([1, 2, 3], shared)], [Pending("p", 1, "ann", "a")], running,
                    {"a": quota}, now=1.0)  # fmt: skip
    assert [d.invocation_id for d in plan(snap, "fair")] == ["p"]


def test_a_share_within_its_guarantee_reclaims_a_whole_gpu_though_less_is_left_to_it() -> None:
    # Group a may hold 1 GPU and holds half of one: the other half is its to take back.
    running = [
        running_share("mine", 0.5, start=0.0, group="a"),
        Running("b1", 0, (1,), "bob", "b", start_time=0.0, borrowed=True),
    ]
    shared = (SharedGpu(0, 0.5, frozenset({"bob"})),)
    snap = Snapshot([node([], shared, gpus=2)], [share("p", 0.5, "ann", "a")], running,
                    {"a": Quota(1, 0), "b": Quota(0)}, now=1.0)  # fmt: skip
    assert [p.invocation_id for p in plan(snap, "fair").preemptions] == ["b1"]


def test_a_share_is_never_a_whole_node_call_for_the_starvation_guard() -> None:
    one = tuple(
        NodeCapacity(i, [], 0, (Gpu(0, "A100", 40960),)) for i in range(3)
    )  # three busy one-GPU nodes
    running = [Running(f"r{i}", i, (0,), "x", start_time=0.0, expected_s=100.0) for i in range(3)]
    pending = [share(f"s{i}", 0.25, submit_time=0.0) for i in range(4)]
    out = plan(Snapshot(one, pending, running, now=1000.0), Fair(starve_after_s=60))
    assert not out.reserved, "no node is held back for parts of a GPU"


def test_fifo_says_a_share_does_not_backfill_onto_reserved_gpus() -> None:
    running = [Running("r", 0, (0, 1, 2), start_time=0.0, expected_s=90.0)]
    snap = Snapshot([node([3])], [Pending("head", 4), share("s", 0.5, expected_s=5.0)],
                    running, now=0.0)  # fmt: skip
    why = explain(snap, "fifo")
    assert "head" in plan(snap, "fifo").reserved
    assert "part of a GPU never backfills onto reserved GPUs" in why["s"][1], why["s"]
