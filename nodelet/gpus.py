"""GPU discovery: NVIDIA GPUs through NVML, or CPU-backed fake GPUs behind the same interface."""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Protocol

import pynvml

from bulletin import wire

log = logging.getLogger(__name__)

#: How many fake GPUs a node without NVIDIA GPUs pretends to have unless told otherwise.
DEFAULT_FAKE_GPUS = 2
FAKE_GPU_MEMORY_MB = 16384


class GpuProvider(Protocol):
    def discover(self) -> list[wire.GpuInfo]: ...

    def device(self, gpu_indices: Sequence[int]) -> str:
        """The torch device a call on these GPUs moves its tensors to ("cuda:0", "cpu")."""
        ...


class NvmlProvider:
    """The node's NVIDIA GPUs, read through NVML (nvidia-ml-py)."""

    def device(self, gpu_indices: Sequence[int]) -> str:
        # The worker sees only its GPUs (CUDA_VISIBLE_DEVICES): the first is cuda:0.
        return "cuda:0" if gpu_indices else "cpu"

    def discover(self) -> list[wire.GpuInfo]:
        pynvml.nvmlInit()
        try:
            return [_nvml_gpu(index) for index in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()


def _nvml_gpu(index: int) -> wire.GpuInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return wire.GpuInfo(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_mb=int(memory.total) // (1024 * 1024),
    )


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else value


class FakeGpuProvider:
    """``count`` CPU-backed fake GPUs, for machines without NVIDIA GPUs and for tests."""

    def __init__(self, count: int, *, node: str | None = None) -> None:
        if count < 0:
            raise ValueError(f"fake GPU count must be >= 0, got {count}")
        self.count = count
        self.node = node or socket.gethostname()

    def device(self, gpu_indices: Sequence[int]) -> str:
        return "cpu"  # a fake GPU is backed by the CPU

    def discover(self) -> list[wire.GpuInfo]:
        return [
            wire.GpuInfo(
                index=index,
                uuid=f"fake-{self.node}-{index}",
                name="Fake GPU",
                memory_mb=FAKE_GPU_MEMORY_MB,
                fake=True,
            )
            for index in range(self.count)
        ]


def choose_provider(fake_gpus: int | None, *, node: str | None = None) -> GpuProvider:
    """An explicit fake count gives fake GPUs; else NVML if it finds a GPU; else 2 fakes."""
    if fake_gpus is not None:
        return FakeGpuProvider(fake_gpus, node=node)
    nvml = NvmlProvider()
    try:
        found = len(nvml.discover())
    except (pynvml.NVMLError, OSError) as exc:
        log.warning("no NVIDIA GPUs usable (%s); using %d fake GPUs", exc, DEFAULT_FAKE_GPUS)
        return FakeGpuProvider(DEFAULT_FAKE_GPUS, node=node)
    if found == 0:
        log.warning("NVML found no GPUs; using %d fake GPUs", DEFAULT_FAKE_GPUS)
        return FakeGpuProvider(DEFAULT_FAKE_GPUS, node=node)
    return nvml
