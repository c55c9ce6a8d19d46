"""GPU discovery and health: NVIDIA GPUs through NVML, or CPU-backed fake GPUs behind the same
interface.

``discover()`` lists a node's GPUs once, when it registers. ``health()`` samples them at each
heartbeat: utilisation, memory in use, temperature, uncorrectable ECC errors and the XID errors
seen since the previous sample. A GPU whose sample has ``critical`` set must be taken out of
service (and its node drained); ``CRITICAL_XIDS`` says which XIDs count.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
import pynvml

from bulletin_core import wire

log = logging.getLogger(__name__)

#: How many fake GPUs a node without NVIDIA GPUs pretends to have unless told otherwise.
DEFAULT_FAKE_GPUS = 2
FAKE_GPU_MEMORY_MB = 16384
#: What a healthy fake GPU reports (fixed, so tests can compare whole samples).
FAKE_GPU_TEMPERATURE_C = 35
#: The model name fake GPUs report unless told another.
FAKE_GPU_MODEL = "Fake GPU"
#: The character-device major number of fake GPUs' device files: one of the numbers Linux
#: keeps for local and experimental use, which no driver claims, so opening one fails with
#: ENXIO unless a devices cgroup denies it first (EPERM).
FAKE_GPU_MAJOR = 242

#: XIDs after which a GPU is taken out of service until an admin resets or replaces it.
#: Source: NVIDIA's Xid catalog (https://docs.nvidia.com/deploy/xid-errors/), the XIDs whose
#: immediate action is a GPU reset, a node reboot or a support case because the hardware
#: (memory, bus, NVLink, GSP firmware) failed. XIDs a user's program causes (13, 31, 43, 45:
#: illegal access, engine exception, stopped channel) are left out: they fail that call only.
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    63: "row remapping pending, GPU reset required",
    64: "row remapping failed",
    74: "NVLink error",
    79: "GPU fell off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
GPU_LOST = "GPU is lost (NVML: GPU_IS_LOST)"

_MIB = 1024 * 1024
#: Events drained per GPU and sample; more would mean a storm, and the next sample gets the rest.
_MAX_EVENTS_PER_SAMPLE = 64


def describe(health: wire.GpuHealthReport) -> str:
    """One line for logs and listings: "GPU 0: ok, 37% busy, 1024 MiB used, 45 C"."""
    state = f"CRITICAL: {health.critical}" if health.critical else "ok"
    parts = [f"GPU {health.index}: {state}"]
    if health.utilization_pct is not None:
        parts.append(f"{health.utilization_pct}% busy")
    if health.memory_used_mb is not None:
        parts.append(f"{health.memory_used_mb} MiB used")
    if health.temperature_c is not None:
        parts.append(f"{health.temperature_c} C")
    return ", ".join(parts)


def critical_reason(*, ecc_double_bit: int | None, xid_errors: Sequence[int]) -> str | None:
    """Why a GPU with these errors must leave service ("XID 79 (GPU fell off the bus)"), or None."""
    reasons = [f"XID {xid} ({CRITICAL_XIDS[xid]})" for xid in xid_errors if xid in CRITICAL_XIDS]
    if ecc_double_bit:
        plural = "s" if ecc_double_bit != 1 else ""
        reasons.append(f"{ecc_double_bit} uncorrectable ECC error{plural}")
    # Cut to what the heartbeat's message takes (wire.Name).
    return "; ".join(reasons)[:200] or None


def _critical_xids(index: int, xids: Sequence[int]) -> list[int]:
    """The critical XIDs among ``xids``, each once, in order; the others are only logged."""
    critical: list[int] = []
    for xid in xids:
        if xid not in CRITICAL_XIDS:
            log.info(
                "GPU %d reported XID %d (not a hardware fault; GPU stays in service)", index, xid
            )
        elif xid not in critical:
            critical.append(xid)
    return critical


class GpuProvider(Protocol):
    def discover(self) -> list[wire.GpuInfo]: ...

    def health(self) -> list[wire.GpuHealthReport]:
        """A health sample of every GPU ``discover`` lists, in index order."""
        ...

    def close(self) -> None:
        """Release what ``health`` holds open; a later ``health`` opens it again."""
        ...

    def device(self, gpu_indices: Sequence[int]) -> str:
        """The torch device a call on these GPUs moves its tensors to ("cuda:0", "cpu")."""
        ...

    def device_files(self) -> dict[int, list[str]]:
        """Each GPU's own device files (``/dev/nvidia3``), by index; shared ones such as
        ``/dev/nvidiactl`` are not listed. A worker is denied the files of others' GPUs."""
        ...


