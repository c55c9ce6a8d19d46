"""Limits and crashes, end to end: calls go through the sdk and a real gateway to real worker
processes. Crashes run on a real nodelet; the time limit's grace and the memory limits run in
an attempt driven here with the pool configured for the test (``NodeHarness``). A memory
mechanism this machine does not offer is skipped, naming what is missing."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cloudpickle
import psutil
import pytest

import sdk
from bulletin_core import wire
from nodelet.accounts import Accounts
from nodelet.attempt import Attempt, NodeFacts
from nodelet.client import GatewayClient
from nodelet.gpus import FakeGpuProvider
from nodelet.limits import Limiter, LimitUnavailable
from nodelet.pool import WorkerPool
from tests.conftest import Cluster, wait_until

# Functions below travel by value, as a notebook's would (this module is not on the nodes).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STUBBORN_CHILD = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
)


def _pid_of(path: Path) -> int:
    wait_until(lambda: path.exists() and path.read_text().strip(), 30, f"a pid in {path}")
    return int(path.read_text())


def _gone(pid: int) -> bool:
    """No such process, or only a zombie left for its new parent to reap."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---------------------------------------------------------------- crashes, on a real nodelet


@sdk.function()
def own_pid() -> int:
    return os.getpid()


def test_a_worker_that_segfaults_mid_call_is_reported_as_crashed_and_replaced(
    cluster: Cluster, tmp_path: Path
) -> None:
    pidfile = tmp_path / "crashed"

    @sdk.function()
    def segfault(path: str) -> None:
        import ctypes

        with open(path, "w") as f:
            f.write(str(os.getpid()))
        ctypes.string_at(0)

    with pytest.raises(sdk.WorkerDiedError, match=r"killed by signal 11 \(SIGSEGV\)") as info:
        segfault(str(pidfile))
    assert "crashed mid-call, in native code" in str(info.value)
    [invocation] = sdk.Client(cluster.url, cluster.token).invocations(limit=1)
    assert (invocation.state, invocation.error_kind) == ("failed", wire.ErrorKind.WORKER_CRASHED)
    assert _gone(_pid_of(pidfile))
    assert own_pid() != _pid_of(pidfile), "the crashed worker was not replaced"


def test_a_worker_that_exits_mid_call_is_reported_with_its_exit_code(cluster: Cluster) -> None:
    @sdk.function()
    def bail_out() -> None:
        os._exit(3)

    with pytest.raises(sdk.WorkerDiedError, match="exited with code 3 without leaving a result"):
        bail_out()
    assert own_pid() > 0, "the node should run the next call in a fresh worker"


# ------------------------------------------------- limits, in an attempt with a chosen pool


class NodeHarness:
    """Node n1 of the cluster, registered with one CPU slot, running one call at a time in
    an :class:`Attempt` with the given pool (renewing its lease meanwhile)."""

    def __init__(self, cluster: Cluster, tmp_path: Path) -> None:
        self.cluster = cluster
        self.work_dir = tmp_path / "work"
        self.work_dir.mkdir(exist_ok=True)
        self.token = cluster.node_token("n1").read_text()
        #: Workers the pool kept warm after the call.
        self.warm_after = 0
        sdk.connect(cluster.url, cluster.token)

    def run(self, submit: Callable[[], sdk.Call], make_pool: Callable[[], WorkerPool]) -> sdk.Call:
        """Submit a call with ``submit`` once the node is registered, and run it here."""
        return asyncio.run(self._run(submit, make_pool()))

    async def _run(self, submit: Callable[[], sdk.Call], pool: WorkerPool) -> sdk.Call:
        client = GatewayClient(self.cluster.url, self.token)
        try:
            registration = await client.register(
                wire.RegisterRequest(name="n1", gpus=[], cpu_slots=1)
            )
            call = await asyncio.to_thread(submit)
            [assignment] = (await client.poll([], hold_s=10)).assignments
            facts = NodeFacts(
                node="n1",
                work_dir=str(self.work_dir),
                inline_limit=registration.inline_limit,
                log_flush_s=0.02,
                gpus=FakeGpuProvider(0),
                accounts=Accounts.from_setting("", trusted_users="*"),
            )
            attempt = Attempt(assignment, client=client, pool=pool, facts=facts)
            renewing = asyncio.create_task(_renew(client, attempt.ref))
            try:
                await asyncio.wait_for(attempt.start(), 60)
            finally:
                renewing.cancel()
            self.warm_after = len(pool._warm)
            return call
        finally:
            await pool.close()
            await client.aclose()


async def _renew(client: GatewayClient, ref: wire.Attempt) -> None:
    while True:
        await client.heartbeat([ref], timeout_s=5)
        await asyncio.sleep(0.5)


@pytest.fixture
def harness(gateway: Cluster, tmp_path: Path) -> NodeHarness:
    return NodeHarness(gateway, tmp_path)


def test_a_call_that_heeds_sigterm_at_the_time_limit_is_not_killed(harness: NodeHarness) -> None:
    @sdk.function(timeout=1)
    def sleeper() -> None:
        time.sleep(300)

    call = harness.run(sleeper.spawn, lambda: WorkerPool(0, kill_grace_s=30))
    with pytest.raises(sdk.CallTimedOut, match=r"terminated \(SIGTERM to its processes\)\.$"):
        call.result(timeout=30)


