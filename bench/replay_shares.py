"""Calls asking for part of a GPU: packed as shares, against each taking a whole GPU.

Run: ``python bench/replay_shares.py [--trace PATH] [--nodes 88] [--fraction 0.44]
[--procs N]``.

The Philly table has no fractional jobs, so this derives a trace from it: the same arrivals,
durations and groups; each group's jobs spread over 4 users at random; and ``--fraction`` of
its one-GPU jobs (44 % by default, the share of GPU jobs asking for part of a GPU in one real
trace, Alibaba's 2020 PAI trace) ask for 0.25, 0.5 or 0.75 of a GPU (half, a third, a sixth of
them). Seeded, so every run replays the same trace. Each policy replays it twice: ``shares``
as asked (packed onto shared GPUs, one user's jobs per GPU), and ``whole`` with every share
rounded up to one GPU (what a scheduler without shares does). A third run, ``across users``,
lets jobs of different users share a GPU. Prints a Markdown table: average / p99 queueing of
all jobs and of the fractional ones, utilisation (GPUs held, shares counted as their fraction),
preemptions and wall time.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from replay_philly import TRACE, fmt  # bench/ is this script's first import path

from scheduler import traces
from scheduler.replay import Options, replay
from scheduler.traces import Job

SHARES = (0.25, 0.25, 0.25, 0.5, 0.5, 0.75)
VARIANTS = ("shares", "whole", "across users")


def derive(trace: str, fraction: float, seed: int = 17) -> list[Job]:
    rng = random.Random(seed)
    out = []
    for job in traces.read(trace):
        user = f"{job.group}-u{rng.randrange(4)}"
        gpus = job.gpus
        if gpus == 1 and rng.random() < fraction:
            gpus = rng.choice(SHARES)
        out.append(replace(job, user=user, gpus=gpus))
    return out


def measure(args: tuple[str, int, float, str, str]) -> dict[str, float]:
    trace, nodes, fraction, policy, variant = args
    jobs = derive(trace, fraction)
    asked = [j.gpus for j in jobs]
    if variant == "whole":
        jobs = [replace(j, gpus=1) if j.gpus < 1 else j for j in jobs]
    with tempfile.TemporaryDirectory() as tmp:
        jobs_out = str(Path(tmp) / "jobs.csv")
        options = Options(policy, nodes, jobs_out=jobs_out,
                          share_across_users=variant == "across users")  # fmt: skip
        out = replay(jobs, options)
        with open(jobs_out, newline="") as f:
            rows = list(csv.DictReader(f))
    waits = sorted(float(r["queue_s"]) for r, a in zip(rows, asked, strict=True)
                   if r["queue_s"] and a < 1)  # fmt: skip
    out["shares avg"] = sum(waits) / len(waits) if waits else 0.0
    out["shares p99"] = waits[int(0.99 * (len(waits) - 1))] if waits else 0.0
    out["fractional"] = sum(a < 1 for a in asked) / len(asked)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--nodes", type=int, default=88, help="8-GPU nodes")
    parser.add_argument("--fraction", type=float, default=0.44)
    parser.add_argument("--policies", default="fifo,fair")
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    runs = [(args.trace, args.nodes, args.fraction, p, v)
            for p in args.policies.split(",") for v in VARIANTS]  # fmt: skip
    with ProcessPoolExecutor(args.procs) as pool:
        results = list(pool.map(measure, runs))
    share = results[0]["fractional"]
    print(f"\n## {Path(args.trace).name} with {share:.1%} of its jobs asking for part of a GPU, "
          f"{args.nodes} x 8 GPUs\n")  # fmt: skip
    print("| policy | shares | avg / p99 queue (s) | fractional jobs: avg / p99 queue (s) "
          "| utilisation | preemptions | wall (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for (_, _, _, p, v), r in zip(runs, results, strict=True):
        print(f"| {p} | {v} | {fmt(r['avg_queue_s'])} / {fmt(r['p99_queue_s'])} | "
              f"{fmt(r['shares avg'])} / {fmt(r['shares p99'])} | {r['utilization']:.3f} | "
              f"{fmt(r['preemptions'])} | {fmt(r['wall_s'])} |")  # fmt: skip


if __name__ == "__main__":
    main()
