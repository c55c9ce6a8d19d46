"""The fault suite: DESIGN.md's invariants under node, network and control-plane faults.

Each test injects one fault into a real cluster (gateway and nodelet subprocesses, real
PostgreSQL, loopback proxies for the network) and checks the history of its calls with
:class:`tests.faults.History`: every accepted call ends in exactly one terminal state, runs
at most ``max_retries + 1`` times and never more often than it was counted, and returns its
last execution's result. docs/reliability.md lists each guarantee with its scenario here.
Timeouts are small (tests/conftest.py FAST_GATEWAY: 3 s leases, 0.5 s heartbeats).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

import sdk
from tests.conftest import ROOT, Cluster, running, wait_until
from tests.faults import History, work
from tests.processes import alive
from tests.proxy import FaultProxy


@pytest.fixture
def history(tmp_path: Path) -> History:
    directory = tmp_path / "history"
    directory.mkdir()
    return History(directory)


def _log(cluster: Cluster, name: str) -> str:
    return (cluster.dir / f"{name}.log").read_text(errors="replace")


def _call_logs(cluster: Cluster, call: sdk.Call[object]) -> str:
    """What the call's log stream (SSE) carries, Bulletin's own lines included."""
    return httpx.get(
        f"{cluster.url}/v1/invocations/{call.id}/logs",
        headers={"Authorization": f"Bearer {cluster.token}"},
        timeout=30,
    ).text


@pytest.fixture
def long_lease(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """A 10 s lease: what happens within it does not race its expiry on a loaded machine."""
    options = {"lease-s": "10", "node-timeout-s": "10"}
    with running(Cluster(database_url, tmp_path), request, options=options) as cluster:
        yield cluster


def test_a_nodelet_restarted_inside_its_lease_runs_nothing_of_its_predecessor_again(
    long_lease: Cluster, history: History
) -> None:
    """A restarted nodelet is a new incarnation: the attempt its predecessor held goes back
    to the queue with a new epoch (counted), instead of being delivered to it again."""
    gateway = long_lease
    first = gateway.start_nodelet()
    sdk.connect(gateway.url, gateway.token)
    with history.gpus_never_shared():
        history.spawn("call", 3, max_retries=2, gpus=2)
        history.wait_started("call")
        first.send_signal(signal.SIGKILL)
        first.wait()
        gateway.start_nodelet()  # at once: well inside the lease
        info = history.check("call")
    assert info.state == "succeeded"
    assert len(history.executions("call")) == 2 and info.attempts == 2
    assert history.gpu_executions() == 2  # both on GPUs 0 and 1 of node-a, never at once
    assert "took back what it held before" in _log(gateway, "gateway")
    call, _ = history.calls["call"]
    assert "[bulletin] the nodelet running this call restarted" in _call_logs(gateway, call)
    assert "queued again to run from the start (attempt 2 of at most 3)" in _call_logs(
        gateway, call
    )


def test_a_second_start_of_a_node_supersedes_the_first_which_stops(
    gateway: Cluster, history: History
) -> None:
    first = gateway.start_nodelet()
    sdk.connect(gateway.url, gateway.token)
    history.spawn("call", 30, max_retries=1)
    history.wait_started("call")
    # The same node again, while the first still runs, as from another machine: a state
    # directory of its own (one start of the same kills the first before it registers:
    # tests/integration/test_process_tracking.py).
    gateway.start_nodelet(**{"state-dir": str(gateway.dir / "state-node-a-elsewhere")})
    assert first.wait(15) == 3  # a distinct status, for RestartPreventExitStatus=3
    assert "another start of it replaced this one" in _log(gateway, "node-a")
    assert "exit status 3 (superseded" in _log(gateway, "node-a")
    # Its call was taken back and runs once more, on the new incarnation.
    wait_until(lambda: len(history.executions("call")) == 2, 30, "the call to run again")
    call, _ = history.calls["call"]
    assert call.info().attempts == 2
    call.cancel()


@pytest.fixture
def two_nodes(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    with running(
        Cluster(database_url, tmp_path), request, options={"silent-hold-s": "60"}
    ) as cluster:
        for name in ("node-a", "node-b"):
            cluster.start_nodelet(name, fake_gpus=1, cpu_slots=1)
        sdk.connect(cluster.url, cluster.token)
        yield cluster


def test_when_every_nodelet_goes_silent_at_once_no_call_is_requeued(
    two_nodes: Cluster, history: History
) -> None:
    """Every node silent for twice the lease is a control-plane or network fault, not two
    node faults: the leader holds expiry, the nodes renew when they come back, and each call
    finishes its one execution."""
    history.spawn("a", 6)
    history.spawn("b", 6)
    history.wait_started("a", "b")
    for nodelet in two_nodes.nodelets:
        nodelet.send_signal(signal.SIGSTOP)
    time.sleep(6.5)  # past the 3 s lease, twice over; the calls themselves end meanwhile
    for nodelet in two_nodes.nodelets:
        nodelet.send_signal(signal.SIGCONT)
    for key in ("a", "b"):
        info = history.check(key)
        assert info.state == "succeeded" and info.attempts == 1, key
        assert len(history.executions(key)) == 1, key
    assert "stopped renewing at once" in _log(two_nodes, "gateway")


def test_a_silence_longer_than_the_hold_expires_its_leases_in_the_end(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest, history: History
) -> None:
    options = {"silent-hold-s": "3", "max-expiries-per-round": "1"}
    with running(Cluster(database_url, tmp_path), request, options=options) as cluster:
        for name in ("node-a", "node-b"):
            cluster.start_nodelet(name, fake_gpus=0, cpu_slots=2)
        sdk.connect(cluster.url, cluster.token)
        for key in ("a", "b", "c"):
            history.spawn(key, 300, max_retries=0)
        history.wait_started("a", "b", "c")
        killed = time.monotonic()
        for nodelet in cluster.nodelets:
            nodelet.send_signal(signal.SIGKILL)
        for key in ("a", "b", "c"):
            info = history.check(key, timeout=30)
            assert info.state == "failed" and info.error_kind == "node_lost", key
        # Not before the lease (3 s) plus the hold (3 s).
        assert time.monotonic() - killed >= 6


def _through(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit(":", 1)[0] + f":{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def test_a_database_outage_does_not_kill_healthy_calls(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest, history: History
) -> None:
    """While PostgreSQL is down the gateway answers 503 db_unavailable; the nodelet keeps
    its calls (nobody can reassign them), and after the database returns the leader gives
    every lease a full term before it expires any: the calls finish, each run once."""
    pg_port = int(urlsplit(database_url).port or 5432)
    with FaultProxy(pg_port) as proxy:
        cluster = Cluster(_through(database_url, proxy.port), tmp_path)
        with running(cluster, request):
            cluster.start_nodelet()
            sdk.connect(cluster.url, cluster.token)
            with history.gpus_never_shared():
                history.spawn("long", 12)
                history.spawn("other", 12, gpus=1)
                history.wait_started("long", "other")
                proxy.refuse()
                time.sleep(8)  # past the lease (3 s) and the nodelet's kill deadline, twice
                proxy.accept()
                for key in ("long", "other"):
                    info = history.check(key, timeout=60)
                    assert info.state == "succeeded" and info.attempts == 1, key
                    assert len(history.executions(key)) == 1, key
            nodelet_log = _log(cluster, "node-a")
            assert "database is unavailable; keeping the 2 running attempts" in nodelet_log
            assert "killing it before its lease expires" not in nodelet_log
            gateway_log = _log(cluster, "gateway")
            assert "unhandled error" not in gateway_log  # every answer was a 503, never a 500
            assert "database unavailable on POST /v1/node/heartbeat" in gateway_log


def test_a_nodelet_cut_off_from_a_working_gateway_still_kills_its_calls(
    gateway: Cluster, history: History
) -> None:
    """The ride-through is only for a gateway that says its database is down: a nodelet
    that cannot reach the gateway at all cannot tell, and self-fences as before."""
    port = int(gateway.url.rsplit(":", 1)[1])
    with FaultProxy(port) as proxy:
        direct = gateway.url
        gateway.url = proxy.url
        gateway.start_nodelet()
        gateway.url = direct
        sdk.connect(direct, gateway.token)
        history.spawn("call", 8, max_retries=1)
        history.wait_started("call")
        proxy.refuse()
        wait_until(
            lambda: "killing it before its lease expires" in _log(gateway, "node-a"),
            10,
            "the nodelet to kill its call",
        )
        proxy.accept()
        info = history.check("call")
        assert info.state == "succeeded" and info.attempts == 2


def test_a_gateway_restart_during_a_blocking_call_and_long_polls_loses_nothing(
    long_lease: Cluster, history: History
) -> None:
    """Stopping the gateway ends its long-polls (the nodelet's poll, the caller's watch,
    log streams) with 503 and Retry-After, never a 500; the sdk waits and re-attaches to the
    restarted gateway, and the blocking call returns its one execution's result. The
    restart is shorter than the nodelet's kill deadline (a 10 s lease: 7.5 s), as a gateway
    restart is with the defaults (22.5 s): a longer absence looks like a partition to the
    node, which kills its calls (docs/reliability.md)."""
    gateway = long_lease
    gateway.start_nodelet()
    client = sdk.connect(gateway.url, gateway.token)
    # The gateway is down for longer than the client retries one request: the wait itself
    # rides through (outage_patience_s) and re-attaches.
    client.retry_deadline_s = 0.5
    fn = sdk.function(max_retries=0)(work)
    results: list[str] = []
    caller = threading.Thread(
        target=lambda: results.append(fn(str(history.directory), "blocking", 6)), daemon=True
    )
    caller.start()
    history.wait_started("blocking")
    [blocking] = [i for i in client.invocations() if i.function_name == "work"]
    streamed: list[int] = []

    def follow_logs() -> None:  # an SSE log stream open across the stop: it just ends
        url = f"{gateway.url}/v1/invocations/{blocking.id}/logs"
        auth = {"Authorization": f"Bearer {gateway.token}"}
        with httpx.stream("GET", url, headers=auth, timeout=30) as stream:
            stream.read()
            streamed.append(stream.status_code)

    follower = threading.Thread(target=follow_logs, daemon=True)
    follower.start()
    time.sleep(0.5)  # the caller is in its watch long-poll, the nodelet in its poll
    # uvicorn exits by the signal it handled, once it has shut down.
    assert gateway.restart_gateway(signal.SIGTERM, down_s=1.0) in (0, -signal.SIGTERM)
    caller.join(60)
    follower.join(10)
    assert streamed == [200], "the log stream ended cleanly"
    assert results == history.executions("blocking"), "one execution, and its result"
    gateway_log = _log(gateway, "gateway")
    assert "Traceback" not in gateway_log and "unhandled error" not in gateway_log
    assert "answered 500" not in _log(gateway, "node-a")


CALLER = """
import sys
import sdk
from tests.faults import hold, work

