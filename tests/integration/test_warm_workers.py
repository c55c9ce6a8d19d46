"""Warm workers through a real cluster: torch is imported and its first optimizer step paid
before the call arrives, and user code may still fork after that warm-up."""

from __future__ import annotations

import pytest

import sdk
from tests.conftest import Cluster, wait_until

pytest.importorskip("torch")


def what_was_loaded() -> tuple[bool, bool]:
    import sys

    return "torch" in sys.modules, "torch._dynamo" in sys.modules


def fork_and_train(n: int) -> list[float]:
    import multiprocessing

    import torch

    context = multiprocessing.get_context("fork")  # as DataLoader workers start on Linux
    results = context.Queue()

    def step(seed: int) -> None:
        torch.manual_seed(seed)
        results.put(float(torch.nn.Linear(4, 1)(torch.randn(64, 4)).sum()))

    children = [context.Process(target=step, args=(seed,)) for seed in range(n)]
    for child in children:
        child.start()
    values = [results.get(timeout=30) for _ in children]  # a deadlocked child never answers
    for child in children:
        child.join(10)
    return values


def test_spare_workers_have_torch_and_its_first_step_loaded(gateway: Cluster) -> None:
    gateway.start_nodelet(**{"warm-torch": "true", "spare-workers": "1"})
    sdk.connect(gateway.url, gateway.token)
    probe = sdk.function(gpus=1)(what_was_loaded)
    wait_until(lambda: "registered" in (gateway.dir / "node-a.log").read_text(), 30, "the node")
    assert probe() == (True, True)
    assert probe.last_call is not None and probe.last_call.timings.warm is True
    trained = sdk.function(gpus=1, timeout=60)(fork_and_train)(3)
    assert len(trained) == 3
