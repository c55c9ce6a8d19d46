"""The replay's yardsticks (scheduler.yardsticks): 2D-LAS and oracle SRTF, what they preempt
and when, and what the replay records of attained service and preemption costs."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings

from scheduler import Quota, replay, traces
from scheduler.model import Gpu, NodeCapacity, Pending, Running, Snapshot, Standing
from scheduler.replay import Cluster, Simulator
from scheduler.traces import Job
from scheduler.yardsticks import Las, Srtf
from tests.unit.test_scheduler_invariants import snapshots

TIRESIAS = Path(__file__).resolve().parents[1] / "data" / "traces" / "tiresias_60_job.csv"


def simulate(jobs: list[Job], policy: Las | Srtf, nodes: int, gpus: int, **kw: float) -> Simulator:
    quotas: dict[str, Quota] = traces.derive_quotas(jobs, nodes * gpus)
    sim = Simulator(jobs, policy, Cluster.uniform(nodes, gpus), quotas, **kw)
    sim.run()
    return sim


def on_cluster(tmp_path: Path, rows: list[str], nodes: int, gpus: int) -> list[str]:
    """Command-line arguments: a trace of ``rows`` (a header first), written under
    ``tmp_path``, on ``nodes`` nodes of ``gpus`` GPUs."""
    trace = tmp_path / "trace.csv"
    trace.write_text("\n".join(rows) + "\n")
    return [str(trace), "--nodes", str(nodes), "--gpus-per-node", str(gpus)]


def node(node_id: int, free: tuple[int, ...] = (), size: int = 2) -> NodeCapacity:
    return NodeCapacity(node_id, list(free), 0, tuple(Gpu(g) for g in range(size)))


def test_las_lets_a_newcomer_preempt_a_job_past_a_threshold() -> None:
    # A has 400 GPU-seconds when B arrives: past 100, so a lower class than B's.
    jobs = [Job("a", 0, 1000, 2), Job("b", 200, 10, 2)]
    sim = simulate(jobs, Las((100.0, 1000.0)), 1, 2)
    assert sim.preemptions == 1
    assert (sim.started[1], sim.completed[1]) == (200, 210)
    assert sim.completed[0] == 1010  # resumed with its remaining 800 s
    costly = simulate(jobs, Las((100.0, 1000.0)), 1, 2, preemption_cost_s=50)
    assert costly.completed[0] == 1060


def test_las_never_preempts_inside_a_class() -> None:
    # A has 20 GPU-seconds when B arrives: both in the first class, served in arrival order.
    jobs = [Job("a", 0, 1000, 2), Job("b", 10, 10, 2)]
    sim = simulate(jobs, Las((100.0, 1000.0)), 1, 2)
    assert sim.preemptions == 0 and sim.started[1] == 1000


def test_srtf_preempts_only_for_a_shorter_remainder() -> None:
    sim = simulate([Job("a", 0, 1000, 2), Job("b", 100, 10, 2)], Srtf(), 1, 2)
    assert sim.preemptions == 1 and (sim.started[1], sim.completed[0]) == (100, 1010)
    sim = simulate([Job("a", 0, 100, 2), Job("b", 10, 500, 2)], Srtf(), 1, 2)
    assert sim.preemptions == 0 and sim.started[1] == 100


@settings(max_examples=400, deadline=None)
@given(snapshots())
def test_srtf_plans_the_same_from_the_standing_a_replay_keeps(snap: Snapshot) -> None:
    # The replay hands srtf its running calls kept in expected-end order (Snapshot.standing),
    # so that a round ranks only the nodes it looks at. Calls past their expected end all rank
    # 0 whatever their end: the plan must be the one ranking every call gives, ties included.
    srtf = Srtf()
    kept = dataclasses.replace(snap, standing=Standing(srtf.standing_key, snap.running))
    fresh, got = srtf.plan(snap), srtf.plan(kept)
    assert list(got) == list(fresh)
    assert got.preemptions == fresh.preemptions


def test_srtf_reads_a_node_s_longest_call_off_the_standing_and_no_other_policy_s() -> None:
    # 90 s left and 40 s left: a call of 60 s preempts the first. A standing in another
    # order (its last call the one of 40 s) would make it look as if nothing were longer.
    nodes = [node(0, (), 2)]
    running = [Running("late", 0, (0,), start_time=0, expected_s=100),
               Running("soon", 0, (1,), start_time=0, expected_s=50)]  # fmt: skip
    snap = Snapshot(nodes, [Pending("new", 1, expected_s=60)], running, now=10)
    other = Standing(lambda r: -r.start_time - (r.expected_s or 0), running)
    for standing in (None, other, Standing(Srtf().standing_key, running)):
        plan = Srtf().plan(dataclasses.replace(snap, standing=standing))
        assert [p.invocation_id for p in plan.preemptions] == ["late"]


def test_preemption_frees_one_node_at_the_least_cost() -> None:
    # Node 0: one 2-GPU job; node 1: two 1-GPU jobs. A 1-GPU call preempts one 1-GPU job,
    # the one that started last (latest in its class).
    now = 5000.0
    snap = Snapshot(
        nodes=[node(0), node(1)],
        pending=[Pending("new", 1, submit_time=now)],
        running=[
            Running("big", 0, (0, 1), start_time=0.0),
            Running("old", 1, (0,), start_time=0.0),
            Running("young", 1, (1,), start_time=100.0),
        ],
        now=now,
    )
    out = Las((100.0, 1000.0)).plan(snap)
    assert [p.invocation_id for p in out.preemptions] == ["young"] and not out


def test_a_gang_preempts_whole_nodes_and_others_keep_off_them() -> None:
    nodes = [node(n) for n in range(3)]
    running = [Running(f"r{n}", n, (0, 1), start_time=0.0) for n in range(3)]
    running.append(Running("fresh", 3, (1,), start_time=1000.0))  # the gang's class: stays
    snap = Snapshot(
        nodes=[*nodes, node(3, (0,))],
        pending=[Pending("gang", 4, submit_time=900.0), Pending("one", 1, submit_time=950.0)],
        running=running,
        now=1000.0,
    )
    out = Las((100.0, 1000.0)).plan(snap)
    assert len(out.preemptions) == 2  # two whole nodes of 2 GPUs, not the third
    assert [d.invocation_id for d in out] == ["one"]  # the free GPU of node 3
    assert {p.invocation_id for p in out.preemptions} <= {"r0", "r1", "r2"}


def test_a_call_of_the_same_class_is_no_victim() -> None:
    snap = Snapshot(
        nodes=[node(0)],
        pending=[Pending("new", 2, submit_time=10.0)],
        running=[Running("r", 0, (0, 1), start_time=0.0)],
        now=10.0,
    )
    assert not Las((100.0, 1000.0)).plan(snap).preemptions
    done = Running("r", 0, (0, 1), start_time=0.0, attained_gpu_s=200.0)
    assert (
        Las((100.0, 1000.0)).plan(Snapshot(snap.nodes, snap.pending, [done], now=10.0)).preemptions
    )


@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize("cost", [0.0, 30.0])
@pytest.mark.parametrize("policy", ["las", "srtf"])
def test_attained_service_adds_up(policy: str, cost: float, nodes: int) -> None:
    # Every job completes, and the service it got is its work plus the work redone after
    # each preemption, on its GPUs.
    jobs = traces.read(TIRESIAS)
    pick = Las((60.0, 600.0)) if policy == "las" else Srtf()
    sim = simulate(jobs, pick, nodes, 4, preemption_cost_s=cost)
    assert len(sim.completed) == len(jobs) and sim.preemptions > 0
    for i, job in enumerate(jobs):
        work = job.duration + cost * sim.preempted[i]
        assert sim.attained[i] == pytest.approx(job.gpus * work)
        assert sim.completed[i] - sim.started[i] >= work - 1e-6


def test_the_command_line_runs_a_yardstick_and_writes_each_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "jobs.csv"
    args = [str(TIRESIAS), "--nodes", "2", "--gpus-per-node", "4", "--format", "json"]
    assert replay.main([*args, "--policy", "srtf", "--preemption-cost-s", "30",
                        "--jobs-out", str(out)]) == 0  # fmt: skip
    metrics = json.loads(capsys.readouterr().out)
    rows = list(csv.DictReader(out.open()))
    assert tuple(rows[0]) == replay.JOB_COLUMNS and len(rows) == 60
    assert all(r["fate"] == "completed" for r in rows)
    assert sum(int(r["preemptions"]) for r in rows) == metrics["preemptions"] > 0
    for r in rows:
        assert float(r["queue_s"]) == pytest.approx(float(r["start"]) - float(r["submit"]))
    mean_jct = sum(float(r["jct_s"]) for r in rows) / 60
    assert mean_jct == pytest.approx(metrics["avg_jct_s"])


def test_settings_that_do_not_apply_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(TIRESIAS), "--nodes", "2"]
    assert replay.main([*args, "--policy", "las", "--starve-after-s", "60"]) == 2
    assert "fair only" in capsys.readouterr().err
    assert replay.main([*args, "--policy", "fifo", "--no-least-attained"]) == 2
    assert "--no-least-attained: settings of --policy fair only" in capsys.readouterr().err
    assert replay.main([*args, "--policy", "fifo", "--no-whole-node-shelter"]) == 2
    assert "--no-whole-node-shelter: settings of --policy fair only" in capsys.readouterr().err
    assert replay.main([*args, "--policy", "fair", "--min-run-s", "-5"]) == 2
    assert "--min-run-s cannot be negative" in capsys.readouterr().err
    assert replay.main([*args, "--preemption-cost-s", "-1"]) == 2
    assert "negative" in capsys.readouterr().err


def test_fair_s_least_attained_service_can_be_turned_off_in_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A 20-hour job holds the one node; 30 one-hour jobs arrive two hours in. With least
    # attained service they take its place; without, or with it never preemptible, they wait.
    rows = ["submit_time,duration,num_gpus", "0,72000,4"]
    rows += [f"{7200 + i},3600,1" for i in range(30)]
    args = [*on_cluster(tmp_path, rows, 1, 4), "--format", "json", "--policy", "fair"]
    runs = {}
    for name, extra in [("las", []), ("off", ["--no-least-attained"]),
                        ("patient", ["--min-run-s", "1e9"])]:  # fmt: skip
        assert replay.main([*args, *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["las"]["preemptions"] > 0 == runs["off"]["preemptions"]
    assert runs["patient"]["preemptions"] == 0
    assert runs["las"]["avg_queue_s"] < runs["off"]["avg_queue_s"] / 2


def test_fair_share_among_borrowers_and_its_margin_in_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Group a fills three 4-GPU nodes with long jobs; group b, guaranteed nothing either,
    # sends four one-hour jobs. b takes a's jobs' places while a, once they are gone, still
    # borrows the margin more than b does: 2 with the default (8), 3 with 6, none off.
    rows = ["submit_time,duration,num_gpus,group"]
    rows += [f"{i},72000,1,a" for i in range(12)] + [f"{100 + i},3600,1,b" for i in range(4)]
    quotas = tmp_path / "quotas.json"
    quotas.write_text('{"a": {"guaranteed": 0}, "b": {"guaranteed": 0}}')
    args = [*on_cluster(tmp_path, rows, 3, 4), "--policy", "fair",
            "--quota-file", str(quotas), "--no-least-attained", "--format", "json"]  # fmt: skip
    runs = {}
    for name, extra in [("default", []), ("close", ["--share-margin", "6"]),
                        ("off", ["--no-share-preemption"])]:  # fmt: skip
        assert replay.main([*args, *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert [runs[n]["preemptions"] for n in ("default", "close", "off")] == [2, 3, 0]
    waits = [runs[n]["avg_queue_s"] for n in ("close", "default", "off")]
    assert waits == sorted(waits) and waits[0] < waits[2]
    assert replay.main([*args, "--share-margin", "0"]) == 2
    assert "--share-margin must be above 0" in capsys.readouterr().err
    assert replay.main([*args[:-5], "--policy", "fifo", "--no-share-preemption"]) == 2
    assert "--no-share-preemption: settings of --policy fair only" in capsys.readouterr().err


def test_a_job_on_whole_nodes_gives_way_to_smaller_jobs_once_in_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A 20-hour job holds the one 4-GPU node; three waves of four one-hour 1-GPU jobs arrive.
    # The first wave takes its place (least attained service); after that it is sheltered,
    # and without the shelter each wave sends it back to the queue again.
    rows = ["submit_time,duration,num_gpus", "0,72000,4"]
    rows += [f"{wave + i},3600,1" for wave in (7200, 30000, 60000) for i in range(4)]
    args = [*on_cluster(tmp_path, rows, 1, 4), "--policy", "fair"]
    jobs = {}
    for name, extra in [("shelter", []), ("bare", ["--no-whole-node-shelter"])]:
        out = tmp_path / f"{name}.csv"
        assert replay.main([*args, *extra, "--jobs-out", str(out), "--format", "json"]) == 0
        capsys.readouterr()
        with out.open() as f:
            jobs[name] = {row["job"]: row for row in csv.DictReader(f)}
    assert jobs["shelter"]["0"]["preemptions"] == "1"
    assert jobs["bare"]["0"]["preemptions"] == "3"
    assert all(j["fate"] == "completed" for run in jobs.values() for j in run.values())


def test_the_replay_orders_a_group_s_jobs_shortest_first_unless_told_not_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One GPU, one group: a long job holds it until t=100 while five jobs queue, longest
    # first (5, 4, 3, 2, 1 s). In queue order they wait 99+103+106+108+109 s, shortest first
    # 95+97+100+104+109 s (the replay expects each job's true duration).
    rows = ["submit_time,duration,num_gpus,group", "0,100,1,a"]
    rows += [f"{1 + i},{5 - i},1,a" for i in range(5)]
    args = [*on_cluster(tmp_path, rows, 1, 1), "--policy", "fair", "--no-least-attained",
            "--format", "json"]  # fmt: skip
    waits = {}
    for name, extra in [("shortest", []), ("queue", ["--no-shortest-first"])]:
        assert replay.main([*args, *extra]) == 0
        waits[name] = json.loads(capsys.readouterr().out)["avg_queue_s"]
    assert waits["queue"] - waits["shortest"] == pytest.approx((525 - 505) / 6)
    assert replay.main([*args[:-3], "--policy", "fifo", "--no-shortest-first"]) == 2
    assert "--no-shortest-first: settings of --policy fair only" in capsys.readouterr().err