class NvmlProvider:
    """The node's NVIDIA GPUs, read through NVML (nvidia-ml-py).

    The first ``health()`` initialises NVML and subscribes to each GPU's critical XID events;
    both stay open until ``close()``. The calls are quick and do not wait for events, but they
    block: an asyncio caller runs them in a thread.
    """

    def __init__(self) -> None:
        self._handles: list[Any] | None = None  # None: health() has not opened NVML yet
        self._event_sets: list[Any] = []  # per GPU, None where it cannot report XID events
        self._warned: set[tuple[int, str]] = set()

    def device(self, gpu_indices: Sequence[int]) -> str:
        # The worker sees only its GPUs (CUDA_VISIBLE_DEVICES): the first is cuda:0.
        return "cuda:0" if gpu_indices else "cpu"

    def device_files(self) -> dict[int, list[str]]:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            log.warning("cannot list the GPUs' device files (%s): they are not isolated", exc)
            return {}
        try:
            files = {}
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                files[index] = [f"/dev/nvidia{pynvml.nvmlDeviceGetMinorNumber(handle)}"]
            return files
        except pynvml.NVMLError as exc:
            log.warning("cannot list the GPUs' device files (%s): they are not isolated", exc)
            return {}
        finally:
            pynvml.nvmlShutdown()

    def discover(self) -> list[wire.GpuInfo]:
        # NVML counts its initialisations, so this works while health() holds it open too.
        pynvml.nvmlInit()
        try:
            gpus = [_nvml_gpu(index) for index in range(pynvml.nvmlDeviceGetCount())]
            try:
                groups = nvlink_groups(len(gpus), _nvlinks(len(gpus)))
            except pynvml.NVMLError as exc:
                log.warning("cannot read the GPUs' NVLink topology (%s); placing without", exc)
                groups = [None] * len(gpus)
            return [
                msgspec.structs.replace(gpu, nvlink_group=group)
                for gpu, group in zip(gpus, groups, strict=True)
            ]
        finally:
            pynvml.nvmlShutdown()

    def health(self) -> list[wire.GpuHealthReport]:
        if self._handles is None:
            self._open()
        assert self._handles is not None
        return [self._sample(index, handle) for index, handle in enumerate(self._handles)]

    def close(self) -> None:
        if self._handles is None:
            return
        for event_set in self._event_sets:
            if event_set is not None:
                self._quietly(pynvml.nvmlEventSetFree, event_set)
        self._handles, self._event_sets = None, []
        self._quietly(pynvml.nvmlShutdown)

    def _open(self) -> None:
        pynvml.nvmlInit()
        handles: list[Any] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handles.append(pynvml.nvmlDeviceGetHandleByIndex(index))
            except _fatal_nvml_errors():
                handles.append(None)  # sampled as lost
        self._event_sets = [self._subscribe(i, h) for i, h in enumerate(handles)]
        self._handles = handles

    def _subscribe(self, index: int, handle: Any) -> Any:
        """A GPU's own event set for its critical XIDs, so each event names its GPU."""
        if handle is None:
            return None
        event_set = pynvml.nvmlEventSetCreate()
        try:
            pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
        except pynvml.NVMLError as exc:
            log.warning(
                "GPU %d cannot report XID errors (%s); ECC and loss still watched", index, exc
            )
            self._quietly(pynvml.nvmlEventSetFree, event_set)
            return None
        return event_set

    def _sample(self, index: int, handle: Any) -> wire.GpuHealthReport:
        if handle is None:
            return wire.GpuHealthReport(index=index, critical=GPU_LOST)
        xids: list[int] = []
        try:
            xids = self._poll_xids(index)
            utilization = self._query(index, "utilisation", _utilization, handle)
            memory_used = self._query(index, "memory", _memory_used_mb, handle)
            temperature = self._query(index, "temperature", _temperature, handle)
            ecc = self._query(index, "ECC", _ecc_double_bit, handle)
        except _fatal_nvml_errors() as exc:
            reason = critical_reason(ecc_double_bit=None, xid_errors=xids)
            lost = GPU_LOST if isinstance(exc, pynvml.NVMLError_GpuIsLost) else f"NVML: {exc}"
            critical = f"{reason}; {lost}" if reason else lost
            return wire.GpuHealthReport(index=index, xid_errors=xids, critical=critical)
        return wire.GpuHealthReport(
            index=index,
            utilization_pct=utilization,
            memory_used_mb=memory_used,
            temperature_c=temperature,
            ecc_double_bit=ecc,
            xid_errors=xids,
            critical=critical_reason(ecc_double_bit=ecc, xid_errors=xids),
        )

    def _poll_xids(self, index: int) -> list[int]:
        event_set = self._event_sets[index]
        if event_set is None:
            return []
        seen: list[int] = []
        for _ in range(_MAX_EVENTS_PER_SAMPLE):
            try:
                event = pynvml.nvmlEventSetWait(event_set, 0)  # 0 ms: only what is pending
            except pynvml.NVMLError_Timeout:
                break
            except _fatal_nvml_errors():
                raise
            except pynvml.NVMLError as exc:
                self._warn_once(index, "XID events", exc)
                break
            if event.eventType == pynvml.nvmlEventTypeXidCriticalError:
                seen.append(int(event.eventData))
        return _critical_xids(index, seen)

    def _query(self, index: int, what: str, read: Callable[[Any], int], handle: Any) -> int | None:
        """``read(handle)``, or None where the GPU does not support it (no ECC on GeForce)."""
        try:
            return read(handle)
        except pynvml.NVMLError_NotSupported:
            return None
        except _fatal_nvml_errors():
            raise
        except pynvml.NVMLError as exc:
            self._warn_once(index, what, exc)
            return None

    def _warn_once(self, index: int, what: str, exc: Exception) -> None:
        # Once per GPU and value: a heartbeat every few seconds would otherwise flood the log.
        if (index, what) not in self._warned:
            self._warned.add((index, what))
            log.warning("GPU %d: reading its %s failed (%s); reported as unknown", index, what, exc)

    @staticmethod
    def _quietly(call: Callable[..., object], *args: Any) -> None:
        try:
            call(*args)
        except pynvml.NVMLError as exc:
            log.debug("NVML clean-up failed: %s", exc)


