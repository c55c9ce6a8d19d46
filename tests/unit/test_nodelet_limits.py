"""Memory limits per call (nodelet/limits.py), with real processes and this machine's real
cgroups; a mechanism the machine does not offer is skipped, naming what is missing."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodelet.cgroups import Cgroup, LimitUnavailable, cgroup_mounts, own_cgroups
from nodelet.config import NodeletConfig
from nodelet.limits import RLIMIT_ENV, Limiter

MiB = 1 << 20

# This machine's kind: cgroup v1 controllers, and a v2 hierarchy with few of them.
HYBRID_MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
34 31 0:31 / /sys/fs/cgroup/cpu\\040set rw,relatime - cgroup cgroup rw,cpuset
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_CGROUP = "4:memory:/process_api/abc\n3:cpuset:/\n1:name=systemd:/\n0::/\n"
# A pure cgroup v2 machine, seen from inside a container's cgroup namespace.
V2_MOUNTINFO = "30 25 0:26 /kubepods/pod1 /sys/fs/cgroup rw shared:4 - cgroup2 cgroup2 rw\n"


def test_cgroup_mounts_are_parsed_with_their_version_root_and_controllers() -> None:
    mounts = cgroup_mounts(HYBRID_MOUNTINFO)
    assert [(m.point, m.version) for m in mounts] == [
        ("/sys/fs/cgroup/memory", 1),
        ("/sys/fs/cgroup/cpu set", 1),
        ("/sys/fs/cgroup/unified", 2),
    ]
    assert "memory" in mounts[0].controllers
    [v2] = cgroup_mounts(V2_MOUNTINFO)
    assert (v2.point, v2.root, v2.version) == ("/sys/fs/cgroup", "/kubepods/pod1", 2)


def test_own_cgroups_per_controller_and_for_v2() -> None:
    paths = own_cgroups(HYBRID_CGROUP)
    assert paths["memory"] == "/process_api/abc"
    assert paths["name=systemd"] == "/"
    assert paths[""] == "/"


def test_no_limit_configured_is_mechanism_none(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "nodelet.limits")
    limiter = Limiter.detect(0)
    assert limiter.mechanism == "none"
    assert limiter.task_env() == {} and limiter.apply(os.getpid()) is None
    assert "no memory limit per call" in caplog.text


def test_detect_picks_a_mechanism_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "nodelet.limits")
    limiter = Limiter.detect(512)
    try:
        assert limiter.mechanism in {"cgroup2", "cgroup1", "rlimit"}
        assert limiter.limit_mb == 512
        assert f"memory limit: {limiter.describe()}" in caplog.text
        if limiter.mechanism == "rlimit":
            assert "cgroups are not usable: " + limiter.unusable in caplog.text
    finally:
        limiter.close()


def test_rlimit_is_passed_to_the_worker_and_forbids_reuse() -> None:
    limiter = Limiter.rlimit(300)
    assert limiter.task_env() == {RLIMIT_ENV: "300"}
    assert not limiter.reuses_workers
    assert limiter.describe() == "300 MiB of address space per process (RLIMIT_AS)"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"kill_grace_s": -1.0}, "kill_grace_s must be at least 0, got -1.0"),
        ({"memory_limit_mb": -5}, "memory_limit_mb must be at least 0, got -5"),
    ],
)
def test_limit_settings_are_validated(override: dict[str, Any], message: str) -> None:
    good = {"gateway_url": "http://127.0.0.1:1", "token": "bn_x"}
    assert NodeletConfig(**good).kill_grace_s == 10.0
    assert NodeletConfig(**good).memory_limit_mb == 0
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        NodeletConfig(**good, **override)


@pytest.fixture(params=[2, 1], ids=["cgroup2", "cgroup1"])
def cgroups(request: pytest.FixtureRequest) -> Iterator[Limiter]:
    """A 64 MiB limiter in each cgroup version this machine lets us use; the others skip."""
    try:
        limiter = Limiter.cgroups(request.param, 64)
    except LimitUnavailable as exc:
        pytest.skip(f"cgroup v{request.param} memory limits are not usable here: {exc}")
    try:
        yield limiter
    finally:
        limiter.close()
    assert not os.path.exists(limiter.base)


# Waits for a line on stdin (so it is confined before it allocates), then allocates.
ALLOCATE = "import sys; sys.stdin.readline(); b = b'x' * ({mb} << 20); print(len(b) >> 20)"


def _confined(limiter: Limiter, mb: int) -> tuple[subprocess.Popen[str], Cgroup]:
    proc = subprocess.Popen(
        [sys.executable, "-c", ALLOCATE.format(mb=mb)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, limiter.apply(proc.pid)


def test_a_process_over_the_cgroup_limit_is_killed_and_counted(cgroups: Limiter) -> None:
    proc, cgroup = _confined(cgroups, 256)
    assert cgroup.pids() == [proc.pid]
    membership = Path(f"/proc/{proc.pid}/cgroup").read_text()
    assert f"/bulletin-{os.getpid()}/worker-{proc.pid}\n" in membership
    assert cgroup.oom_kills() == 0
    proc.communicate("go\n", timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert cgroup.oom_kills() == 1
    assert _removed(cgroup)
    assert cgroup.oom_kills() == 1, "the count is kept once the cgroup is gone"


def test_a_process_under_the_cgroup_limit_runs(cgroups: Limiter) -> None:
    proc, cgroup = _confined(cgroups, 16)
    out, _ = proc.communicate("go\n", timeout=60)
    assert (proc.returncode, out) == (0, "16\n")
    assert cgroup.oom_kills() == 0
    assert _removed(cgroup)


def test_removing_a_cgroup_kills_what_escaped_the_process_group(cgroups: Limiter) -> None:
    # A daemon in a session of its own: killing the worker's process group misses it.
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.stdin.readline(); time.sleep(300)"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    cgroup = cgroups.apply(proc.pid)
    assert _removed(cgroup)
    assert proc.wait(10) == -signal.SIGKILL


def _removed(cgroup: Cgroup) -> bool:
    deadline = time.monotonic() + 10
    while not cgroup.try_remove():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return not os.path.exists(cgroup.path)


# ------------------------------------------------------------------ CPU quota and GPU devices

# Waits for a line on stdin (so it is confined first), spins for a second, prints the share
# of one core it got.
SPIN = (
    "import sys, time; sys.stdin.readline(); wall = time.monotonic(); cpu = time.process_time()\n"
    "while time.monotonic() - wall < 1.5: pass\n"
    "print((time.process_time() - cpu) / (time.monotonic() - wall))"
)


@pytest.mark.parametrize("version", [2, 1], ids=["cgroup2", "cgroup1"])
def test_a_cpu_quota_holds_a_busy_process_to_its_share(version: int) -> None:
    try:
        limiter = Limiter.cgroups(version, cpus=0.25)
    except LimitUnavailable as exc:
        pytest.skip(f"cgroup v{version} CPU limits are not usable here: {exc}")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        cgroup = limiter.apply(proc.pid)
        assert cgroup is not None and cgroup.pids() == [proc.pid]
        out, _ = proc.communicate("go\n", timeout=60)
        assert float(out) < 0.45, f"a 0.25-core quota let it use {float(out):.2f} of a core"
        assert "0.25 CPU cores per call" in limiter.describe_cpu()
        assert _removed(cgroup)
    finally:
        limiter.close()


# Opens each path given, after setting CUDA_VISIBLE_DEVICES to every GPU; prints the errnos.
OPEN_ALL = (
    "import os, sys; sys.stdin.readline(); os.environ['CUDA_VISIBLE_DEVICES'] = '0,1'\n"
    "def errno(path):\n"
    "    try:\n"
    "        os.close(os.open(path, os.O_RDWR))\n"
    "    except OSError as exc:\n"
    "        return exc.errno\n"
    "    return 0\n"
    "print(' '.join(str(errno(p)) for p in sys.argv[1:]))"
)


@pytest.fixture
def fake_gpu_files(tmp_path: Path) -> dict[int, tuple[str, ...]]:
    """Two fake GPUs' device rules, from device files made by FakeGpuProvider."""
    from nodelet.gpus import FakeGpuProvider
    from nodelet.limits import device_rule

    files = FakeGpuProvider(2, device_dir=tmp_path / "dev").device_files()
    if not files:
        pytest.skip("cannot make device files here (mknod needs root)")
    return {i: tuple(r for r in map(device_rule, paths) if r) for i, paths in files.items()}


