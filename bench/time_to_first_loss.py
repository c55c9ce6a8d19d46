"""Time to first loss: how long until a call's code runs, and until one small torch training
step is done, for a warm worker (Bulletin) and a cold start (a fresh interpreter that
imports torch, as a batch job or submitit starts).

Starts its own single-machine cluster (`bulletin up`: fake GPUs, workers warmed with torch)
and measures, over N calls each:
  * call to user code: the timeline's `started - submitted` of a no-op call, and its round trip;
  * a torch step: a Linear(256, 256) + Adam step on a batch of 64, round trip;
  * the same step cold: `python -c "import torch; <the step>"`, from process start to done.
Usage: python bench/time_to_first_loss.py [--calls 30]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from roundtrip import start_cluster  # type: ignore[import-not-found]

import sdk

STEP = """
import torch
model = torch.nn.Linear(256, 256)
optimizer = torch.optim.Adam(model.parameters())
loss = model(torch.randn(64, 256)).pow(2).mean()
loss.backward()
optimizer.step()
"""


def noop() -> None:
    return None


def torch_step() -> float:
    import torch

    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.Adam(model.parameters())
    loss = model(torch.randn(64, 256)).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def cold_step() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", STEP], check=True)
    return time.perf_counter() - started


def median_ms(values: list[float]) -> str:
    return f"median {1000 * statistics.median(values):.1f} ms, best {1000 * min(values):.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o711)  # as root, PostgreSQL's system account must traverse it
        state = Path(tmp) / "state"
        proc = start_cluster(state)
        try:
            sdk.connect(config=state / "client.toml")
            quick = sdk.function(gpus=1)(noop)
            step = sdk.function(gpus=1)(torch_step)
            time.sleep(5)  # the spare workers import torch
            quick()  # the caller's connection
            started = time.perf_counter()
            step()  # the first torch step, on a spare worker warmed at start
            first = time.perf_counter() - started
            to_code, round_trips, steps = [], [], []
            for _ in range(args.calls):
                started = time.perf_counter()
                quick()
                round_trips.append(time.perf_counter() - started)
                timings = quick.last_call.timings  # type: ignore[union-attr]
                to_code.append(timings.started - timings.submitted)  # type: ignore[operator]
                started = time.perf_counter()
                step()
                steps.append(time.perf_counter() - started)
            cold = [cold_step() for _ in range(max(3, args.calls // 10))]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(f"warm call to user code (timeline): {median_ms(to_code)}")
    print(f"warm no-op round trip: {median_ms(round_trips)}")
    print(f"first torch step on a spare worker (warmed at start): {1000 * first:.1f} ms")
    print(f"warm torch step round trip: {median_ms(steps)}")
    print(f"cold torch step (fresh interpreter): {median_ms(cold)}")
    print(
        f"cold / warm for the torch step: {statistics.median(cold) / statistics.median(steps):.0f}x"
    )


if __name__ == "__main__":
    main()
