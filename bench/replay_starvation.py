"""Whole-node calls under FIFO and ``fair``, with and without the starvation guard.

Run: ``python bench/replay_starvation.py [--trace PATH] [--nodes 88,64] [--costs 0,300]
[--procs N]``.

Each (size, policy, preemption cost) is one replay of the whole trace (8-GPU nodes, quotas
derived from the trace, as ``bench/replay_philly.py`` does) with ``--jobs-out``; the jobs'
queueing delays (first start minus submission) are then averaged per size of call: one GPU,
2 to 7, a whole node (8) and several whole nodes (more than 8). ``fair`` is
the default (the guard on at 3600 s), ``fair, no guard`` is ``--starve-after-s 0``. Prints one
Markdown table per size: average / p99 queueing per class,
then the whole trace's average and p99 queueing, Jain of the due, preemptions and wall time.
"""

from __future__ import annotations

import argparse
import csv
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from replay_philly import TRACE, fmt  # bench/ is this script's first import path

from scheduler import traces
from scheduler.replay import Options, replay

CLASSES = [("1 GPU", 1, 1), ("2-7 GPUs", 2, 7), ("8 (a node)", 8, 8), ("> 8 (nodes)", 9, 10**9)]
VARIANTS = {"fifo": ("fifo", None), "fair, no guard": ("fair", 0.0), "fair": ("fair", None)}


def measure(args: tuple[str, int, float, str]) -> dict[str, float]:
    trace, nodes, cost, variant = args
    policy, starve = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        jobs_out = str(Path(tmp) / "jobs.csv")
        options = Options(policy, nodes, preemption_cost_s=cost, starve_after_s=starve,
                          jobs_out=jobs_out)  # fmt: skip
        out = replay(traces.read(trace), options)
        with open(jobs_out, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["queue_s"]]
    for name, low, high in CLASSES:
        waits = sorted(float(r["queue_s"]) for r in rows if low <= int(r["gpus"]) <= high)
        out[f"{name} avg"] = sum(waits) / len(waits) if waits else 0.0
        out[f"{name} p99"] = waits[int(0.99 * (len(waits) - 1))] if waits else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--nodes", default="88,64", help="cluster sizes, 8-GPU nodes")
    parser.add_argument("--costs", default="0,300", help="--preemption-cost-s values")
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    costs = [float(c) for c in args.costs.split(",")]
    runs = [
        (args.trace, n, c, v)
        for n in sizes
        for v in VARIANTS
        for c in costs
        if not (v == "fifo" and c != costs[0])  # FIFO never preempts
    ]
    with ProcessPoolExecutor(args.procs) as pool:
        results = list(pool.map(measure, runs))
    head = [f"{name} avg / p99 (s)" for name, _, _ in CLASSES]
    tail = ["avg / p99 queue (s)", "Jain of the due", "preemptions", "wall (s)"]
    for size in sizes:
        print(f"\n## {Path(args.trace).name}, {size} x 8 GPUs: queueing by call size\n")
        print("| policy | cost (s) | " + " | ".join(head + tail) + " |")
        print("|---|---|" + "---|" * (len(head) + len(tail)))
        for (_, n, c, v), r in zip(runs, results, strict=True):
            if n != size:
                continue
            cells = [f"{fmt(r[f'{k} avg'])} / {fmt(r[f'{k} p99'])}" for k, _, _ in CLASSES]
            cells += [f"{fmt(r['avg_queue_s'])} / {fmt(r['p99_queue_s'])}", fmt(r["jain_due"]),
                      fmt(r["preemptions"]), fmt(r["wall_s"])]  # fmt: skip
            print(f"| {v} | {c:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
