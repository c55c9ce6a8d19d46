"""GPU discovery and health: fake GPUs and their injected faults, NVML through a stand-in for the
NVIDIA library, and the fallback on a machine without NVIDIA GPUs."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from bulletin_core import wire
from bulletin_core.wire import GpuHealthReport
from nodelet import gpus
from nodelet.gpus import (
    FAKE_GPU_TEMPERATURE_C,
    GPU_LOST,
    FakeGpuProvider,
    GpuProvider,
    NvmlProvider,
    choose_provider,
    describe,
)


def test_fake_gpus_look_like_real_ones() -> None:
    gpus = FakeGpuProvider(3, node="node-a").discover()
    assert gpus == [
        wire.GpuInfo(index=i, uuid=f"fake-node-a-{i}", name="Fake GPU", memory_mb=16384, fake=True)
        for i in range(3)
    ]


def test_fake_gpu_uuids_differ_between_nodes() -> None:
    a = {g.uuid for g in FakeGpuProvider(2, node="a").discover()}
    b = {g.uuid for g in FakeGpuProvider(2, node="b").discover()}
    assert a.isdisjoint(b)


def test_zero_fake_gpus_is_a_cpu_only_node() -> None:
    assert FakeGpuProvider(0).discover() == []


def test_negative_fake_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="fake GPU count must be >= 0, got -1"):
        FakeGpuProvider(-1)


def test_explicit_fake_count_wins() -> None:
    provider = choose_provider(4, node="n")
    assert isinstance(provider, FakeGpuProvider)
    assert [g.index for g in provider.discover()] == [0, 1, 2, 3]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has NVIDIA GPUs")
def test_without_nvidia_gpus_falls_back_to_two_fakes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nodelet.gpus"):
        provider: GpuProvider = choose_provider(None, node="n")
    assert not isinstance(provider, NvmlProvider)
    gpus = provider.discover()
    assert len(gpus) == 2
    assert all(g.fake for g in gpus)
    assert "using 2 fake GPUs" in caplog.text


def test_calls_on_real_gpus_move_their_tensors_to_cuda_and_all_others_stay_on_the_cpu() -> None:
    # The worker sees only its own GPUs (CUDA_VISIBLE_DEVICES): the first of them is cuda:0.
    assert NvmlProvider().device([3, 5]) == "cuda:0"
    assert NvmlProvider().device([]) == "cpu"
    assert FakeGpuProvider(2).device([1]) == "cpu"
    assert FakeGpuProvider(2).device([]) == "cpu"


# --- health: fake GPUs and their fault file ---------------------------------------------------


def test_fake_gpus_are_healthy_and_the_same_every_time() -> None:
    provider = FakeGpuProvider(2, node="n")
    expected = [
        GpuHealthReport(
            index=i,
            utilization_pct=0,
            memory_used_mb=0,
            temperature_c=FAKE_GPU_TEMPERATURE_C,
            ecc_double_bit=0,
        )
        for i in range(2)
    ]
    assert provider.health() == expected
    assert provider.health() == expected
    assert expected[0].critical is None
    assert expected[0].xid_errors == []
    assert describe(expected[0]) == "GPU 0: ok, 0% busy, 0 MiB used, 35 C"


def test_a_missing_fault_file_means_no_faults(tmp_path: Path) -> None:
    provider = FakeGpuProvider(1, fault_file=tmp_path / "faults")
    assert provider.health()[0].critical is None


def test_an_injected_xid_is_critical_in_one_sample_and_ecc_in_every_sample(
    tmp_path: Path,
) -> None:
    faults = tmp_path / "faults"
    faults.write_text("# injected by the test\n0 xid 79\n1 ecc 2\n")
    provider = FakeGpuProvider(3, fault_file=faults)

    gpu0, gpu1, gpu2 = provider.health()
    assert gpu0.xid_errors == [79]
    assert gpu0.critical == "XID 79 (GPU fell off the bus)"
    assert describe(gpu0).startswith("GPU 0: CRITICAL: XID 79 (GPU fell off the bus), ")
    assert gpu1.ecc_double_bit == 2
    assert gpu1.critical == "2 uncorrectable ECC errors"
    assert gpu2.critical is None

    gpu0, gpu1, _ = provider.health()
    assert gpu0.xid_errors == [] and gpu0.critical is None  # an XID is an event: reported once
    assert gpu1.critical == "2 uncorrectable ECC errors"  # an ECC count is a state: it stays

    with faults.open("a") as f:  # another process appends while the nodelet runs
        f.write("0 xid 48\n1 ecc 0\n")
    gpu0, gpu1, _ = provider.health()
    assert gpu0.critical == "XID 48 (double-bit ECC error)"
    assert gpu1.ecc_double_bit == 0 and gpu1.critical is None


def test_xids_of_a_users_program_leave_the_gpu_in_service(tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.write_text("0 xid 13\n0 xid 31\n")
    assert FakeGpuProvider(1, fault_file=faults).health()[0].critical is None


def test_errors_together_give_one_reason_naming_all(tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.write_text("0 xid 94\n0 xid 94\n0 xid 119\n0 ecc 1\n")
    gpu = FakeGpuProvider(1, fault_file=faults).health()[0]
    assert gpu.xid_errors == [94, 119]
    assert gpu.critical == (
        "XID 94 (contained ECC error); XID 119 (GSP RPC timeout); 1 uncorrectable ECC error"
    )


def test_a_lost_fake_gpu_reports_nothing_but_its_loss(tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.write_text("1 lost\n")
    gpu = FakeGpuProvider(2, fault_file=faults).health()[1]
    assert gpu == GpuHealthReport(index=1, critical=GPU_LOST)
    assert describe(gpu) == "GPU 1: CRITICAL: GPU is lost (NVML: GPU_IS_LOST)"


def test_malformed_fault_lines_are_logged_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    faults = tmp_path / "faults"
    faults.write_text("0 xid seventy-nine\n5 ecc 1\nzero lost\n0 melted\n0\n0 ecc 1\n")
    with caplog.at_level(logging.WARNING, logger="nodelet.gpus"):
        gpu = FakeGpuProvider(1, fault_file=faults).health()[0]
    assert gpu.critical == "1 uncorrectable ECC error"
    assert caplog.text.count("ignoring fault line") == 5
    assert "faults:2: ignoring fault line '5 ecc 1'" in caplog.text  # GPU 5 does not exist


def test_choose_provider_hands_the_fault_file_to_fake_gpus(tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.write_text("0 ecc 3\n")
    provider = choose_provider(1, node="n", fault_file=faults)
    assert provider.health()[0].critical == "3 uncorrectable ECC errors"
    provider.close()


# --- health: NVML, through a stand-in for the NVIDIA library (there is no GPU here) -----------


class _Event:
    def __init__(self, xid: int) -> None:
        self.eventType = pynvml.nvmlEventTypeXidCriticalError
        self.eventData = xid


class FakeNvml:
    """Stands in for the ``pynvml`` module: the calls the provider makes, the real constants and
    exception classes. Errors are raised as pynvml raises them, from an NVML return code."""

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVMLError_ResetRequired = pynvml.NVMLError_ResetRequired
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self, count: int) -> None:
        self.count = count
        self.initialised = 0
        #: Per GPU, the NVML error code a call raises instead of answering, by call name.
        self.errors: list[dict[str, int]] = [{} for _ in range(count)]
        self.ecc = [0] * count
        self.pending: list[list[_Event]] = [[] for _ in range(count)]
        self.event_sets: dict[int, int] = {}  # event set -> GPU index
        self.freed: list[int] = []

    def _check(self, index: int, call: str) -> None:
        if call in self.errors[index]:
            raise pynvml.NVMLError(self.errors[index][call])

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        assert self.initialised > 0
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check(index, "handle")
        return index  # a handle is opaque; the GPU's index will do

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        self._check(handle, "utilization")
        return SimpleNamespace(gpu=37 + handle, memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        self._check(handle, "memory")
        return SimpleNamespace(total=80 * 1024**3, used=1024 * 1024**2, free=0)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        self._check(handle, "temperature")
        return 45

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter: int) -> int:
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == pynvml.NVML_VOLATILE_ECC
        self._check(handle, "ecc")
        return self.ecc[handle]

    def nvmlEventSetCreate(self) -> int:
        return 1000 + len(self.event_sets) + len(self.freed)

    def nvmlDeviceRegisterEvents(self, handle: int, event_types: int, event_set: int) -> None:
        assert event_types == pynvml.nvmlEventTypeXidCriticalError
        self._check(handle, "register")
        self.event_sets[event_set] = handle

    def nvmlEventSetWait(self, event_set: int, timeout_ms: int) -> _Event:
        assert timeout_ms == 0  # a heartbeat must never wait for an event
        index = self.event_sets[event_set]
        self._check(index, "wait")
        if not self.pending[index]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.pending[index].pop(0)

    def nvmlEventSetFree(self, event_set: int) -> None:
        self.event_sets.pop(event_set, None)
        self.freed.append(event_set)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml(2)
    monkeypatch.setattr(gpus, "pynvml", fake)
    return fake


def test_nvml_health_reads_each_gpu(nvml: FakeNvml) -> None:
    provider = NvmlProvider()
    assert provider.health() == [
        GpuHealthReport(
            index=i,
            utilization_pct=37 + i,
            memory_used_mb=1024,
            temperature_c=45,
            ecc_double_bit=0,
        )
        for i in range(2)
    ]
    provider.close()
    assert nvml.initialised == 0
    assert nvml.event_sets == {}


def test_values_a_gpu_does_not_support_are_none(nvml: FakeNvml) -> None:
    # A GeForce card has no ECC; some report no temperature or utilisation either.
    for call in ("ecc", "temperature", "utilization", "register"):
        nvml.errors[0][call] = pynvml.NVML_ERROR_NOT_SUPPORTED
    provider = NvmlProvider()
    gpu = provider.health()[0]
    assert gpu == GpuHealthReport(index=0, memory_used_mb=1024)
    assert describe(gpu) == "GPU 0: ok, 1024 MiB used"


def test_an_nvml_xid_79_is_critical_once(nvml: FakeNvml) -> None:
    provider = NvmlProvider()
    provider.health()  # subscribes to XID events
    nvml.pending[1] = [_Event(13), _Event(79), _Event(79)]
    gpu0, gpu1 = provider.health()
    assert gpu0.critical is None
    assert gpu1.xid_errors == [79]
    assert gpu1.critical == "XID 79 (GPU fell off the bus)"
    assert gpu1.utilization_pct == 38  # the rest of the sample is still read
    assert provider.health()[1].critical is None


def test_uncorrectable_ecc_errors_are_critical(nvml: FakeNvml) -> None:
    nvml.ecc[0] = 2
    provider = NvmlProvider()
    assert provider.health()[0].critical == "2 uncorrectable ECC errors"
    assert provider.health()[0].critical == "2 uncorrectable ECC errors"


def test_a_lost_gpu_is_critical(nvml: FakeNvml) -> None:
    provider = NvmlProvider()
    provider.health()
    nvml.pending[0] = [_Event(79)]
    nvml.errors[0]["utilization"] = pynvml.NVML_ERROR_GPU_IS_LOST
    gpu0, gpu1 = provider.health()
    assert gpu0 == GpuHealthReport(
        index=0, xid_errors=[79], critical="XID 79 (GPU fell off the bus); " + GPU_LOST
    )
    assert gpu1.critical is None


def test_a_gpu_lost_before_the_first_sample_is_critical(nvml: FakeNvml) -> None:
    nvml.errors[1]["handle"] = pynvml.NVML_ERROR_GPU_IS_LOST
    provider = NvmlProvider()
    assert provider.health()[1] == GpuHealthReport(index=1, critical=GPU_LOST)
    assert provider.health()[1].critical == GPU_LOST
    assert provider.health()[0].critical is None


def test_a_gpu_that_needs_a_reset_is_critical(nvml: FakeNvml) -> None:
    nvml.errors[0]["wait"] = pynvml.NVML_ERROR_RESET_REQUIRED
    gpu = NvmlProvider().health()[0]
    assert gpu.critical == "NVML: GPU requires restart"


def test_other_nvml_errors_give_an_unknown_value_and_one_warning(
    nvml: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    nvml.errors[0]["temperature"] = pynvml.NVML_ERROR_UNKNOWN
    provider = NvmlProvider()
    with caplog.at_level(logging.WARNING, logger="nodelet.gpus"):
        assert provider.health()[0].temperature_c is None
        assert provider.health()[0].critical is None
    assert caplog.text.count("GPU 0: reading its temperature failed (Unknown Error)") == 1


def test_close_then_health_opens_nvml_again(nvml: FakeNvml) -> None:
    provider = NvmlProvider()
    provider.health()
    provider.close()
    provider.close()  # twice is harmless
    assert nvml.initialised == 0
    assert len(nvml.freed) == 2
    assert len(provider.health()) == 2
    assert nvml.initialised == 1


def test_nvlink_groups_join_gpus_linked_directly_or_through_switches() -> None:
    from nodelet.gpus import nvlink_groups

    # Two NVLink pairs (a PCIe box with bridges): 0-1 and 2-3; GPU 4 has no NVLink.
    assert nvlink_groups(5, [(0, 1), (1, 0), (2, 3), (3, 2)]) == [0, 0, 2, 2, None]
    # An HGX board: every GPU's links go to NVSwitches, so all reach each other.
    assert nvlink_groups(8, [(i, None) for i in range(8) for _ in range(2)]) == [0] * 8
    # A ring 0-1-2-3 is one group.
    assert nvlink_groups(4, [(0, 1), (1, 2), (2, 3)]) == [0, 0, 0, 0]
    assert nvlink_groups(2, []) == [None, None]
