"""The fair scheduler live: a group gets its guarantee back by preempting borrowed work
(which is queued again and completes), calls that can never fit are refused at submission
with the reason, a waiting call says why, usage is accounted, and admins manage quotas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import sdk
from bulletin import admin
from tests.conftest import Cluster, running, wait_until


@pytest.fixture
def fair(database_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A gateway with the fair policy and a 1 s preemption grace; no nodelet yet."""
    options = {"scheduler-policy": "fair", "preemption-grace-s": "1"}
    with running(Cluster(database_url, tmp_path), request, options=options) as cluster:
        yield cluster


def hold(directory: str, name: str) -> str:
    """Runs until ``directory/release`` exists; a SIGTERM (a preemption notice) is noted in
    ``directory/<name>.notice`` and ends the call as Python's default would."""
    import os
    import signal
    import sys
    import time

    def notice(signum: int, frame: object) -> None:
        with open(os.path.join(directory, f"{name}.notice"), "a") as file:
            file.write("SIGTERM\n")
        sys.exit(1)

    signal.signal(signal.SIGTERM, notice)
    open(os.path.join(directory, f"{name}.started"), "a").close()
    while not os.path.exists(os.path.join(directory, "release")):
        time.sleep(0.05)
    return f"{name} done"


def quick(tag: str) -> str:
    return f"{tag} ran"


def test_a_group_gets_its_guarantee_back_by_preempting_borrowed_work(
    fair: Cluster, tmp_path: Path
) -> None:
    fair.set_group("vision", 1)
    fair.set_group("nlp", 1)
    alice = fair.add_user("alice", group="vision")
    bob = fair.add_user("bob", group="nlp")
    fair.start_nodelet(fake_gpus=2)
    gpu_hold = sdk.function(gpus=1, max_retries=0)(hold)
    sdk.connect(fair.url, alice)
    first = gpu_hold.spawn(str(tmp_path), "first")
    wait_until(lambda: (tmp_path / "first.started").exists(), 30, "alice's first call to start")
    second = gpu_hold.spawn(str(tmp_path), "second")  # over vision's guarantee: borrowed
    wait_until(lambda: (tmp_path / "second.started").exists(), 30, "alice's borrowed call")

    sdk.connect(fair.url, bob)  # alice's calls keep their own client
    bobs = sdk.function(gpus=1)(quick).spawn("bob")
    assert bobs.result(timeout=60) == "bob ran", "nlp got its guaranteed GPU back"
    assert (tmp_path / "second.notice").read_text() == "SIGTERM\n", "the youngest got notice"
    assert not (tmp_path / "first.notice").exists(), "work within the guarantee is not touched"
    status = second.status()
    assert status.preemptions == 1
    assert status.preempt_reason and "nlp" in status.preempt_reason
    assert first.status() == "running" and first.status().preemptions == 0

    (tmp_path / "release").touch()
    assert first.result(timeout=60) == "first done"
    assert second.result(timeout=60) == "second done", "the preempted call ran again"
    assert second.info().attempts == 1, "a preemption does not use up a retry"
    # Its log says so, between what the two runs printed.
    logs = httpx.get(
        f"{fair.url}/v1/invocations/{second.id}/logs",
        headers={"Authorization": f"Bearer {alice}"},
        timeout=30,
    ).text
    assert "[bulletin] preempted (" in logs and "nlp" in logs
    assert "this run does not count as an attempt" in logs
    gateway_log = (fair.dir / "gateway.log").read_text()
    assert f"preempting {second.id}" in gateway_log


def save_and_return(directory: str) -> str:
    """Runs until SIGTERM, then saves its work within the grace and returns normally."""
    import os
    import signal
    import time

    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    open(os.path.join(directory, "saver.started"), "a").close()
    while not stop:
        time.sleep(0.05)
    return "saved"


