"""``bulletin node drain --wait``, ``undrain`` and ``remove`` through a real gateway: draining
waits for a real nodelet's running call; removing a node refuses one that is not drained
or still runs work, then revokes its token at once, hides it from ``node list`` and takes
its GPUs out of the cluster's capacity; ``node add`` brings it back."""

from __future__ import annotations

import time

import sdk
from bulletin import cli
from bulletin_core import wire
from nodelet import agent
from tests.conftest import Cluster, wait_until
from tests.integration.conftest import wait_until_running
from tests.integration.test_gateway_api import Http, call, register


def bulletin(cluster: Cluster, *args: str, status: int = 0) -> str:
    """Run ``bulletin ARGS`` against the cluster's database; its stdout (stderr if it
    failed, as it must with ``status``)."""
    from click.testing import CliRunner

    env = {"BULLETIN_DATABASE_URL": cluster.database_url}
    result = CliRunner().invoke(cli, list(args), env=env)
    assert result.exit_code == status, result.output
    return result.stdout if status == 0 else result.stderr


def nap(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return "rested"


def test_drain_waits_for_the_running_call_then_the_node_can_be_removed(cluster: Cluster) -> None:
    running = sdk.function()(nap).spawn(4)
    wait_until_running(running)
    assert "is not draining: drain it first" in bulletin(
        cluster, "node", "remove", "node-a", status=1
    )
    assert bulletin(cluster, "node", "drain", "node-a", "--wait", "0.5").splitlines() == [
        "node node-a is draining: it gets no new work",
        "node node-a still runs 1 call(s) after 0.5 s",
    ]
    assert "still runs 1 call(s): wait for them" in bulletin(
        cluster, "node", "remove", "node-a", status=1
    )
    started = time.monotonic()
    assert bulletin(cluster, "node", "drain", "node-a", "--wait", "60").splitlines() == [
        "node node-a was already draining (drained by an admin)",
        "node node-a runs no calls",
    ]
    assert time.monotonic() - started < 10, "the wait ends when the call does"
    assert running.result(timeout=10) == "rested"

    token = (cluster.dir / "node-a.token").read_text()
    assert bulletin(cluster, "node", "remove", "node-a") == "node node-a removed\n"
    # At once: the nodelet's own token is refused, and the nodelet, told so, stops.
    assert Http(cluster.url, token).post("/v1/node/leave", {}).status_code == 401
    assert "node-a" not in bulletin(cluster, "node", "list")
    [nodelet] = cluster.nodelets
    wait_until(lambda: nodelet.poll() is not None, 15, "the removed node's nodelet to stop")
    assert "rejected the node token" in (cluster.dir / "node-a.log").read_text()
    assert nodelet.returncode == agent.REJECTED_EXIT  # which systemd is told not to restart


def test_a_removed_node_is_refused_and_counts_for_nothing_until_added_again(
    gateway: Cluster,
) -> None:
    big = register(gateway, "node-b", gpus=4)
    register(gateway, "node-c", gpus=1)
    alice = Http(gateway.url, gateway.token)

    def submit_four_gpus() -> int:
        return alice.post("/v1/invocations", wire.SubmitRequest(calls=[call(gpus=4)])).status_code

    assert bulletin(gateway, "node", "undrain", "node-b") == "node node-b was not draining\n"
    assert "is not draining" in bulletin(gateway, "node", "remove", "node-b", status=1)

    drain = ("node", "drain", "node-b")
    out = bulletin(gateway, *drain, "--reason", "old PSU")
    assert out == "node node-b is draining: it gets no new work\n"
    assert bulletin(gateway, *drain) == "node node-b was already draining (old PSU)\n"
    out = bulletin(gateway, *drain, "--reason", "upgrade", "--wait", "5")
    assert out.splitlines() == [
        "node node-b was already draining (old PSU)",
        "node node-b runs no calls",
    ]
    assert "DRAINING (old PSU)" in bulletin(gateway, "node", "list"), "the first reason stays"
    assert bulletin(gateway, "node", "undrain", "node-b", "--if-reason", "upgrade") == (
        "node node-b drains for another reason (old PSU): left draining\n"
    )
    assert "DRAINING (old PSU)" in bulletin(gateway, "node", "list")
    assert submit_four_gpus() == 201  # a drained node still counts

    assert bulletin(gateway, "node", "remove", "node-b") == "node node-b removed\n"
    poll = wire.PollRequest(running=[], timeout_s=0)
    assert big.post("/v1/node/poll", poll).status_code == 401
    assert submit_four_gpus() == 422  # never fits: the removed node's GPUs are gone
    listed = bulletin(gateway, "node", "list")
    assert "node-b" not in listed and "node-c: 1 GPUs" in listed
    assert bulletin(gateway, "node", "remove", "node-b") == "no node named node-b\n"
    assert "no node named 'node-b'" in bulletin(gateway, *drain, status=1)
    assert "no node named 'node-b'" in bulletin(gateway, "node", "undrain", "node-b", status=1)

    token = bulletin(gateway, "node", "add", "node-b").strip()
    gpus = [
        wire.GpuInfo(index=i, uuid=f"b{i}", name="Fake", memory_mb=1, fake=True) for i in range(4)
    ]
    again = wire.RegisterRequest(name="node-b", gpus=gpus, cpu_slots=1)
    assert Http(gateway.url, token).post("/v1/node/register", again).status_code == 200
    assert big.post("/v1/node/poll", poll).status_code == 401, "its old token stays revoked"
    [line] = [line for line in bulletin(gateway, "node", "list").splitlines() if "node-b" in line]
    assert line.startswith("node-b: 4 GPUs") and line.endswith("in service")
    assert submit_four_gpus() == 201