url, token, directory = sys.argv[1:4]
sdk.connect(url, token)
spawned = sdk.function()(work).spawn(directory, "spawned", 4)
print(spawned.id, flush=True)
sdk.function(gpus=1)(hold)(directory, "blocking")
"""


@pytest.fixture
def short_callers(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """Callers that stop waiting are given up after 3 s (keepalives every 0.5 s)."""
    options = {"caller-timeout-s": "3"}
    with running(Cluster(database_url, tmp_path), request, options=options) as cluster:
        cluster.start_nodelet()
        yield cluster


def test_a_blocking_call_whose_caller_dies_is_cancelled_and_its_gpu_freed(
    short_callers: Cluster, history: History
) -> None:
    """kill -9 of a script blocked in a call: its keepalives stop, and the gateway cancels
    the call (the worker is killed, the GPU free) with the reason; what the script spawned
    is detached and runs to its end."""
    cluster = short_callers
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, cluster.url, cluster.token, str(history.directory)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert caller.stdout is not None
        spawned_id = caller.stdout.readline().decode().strip()
        pid_file = history.directory / "blocking.pid"
        wait_until(pid_file.exists, 30, "the blocking call to start")
        time.sleep(4)  # longer than the caller timeout: a live caller's call is kept
        client = sdk.connect(cluster.url, cluster.token)
        [blocking] = [i for i in client.invocations() if i.function_name == "hold"]
        assert client.get(blocking.id).state == "running"
        caller.send_signal(signal.SIGKILL)
    finally:
        caller.kill()
        caller.wait()
    worker = int(pid_file.read_text())
    wait_until(lambda: client.get(blocking.id).state == "cancelled", 15, "the call cancelled")
    assert "its caller stopped waiting" in (client.get(blocking.id).error_message or "")
    wait_until(lambda: not alive(worker), 10, "the abandoned call's worker to be killed")
    # Its GPU is free again: a call for both GPUs runs.
    assert sdk.function(gpus=2)(work)(str(history.directory), "both", 0) == (
        history.executions("both")[-1]
    )
    spawned = sdk.Call.from_id(spawned_id, client=client)
    assert spawned.result(timeout=30) == history.executions("spawned")[-1]
    assert "cancelled 1 calls whose caller stopped waiting" in _log(cluster, "gateway")


def test_a_map_whose_caller_pauses_between_items_is_not_given_up(
    short_callers: Cluster, history: History
) -> None:
    """The session is kept alive while the map is collected, however slowly."""
    sdk.connect(short_callers.url, short_callers.token)
    fn = sdk.function()(work)
    results = fn.map([str(history.directory)] * 3, ["a", "b", "c"], [0, 6, 6])
    first = next(results)
    time.sleep(4.5)  # longer than the caller timeout, while b and c still run
    assert [first, *results] == [history.executions(k)[-1] for k in ("a", "b", "c")]


def test_a_nodelet_stopped_past_its_lease_loses_its_call_to_another_node(
    two_nodes: Cluster, history: History
) -> None:
    """One node of two frozen (SIGSTOP) past its lease is a node fault: its call runs again
    on the other node, and when the frozen one thaws its attempt is revoked and its result
    refused; the committed result is the second run's."""
    with history.gpus_never_shared():
        call = history.spawn("call", 4, max_retries=1, gpus=1)
        history.wait_started("call")
        frozen = dict(zip(("node-a", "node-b"), two_nodes.nodelets, strict=True))
        node = call.info().node
        assert node in frozen
        frozen[node].send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: len(history.executions("call")) == 2, 30, "the call to run again")
            assert call.info().node != node
        finally:
            frozen[node].send_signal(signal.SIGCONT)
        info = history.check("call")
    assert info.state == "succeeded" and info.attempts == 2
    wait_until(
        lambda: "revoked by the gateway" in _log(two_nodes, node)
        or "is no longer ours" in _log(two_nodes, node),
        15,
        "the thawed nodelet to drop its attempt",
    )