def test_a_preempted_call_that_finishes_within_its_grace_completes(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    options = {"scheduler-policy": "fair", "preemption-grace-s": "10"}
    with running(Cluster(database_url, tmp_path), request, options=options) as cluster:
        cluster.set_group("vision", 0)
        cluster.set_group("nlp", 1)
        sdk.connect(cluster.url, cluster.add_user("alice2", group="vision"))
        cluster.start_nodelet(fake_gpus=1)
        saver = sdk.function(gpus=1, max_retries=0)(save_and_return).spawn(str(tmp_path))
        wait_until(lambda: (tmp_path / "saver.started").exists(), 30, "the borrowed call")
        sdk.connect(cluster.url, cluster.add_user("bob2", group="nlp"))
        bobs = sdk.function(gpus=1)(quick).spawn("bob")
        assert saver.result(timeout=30) == "saved", "it finished within the grace: kept"
        assert saver.info().state == "succeeded" and saver.info().preemptions == 0
        assert bobs.result(timeout=30) == "bob ran"


def test_calls_that_can_never_fit_are_refused_with_the_reason(fair: Cluster) -> None:
    fair.set_group("small", 1, borrow_limit=0)
    sdk.connect(fair.url, fair.add_user("carol", group="small"))
    fair.start_nodelet(fake_gpus=2)
    wait_until(lambda: "registered" in (fair.dir / "node-a.log").read_text(), 30, "the node")
    cases = [
        (sdk.function(gpus=2)(quick), "group small may hold at most 1"),
        (sdk.function(gpus=1, gpu="A100")(quick), "no node has A100 GPUs; models here: Fake"),
        (sdk.function(gpus=1, gpu=["A100", "H100"])(quick), "no node has A100 or H100 GPUs"),
        (sdk.function(gpus=1, gpu_memory_gb=64)(quick), "with at least 61035 MiB"),
    ]
    for fn, reason in cases:
        with pytest.raises(sdk.InvalidRequest, match=reason):
            fn("x")
    sdk.connect(fair.url, fair.token)  # alice, in 'default': no quota ceiling
    with pytest.raises(sdk.InvalidRequest, match=r"the largest node has 2"):
        sdk.function(gpus=3)(quick)("x")
    assert sdk.function(gpus=1, gpu="Fake", gpu_memory_gb=16)(quick)("y") == "y ran"
    assert sdk.function(gpus=1, gpu=["H100", "fake"])(quick)("z") == "z ran"  # any of them


def test_only_administrators_raise_a_calls_priority(fair: Cluster) -> None:
    fair.start_nodelet(fake_gpus=1)
    sdk.connect(fair.url, fair.token)
    with pytest.raises(sdk.InvalidRequest, match="only administrators may raise a call's prio"):
        sdk.function(priority=5)(quick)("x")
    assert sdk.function(priority=-5)(quick)("nice") == "nice ran"
    sdk.connect(fair.url, fair.add_user("root", is_admin=True))
    urgent = sdk.function(priority=5)(quick).spawn("urgent")
    assert urgent.result(timeout=30) == "urgent ran" and urgent.info().priority == 5


def test_a_call_too_big_for_every_live_node_waits_without_holding_gpus(
    fair: Cluster, tmp_path: Path
) -> None:
    fair.start_nodelet("node-a", fake_gpus=2)
    fair.start_nodelet("node-b", fake_gpus=1)
    sdk.connect(fair.url, fair.token)
    for name in ("node-a", "node-b"):
        log = fair.dir / f"{name}.log"
        wait_until(lambda log=log: "registered" in log.read_text(), 30, f"{name} to register")
    asyncio.run(admin.drain(fair.database_url, "node-a", "maintenance"))
    pair = sdk.function(gpus=2)(quick).spawn("pair")  # node-a could take it: accepted
    wait_until(lambda: pair.status().reason is not None, 30, "the scheduler's explanation")
    assert "needs 2 GPUs on one node; the largest live node has 1" in str(pair.status().reason)
    sdk.connect(fair.url, fair.add_user("bob"))
    assert sdk.function(gpus=1)(quick)("single") == "single ran", "node-b is not held for it"
    asyncio.run(admin.undrain(fair.database_url, "node-a"))
    assert pair.result(timeout=30) == "pair ran"


def test_group_quotas_change_only_what_the_admin_says(fair: Cluster) -> None:
    from click.testing import CliRunner

    from bulletin import cli

    env = {"BULLETIN_DATABASE_URL": fair.database_url}
    run = lambda *args: CliRunner().invoke(cli, list(args), env=env)  # noqa: E731
    assert run("group", "set", "vision", "--guaranteed", "4", "--borrow-limit", "8").exit_code == 0
    out = run("group", "set", "vision", "--guaranteed", "6").output
    assert "6 GPUs guaranteed, borrows up to 8 more" in out
    assert "borrows no limit" in run("group", "set", "vision", "--no-borrow-limit").output
    assert run("group", "set", "vision", "--guaranteed", "99999999999").exit_code == 2
    bad = run("group", "set", "vision!")
    assert bad.exit_code == 2 and "starting with a letter or digit" in bad.output
    assert run("user", "set-group", "alice", "vision").exit_code == 0
    assert "no group 'nope'" in run("user", "set-group", "alice", "nope").output
    assert (
        "vision: 6 GPUs guaranteed, borrow limit no limit, 1 users" in run("group", "list").output
    )


def test_a_waiting_call_says_where_it_stands_and_why(fair: Cluster, tmp_path: Path) -> None:
    fair.start_nodelet(fake_gpus=2)
    sdk.connect(fair.url, fair.token)
    gpu_hold = sdk.function(gpus=2)(hold)
    holding = gpu_hold.spawn(str(tmp_path), "all")
    wait_until(lambda: (tmp_path / "all.started").exists(), 30, "the call holding both GPUs")
    waiting = sdk.function(gpus=1)(quick).spawn("later")
    wait_until(lambda: waiting.status().position is not None, 30, "the scheduler's explanation")
    status = waiting.status()
    assert status == "queued" and status.position == 1
    assert status.reason and "GPU" in status.reason
    assert "position 1" in repr(status)
    (tmp_path / "release").touch()
    assert holding.result(timeout=30) == "all done"
    assert waiting.result(timeout=30) == "later ran"
    assert waiting.status().position is None


def test_usage_is_accounted_per_user_and_group(fair: Cluster, tmp_path: Path) -> None:
    fair.set_group("vision", 2)
    sdk.connect(fair.url, fair.add_user("dave", group="vision"))
    fair.start_nodelet(fake_gpus=2)

    @sdk.function(gpus=2)
    def busy(seconds: float) -> None:
        time.sleep(seconds)

    busy(2.0)
    rows: list[admin.db.UsageRow] = []

    def accounted() -> bool:
        rows[:] = asyncio.run(admin.usage(fair.database_url, 1))
        return any(r.user == "dave" and r.calls == 1 for r in rows)

    wait_until(accounted, 10, "the leader to accrue dave's usage")
    [dave] = [r for r in rows if r.user == "dave"]
    assert dave.group == "vision"
    assert 2 * 2.0 <= dave.gpu_seconds < 2 * 2.0 + 2 * 3, "2 GPUs for about 2 s"


def test_admins_manage_groups_over_http(fair: Cluster) -> None:
    root = httpx.Client(
        base_url=fair.url,
        headers={"Authorization": f"Bearer {fair.add_user('root', is_admin=True)}"},
    )
    user = httpx.Client(base_url=fair.url, headers={"Authorization": f"Bearer {fair.token}"})
    assert user.get("/v1/admin/groups").status_code == 403
    assert user.put("/v1/admin/groups/x", json={"guaranteed_gpus": 1}).status_code == 403
    r = root.put("/v1/admin/groups/vision", json={"guaranteed_gpus": 8, "borrow_limit_gpus": 16})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "name": "vision", "guaranteed_gpus": 8, "borrow_limit_gpus": 16, "users": 0, "models": {}
    }  # fmt: skip
    assert root.put("/v1/admin/users/alice/group", json={"group": "vision"}).status_code == 204
    groups = {g["name"]: g for g in root.get("/v1/admin/groups").json()}
    assert groups["vision"]["users"] == 1 and groups["default"]["guaranteed_gpus"] == 0
    bad = [
        root.put("/v1/admin/groups/bad name", json={"guaranteed_gpus": 1}),
        root.put("/v1/admin/groups/v", json={"guaranteed_gpus": -1}),
        root.put("/v1/admin/users/alice/group", json={"group": "nope"}),
        root.get("/v1/admin/usage", params={"days": 0}),
    ]
    assert [r.status_code for r in bad] == [422, 422, 422, 422], [r.text for r in bad]
    assert "create it first" in bad[2].json()["detail"]
    assert root.put("/v1/admin/users/nobody/group", json={"group": "vision"}).status_code == 404
    assert root.get("/v1/admin/usage").json() == []


