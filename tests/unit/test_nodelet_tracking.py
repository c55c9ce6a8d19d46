"""Process tracking (nodelet/limits.py, nodelet/cgroups.py, nodelet/pool.py), with real
workers and this machine's real cgroups: whatever a call starts (a child, a setsid child, a
double-forked daemon) is found, and killed when the call ends while its worker is kept."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest

from bulletin_core import wire
from bulletin_core.pickling import caller
from nodelet import procs
from nodelet.cgroups import Cgroup, LimitUnavailable, make_base, own_cgroup_dir
from nodelet.limits import Limiter
from nodelet.pool import WorkerPool
from tests.processes import alive, start_escapees

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MECHANISMS = ["cgroup2", "cgroup1", "subreaper"]


def start_three_and_sleep() -> None:
    """Start a child, a setsid child and a double-forked daemon; print their pids; sleep."""
    import time

    print(*start_escapees(600), flush=True)
    time.sleep(600)


def _limiter(mechanism: str) -> Limiter:
    try:
        return Limiter.detect(tracking=mechanism, name=f"bulletin-test-{uuid.uuid4().hex[:8]}")
    except LimitUnavailable as exc:
        if mechanism == "cgroup2":
            pytest.skip(f"cgroup v2 tracking is not usable here: {exc}")
        raise


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_what_a_call_left_is_killed_and_its_worker_kept(
    tmp_path: Path, mechanism: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "nodelet.limits")
    limiter = _limiter(mechanism)
    assert limiter.tracking == mechanism
    assert f"process tracking: {mechanism}" in caplog.text
    asyncio.run(_end_call(tmp_path, limiter))
    for base in limiter.cgroup_bases():
        assert not os.path.exists(base)


async def _end_call(tmp_path: Path, limiter: Limiter) -> None:
    pool = WorkerPool(0, cwd=str(tmp_path), limiter=limiter)
    try:
        worker = await pool.acquire()
        cgroup = worker.cgroup
        # The cheap check after each call (in cgroup v2, cgroup.procs held open and read
        # again): it sees what a call starts, and sees it gone once killed.
        assert cgroup is None or not cgroup.has_others(worker.pid)
        task = wire.WorkerTask(
            invocation_id="inv",
            payload=caller.pack_call(start_three_and_sleep, (), {}, sync=False).packed.tobytes(),
        )
        await worker.send(task)
        pids = [int(p) for p in (await asyncio.wait_for(worker.stdout.readline(), 30)).split()]
        assert set(worker.members()) == {worker.pid, *pids}
        if worker.cgroup is not None:  # each is in the worker's cgroup, setsid or not
            for pid in pids:
                assert (
                    Path(f"/proc/{pid}/cgroup").read_text()
                    == Path(f"/proc/{worker.pid}/cgroup").read_text()
                )
        else:  # the daemon was adopted by the worker, a subreaper
            assert procs.read_stat(pids[2]).ppid == worker.pid  # type: ignore[union-attr]
        assert cgroup is None or cgroup.has_others(worker.pid)
        await worker.end_call()
        assert not any(alive(pid) for pid in pids)
        assert cgroup is None or not cgroup.has_others(worker.pid)
        assert worker.returncode is None and set(worker.members()) == {worker.pid}
        worker.kill()
        assert await worker.wait() == -signal.SIGKILL
    finally:
        await pool.close()


def test_auto_picks_the_best_tracking_this_machine_offers() -> None:
    usable = []
    for mechanism in ("cgroup2", "cgroup1"):
        try:
            limiter = Limiter.detect(tracking=mechanism, name=f"bulletin-test-{mechanism}")
        except LimitUnavailable:
            continue
        usable.append(mechanism)
        limiter.close()
    for choice in ("auto", "cgroup") if usable else ("auto",):
        limiter = Limiter.detect(tracking=choice, name=f"bulletin-test-{choice}")
        limiter.close()
        assert limiter.tracking == (usable[0] if usable else "subreaper")


def test_a_tracking_asked_for_that_is_not_usable_is_refused() -> None:
    with pytest.raises(LimitUnavailable, match="process tracking 'cgroup1' is not usable"):
        Limiter.detect(tracking="cgroup1", name="no/such/dir")
    with pytest.raises(ValueError, match="process_tracking must be one of"):
        Limiter.detect(tracking="magic")
    assert Limiter.detect(tracking="subreaper").bases == {}


# A process that starts a child and a setsid grandchild and waits (its pid, then theirs).
FAMILY = (
    "import subprocess, time\n"
    "a = subprocess.Popen(['sleep', '600'])\n"
    "b = subprocess.Popen(['setsid', 'sleep', '600'])\n"
    "print(a.pid, b.pid, flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture(params=["unified", "freezer", "pids"])
def cgroup_dir(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh cgroup in the v2 hierarchy, the v1 freezer or the v1 pids hierarchy."""
    version = 2 if request.param == "unified" else 1
    try:
        here = own_cgroup_dir(version, os.getpid(), request.param)
        path = os.path.join(here, f"bulletin-test-{uuid.uuid4().hex[:8]}")
        os.mkdir(path)
    except (LimitUnavailable, OSError) as exc:
        if version == 2:
            pytest.skip(f"no writable cgroup v2 hierarchy here: {exc}")
        raise
    yield path
    Cgroup.at(path).kill()
    deadline = time.monotonic() + 10
    while os.path.exists(path):
        try:
            os.rmdir(path)
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_a_cgroup_kills_all_but_one_then_all(cgroup_dir: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); " + FAMILY.replace("\n", ";")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        Path(cgroup_dir, "cgroup.procs").write_text(str(process.pid))
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(b"\n")
        process.stdin.flush()
        children = [int(p) for p in process.stdout.readline().split()]
        cgroup = Cgroup.at(cgroup_dir)
        assert set(cgroup.members()) == {process.pid, *children}
        cgroup.kill(spare=process.pid)
        deadline = time.monotonic() + 10
        while set(cgroup.members()) != {process.pid}:
            assert time.monotonic() < deadline, cgroup.members()
            time.sleep(0.01)
        assert process.poll() is None
        cgroup.kill()
        assert process.wait(10) == -signal.SIGKILL
    finally:
        process.kill()
        process.wait()


def _inside(directory: Path) -> subprocess.Popen[bytes]:
    """A process (with a child) moved into the cgroup ``directory`` before it forks."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); " + FAMILY.replace("\n", ";")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    (directory / "cgroup.procs").write_text(str(process.pid))
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(b"\n")
    process.stdin.flush()
    process.stdout.readline()
    return process


def test_a_base_is_made_clear_of_what_an_earlier_nodelet_left() -> None:
    here = Path(own_cgroup_dir(1, os.getpid(), "freezer"))
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no nodelet now
    old_style = here / f"bulletin-{gone.pid}" / "worker-1"
    same_name = here / f"bulletin-test-{uuid.uuid4().hex[:8]}" / "worker-2"
    processes = []
    try:
        for directory in (old_style, same_name):
            directory.mkdir(parents=True)
            processes.append(_inside(directory))
        assert make_base(str(here), same_name.parent.name, 1, []) == str(same_name.parent)
        assert [p.wait(10) for p in processes] == [-signal.SIGKILL, -signal.SIGKILL]
        assert not old_style.parent.exists() and not same_name.exists()
        assert same_name.parent.is_dir()
    finally:
        for process in processes:
            process.kill()
            process.wait()
        for directory in (same_name, same_name.parent, old_style, old_style.parent):
            with contextlib.suppress(OSError):
                directory.rmdir()