def _fatal_nvml_errors() -> tuple[type[Exception], ...]:
    """Errors that mean the GPU itself is gone or wedged, not that a value is unavailable."""
    # Looked up at each call: tests substitute a stand-in for the pynvml module.
    return (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_ResetRequired)


def _utilization(handle: Any) -> int:
    return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def _memory_used_mb(handle: Any) -> int:
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used) // _MIB


def _temperature(handle: Any) -> int:
    return int(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))


def _ecc_double_bit(handle: Any) -> int:
    # Volatile: since the driver loaded, so a reset GPU starts clean again.
    return int(
        pynvml.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
        )
    )


def _nvml_gpu(index: int) -> wire.GpuInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return wire.GpuInfo(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_mb=int(memory.total) // _MIB,
    )


def nvlink_groups(count: int, links: Sequence[tuple[int, int | None]]) -> list[int | None]:
    """Each GPU's NVLink group (the lowest index in it), from its active links as (GPU,
    peer GPU) pairs, the peer None for a link to an NVSwitch: GPUs on switches all reach each
    other. A GPU without NVLink gets None."""
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    on_switch: list[int] = []
    linked: set[int] = set()
    for gpu, peer in links:
        linked.add(gpu)
        if peer is None:
            on_switch.append(gpu)
        else:
            linked.add(peer)
            parent[root(gpu)] = root(peer)
    for gpu in on_switch[1:]:
        parent[root(gpu)] = root(on_switch[0])
    lowest: dict[int, int] = {}
    for i in range(count):
        lowest.setdefault(root(i), i)
    return [lowest[root(i)] if i in linked else None for i in range(count)]