def test_a_group_holds_no_more_of_a_model_than_its_quota_for_it(
    fair: Cluster, tmp_path: Path
) -> None:
    root = _http(fair.url, fair.add_user("root", is_admin=True))
    quota = {"guaranteed_gpus": 0, "models": {"A100": {"borrow_limit_gpus": 1}}}
    r = root.put("/v1/admin/groups/vision", json=quota)
    assert r.status_code == 200, r.text
    assert r.json()["models"] == {"A100": {"guaranteed_gpus": 0, "borrow_limit_gpus": 1}}
    clash = {"models": {"A100": {}, "a100": {}}}
    r = root.put("/v1/admin/groups/vision", json=clash)
    assert r.status_code == 422 and "differ only in case" in r.json()["detail"]
    r = root.put("/v1/admin/groups/vision", json={"models": {"A100|H100": {}}})
    assert r.status_code == 422, r.text
    r = root.put("/v1/admin/groups/vision", json={"guaranteed_gpus": 0})  # models left as they are
    assert r.json()["models"] == {"A100": {"guaranteed_gpus": 0, "borrow_limit_gpus": 1}}
    sdk.connect(fair.url, fair.add_user("vic", group="vision"))
    fair.start_nodelet("node-a", fake_gpus=2, **{"fake-gpu-model": "NVIDIA A100-SXM4-80GB"})
    fair.start_nodelet("node-b", fake_gpus=2, **{"fake-gpu-model": "NVIDIA H100 80GB HBM3"})
    for name in ("node-a", "node-b"):
        log = fair.dir / f"{name}.log"
        wait_until(lambda log=log: "registered" in log.read_text(), 30, name)  # type: ignore[misc]
    with pytest.raises(sdk.InvalidRequest, match="at most 1 A100"):
        sdk.function(gpus=2, gpu="A100")(quick)("x")  # could never run
    a100 = sdk.function(gpus=1, gpu="A100")(hold)
    first = a100.spawn(str(tmp_path), "first")
    wait_until(lambda: (tmp_path / "first.started").exists(), 30, "the first A100 call")
    second = a100.spawn(str(tmp_path), "second")
    wait_until(lambda: second.status().reason is not None, 30, "the scheduler's explanation")
    reason = second.status().reason or ""
    assert "quota for the GPU models" in reason and "1 of at most 1 A100" in reason, reason
    anywhere = sdk.function(gpus=1)(hold).spawn(str(tmp_path), "anywhere")
    wait_until(lambda: (tmp_path / "anywhere.started").exists(), 30, "a call of any model")
    assert anywhere.info().node == "node-b"  # the A100 left is not the group's to take
    assert second.status() == "queued"
    (tmp_path / "release").touch()
    assert [c.result(timeout=30) for c in (first, second, anywhere)] == [
        "first done", "second done", "anywhere done"]  # fmt: skip
    assert first.info().node == second.info().node == "node-a"


