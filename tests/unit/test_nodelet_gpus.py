"""GPU discovery: the fake provider's shape and the fallback on a machine without NVIDIA GPUs."""

from __future__ import annotations

import logging
import shutil

import pytest

from bulletin import wire
from nodelet.gpus import FakeGpuProvider, GpuProvider, NvmlProvider, choose_provider


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