def _nvlinks(count: int) -> list[tuple[int, int | None]]:
    """The active NVLinks of the node's GPUs as (GPU, peer GPU or None for an NVSwitch);
    none where NVML cannot tell (no NVLink, an old driver)."""
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    by_bus = {_bus(pynvml.nvmlDeviceGetPciInfo(h).busId): i for i, h in enumerate(handles)}
    links: list[tuple[int, int | None]] = []
    for index, handle in enumerate(handles):
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _bus(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
            except pynvml.NVMLError:
                break  # no such link on this GPU (or no NVLink at all)
            links.append((index, by_bus.get(remote)))
    return links


def _bus(bus_id: str | bytes) -> str:
    """A PCI bus id in one spelling: NVML pads the domain to 4 or 8 digits."""
    parts = _text(bus_id).lower().split(":")
    if len(parts) != 3:
        return ":".join(parts)
    domain, bus, device = parts
    return f"{int(domain, 16):x}:{bus}:{device}"


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else value


class FakeGpuProvider:
    """``count`` CPU-backed fake GPUs, for machines without NVIDIA GPUs and for tests.

    Fake GPUs are healthy (idle, ``FAKE_GPU_TEMPERATURE_C``, no ECC errors) unless
    ``fault_file`` injects faults. Each ``health()`` re-reads that file, so another process (a
    test driving a nodelet subprocess) can write it at any time; a missing file means no faults.
    One fault a line, ``#`` starts a comment::

        0 xid 79    # GPU 0 reports XID 79 in the next sample only; append the line to repeat it
        1 ecc 2     # GPU 1 has 2 uncorrectable ECC errors, in every sample until "1 ecc 0"
        0 lost      # GPU 0 is lost, as NVML's GPU_IS_LOST, in every sample

    With ``device_dir``, each fake GPU also gets a device file there, ``fakegpu<index>``, a
    character device of major ``FAKE_GPU_MAJOR`` (made on first use; needs root), so GPU
    device isolation can be tested without GPUs.

    An XID line is an event: this provider reports it once, remembering it by line number and
    text, so append new lines rather than insert them (a new provider, as in a restarted
    nodelet, reports the file's XID lines again). ``ecc`` and ``lost`` are states: the last
    ``ecc`` line of a GPU wins. XIDs outside ``CRITICAL_XIDS`` are reported nowhere, as with
    NVML. Malformed lines and lines for GPUs beyond ``count`` are logged and skipped.
    """

    def __init__(
        self,
        count: int,
        *,
        node: str | None = None,
        fault_file: str | os.PathLike[str] | None = None,
        device_dir: str | os.PathLike[str] | None = None,
        model: str = FAKE_GPU_MODEL,
    ) -> None:
        if count < 0:
            raise ValueError(f"fake GPU count must be >= 0, got {count}")
        self.count = count
        self.model = model
        self.node = node or socket.gethostname()
        self.fault_file = Path(fault_file) if fault_file is not None else None
        self._xid_lines_seen: set[tuple[int, str]] = set()  # (line number, line) reported once
        self.device_dir = Path(device_dir) if device_dir is not None else None

    def device(self, gpu_indices: Sequence[int]) -> str:
        return "cpu"  # a fake GPU is backed by the CPU

    def device_files(self) -> dict[int, list[str]]:
        if self.device_dir is None:
            return {}
        files = {}
        self.device_dir.mkdir(parents=True, exist_ok=True)
        for index in range(self.count):
            path = self.device_dir / f"fakegpu{index}"
            if not path.is_char_device():
                try:
                    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(FAKE_GPU_MAJOR, index))
                except OSError as exc:
                    log.warning("cannot make fake GPU device file %s: %s", path, exc)
                    return {}
            files[index] = [str(path)]
        return files

    def discover(self) -> list[wire.GpuInfo]:
        return [
            wire.GpuInfo(
                index=index,
                uuid=f"fake-{self.node}-{index}",
                name=self.model,
                memory_mb=FAKE_GPU_MEMORY_MB,
                fake=True,
            )
            for index in range(self.count)
        ]

    def health(self) -> list[wire.GpuHealthReport]:
        faults = self._read_faults()
        return [self._sample(index, faults.get(index, _Faults())) for index in range(self.count)]

    def close(self) -> None:
        pass  # nothing held open

    def _sample(self, index: int, faults: _Faults) -> wire.GpuHealthReport:
        xids = _critical_xids(index, faults.xids)
        if faults.lost:
            reason = critical_reason(ecc_double_bit=None, xid_errors=xids)
            critical = f"{reason}; {GPU_LOST}" if reason else GPU_LOST
            return wire.GpuHealthReport(index=index, xid_errors=xids, critical=critical)
        return wire.GpuHealthReport(
            index=index,
            utilization_pct=0,
            memory_used_mb=0,
            temperature_c=FAKE_GPU_TEMPERATURE_C,
            ecc_double_bit=faults.ecc,
            xid_errors=xids,
            critical=critical_reason(ecc_double_bit=faults.ecc, xid_errors=xids),
        )

    def _read_faults(self) -> dict[int, _Faults]:
        if self.fault_file is None:
            return {}
        try:
            lines = self.fault_file.read_text().splitlines()
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("cannot read fake GPU fault file %s: %s", self.fault_file, exc)
            return {}
        faults: dict[int, _Faults] = {}
        for number, line in enumerate(lines, start=1):
            words = line.split("#", 1)[0].split()
            if words and not self._apply_fault(faults, number, words):
                log.warning("%s:%d: ignoring fault line %r", self.fault_file, number, line)
        return faults

    def _apply_fault(self, faults: dict[int, _Faults], number: int, words: list[str]) -> bool:
        """Adds one line's fault to ``faults``; False if the line is malformed."""
        index = words[0]
        if not (index.isdigit() and int(index) < self.count):
            return False
        gpu = faults.setdefault(int(index), _Faults())
        match words[1:]:
            case ["lost"]:
                gpu.lost = True
            case ["ecc", count] if count.isdigit():
                gpu.ecc = int(count)
            case ["xid", xid] if xid.isdigit():
                key = (number, " ".join(words))
                if key not in self._xid_lines_seen:
                    self._xid_lines_seen.add(key)
                    gpu.xids.append(int(xid))
            case _:
                return False
        return True


