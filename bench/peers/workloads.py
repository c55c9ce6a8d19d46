"""The workloads of bench/compare.py, defined once for every system it measures.

Imported by the Bulletin side (bench/compare.py, the project's interpreter) and by the peer
sides (ray_side.py, celery_side.py, the peers' virtualenv), so it needs nothing but the
standard library; torch is imported inside the (C) body only. The definitions are those of
../shared/peer-bench (its "shared harness block"):

  (A) sequential no-op round trip, submit + wait for the result, ``time.perf_counter`` in the
      caller, after a warm-up and once the machine is idle (:func:`quiet`); p50/p99
      nearest-rank.
  (B) fan-out of N no-op calls with the system's natural fan-out (submit all, then gather):
      calls/s = N / (first submit -> last result), after a warm-up fan-out of N/10 and once
      the machine is idle again (:func:`quiet`: what the warm-up started in the background,
      such as a worker pool refilling its spares, is not measured).
  (C) warm torch step round trip: ``torch_step`` (import torch, Linear(64, 64), SGD(lr=0.1),
      forward on 32x64, backward, step, return the loss) as the remote function; only calls
      that land on a worker process that already ran it (same pid) are counted.

Every side prints one JSON object per line on stdout: ``{"system", "metric", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

# torch runs with one intra-op thread in every worker of every system (Ray's own default for
# a 1-CPU task); on a 2-core box two threads made the tiny step ~50x slower. Children inherit.
os.environ.setdefault("OMP_NUM_THREADS", "1")

METRIC_BOOT = "boot_to_ready"
METRIC_A = "A_seq_noop_roundtrip"
METRIC_AH = "AH_http_json_invoke"
METRIC_B = "B_fanout_noop_throughput"
METRIC_C = "C_warm_torch_call"
#: The workloads --skip names (A' is the JSON invoke over plain HTTP, Bulletin only).
WORKLOADS = ("A", "A'", "B", "C")


def noop() -> None:
    """(A) and (B): the no-op remote function."""
    return None


def item_noop(x: Any) -> Any:
    """(B) for a system whose fan-out maps over items, and (A') over JSON."""
    return x


def torch_step() -> dict[str, Any]:
    """(C) body: import torch + one SGD step of Linear(64, 64) on CPU; returns the loss, the
    worker's pid (a warm call is one on a pid that ran this before) and in-body timings."""
    import os
    import time

    t0 = time.perf_counter()
    import torch

    t1 = time.perf_counter()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    t2 = time.perf_counter()
    return {
        "pid": os.getpid(),
        "loss": float(loss.item()),
        "threads": torch.get_num_threads(),
        "import_ms": (t1 - t0) * 1e3,
        "step_ms": (t2 - t1) * 1e3,
    }


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile, p in 0..100."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    rank = -(-p * len(ordered) // 100)  # ceil(p/100 * n)
    return ordered[max(0, min(len(ordered) - 1, int(rank) - 1))]


def lat_stats(ms: list[float]) -> dict[str, Any]:
    """n, p50, p99 (nearest rank), mean, min and max of latencies in milliseconds."""
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "mean_ms": round(sum(ms) / len(ms), 3),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
    }


def seq_latency(call: Callable[[], object], n: int) -> list[float]:
    """(A): n sequential submit + wait round trips; their latencies in ms, once the machine
    is quiet (what the system started in the background, spare workers importing torch, a
    pool prestarting, is not measured)."""
    quiet()
    out = []
    pc = time.perf_counter
    for _ in range(n):
        t0 = pc()
        call()
        out.append((pc() - t0) * 1e3)
    return out


def _busy() -> tuple[int, int]:
    """The machine's CPU time so far, busy and in all (``/proc/stat``, clock ticks)."""
    with open("/proc/stat") as stat:
        ticks = [int(n) for n in stat.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # idle and iowait are not busy


def quiet(timeout_s: float = 60.0) -> None:
    """Wait until the machine is idle (under 15 % busy over half a second), for at most
    ``timeout_s``: what the warm-up set going in the background (a worker pool refilling
    itself, a spare importing torch) is done before the measurement, for every system."""
    deadline = time.monotonic() + timeout_s
    busy, total = _busy()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now_busy, now_total = _busy()
        if now_total > total and (now_busy - busy) / (now_total - total) < 0.15:
            return
        busy, total = now_busy, now_total


def fanout_rate(run: Callable[[int], object], n: int) -> dict[str, Any]:
    """(B): time ``run(n)`` (submit n no-op calls, then gather every result), once the
    machine is quiet after the warm-up fan-out."""
    quiet()
    t0 = time.perf_counter()
    run(n)
    total = time.perf_counter() - t0
    return {"n": n, "calls_per_s": round(n / total, 1), "total_s": round(total, 3)}


def warm_torch(call: Callable[[], dict[str, Any]], n: int) -> dict[str, Any]:
    """(C): call ``torch_step`` remotely until n calls have landed on a warm worker (a pid
    seen before); the cold calls before them are not counted (at most 3n + 10 calls)."""
    quiet()
    seen: set[int] = set()
    warm: list[float] = []
    steps: list[float] = []
    cold: list[float] = []
    while len(warm) < n and len(warm) + len(cold) < 3 * n + 10:
        t0 = time.perf_counter()
        result = call()
        ms = (time.perf_counter() - t0) * 1e3
        if result["pid"] in seen:
            warm.append(ms)
            steps.append(result["step_ms"])
        else:
            cold.append(ms)
            seen.add(result["pid"])
    if not warm:
        raise RuntimeError(f"no torch_step call landed on a warm worker in {len(cold)} calls")
    return {
        **lat_stats(warm),
        "cold_calls": len(cold),
        "cold_first_ms": round(cold[0], 1),
        "workers": len(seen),
        "step_ms_in_body_p50": round(percentile(steps, 50), 3),
    }


def emit(system: str, metric: str, **fields: Any) -> None:
    """Print one result line for bench/compare.py."""
    print(json.dumps({"system": system, "metric": metric, **fields}), flush=True)


def side_arguments(description: str | None) -> argparse.Namespace:
    """The command line every side takes (bench/compare.py passes it; defaults: a smoke test)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--warmup", type=int, default=20, help="no-op calls before (A)")
    parser.add_argument("--calls-a", type=int, default=50, help="(A) calls recorded")
    parser.add_argument("--calls-b", type=int, default=500, help="(B) calls in the fan-out")
    parser.add_argument("--warm-calls", type=int, default=5, help="(C) warm calls recorded")
    parser.add_argument("--skip", default="", help="comma list of A,A',B,C")
    args = parser.parse_args()
    args.skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    return args
