"""A nodelet cut off from the gateway kills its own running work before its lease can expire
and the call run elsewhere (design invariant 3), through a pausing TCP proxy on loopback."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import cloudpickle
import psutil

import sdk
from tests.conftest import Cluster, wait_until
from tests.proxy import FaultProxy

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def hang(path: str) -> str:
    import os

    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
    return "never"


def test_a_partitioned_nodelet_kills_its_work_before_the_lease_expires(
    gateway: Cluster, tmp_path: Path
) -> None:
    port = int(gateway.url.rsplit(":", 1)[1])
    with FaultProxy(port) as proxy:
        direct_url = gateway.url
        gateway.url = proxy.url  # the nodelet reaches the gateway only through the proxy
        gateway.start_nodelet()
        gateway.url = direct_url
        sdk.connect(direct_url, gateway.token)
        pidfile = tmp_path / "pid"
        call = sdk.function(gpus=1, max_retries=1)(hang).spawn(str(pidfile))
        wait_until(lambda: pidfile.exists() and pidfile.read_text(), 30, "the call to start")
        worker = psutil.Process(int(pidfile.read_text()))
        proxy.pause()
        worker_died = requeued = None
        deadline = time.monotonic() + 20
        while (worker_died is None or requeued is None) and time.monotonic() < deadline:
            if worker_died is None and not worker.is_running():
                worker_died = time.monotonic()
            if requeued is None and (call.status() == "queued" or call.info().attempts == 2):
                requeued = time.monotonic()
            time.sleep(0.02)
        assert worker_died is not None, "the cut-off nodelet left its work running"
        assert requeued is not None, "the gateway never took the call back"
        assert worker_died < requeued, "the call was requeued while its first attempt still ran"
        call.cancel()
