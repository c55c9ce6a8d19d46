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

from nodelet.config import NodeletConfig
from nodelet.limits import (
    RLIMIT_ENV,
    Cgroup,
    CgroupLimiter,
    LimitUnavailable,
    MemoryLimiter,
    RlimitLimiter,
    cgroup_mounts,
    own_cgroups,
)

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
    limiter = MemoryLimiter.detect(0)
    assert limiter.mechanism == "none"
    assert limiter.task_env() == {} and limiter.apply(os.getpid()) is None
    assert "no memory limit per call" in caplog.text


def test_detect_picks_a_mechanism_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "nodelet.limits")
    limiter = MemoryLimiter.detect(512)
    try:
        assert limiter.mechanism in {"cgroup2", "cgroup1", "rlimit"}
        assert limiter.limit_mb == 512
        assert f"memory limit: {limiter.describe()}" in caplog.text
        if limiter.mechanism == "rlimit":
            assert "cgroups are not usable: " + limiter.unusable in caplog.text
    finally:
        limiter.close()


def test_rlimit_is_passed_to_the_worker_and_forbids_reuse() -> None:
    limiter = RlimitLimiter(300)
    assert limiter.task_env() == {RLIMIT_ENV: "300"}
    assert not limiter.reuses_workers
    assert limiter.describe() == "300 MiB of address space per process (RLIMIT_AS)"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"kill_grace_s": -1.0}, "kill_grace_s must be >= 0, got -1.0"),
        ({"memory_limit_mb": -5}, "memory_limit_mb must be >= 0 (0 = no limit), got -5"),
    ],
)
def test_limit_settings_are_validated(override: dict[str, Any], message: str) -> None:
    good = {"gateway_url": "http://127.0.0.1:1", "token": "bn_x"}
    assert NodeletConfig(**good).kill_grace_s == 10.0
    assert NodeletConfig(**good).memory_limit_mb == 0
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        NodeletConfig(**good, **override)


@pytest.fixture(params=[2, 1], ids=["cgroup2", "cgroup1"])
def cgroups(request: pytest.FixtureRequest) -> Iterator[CgroupLimiter]:
    """A 64 MiB limiter in each cgroup version this machine lets us use; the others skip."""
    try:
        limiter = CgroupLimiter.create(request.param, 64)
    except LimitUnavailable as exc:
        pytest.skip(f"cgroup v{request.param} memory limits are not usable here: {exc}")
    try:
        yield limiter
    finally:
        limiter.close()
    assert not os.path.exists(limiter.base)


# Waits for a line on stdin (so it is confined before it allocates), then allocates.
ALLOCATE = "import sys; sys.stdin.readline(); b = b'x' * ({mb} << 20); print(len(b) >> 20)"


def _confined(limiter: CgroupLimiter, mb: int) -> tuple[subprocess.Popen[str], Cgroup]:
    proc = subprocess.Popen(
        [sys.executable, "-c", ALLOCATE.format(mb=mb)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, limiter.apply(proc.pid)


def test_a_process_over_the_cgroup_limit_is_killed_and_counted(cgroups: CgroupLimiter) -> None:
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


def test_a_process_under_the_cgroup_limit_runs(cgroups: CgroupLimiter) -> None:
    proc, cgroup = _confined(cgroups, 16)
    out, _ = proc.communicate("go\n", timeout=60)
    assert (proc.returncode, out) == (0, "16\n")
    assert cgroup.oom_kills() == 0
    assert _removed(cgroup)


def test_removing_a_cgroup_kills_what_escaped_the_process_group(cgroups: CgroupLimiter) -> None:
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