def test_admins_set_quotas_per_model_from_the_command_line(fair: Cluster) -> None:
    from click.testing import CliRunner

    from bulletin import cli

    env = {"BULLETIN_DATABASE_URL": fair.database_url}
    run = lambda *args: CliRunner().invoke(cli, list(args), env=env)  # noqa: E731
    assert run("group", "set", "vision", "--guaranteed", "8").exit_code == 0
    out = run("group", "set", "vision", "--model", "A100", "--guaranteed", "2",
              "--borrow-limit", "0").output  # fmt: skip
    assert out.strip() == (
        "group vision: 8 GPUs guaranteed, borrows no limit; "
        "A100: 2 GPUs guaranteed, borrows up to 0 more"
    )
    out = run("group", "set", "vision", "--model", "A100", "--no-borrow-limit").output
    assert "A100: 2 GPUs guaranteed, borrows no limit" in out  # its guarantee kept
    assert "8 GPUs guaranteed" in run("group", "set", "vision", "--model", "H100").output
    listed = run("group", "list").output
    assert "  A100: 2 guaranteed, borrow limit no limit\n  H100: 0 guaranteed" in listed
    bad = run("group", "set", "vision", "--model", "A100|H100")
    assert bad.exit_code == 2 and "one GPU model" in bad.output
    # Models match case-insensitively: this is the same model's quota, renamed.
    out = run("group", "set", "vision", "--model", "a100", "--guaranteed", "1").output
    assert "a100: 1 GPUs guaranteed, borrows no limit" in out and "A100" not in out
    assert run("group", "set", "vision", "--drop-model").exit_code == 2
    out = run("group", "set", "vision", "--model", "A100", "--drop-model").output
    assert "A100" not in out.upper() and "H100: 0 GPUs guaranteed" in out
    gone = run("group", "set", "vision", "--model", "L40S", "--drop-model")
    assert gone.exit_code == 1 and "no quota for GPU model 'L40S'" in gone.output
    [vision] = [g for g in asyncio.run(admin.groups(fair.database_url)) if g.name == "vision"]
    assert [m.model for m in vision.models] == ["H100"]


def _http(url: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"})


def test_a_call_prefers_a_node_where_its_function_is_warm(fair: Cluster, tmp_path: Path) -> None:
    # node-a, registered first, comes first among equals; a blocker keeps it busy while
    # `quick` first runs, on node-b.
    fair.start_nodelet("node-a", fake_gpus=1)
    sdk.connect(fair.url, fair.token)
    blocker = sdk.function(gpus=1)(hold).spawn(str(tmp_path), "blocker")
    wait_until(lambda: (tmp_path / "blocker.started").exists(), 30, "the blocker to start")
    fair.start_nodelet("node-b", fake_gpus=1)
    where = sdk.function(gpus=1)(quick)
    first = where.spawn("first")
    assert first.result(timeout=30) == "first ran"
    (tmp_path / "release").touch()
    assert blocker.result(timeout=30) == "blocker done"
    assert (blocker.info().node, first.info().node) == ("node-a", "node-b")
    # Both nodes are free and equal now; the one where `quick` is warm wins once its
    # heartbeat (every 0.5 s here) has reported it.
    time.sleep(2)
    second = where.spawn("second")
    assert second.result(timeout=30) == "second ran"
    assert second.info().node == "node-b"
    assert second.info().timeline.warm
