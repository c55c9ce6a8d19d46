"""WorkerPool and Worker with real worker processes (POSIX: process groups, SIGTERM and
SIGKILL, cgroups where this machine lets us use them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import msgspec
import pytest

from bulletin_core import wire
from bulletin_core.pickling import caller, envelope
from nodelet import pool as pool_module
from nodelet import procs
from nodelet.agent import spare_gpu_sets
from nodelet.limits import Limiter
from nodelet.pool import WorkerPool
from tests.processes import alive

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def spawn_grandchild_and_hang() -> None:
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)


def greet(name: str) -> str:
    print(f"hello {name}")
    return name.upper()


def _task(tmp_path: Path, fn: object, *args: object) -> wire.WorkerTask:
    return wire.WorkerTask(
        invocation_id="inv",
        payload=caller.pack_call(fn, args, {}, sync=False).packed.tobytes(),
    )


def test_acquire_hands_out_a_spare_and_refills(tmp_path: Path) -> None:
    asyncio.run(_acquire_hands_out_a_spare_and_refills(tmp_path))


async def _acquire_hands_out_a_spare_and_refills(tmp_path: Path) -> None:
    pool = WorkerPool(1, cwd=str(tmp_path))
    maintainer = asyncio.create_task(pool.maintain())
    try:
        await _until(lambda: len(pool._idle) == 1)
        spare = pool._idle[0]
        worker = await pool.acquire()
        assert worker is spare
        await _until(lambda: len(pool._idle) == 1 and pool._idle[0] is not spare)
        assert await worker.send(_task(tmp_path, greet, "ada"))
        output = await worker.stdout.read()
        assert await worker.wait() == 0
        assert output == b"hello ada\n"
        outcome = await worker.read_outcome("inv", 1 << 20)
        assert outcome is not None
        assert caller.load_outcome(envelope.open_bytes(outcome.result or b""), None).value == "ADA"
    finally:
        maintainer.cancel()
        await pool.close()
    assert not pool._idle


def test_without_spares_acquire_starts_a_worker(tmp_path: Path) -> None:
    asyncio.run(_without_spares_acquire_starts_a_worker(tmp_path))


async def _without_spares_acquire_starts_a_worker(tmp_path: Path) -> None:
    pool = WorkerPool(0, cwd=str(tmp_path))
    worker = await pool.acquire()
    assert worker.returncode is None
    worker.kill()
    assert await worker.wait() == -9


def test_kill_takes_the_whole_process_group(tmp_path: Path) -> None:
    asyncio.run(_kill_takes_the_whole_process_group(tmp_path))


async def _kill_takes_the_whole_process_group(tmp_path: Path) -> None:
    pool = WorkerPool(0, cwd=str(tmp_path))
    worker = await pool.acquire()
    await worker.send(_task(tmp_path, spawn_grandchild_and_hang))
    grandchild = int(await asyncio.wait_for(worker.stdout.readline(), 30))
    worker.kill()
    assert await worker.wait() == -9
    await _until(lambda: not alive(grandchild))
    worker.kill()  # killing again is harmless


async def _until(condition: object, timeout_s: float = 30.0) -> None:
    assert callable(condition)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.02)


def test_warm_workers_are_kept_per_key_and_evicted_from_gpus_given_to_another(
    tmp_path: Path,
) -> None:
    asyncio.run(_warm_keys(tmp_path))


async def _warm_keys(tmp_path: Path) -> None:
    pool = WorkerPool(0, cwd=str(tmp_path))
    try:
        alice_gpu0, alice_cpu = ("alice", (0,)), ("alice", ())
        first = await pool.acquire(alice_gpu0)
        cpu = await pool.acquire(alice_cpu)
        pool.release(first, alice_gpu0)
        pool.release(cpu, alice_cpu)
        assert await pool.acquire(alice_gpu0) is first  # warm for the same owner and GPUs
        pool.release(first, alice_gpu0)
        bobs = await pool.acquire(("bob", (0, 1)))
        assert bobs is not first and bobs is not cpu  # never another owner's worker
        # Alice's worker on GPU 0 may hold memory there: it goes; her CPU-only one stays.
        assert await asyncio.wait_for(first.wait(), 10) is not None
        assert cpu.returncode is None
        bobs.kill()
        await bobs.wait()
    finally:
        await pool.close()


def spawn_stubborn_child_and_hang() -> None:
    import subprocess
    import sys
    import time

    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", ignore])
    time.sleep(0.3)  # so the child ignores SIGTERM before it can get one
    print(child.pid, flush=True)
    time.sleep(600)


def test_stop_terminates_then_kills_what_outlives_the_grace(tmp_path: Path) -> None:
    asyncio.run(_stop_terminates_then_kills(tmp_path))


async def _stop_terminates_then_kills(tmp_path: Path) -> None:
    pool = WorkerPool(0, cwd=str(tmp_path))
    worker = await pool.acquire()
    await worker.send(_task(tmp_path, spawn_stubborn_child_and_hang))
    child = int(await asyncio.wait_for(worker.stdout.readline(), 30))
    started = time.monotonic()
    assert await worker.stop(0.5) is True  # the child ignored SIGTERM: killed
    assert time.monotonic() - started >= 0.5
    assert await worker.wait() == -signal.SIGTERM  # the worker itself went at SIGTERM
    await _until(lambda: not alive(child))


def test_stop_of_a_worker_that_heeds_sigterm_kills_nothing(tmp_path: Path) -> None:
    asyncio.run(_stop_heeded(tmp_path))


async def _stop_heeded(tmp_path: Path) -> None:
    pool = WorkerPool(0, cwd=str(tmp_path))
    worker = await pool.acquire()
    await worker.send(_task(tmp_path, spawn_grandchild_and_hang))
    grandchild = int(await asyncio.wait_for(worker.stdout.readline(), 30))
    started = time.monotonic()
    assert await worker.stop(30) is False
    assert time.monotonic() - started < 10
    assert await worker.wait() == -signal.SIGTERM
    assert not alive(grandchild)


def test_under_an_address_space_limit_a_worker_runs_one_call_only(tmp_path: Path) -> None:
    asyncio.run(_rlimit_retires(tmp_path))


async def _rlimit_retires(tmp_path: Path) -> None:
    pool = WorkerPool(0, cwd=str(tmp_path), limiter=Limiter.rlimit(512))
    try:
        key = ("alice", ())
        worker = await pool.acquire(key)
        pool.release(worker, key)
        assert not pool._warm
        assert await asyncio.wait_for(worker.wait(), 10) == -signal.SIGKILL
    finally:
        await pool.close()


def test_under_a_cgroup_limit_each_worker_has_a_cgroup_removed_when_it_ends(
    tmp_path: Path,
) -> None:
    limiter = Limiter.detect(256)
    if not limiter.mechanism.startswith("cgroup"):
        pytest.skip(f"no cgroup memory limits here: {limiter.unusable}")
    asyncio.run(_cgroup_per_worker(tmp_path, limiter))
    assert not Path(limiter.base).exists()


async def _cgroup_per_worker(tmp_path: Path, limiter: Limiter) -> None:
    pool = WorkerPool(1, cwd=str(tmp_path), limiter=limiter)
    maintainer = asyncio.create_task(pool.maintain())
    try:
        await _until(lambda: len(pool._idle) == 1)
        worker = await pool.acquire()
        assert worker.cgroup is not None
        assert worker.cgroup.pids() == [worker.pid]
        # What a call starts is in every hierarchy of its worker's cgroup, as if forked
        # there: the cheap check after each call, which reads one of them, sees it.
        assert not worker.cgroup.has_others(worker.pid)
        left = subprocess.Popen(["sleep", "60"])
        try:
            for directory in set(worker.cgroup.dirs.values()):
                Path(directory, "cgroup.procs").write_text(str(left.pid))
            assert worker.cgroup.has_others(worker.pid)
            assert worker.cgroup.pids() == sorted([worker.pid, left.pid])
            assert await worker.end_call()  # all but the worker killed: it stays warm
            assert left.wait(timeout=10) == -signal.SIGKILL
        finally:
            left.kill()
            left.wait()
        assert not worker.cgroup.has_others(worker.pid)
        knob = "memory.max" if limiter.version == 2 else "memory.limit_in_bytes"
        assert Path(worker.cgroup.path, knob).read_text() == f"{256 << 20}\n"
        assert worker.oom_kills() == 0
        worker.kill()
        assert await worker.wait() == -signal.SIGKILL
        assert not Path(worker.cgroup.path).exists()
    finally:
        maintainer.cancel()
        await pool.close()


def test_a_calls_process_cannot_leave_its_workers_cgroup(unix_accounts: dict[str, int]) -> None:
    # After each call the nodelet looks for leftovers in one hierarchy of the worker's cgroup
    # (Cgroup.has_others): a process of the call, run as its unprivileged owner, must not be
    # able to move itself out of it, into any cgroup above it up to the hierarchy's root.
    limiter = Limiter.detect(256)
    if not limiter.mechanism.startswith("cgroup"):
        pytest.skip(f"no cgroup memory limits here: {limiter.unusable}")
    script = (
        "echo $$; while read d; do [ \"$d\" = go ] && break; "
        'if echo $$ 2>/dev/null > "$d/cgroup.procs"; then echo "left for $d"; fi; done; '
        "echo done; exec sleep 60"
    )
    escaping = subprocess.Popen(
        ["runuser", "-u", "bt-alice", "--", "/bin/sh", "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert escaping.stdin is not None and escaping.stdout is not None
    cgroup, pid = None, None
    try:
        pid = int(escaping.stdout.readline())
        cgroup = limiter.apply(pid)  # as the nodelet puts a worker in, before its first call
        assert cgroup is not None and not cgroup.has_others(pid)
        above = set()
        for directory in cgroup.dirs.values():
            up = Path(directory).parent
            while (up / "cgroup.procs").exists():
                above.add(str(up))
                up = up.parent
        assert above
        escaping.stdin.write("".join(f"{d}\n" for d in sorted(above)) + "go\n")
        escaping.stdin.flush()
        assert escaping.stdout.readline().strip() == "done"  # no "left for ..." before it
        assert cgroup.pids() == [pid]
        assert cgroup.has_others(escaping.pid)  # seen from any other pid: it is still there
    finally:
        escaping.kill()
        if pid is not None:  # the shell itself, wherever it went
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if cgroup is not None:
            deadline = time.monotonic() + 10
            while not cgroup.try_remove() and time.monotonic() < deadline:
                time.sleep(0.05)
        escaping.wait()
        limiter.close()


def test_warm_workers_that_ran_the_function_are_preferred_and_workers_are_recycled(
    tmp_path: Path,
) -> None:
    asyncio.run(_affinity_and_recycling(tmp_path))


async def _affinity_and_recycling(tmp_path: Path) -> None:
    pool = WorkerPool(0, cwd=str(tmp_path), max_calls=3)
    try:
        key = ("alice", (0,))
        loads_model, trains = await pool.acquire(key), await pool.acquire(key)
        pool.release(loads_model, key, function="load_model")
        pool.release(trains, key, function="train")  # the newest: first without affinity
        assert await pool.acquire(key, "load_model") is loads_model
        pool.release(loads_model, key, function="load_model")  # its second call
        assert await pool.acquire(key, "evaluate") is loads_model  # no match: the newest
        pool.release(loads_model, key, function="evaluate")  # its third: recycled
        assert await asyncio.wait_for(loads_model.wait(), 10) is not None
        assert await pool.acquire(key, "train") is trains
        pool.release(trains, key, recycle="its call hit a CUDA error")
        assert await asyncio.wait_for(trains.wait(), 10) is not None
    finally:
        await pool.close()


def test_a_worker_over_its_memory_bound_is_recycled(tmp_path: Path) -> None:
    asyncio.run(_memory_bound(tmp_path))


async def _memory_bound(tmp_path: Path) -> None:
    pool = WorkerPool(0, cwd=str(tmp_path), max_rss_mb=1)  # any Python is over 1 MiB
    try:
        worker = await pool.acquire(("alice", ()))
        await asyncio.sleep(0.2)  # let it start
        pool.release(worker, ("alice", ()))
        assert await asyncio.wait_for(worker.wait(), 10) is not None
    finally:
        await pool.close()


def test_spares_started_with_their_gpu_serve_calls_on_that_gpu(tmp_path: Path) -> None:
    asyncio.run(_gpu_spares(tmp_path))


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\x00")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


async def _gpu_spares(tmp_path: Path) -> None:
    pool = WorkerPool(0, cwd=str(tmp_path))
    pool.set_gpu_spares(spare_gpu_sets([0, 1, 2], [1, 2]), 1)  # (0,) (1,) (2,) (0, 1)
    maintainer = asyncio.create_task(pool.maintain())
    try:
        await _until(lambda: all(len(pool._gpu_idle.get(s, ())) == 1 for s in pool.gpu_spares))
        assert set(pool.gpu_spares) == {(0,), (1,), (2,), (0, 1)}
        spare = pool._gpu_idle[(1,)][0]
        worker = await pool.acquire(("alice", (1,)))
        assert worker is spare and worker.warm
        assert _environ(worker.pid)["CUDA_VISIBLE_DEVICES"] == "1"
        await _until(
            lambda: len(pool._gpu_idle[(1,)]) == 1 and pool._gpu_idle[(1,)][0] is not spare
        )
        pair = await pool.acquire(("alice", (0, 1)))  # the spare of that shape
        assert pair.warm and _environ(pair.pid)["CUDA_VISIBLE_DEVICES"] == "0,1"
        cold = await pool.acquire(("alice", (1, 2)))  # no spare of those GPUs: a new process
        assert not cold.warm
        for started in (worker, pair, cold):
            started.kill()
            await started.wait()
    finally:
        maintainer.cancel()
        await pool.close()


def test_spare_shapes_are_aligned_blocks_of_the_nodes_gpus() -> None:
    assert spare_gpu_sets([0, 1, 2, 3], [1]) == [(0,), (1,), (2,), (3,)]
    assert spare_gpu_sets([3, 2, 1, 0], [2, 4]) == [(0, 1), (2, 3), (0, 1, 2, 3)]
    assert spare_gpu_sets([0, 1, 2], [2, 8]) == [(0, 1)]  # no 8-GPU block on 3 GPUs
    assert spare_gpu_sets([], [1]) == []


def leave_a_child_the_worker_does_not_kill() -> None:
    """Start a child, and keep the worker from killing it after the call (as a child the
    worker may not signal would: one that became root through a setuid program)."""
    import subprocess
    import sys

    child = subprocess.Popen(["sleep", "600"])
    sys.modules["__main__"].kill_leftovers = dict  # the worker's own kill: a no-op
    print(child.pid, flush=True)


def test_a_worker_whose_call_left_what_cannot_be_killed_is_not_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(_end_call_with_a_survivor(tmp_path, monkeypatch))


async def _end_call_with_a_survivor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = WorkerPool(0, cwd=str(tmp_path))
    try:
        worker = await pool.acquire(("alice", ()))
        marker = b"\x00end\x00"
        task = msgspec.structs.replace(
            _task(tmp_path, leave_a_child_the_worker_does_not_kill), end_marker=marker
        )
        await worker.send(task)
        child = int(await asyncio.wait_for(worker.stdout.readline(), 30))
        await asyncio.wait_for(worker.stdout.readuntil(marker), 30)
        monkeypatch.setattr(pool_module, "KILL_WAIT_S", 0.3)
        with monkeypatch.context() as patched:  # the nodelet's kills miss it too
            patched.setattr(procs.Tree, "kill", lambda self, spare=None: {})
            assert await worker.end_call() is False
        assert alive(child)
        # Once its kill works again (it retries), nothing is left.
        assert await worker.end_call() is True
        assert not alive(child) and worker.returncode is None
        worker.kill()
        assert await worker.wait() == -signal.SIGKILL
    finally:
        await pool.close()
