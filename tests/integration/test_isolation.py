"""GPU and CPU isolation through a real nodelet: a call that resets CUDA_VISIBLE_DEVICES
still cannot open the device files of GPUs that are not its own, and a CPU cap holds. Where
this machine cannot enforce them, the tests skip with the reason the nodelet logged."""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

import pytest

import sdk
from tests.conftest import Cluster, wait_until


def open_gpu_files(directory: str) -> dict[str, Any]:
    """Tries every fake GPU's device file after making every GPU 'visible': the errno per
    GPU, for the call's own GPUs (as given) and the others."""
    import os

    own = os.environ["CUDA_VISIBLE_DEVICES"]
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    results = {}
    for index in (0, 1):
        try:
            os.close(os.open(os.path.join(directory, f"fakegpu{index}"), os.O_RDWR))
            results[index] = 0
        except OSError as exc:
            results[index] = exc.errno
    return {"own": [int(g) for g in own.split(",") if g], "errnos": results}


def spin(seconds: float) -> float:
    """Busy for ``seconds`` of wall time: the share of one core it got."""
    import time

    wall, cpu = time.monotonic(), time.process_time()
    while time.monotonic() - wall < seconds:
        pass
    return (time.process_time() - cpu) / (time.monotonic() - wall)


def _started(gateway: Cluster, *lines: str, node: str = "node-a") -> str:
    """The nodelet's log once it has logged one of ``lines`` (how it enforces a limit:
    logged just after it registered, so waiting for "registered" alone races with it)."""
    log = gateway.dir / f"{node}.log"
    seen = lambda: any(line in log.read_text() for line in lines)  # noqa: E731
    wait_until(seen, 30, f"the nodelet to log one of {lines}")
    return log.read_text()


def test_a_call_reaches_only_its_own_gpus_device_files(gateway: Cluster, tmp_path: Path) -> None:
    devices = tmp_path / "dev"
    gateway.start_nodelet(**{"fake-gpu-device-dir": str(devices), "spare-workers": "1"})
    log = _started(gateway, "GPU isolation", "cannot make fake GPU device file")
    if "GPU isolation: CUDA_VISIBLE_DEVICES only" in log or not devices.exists():
        reason = re.search(r"(GPU isolation: .*|cannot make fake GPU device file .*)", log)
        pytest.skip(f"not enforced here: {reason.group(1) if reason else 'see the log'}")
    assert "GPU isolation: CUDA_VISIBLE_DEVICES, and other GPUs' device files denied" in log
    sdk.connect(gateway.url, gateway.token)
    allowed, denied = errno.ENXIO, errno.EPERM  # no driver behind an allowed file
    for gpus in (1, 2, 0, 1):  # the second 1-GPU call may run in the first one's warm worker
        seen = sdk.function(gpus=gpus)(open_gpu_files)(str(devices))
        assert len(seen["own"]) == gpus
        expected = {i: allowed if i in seen["own"] else denied for i in (0, 1)}
        assert seen["errnos"] == expected, f"a {gpus}-GPU call on GPUs {seen['own']}"


def test_a_cpu_cap_holds_a_busy_call_to_its_share(gateway: Cluster) -> None:
    gateway.start_nodelet(**{"cpu-limit": "0.25"})
    log = _started(gateway, "CPU limit")
    if "CPU limit of 0.25 cores per call NOT enforced" in log:
        pytest.skip(re.search(r"NOT enforced: (.*)", log).group(1))  # type: ignore[union-attr]
    assert re.search(r"CPU limit: 0\.25 CPU cores per call \(cgroup v[12] cpu", log)
    sdk.connect(gateway.url, gateway.token)
    share = sdk.function()(spin)(1.5)
    assert share < 0.45, f"a 0.25-core cap let the call use {share:.2f} of a core"
