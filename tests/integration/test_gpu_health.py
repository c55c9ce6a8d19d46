"""GPU health through a real cluster: a fake GPU made to report a critical XID drains its
node (no new work), the admin undrains it with the CLI, and drains it by hand."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import sdk
from bulletin import admin
from gateway.db import NodeStatus
from tests.conftest import Cluster, wait_until


def double(x: int) -> int:
    return 2 * x


def bulletin(cluster: Cluster, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "bulletin", *args],
        env={**os.environ, "BULLETIN_DATABASE_URL": cluster.database_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def node_status(cluster: Cluster) -> NodeStatus:
    [status] = asyncio.run(admin.nodes(cluster.database_url))
    return status


def test_a_critical_xid_drains_the_node_until_an_admin_undrains_it(gateway: Cluster) -> None:
    faults = gateway.dir / "faults"
    gateway.start_nodelet(**{"fake-gpu-faults": str(faults)})
    sdk.connect(gateway.url, gateway.token)
    fn = sdk.function(gpus=1)(double)
    assert fn(1) == 2
    wait_until(lambda: node_status(gateway).gpu_health, 10, "a health report")
    assert node_status(gateway).gpu_health[0].temperature_c == 35
    assert not node_status(gateway).draining

    faults.write_text("0 xid 79\n")
    wait_until(lambda: node_status(gateway).draining, 10, "the node to drain")
    status = node_status(gateway)
    assert status.drain_reason is not None and "GPU 0" in status.drain_reason
    assert "XID 79" in status.drain_reason
    assert "DRAINING" in bulletin(gateway, "node", "list")

    call = fn.spawn(2)  # no new work on a draining node
    time.sleep(2)
    assert call.status() == "queued"
    assert "takes work again" in bulletin(gateway, "node", "undrain", "node-a")
    assert call.result(timeout=30) == 4  # the XID was reported once: the node stays in service
    assert not node_status(gateway).draining
    assert "this node is draining" in (gateway.dir / "node-a.log").read_text()


def test_an_admin_drains_a_node_by_hand(cluster: Cluster) -> None:
    out = bulletin(cluster, "node", "drain", "node-a", "--reason", "new PSU")
    assert "draining" in out
    assert "DRAINING (new PSU)" in bulletin(cluster, "node", "list")
    call = sdk.function()(double).spawn(5)
    time.sleep(2)
    assert call.status() == "queued"
    bulletin(cluster, "node", "undrain", "node-a")
    assert call.result(timeout=30) == 10
