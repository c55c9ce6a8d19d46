"""Round-trip latency of a no-op call through the whole path, and `map` throughput.

Starts its own single-machine cluster (`bulletin up` in a temporary state dir, fake GPUs)
unless --config points at a running one, then measures:
  * p50/p90/p99 latency of N sequential no-op calls (submit -> schedule -> nodelet ->
    worker -> result back in the caller), CPU-only and 1-GPU;
  * throughput of fn.map over M no-op calls;
  * p50/p90/p99 latency of N sequential JSON invocations of a registered no-op function over
    plain HTTP (POST /v1/functions/noop/invoke?wait=30, as curl would), CPU-only.
Usage: python bench/roundtrip.py [--calls 1000] [--map 5000] [--config client.toml]
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
import tomllib
from pathlib import Path

import httpx

import sdk


def noop(x: int) -> int:
    return x


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_cluster(state: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bulletin",
            "--log-level",
            "warning",
            "up",
            "--state-dir",
            str(state),
            "--port",
            "0",
            "--fake-gpus",
            "2",
        ],
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (state / "client.toml").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("bulletin up did not start")
        time.sleep(0.2)
    time.sleep(1.0)  # let the nodelet register and pre-start its workers
    return proc


def latency(fn: sdk.Function, calls: int) -> list[float]:
    fn(0)  # warm: connection, first worker
    samples = []
    for i in range(calls):
        started = time.perf_counter()
        assert fn(i) == i
        samples.append(time.perf_counter() - started)
    return samples


def json_latency(config: Path, calls: int) -> list[float]:
    sdk.function(gpus=0)(noop).register("noop")
    settings = tomllib.loads(config.read_text())
    headers = {"Authorization": f"Bearer {settings['token']}"}
    samples = []
    with httpx.Client(base_url=settings["url"], headers=headers, timeout=60) as client:
        for i in range(calls + 1):
            started = time.perf_counter()
            answer = client.post("/v1/functions/noop/invoke?wait=30", json={"args": [i]})
            elapsed = time.perf_counter() - started
            assert answer.status_code == 200 and answer.json()["result_json"] == i, answer.text
            if i:  # the first warms the connection and a worker
                samples.append(elapsed)
    return samples


def report_latency(label: str, samples: list[float]) -> None:
    ms = [s * 1000 for s in samples]
    print(
        f"{label}: n={len(ms)} p50={percentile(ms, 0.5):.1f} ms "
        f"p90={percentile(ms, 0.9):.1f} ms p99={percentile(ms, 0.99):.1f} ms "
        f"mean={statistics.fmean(ms):.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--map", type=int, default=5000, dest="map_calls")
    parser.add_argument("--config", type=Path)
    args = parser.parse_args()
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}"
    )
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o711)  # as root, PostgreSQL's system account must traverse it
        config = args.config
        if config is None:
            proc = start_cluster(Path(tmp) / "state")
            config = Path(tmp) / "state" / "client.toml"
        sdk.connect(config=config)
        try:
            report_latency("no-op call, gpus=0", latency(sdk.function(gpus=0)(noop), args.calls))
            report_latency("no-op call, gpus=1", latency(sdk.function(gpus=1)(noop), args.calls))
            report_latency("JSON invoke over HTTP, gpus=0", json_latency(config, args.calls))
            fn = sdk.function(gpus=0)(noop)
            started = time.perf_counter()
            results = list(fn.map(range(args.map_calls)))
            elapsed = time.perf_counter() - started
            assert results == list(range(args.map_calls))
            print(
                f"map: {args.map_calls} no-op calls in {elapsed:.2f} s = "
                f"{args.map_calls / elapsed:.0f} calls/s"
            )
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)


if __name__ == "__main__":
    main()