def test_a_shared_directory_that_fills_up_loses_nothing(
    database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A full NAS (a 2 MiB tmpfs): the sdk sends a big payload through the gateway instead,
    the worker its big result; the call succeeds with the right value, and no partial
    file is left behind."""
    nas = tmp_path / "nas"
    nas.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(nas)])
    if mounted.returncode != 0:
        pytest.fail("cannot mount a small tmpfs for the full shared directory (needs root)")
    try:
        with running(Cluster(database_url, tmp_path), request, shared_dir=nas) as cluster:
            cluster.start_nodelet()
            sdk.connect(cluster.url, cluster.token)
            big = b"x" * (3 << 20)  # over the inline limit, and more than the NAS holds
            with pytest.warns(UserWarning, match="shared directory cannot be used"):
                echoed = sdk.function()(_reversed)(big)
            assert echoed == big[::-1]
            left = [p for p in nas.rglob("*.bin*") if p.is_file()]
            assert left == [], f"partial files left in the full NAS: {left}"
    finally:
        subprocess.run(["umount", "-l", str(nas)], check=False)


def _reversed(data: bytes) -> bytes:
    return data[::-1]


def test_many_clients_while_a_nodelet_is_killed_and_restarted_lose_nothing(
    two_nodes: Cluster, history: History
) -> None:
    """Three clients submit 30 short calls each while one of the two nodelets is SIGKILLed
    and restarted: every call ends once, within its retries, with its last run's result."""
    keys = [f"c{client}-{n}" for client in range(3) for n in range(30)]

    def submit(client: int) -> None:
        for n in range(30):
            history.spawn(f"c{client}-{n}", 0.2, max_retries=3, gpus=1 if n % 3 == 0 else 0)

    clients = [threading.Thread(target=submit, args=(c,)) for c in range(3)]
    with history.gpus_never_shared():
        for thread in clients:
            thread.start()
        time.sleep(2)
        victim = two_nodes.nodelets[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        time.sleep(1)
        two_nodes.start_nodelet("node-a", fake_gpus=1, cpu_slots=1)
        for thread in clients:
            thread.join(60)
        states = {key: history.check(key, timeout=90).state for key in keys}
    assert set(states.values()) == {"succeeded"}, states
