"""Replay the Philly trace through ``fifo`` and ``fair`` and print the metrics side by side.

Run: ``python bench/replay_philly.py [--trace PATH] [--sizes 72,80,88,96,112] [--procs N]``.

1. Cluster size: FIFO is replayed on each candidate size (nodes of 8 GPUs), and the size whose
   FIFO average queueing delay comes closest to what the real Philly cluster saw (3,761 s,
   Jeon et al., ATC 2019; see the traces' README) is kept, among the sizes where the system is
   stable (every job completes and FIFO's p99 queueing stays under a week). That is a cluster
   where FIFO queues as much as the real one did: real queueing, not a meltdown.
2. Both policies on that size, with guarantees derived from each virtual cluster's share of the
   trace's GPU-time (scheduler.traces.derive_quotas) and the default half-life (1 day).
3. For transparency, ``fair`` again with other half-lives and with the starvation guard on.

Replays run in parallel processes (``--procs``), each on one core; ``wall_s`` is per replay.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from scheduler import traces
from scheduler.replay import Options, replay

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "philly_jobs_pollux_osdi21.csv"
REAL_AVG_QUEUE_S = 3761.0  # the real Philly cluster's average queueing delay of GPU jobs
WEEK_S = 7 * 24 * 3600.0
METRICS = [
    ("avg_jct_s", "average JCT (s)", "lower"),
    ("p50_jct_s", "median JCT (s)", "lower"),
    ("p99_jct_s", "p99 JCT (s)", "lower"),
    ("avg_queue_s", "average queueing delay (s)", "lower"),
    ("p50_queue_s", "median queueing delay (s)", "lower"),
    ("p99_queue_s", "p99 queueing delay (s)", "lower"),
    ("utilization", "GPU utilisation (mean)", "higher"),
    ("jain_fairness", "Jain's fairness across groups", "higher"),
    ("preemptions", "preemptions", "lower"),
    ("rejected", "rejected jobs", "lower"),
    ("wall_s", "replay wall time (s, one core)", "lower"),
]


def run(args: tuple[str, Options]) -> dict[str, float]:
    return replay(traces.read(args[0]), args[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--sizes", default="72,80,88,96,112", help="node counts to try")
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with ProcessPoolExecutor(args.procs) as pool:
        fifos = pool.map(run, [(args.trace, Options("fifo", n)) for n in sizes])
        sweep = dict(zip(sizes, fifos, strict=True))
        print("## Cluster size (8-GPU nodes), FIFO with EASY backfill\n")
        print("| nodes | GPUs | avg queue (s) | p99 queue (s) | utilisation | completed |")
        print("|---|---|---|---|---|---|")
        for n, r in sweep.items():
            print(f"| {n} | {8 * n} | {r['avg_queue_s']:.0f} | {r['p99_queue_s']:.0f} "
                  f"| {r['utilization']:.3f} | {r['completed']:.0f}/{r['jobs']:.0f} |")  # fmt: skip
        stable = {
            n: r
            for n, r in sweep.items()
            if r["completed"] + r["rejected"] == r["jobs"] and r["p99_queue_s"] < WEEK_S
        }
        size = min(stable, key=lambda n: abs(stable[n]["avg_queue_s"] - REAL_AVG_QUEUE_S))
        print(f"\nChosen: {size} nodes ({8 * size} GPUs): FIFO's average queueing delay there "
              f"({stable[size]['avg_queue_s']:.0f} s) is the closest to the real Philly "
              f"cluster's {REAL_AVG_QUEUE_S:.0f} s among the stable sizes.\n")  # fmt: skip
        variants = {
            "fair": Options("fair", size),
            "fair, half-life 1 h": Options("fair", size, half_life_s=3600),
            "fair, half-life 6 h": Options("fair", size, half_life_s=6 * 3600),
            "fair, half-life 7 d": Options("fair", size, half_life_s=7 * 86400),
            "fair, no starvation guard": Options("fair", size, starve_after_s=0),
        }
        fairs = pool.map(run, [(args.trace, o) for o in variants.values()])
        results = dict(zip(variants, fairs, strict=True))
    fifo, fair = stable[size], results.pop("fair")
    print(f"## Philly trace, {size} x 8 GPUs: fifo vs fair\n")
    print("| metric | fifo | fair | fair vs fifo |")
    print("|---|---|---|---|")
    for key, label, better in METRICS:
        a, b = fifo[key], fair[key]
        change = f"{(b - a) / a * 100:+.1f} %" if a else "n/a"
        won = (b < a) if better == "lower" else (b > a)
        mark = "" if a == b or key in ("wall_s", "preemptions") else (" ✓" if won else " ✗")
        print(f"| {label} | {fmt(a)} | {fmt(b)} | {change}{mark} |")
    print("\n## Other settings of fair (same cluster)\n")
    print("| variant | avg JCT (s) | avg queue (s) | p99 queue (s) | utilisation | Jain | "
          "preemptions |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['avg_jct_s']:.0f} | {r['avg_queue_s']:.0f} | "
              f"{r['p99_queue_s']:.0f} | {r['utilization']:.3f} | {r['jain_fairness']:.3f} | "
              f"{r['preemptions']:.0f} |")  # fmt: skip


def fmt(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 10 and value != int(value) else f"{value:,.0f}"


if __name__ == "__main__":
    main()
