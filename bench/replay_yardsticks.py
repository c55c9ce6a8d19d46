"""The live policies beside the research yardsticks, on one trace, per cluster size and cost.

Run: ``python bench/replay_yardsticks.py [--trace PATH] [--nodes 88,64] [--costs 0,300]
[--policies fifo,fair,las,srtf] [--procs N]``.

Every (size, preemption cost, policy) is one replay of the whole trace (8-GPU nodes, the
default half-life, quotas derived from the trace as ``bench/replay_philly.py`` does), each in
its own process on one core; ``las`` and ``srtf`` are the replay-only yardsticks of
``scheduler/yardsticks.py``. Prints one Markdown table per size: average and p99 queueing
delay, average and p99 JCT, Jain's fairness across groups (over got/due, and over
min(got/due, 1): scheduler/metrics.py), preemptions, utilisation and the replay's wall time.
A preemption cost only changes policies that preempt (``fifo`` never does: it runs once per
size).
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from replay_philly import TRACE, fmt, run  # bench/ is this script's first import path

from scheduler.replay import Options

COLUMNS = [
    ("avg_queue_s", "avg queue (s)"),
    ("p99_queue_s", "p99 queue (s)"),
    ("avg_jct_s", "avg JCT (s)"),
    ("p99_jct_s", "p99 JCT (s)"),
    ("jain_fairness", "Jain"),
    ("jain_due", "Jain of the due"),
    ("preemptions", "preemptions"),
    ("utilization", "utilisation"),
    ("wall_s", "wall (s)"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--nodes", default="88,64", help="cluster sizes, 8-GPU nodes")
    parser.add_argument("--costs", default="0,300", help="--preemption-cost-s values")
    parser.add_argument(
        "--policies",
        default="fifo,fair-fs,fair,las,srtf",
        help="fair-fs: fair before least attained service (fair-share order, 1 h guard)",
    )
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    costs = [float(c) for c in args.costs.split(",")]
    names = args.policies.split(",")
    runs = [
        (n, c, p)
        for n in sizes
        for c in costs
        for p in names
        if not (p == "fifo" and c != costs[0])
    ]
    with ProcessPoolExecutor(args.procs) as pool:
        results = list(
            pool.map(run, [(args.trace, options(p, n, c)) for n, c, p in runs])
        )
    for size in sizes:
        print(f"\n## {Path(args.trace).name}, {size} x 8 GPUs\n")
        print("| policy | preemption cost (s) | " + " | ".join(h for _, h in COLUMNS) + " |")
        print("|---|---|" + "---|" * len(COLUMNS))
        for (n, c, p), r in zip(runs, results, strict=True):
            if n == size:
                cells = " | ".join(fmt(r[k]) for k, _ in COLUMNS)
                print(f"| {p} | {c:.0f} | {cells} |")


def options(name: str, nodes: int, cost: float) -> Options:
    """``fair-fs``: ``fair`` as it was before least attained service (fair-share order only,
    the starvation guard at one hour)."""
    if name == "fair-fs":
        return Options("fair", nodes, preemption_cost_s=cost, least_attained=False,
                       starve_after_s=3600.0)  # fmt: skip
    return Options(name, nodes, preemption_cost_s=cost)


if __name__ == "__main__":
    main()