def test_a_worker_cannot_open_the_device_files_of_gpus_that_are_not_its_own(
    tmp_path: Path, fake_gpu_files: dict[int, tuple[str, ...]]
) -> None:
    import errno

    try:
        limiter = Limiter.cgroups(1, gpu_devices=fake_gpu_files)
    except LimitUnavailable as exc:
        pytest.skip(f"the cgroup v1 devices controller is not usable here: {exc}")
    paths = [str(tmp_path / "dev" / f"fakegpu{i}") for i in (0, 1)]
    allowed, denied = errno.ENXIO, errno.EPERM  # no driver behind an allowed one
    try:
        for gpus, grant, expected in [
            ((0,), (), [allowed, denied]),
            ((), (), [denied, denied]),
            ((), (1,), [denied, allowed]),  # a spare given a call's GPU later
        ]:
            proc = subprocess.Popen(
                [sys.executable, "-c", OPEN_ALL, *paths],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            cgroup = limiter.apply(proc.pid, gpus)
            assert cgroup is not None
            cgroup.allow_gpus(grant)
            out, _ = proc.communicate("go\n", timeout=60)
            assert [int(e) for e in out.split()] == expected, (gpus, grant)
            assert _removed(cgroup)
    finally:
        limiter.close()
    assert not os.path.exists(limiter.base)


def test_devices_are_not_claimed_on_cgroup_v2() -> None:
    with pytest.raises(LimitUnavailable, match="eBPF"):
        Limiter.cgroups(2, gpu_devices={0: ("c 195:0",)})
