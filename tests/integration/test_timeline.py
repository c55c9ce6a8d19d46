"""Every call's time-to-first-loss timeline, through a real cluster: each step stamped in
order, warm versus cold workers, the first fetch, and the sdk's call.timings / last_call."""

from __future__ import annotations

import threading
import time

import httpx
import psutil

import sdk
from tests.conftest import Cluster, wait_until
from tests.integration.test_sse_logs import open_logs


def double(x: int) -> int:
    return 2 * x


STEPS = ("submitted", "scheduled", "delivered", "worker_acquired", "started", "finished")


def test_a_blocking_call_records_every_step_in_order(cluster: Cluster) -> None:
    fn = sdk.function()(double)
    assert fn.last_call is None
    assert fn(21) == 42
    call = fn.last_call
    assert call is not None
    timings = call.timings
    stamps = [getattr(timings, step) for step in STEPS]
    assert all(stamp is not None for stamp in stamps), timings
    # One machine: the node's clock and the database's are the same clock.
    assert stamps == sorted(stamps), timings
    assert timings.stored is not None and timings.finished <= timings.stored  # type: ignore[operator]
    assert timings.fetched is not None and timings.stored <= timings.fetched
    assert timings.warm is True  # the nodelet keeps spare workers started
    assert sdk.Call.from_id(call.id).timings == timings  # the API returns the same timeline


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return "rested"


def test_only_the_owner_fetching_a_result_stamps_it_not_an_admin_following_it(
    cluster: Cluster,
) -> None:
    # The gateway hands a result over to its owner's request waiting for it as the completion
    # commits, stamping it fetched there; an administrator following the call's log stream
    # on the same gateway as it completes, or reading it, fetches nothing.
    boss = cluster.add_user("boss", is_admin=True)
    call = sdk.function()(nap).spawn(1.0)  # alice's
    followed: list[str] = []

    def follow() -> None:
        with open_logs(cluster, call.id, token=boss) as stream:
            followed.extend(event.event for event in stream.events)

    follower = threading.Thread(target=follow)
    follower.start()
    follower.join(30)
    assert followed and followed[-1] == "end"  # it followed the call to its end
    admin = httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {boss}"})
    seen = admin.get(f"/v1/invocations/{call.id}").json()
    assert seen["state"] == "succeeded" and seen["timeline"]["fetched"] is None
    assert call.result(timeout=30) == "rested"
    stamped = sdk.Call.from_id(call.id).timings
    assert stamped.fetched is not None and stamped.stored <= stamped.fetched  # type: ignore[operator]


def test_a_call_without_a_spare_worker_is_cold_and_the_next_one_warm(gateway: Cluster) -> None:
    gateway.start_nodelet(**{"spare-workers": "0", "gpu-spare-workers": "0"})
    sdk.connect(gateway.url, gateway.token)
    fn = sdk.function(gpus=1)(double)
    assert fn(1) == 2
    first = fn.last_call
    assert fn(2) == 4
    second = fn.last_call
    assert first is not None and second is not None
    assert first.timings.warm is False  # a worker process was started for it
    assert second.timings.warm is True  # the same owner on the same GPU: kept warm
    cold = first.timings.started - first.timings.worker_acquired  # type: ignore[operator]
    assert cold >= 0
    assert "warm-pool miss" in (gateway.dir / "node-a.log").read_text()


def test_a_gpu_call_gets_a_spare_started_with_its_gpu(gateway: Cluster) -> None:
    nodelet = gateway.start_nodelet(**{"spare-workers": "0", "gpu-spare-workers": "1"})
    sdk.connect(gateway.url, gateway.token)
    # One spare per fake GPU, started once the node has registered.
    wait_until(lambda: len(psutil.Process(nodelet.pid).children()) >= 2, 30, "GPU spares")
    fn = sdk.function(gpus=1)(double)
    assert fn(1) == 2
    assert fn.last_call is not None and fn.last_call.timings.warm is True