def test_a_call_that_handles_sigterm_ends_without_waiting_out_the_grace(
    harness: NodeHarness, capsys: pytest.CaptureFixture[str]
) -> None:
    @sdk.function(timeout=1)
    def checkpointing() -> None:
        import signal

        def save_and_leave(*_: object) -> None:
            print("checkpoint saved", flush=True)
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, save_and_leave)
        time.sleep(300)

    started = time.monotonic()
    call = harness.run(checkpointing.spawn, lambda: WorkerPool(0, kill_grace_s=60))
    with pytest.raises(sdk.CallTimedOut, match=r"terminated \(SIGTERM to its processes\)\.$"):
        call.result(timeout=30)
    assert time.monotonic() - started < 30, "the worker was kept to the end of the grace"
    assert "checkpoint saved" in capsys.readouterr().out


@sdk.function()
def allocate(mib: int) -> int:
    block = b"x" * (mib << 20)  # written, so every page is really used
    return len(block) >> 20


def test_over_an_address_space_limit_the_call_fails_out_of_memory(harness: NodeHarness) -> None:
    call = harness.run(
        lambda: allocate.spawn(1024), lambda: WorkerPool(0, limiter=Limiter.rlimit(256))
    )
    with pytest.raises(sdk.OutOfMemoryError) as info:
        call.result(timeout=30)
    assert "at its limit of 256 MiB of address space per process (RLIMIT_AS)" in str(info.value)
    assert "in allocate" in (info.value.remote_traceback or "")
    assert harness.warm_after == 0, "a worker under RLIMIT_AS must not be kept for another call"


def _cgroups(version: int, limit_mb: int) -> Limiter:
    try:
        return Limiter.cgroups(version, limit_mb)
    except LimitUnavailable as exc:
        pytest.skip(f"cgroup v{version} memory limits are not usable here: {exc}")


@pytest.mark.parametrize("version", [2, 1], ids=["cgroup2", "cgroup1"])
def test_over_a_cgroup_limit_the_call_is_killed_out_of_memory(
    harness: NodeHarness, version: int
) -> None:
    limiter = _cgroups(version, 128)
    call = harness.run(lambda: allocate.spawn(512), lambda: WorkerPool(0, limiter=limiter))
    knob = "memory.max" if version == 2 else "memory.limit_in_bytes"
    with pytest.raises(sdk.OutOfMemoryError, match=rf"128 MiB per call \(cgroup v{version} {knob}"):
        call.result(timeout=30)
    assert not os.path.exists(limiter.base)


@pytest.mark.parametrize("version", [2, 1], ids=["cgroup2", "cgroup1"])
def test_a_cgroup_limit_holds_for_what_the_call_spawns_too(
    harness: NodeHarness, version: int
) -> None:
    limiter = _cgroups(version, 128)

    @sdk.function()
    def spawn_a_hog() -> int:
        import subprocess

        return subprocess.run([sys.executable, "-c", "b = b'x' * (512 << 20)"]).returncode

    call = harness.run(spawn_a_hog.spawn, lambda: WorkerPool(0, limiter=limiter))
    # cgroup v2 (memory.oom.group) kills the whole call; v1 kills the biggest process.
    if version == 2:
        with pytest.raises(sdk.OutOfMemoryError):
            call.result(timeout=30)
    else:
        assert call.result(timeout=30) == -9


def test_without_a_limit_nothing_is_confined(harness: NodeHarness) -> None:
    call = harness.run(lambda: allocate.spawn(64), lambda: WorkerPool(0, limiter=Limiter()))
    assert call.result(timeout=30) == 64
    assert harness.warm_after == 1


# ------------------------------------- the nodelet's settings: --kill-grace-s, --memory-limit-mb


def stubborn(path: str) -> None:
    """Leaves a child that ignores SIGTERM (its pid in ``path``), then sleeps."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", STUBBORN_CHILD])
    time.sleep(0.5)  # the child ignores SIGTERM by now
    with open(path, "w") as f:
        f.write(str(child.pid))
    time.sleep(300)


def test_at_the_time_limit_the_call_is_terminated_then_killed_after_the_grace(
    gateway: Cluster, tmp_path: Path
) -> None:
    gateway.start_nodelet(**{"kill-grace-s": "1"})
    sdk.connect(gateway.url, gateway.token)
    pidfile = tmp_path / "child"
    # (The limit counts from when the node takes the call, a spare worker's start-up
    # included: under a loaded suite a 1 s limit ran out before the call wrote its child's
    # pid, 0.5 s into its code.)
    call = sdk.function(timeout=3)(stubborn).spawn(str(pidfile))
    child = _pid_of(pidfile)
    started = time.monotonic()
    with pytest.raises(sdk.CallTimedOut) as info:
        call.result(timeout=30)
    assert time.monotonic() - started < 3 + 1 + 10
    message = str(info.value)
    assert "time limit of 3 s and was terminated (SIGTERM to its processes)" in message
    assert "then killed (SIGKILL) as it was still running 1 s later" in message
    assert call.status() == "timed_out"
    wait_until(lambda: _gone(child), 10, "the child that ignored SIGTERM to be killed")


def test_the_nodelet_holds_calls_to_its_memory_limit(gateway: Cluster) -> None:
    gateway.start_nodelet(**{"memory-limit-mb": "256"})
    sdk.connect(gateway.url, gateway.token)
    with pytest.raises(sdk.OutOfMemoryError, match="256 MiB"):
        allocate(1024)
    assert allocate(16) == 16
    log = (gateway.dir / "node-a.log").read_text()
    assert "memory limit: 256 MiB per call" in log