@dataclasses.dataclass
class _Faults:
    """One fake GPU's injected faults, as its fault file lines say."""

    ecc: int = 0
    xids: list[int] = dataclasses.field(default_factory=list)
    lost: bool = False


def choose_provider(
    fake_gpus: int | None,
    *,
    node: str | None = None,
    fault_file: str | os.PathLike[str] | None = None,
    device_dir: str | os.PathLike[str] | None = None,
    model: str = "",
) -> GpuProvider:
    """An explicit fake count gives fake GPUs; else NVML if it finds a GPU; else 2 fakes.

    ``fault_file`` injects faults into fake GPUs, ``device_dir`` gives them device files, and
    ``model`` names their model (see ``FakeGpuProvider``); NVML ignores them.
    """
    fakes = functools.partial(
        FakeGpuProvider, node=node, fault_file=fault_file, device_dir=device_dir,
        model=model or FAKE_GPU_MODEL,
    )  # fmt: skip
    if fake_gpus is not None:
        return fakes(fake_gpus)
    nvml = NvmlProvider()
    try:
        found = len(nvml.discover())
    except (pynvml.NVMLError, OSError) as exc:
        log.warning("no NVIDIA GPUs usable (%s); using %d fake GPUs", exc, DEFAULT_FAKE_GPUS)
        return fakes(DEFAULT_FAKE_GPUS)
    if found == 0:
        log.warning("NVML found no GPUs; using %d fake GPUs", DEFAULT_FAKE_GPUS)
        return fakes(DEFAULT_FAKE_GPUS)
    return nvml
