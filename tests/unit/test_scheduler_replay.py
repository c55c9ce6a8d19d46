"""The trace-replay simulator: trace formats, quota files, the command line, determinism."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from scheduler import Plan, Quota, Snapshot, policies, replay, traces
from scheduler.backfill import releases
from scheduler.model import Standing
from scheduler.quotas import Book
from scheduler.replay import Cluster, Simulator
from scheduler.traces import Job, TraceError

#: A copy of the shared traces' Tiresias 60-job file (tests/data/traces/README.md).
TIRESIAS = Path(__file__).resolve().parents[1] / "data" / "traces" / "tiresias_60_job.csv"
KEYS = {"avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_queue_s", "p99_queue_s", "utilization",
        "jain_fairness", "jain_due", "preemptions", "wall_s"}  # fmt: skip


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def simulate(
    jobs: list[Job],
    policy: str,
    nodes: int,
    gpus: int,
    quotas: dict[str, Quota] | None = None,
    **kw: float,
) -> Simulator:
    quotas = traces.derive_quotas(jobs, nodes * gpus) if quotas is None else quotas
    sim = Simulator(jobs, replay.get_policy(policy), Cluster.uniform(nodes, gpus), quotas, **kw)
    sim.run()
    return sim


@pytest.mark.parametrize("policy", ["fifo", "fair"])
def test_the_tiresias_trace_replays_deterministically(policy: str) -> None:
    jobs = traces.read(TIRESIAS)
    runs = [simulate(jobs, policy, 4, 4) for _ in range(2)]
    assert runs[0].record.summary() == runs[1].record.summary()
    sim = runs[0]
    assert len(jobs) == 60 and len(sim.completed) == 60
    for i, job in enumerate(jobs):
        assert sim.completed[i] - job.submit >= job.duration - 1e-9
        assert sim.started[i] >= job.submit


def test_the_command_line_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    code = replay.main([str(TIRESIAS), "--policy", "fair", "--nodes", "2",
                        "--gpus-per-node", "4", "--format", "json"])  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= KEYS and result["completed"] == 60 and result["rejected"] == 0


def test_plain_traces_with_optional_columns(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "submit_time,duration,num_gpus,user,group,gpu_type\n"
                 "5,10,1,ann,vision,\n0,20,2,bob,nlp,V100\n")  # fmt: skip
    jobs = traces.read(path)
    assert [(j.submit, j.gpus, j.group, j.gpu_type) for j in jobs] == [
        (0.0, 2, "nlp", "V100"),
        (5.0, 1, "vision", None),
    ]


def test_philly_rows_count_from_the_first_timestamp(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "p.csv",
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-01 00:01:00,60.0,2,120.0,vc2\n2017-10-01 00:00:00,30.0,1,30.0,vc1\n",
    )
    jobs = traces.read(path)
    assert [(j.submit, j.duration, j.gpus, j.group) for j in jobs] == [
        (0.0, 30.0, 1, "vc1"),
        (60.0, 60.0, 2, "vc2"),
    ]


def test_unknown_trace_formats_and_bad_rows_are_reported(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="unknown trace format"):
        traces.read(write(tmp_path, "x.csv", "a,b\n1,2\n"))
    with pytest.raises(TraceError, match="bad row"):
        traces.read(write(tmp_path, "y.csv", "submit_time,duration,num_gpus\n0,ten,1\n"))
    assert replay.main([str(tmp_path / "missing.csv")]) == 2


def test_quota_files_and_derived_quotas(tmp_path: Path) -> None:
    path = write(tmp_path, "q.json", '{"a": {"guaranteed": 8, "borrow_limit": 4}, '
                 '"b": {"guaranteed": 2, "borrow_limit": null}}')  # fmt: skip
    assert traces.read_quotas(path) == {"a": Quota(8, 4), "b": Quota(2, None)}
    with pytest.raises(TraceError, match="guaranteed"):
        traces.read_quotas(write(tmp_path, "bad.json", '{"a": {"borrow": 1}}'))
    jobs = [Job("1", 0, 100, 1, group="a"), Job("2", 0, 100, 2, group="b")]
    assert traces.derive_quotas(jobs, 10) == {"a": Quota(3), "b": Quota(7)}
    path = write(tmp_path, "m.json", '{"a": {"guaranteed": 8, "models": {"V100": '
                 '{"guaranteed": 0, "borrow_limit": 4}}}}')  # fmt: skip
    assert traces.read_quotas(path) == {"a": Quota(8, None, (("V100", Quota(0, 4)),))}
    with pytest.raises(TraceError, match="models"):  # a model's quota has no models
        traces.read_quotas(write(tmp_path, "deep.json", '{"a": {"guaranteed": 8, "models": '
                                 '{"V100": {"guaranteed": 0, "models": {"X": {}}}}}}'))  # fmt: skip


def test_a_quota_per_model_keeps_a_group_off_a_model_in_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One A100 and one V100 node of 4 GPUs; group a may hold no V100: its 4-GPU jobs run
    # one at a time on the A100 node, while group b's use both.
    trace = write(tmp_path, "t.csv", "submit_time,duration,num_gpus,group\n"
                  + "".join(f"0,100,4,{g}\n" for g in "aaaa"))  # fmt: skip
    quotas = write(tmp_path, "q.json", '{"a": {"guaranteed": 0, "models": {"V100": '
                   '{"guaranteed": 0, "borrow_limit": 0}}}}')  # fmt: skip
    starts = []
    for extra in (["--quota-file", quotas], []):
        out = tmp_path / "jobs.csv"
        assert replay.main([trace, "--nodes", "2", "--gpus-per-node", "4", "--node-models",
                            "A100,V100", "--policy", "fair", "--jobs-out", str(out), *extra]) == 0
        capsys.readouterr()
        starts.append(sorted(float(j["start"]) for j in csv.DictReader(out.open())))
    assert starts == [[0, 100, 200, 300], [0, 0, 100, 100]]


def test_jobs_that_never_fit_are_rejected_and_counted() -> None:
    jobs = [Job("1", 0, 10, 1), Job("2", 0, 10, 64), Job("3", 1, 10, 8)]
    sim = simulate(jobs, "fifo", 2, 4)
    assert sim.rejected == {1} and set(sim.completed) == {0, 2}


def test_gpu_types_need_node_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "t.csv", "submit_time,duration,num_gpus,gpu_type\n0,10,1,V100\n"
                 "0,10,1,A100\n0,10,1,H100\n")  # fmt: skip
    args = [path, "--nodes", "2", "--gpus-per-node", "1", "--format", "json"]
    replay.main([*args, "--node-models", "V100,A100"])
    assert json.loads(capsys.readouterr().out)["rejected"] == 1
    replay.main(args)  # without models the constraint is dropped
    assert json.loads(capsys.readouterr().out)["rejected"] == 0


def replay_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trace: str, *flags: str
) -> tuple[dict[str, float], list[list[str]]]:
    """The JSON metrics and the --jobs-out rows of a replay of ``trace``."""
    path, out = write(tmp_path, "t.csv", trace), tmp_path / "jobs.csv"
    assert replay.main([path, "--format", "json", "--jobs-out", str(out), *flags]) == 0
    rows = [line.split(",") for line in out.read_text().splitlines()[1:]]
    return json.loads(capsys.readouterr().out), rows


def test_gpu_type_alternatives_take_any_of_their_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = ("submit_time,duration,num_gpus,gpu_type\n"
             "0,10,1,V100M16|V100M32\n0,10,1,V100M16\n0,10,1,T4|K80\n")  # fmt: skip
    result, rows = replay_jobs(tmp_path, capsys, trace, "--nodes", "1", "--gpus-per-node", "2",
                               "--node-models", "V100M32")  # fmt: skip
    assert result["rejected"] == 2
    assert [r[-1] for r in rows] == ["completed", "rejected", "rejected"]


def test_a_nodes_file_gives_a_cluster_of_mixed_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = write(tmp_path, "nodes.csv", "gpus,model,count\n8,A100,1\n4,V100M16,2\n")
    trace = write(tmp_path, "t.csv", "submit_time,duration,num_gpus,gpu_type\n"
                  "0,10,8,A100\n0,10,4,V100\n0,10,8,V100\n0,10,6,V100\n1,10,16,\n")  # fmt: skip
    out = tmp_path / "jobs.csv"
    assert replay.main([trace, "--nodes-file", nodes, "--format", "json",
                        "--jobs-out", str(out)]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert (result["nodes"], result["gpus"], result["gpus_per_node"]) == (3, 16, "mixed")
    # 6 V100 GPUs: more than a V100 node has, so whole nodes (8): fits; 16 takes all three.
    assert result["rejected"] == 0 and result["completed"] == 5
    jobs = list(csv.DictReader(out.open()))
    assert [float(j["start"]) for j in jobs] == [0, 0, 10, 20, 30]


def test_nodes_files_and_flags_that_cannot_apply_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write(tmp_path, "t.csv", "submit_time,duration,num_gpus,gpu_type\n0,10,1,A100\n")
    good = write(tmp_path, "n.csv", "gpus,model\n8,A100\n")
    assert replay.main([trace, "--nodes-file", good, "--nodes", "4"]) == 2
    assert "drop --nodes" in capsys.readouterr().err
    for text, says in [("gpus,model\n0,A100\n", "line 2: gpus must be at least 1"),
                       ("gpus,model\nmany,A100\n", "expected the columns gpus,model,count"),
                       ("gpus,model\n", "no nodes")]:  # fmt: skip
        bad = write(tmp_path, "bad.csv", text)
        assert replay.main([trace, "--nodes-file", bad]) == 2
        assert says in capsys.readouterr().err
    assert replay.main([trace, "--nodes", "1", "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["gpu_types_ignored"] == 1
    assert "1 jobs ask for a GPU model (gpu_type) but the cluster's nodes have none" in (
        captured.err
    )


def test_a_preempted_job_keeps_its_gpus_for_the_grace_then_resumes() -> None:
    # b borrows the whole node; a arrives within its guarantee and reclaims it.
    jobs = [Job("b", 0, 100, 2, group="b"), Job("a", 10, 50, 2, group="a")]
    quotas = {"a": Quota(2), "b": Quota(0)}
    sim = simulate(jobs, "fair", 1, 2, quotas, grace_s=5)
    assert sim.preemptions == 1
    assert sim.started[1] == 15  # after b's 5 s grace
    assert sim.completed[1] == 65
    assert sim.completed[0] == 65 + 100 - 15  # b resumes with its remaining work
    out = simulate(jobs, "fair", 1, 2, quotas, grace_s=5, preemption_cost_s=7)
    assert out.completed[0] == 65 + 100 - 15 + 7


def test_bulletin_replay_runs_the_simulator(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from bulletin import cli

    path = write(tmp_path, "t.csv", "submit_time,duration,num_gpus,group\n0,10,2,a\n1,5,2,b\n")
    args = ["replay", str(path), "--policy", "fifo", "--nodes", "1", "--gpus-per-node", "2"]
    result = CliRunner().invoke(cli, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output)
    assert set(metrics) >= KEYS
    assert metrics["avg_jct_s"] == pytest.approx((10 + (15 - 1)) / 2)  # b waits for a
    assert "usage: bulletin replay" in CliRunner().invoke(cli, ["replay", "--help"]).output


def test_a_failing_node_stops_its_jobs_which_queue_again_until_it_is_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two 2-GPU nodes. Job 0 runs on node 0 from 0 to 100; node 0 fails at 40, back at 300.
    # Job 0 moves to node 1 once job 1 leaves it (at 50), redoing 10 s lost, and job 2
    # (2 GPUs) waits for a node: node 1 is busy until 120, node 0 is down until 300.
    trace = write(tmp_path, "t.csv", "submit_time,duration,num_gpus\n0,100,2\n0,50,2\n1,10,2\n")
    failures = write(tmp_path, "f.csv", "node,down,up\n0,40,300\n")
    out = tmp_path / "jobs.csv"
    args = [trace, "--nodes", "2", "--gpus-per-node", "2", "--format", "json"]
    assert replay.main([*args, "--node-failures", failures, "--preemption-cost-s", "10",
                        "--jobs-out", str(out)]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert (result["node_failures"], result["interruptions"], result["completed"]) == (1, 1, 3)
    jobs = {r["job"]: r for r in csv.DictReader(out.open())}
    assert (jobs["0"]["end"], jobs["0"]["interruptions"], jobs["0"]["preemptions"]) == (
        "120", "1", "0")  # fmt: skip
    assert float(jobs["0"]["attained_gpu_s"]) == 2 * (100 + 10)
    assert (jobs["2"]["start"], jobs["2"]["end"]) == ("120", "130")
    never = write(tmp_path, "g.csv", "node,down,up\n1,0,\n0,5,\n")
    assert replay.main([*args, "--node-failures", never]) == 0
    assert json.loads(capsys.readouterr().out)["completed"] == 0  # no node ever again
    for text, says in [("node,down,up\n2,0,5\n", "not one of the cluster's 0..1"),
                       ("node,down,up\n0,9,5\n", "up after down"),
                       ("node,when\n0,5\n", "expected the columns node,down,up")]:  # fmt: skip
        bad = write(tmp_path, "bad.csv", text)
        assert replay.main([*args, "--node-failures", bad]) == 2
        assert says in capsys.readouterr().err


def test_fairness_over_the_due_does_not_count_lending_idle_gpus_as_unfair() -> None:
    from scheduler.metrics import Recorder

    rec = Recorder(8, {"tiny": 1.0, "b": 1.0, "c": 1.0})
    # A tiny group that borrowed three times its due, two that got exactly theirs.
    rec.due_s = {"tiny": 10.0, "b": 500.0, "c": 500.0}
    rec.got_s = {"tiny": 30.0, "b": 500.0, "c": 500.0}
    out = rec.summary()
    assert out["jain_fairness"] == pytest.approx(25 / 33)  # (3 + 1 + 1)^2 / (3 * 11)
    assert out["jain_due"] == 1.0
    rec.got_s["c"] = 250.0  # c got half its due
    assert rec.summary()["jain_due"] == pytest.approx(2.5**2 / (3 * 2.25))


def test_a_status_column_gives_each_job_its_outcome(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One GPU: the failed job still holds it for its 10 s, so the last job waits 20 s.
    trace = ("submit_time,duration,num_gpus,status\n0,10,1,Pass\n0,10,1,failed\n0,5,1,killed\n"
             "0,5,1,\n")  # fmt: skip
    result, rows = replay_jobs(tmp_path, capsys, trace, "--nodes", "1", "--gpus-per-node", "1")
    assert (result["completed"], result["failed"], result["cancelled"]) == (4, 1, 1)
    assert [r[-1] for r in rows] == ["completed", "failed", "cancelled", "completed"]
    assert [r[9] for r in rows] == ["0", "10", "20", "25"]  # queue_s


def test_an_unknown_status_is_refused_with_the_values_it_may_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "t.csv", "submit_time,duration,num_gpus,status\n0,10,1,exploded\n")
    assert replay.main([path]) == 2
    err = capsys.readouterr().err
    assert "exploded" in err and "completed, failed, cancelled" in err and "t.csv" in err


def test_a_negative_starvation_bound_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "t.csv", "submit_time,duration,num_gpus\n0,10,1\n")
    assert replay.main([path, "--policy", "fair", "--starve-after-s", "-60"]) == 2
    assert "--starve-after-s cannot be negative" in capsys.readouterr().err
    assert replay.main([path, "--policy", "fair", "--starve-after-s", "3600"]) == 0


@pytest.mark.parametrize("policy", ["fifo", "fair", "las", "srtf"])
def test_the_replay_keeps_each_node_s_expected_ends_and_each_group_s_gpus_as_its_running_calls_say(
    policy: str,
) -> None:
    # The replay hands rounds the running calls' expected ends and the GPUs each group holds
    # kept up to date (Snapshot.ends, Snapshot.held) rather than derived each round: through
    # starts, ends, preemptions, a node failure and calls sharing a GPU, every round must see
    # what deriving them would give.
    jobs = [
        Job(str(i), float(3 * i), float(20 + 7 * (i % 5)), gpus, group=f"g{i % 3}",
            user=f"u{i % 2}")
        for i, gpus in enumerate([1, 2, 4, 0.5, 8, 0.3, 1, 3, 4, 0.1, 2, 8, 1, 0.7, 0.2, 4] * 3)
    ]  # fmt: skip
    quotas = {"g0": Quota(4), "g1": Quota(2), "g2": Quota(2)}
    sim = Simulator(jobs, replay.get_policy(policy), Cluster.uniform(3, 4), quotas,
                    preemption_cost_s=5.0, failures=[(1, 30.0, 90.0)])  # fmt: skip
    planner, rounds = sim.plan, []

    def checked(now: float) -> Plan:
        derived = releases(Snapshot(sim.nodes, [], list(sim.running.values()), now=now), [])
        kept = releases(Snapshot(sim.nodes, [], [], now=now, ends=sim.ends), [])
        assert {n: e for n, e in kept.items() if e} == {n: e for n, e in derived.items() if e}
        counted = Book(list(sim.running.values()), quotas).used
        assert {g: n for g, n in sim.held.items() if n} == {g: n for g, n in counted.items() if n}
        if sim.standing is not None:  # (srtf: its running calls in expected-end order)
            fresh = Standing(sim.standing.key, sim.running.values())
            assert sim.standing.by_node == fresh.by_node
            assert {n: sorted(g) for n, g in sim.standing.leaving.items()} == {
                n: sorted(g) for n, g in fresh.leaving.items()
            }
        rounds.append(now)
        return planner(now)

    sim.plan = checked  # type: ignore[method-assign]
    sim.run()
    assert len(sim.completed) == len(jobs) and len(rounds) > len(jobs) // 2
    assert not any(sim.ends.by_node.values())  # (everything ended: nothing left listed)
    assert (sim.standing is None) == (policy != "srtf")
    assert sim.standing is None or not (sim.standing.by_node or sim.standing.leaving)


def test_the_replay_adds_up_what_each_group_held_and_was_due_over_time() -> None:
    # Two GPUs, two groups of equal weight. a holds both from 0 to 100; b asks for one at
    # 50 and waits for it until 100, then runs 10 s. The fair split: a both GPUs until 50,
    # one each from 50 to 100, b one from 100 to 110.
    jobs = [Job("a", 0, 100, 2, group="a"), Job("b", 50, 10, 1, group="b")]
    quotas = {"a": Quota(guaranteed=1), "b": Quota(guaranteed=1)}
    sim = Simulator(jobs, policies.get("fifo"), Cluster.uniform(1, 2), quotas)
    out = sim.run()
    assert sim.record.got_s == {"a": 200.0, "b": 10.0}
    assert sim.record.due_s == {"a": 150.0, "b": 60.0}
    assert out["utilization"] == pytest.approx(210 / 220)
    # got / due: 4/3 and 1/6.
    assert out["jain_fairness"] == pytest.approx((4 / 3 + 1 / 6) ** 2 / (2 * (16 / 9 + 1 / 36)))
    assert out["jain_due"] == pytest.approx((1 + 1 / 6) ** 2 / (2 * (1 + 1 / 36)))
    # The node fails for good at 100, just before a would end: a queues again, and neither
    # runs again. What they are due while they wait, one GPU each, counts up to the last
    # event (the node failing again at 130), though the replay ends with no job ending then.
    down = [(0, 100.0, None), (0, 130.0, None)]
    sim = Simulator(jobs, policies.get("fifo"), Cluster.uniform(1, 2), quotas, failures=down)
    sim.run()
    assert sim.record.got_s == {"a": 200.0, "b": 0.0}
    assert sim.record.due_s == {"a": 180.0, "b": 80.0}
