"""The CUDA paths, for real: a nodelet on the machine's NVIDIA GPUs (NVML, no fakes) runs a
call whose notebook state moves to the GPU and comes back on the CPU. Skipped without CUDA;
run on a GPU machine with ``pytest -m cuda``."""

from __future__ import annotations

import pytest

import sdk
from tests.conftest import Cluster

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and a CUDA torch"),
]


@pytest.fixture
def gpu_cluster(gateway: Cluster) -> Cluster:
    gateway.start_nodelet(fake_gpus=None)
    sdk.connect(gateway.url, gateway.token)
    return gateway


def test_state_runs_on_the_gpu_and_comes_back_on_the_cpu(gpu_cluster: Cluster) -> None:
    namespace = {"__name__": "__main__", "torch": torch}
    exec(
        "model = torch.nn.Linear(8, 8)\n"
        "weight = model.weight\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "outputs = []\n"
        "def train(x):\n"
        "    where = (str(x.device), str(model.weight.device), str(torch.randn(1).device))\n"
        "    loss = model(x).pow(2).sum()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    outputs.append(model(x))\n"
        "    return where\n",
        namespace,
    )
    before = namespace["weight"].detach().clone()
    train = sdk.function(gpus=1)(namespace["train"])
    assert train(torch.randn(4, 8)) == ("cuda:0", "cuda:0", "cuda:0")
    weight = namespace["weight"]
    assert namespace["model"].weight is weight and weight.device.type == "cpu"
    assert weight.requires_grad and not torch.equal(weight.detach(), before)
    assert namespace["opt"].param_groups[0]["params"][0] is weight
    [output] = namespace["outputs"]
    assert output.device.type == "cpu" and output.requires_grad


def fill_gpu(mib: int) -> int:
    import torch

    block = torch.ones(mib << 18, device="cuda")  # float32: 4 bytes each
    del block
    return torch.cuda.memory_reserved()


def reserved_and_visible() -> tuple[int, int, str]:
    import os

    import torch

    return (
        torch.cuda.memory_reserved(),
        torch.cuda.device_count(),
        os.environ["CUDA_VISIBLE_DEVICES"],
    )


def test_a_warm_worker_has_its_cuda_context_and_an_empty_cache_between_calls(
    gpu_cluster: Cluster,
) -> None:
    fill = sdk.function(gpus=1)(fill_gpu)
    assert fill(256) >= 256 << 20, "the caching allocator keeps the freed block"
    probe = sdk.function(gpus=1)(reserved_and_visible)
    reserved, count, visible = probe()
    assert probe.last_call is not None and probe.last_call.timings.warm
    assert reserved == 0, "the worker emptied torch's CUDA cache after the last call"
    assert count == 1 and visible.isdigit()


def allocate(fraction: float) -> str:
    """Allocate ``fraction`` of the GPU's memory through torch; say how that went."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    try:
        block = torch.empty(int(total * fraction), dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        return "out of memory"
    del block
    torch.cuda.empty_cache()
    return "allocated"


def test_part_of_a_gpu_caps_the_call_s_cuda_memory_at_its_part(gpu_cluster: Cluster) -> None:
    quarter = sdk.function(gpus=0.25)(allocate)
    assert quarter(0.1) == "allocated"
    assert quarter(0.5) == "out of memory", "torch's memory fraction holds the call to 0.25"
    # A warm worker's next call of a whole GPU gets the whole GPU back.
    assert sdk.function(gpus=1)(allocate)(0.5) == "allocated"
