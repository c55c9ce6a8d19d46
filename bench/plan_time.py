"""Decision time of one ``plan()``: 1,000 nodes x 8 GPUs, 5,000 running, 10,000 pending calls.

Run: ``python bench/plan_time.py [--runs 7] [--bytecodes]``. Prints the median wall time of one
plan per policy and snapshot variant (target: at most 100 ms on one core). ``--bytecodes``
also counts the Python bytecodes one plan executes (a second plan of the same snapshot, as
the timed ones are; under a tracer, so slow): unlike the time, the count does not move with
the machine's speed, which on a shared VM swings by half between minutes, so it compares
two versions of the code exactly (calls into C count as one bytecode each; the script runs
itself again with ``PYTHONHASHSEED=0``, as set orders follow the per-process hash salt).

The snapshot is synthetic but shaped like a busy lab: 8-GPU nodes (two NVLink groups of four
in the ``nvlink`` variant, a fifth of them H100s and the rest A100s), running calls mostly
single-GPU, leaving about 2,500 GPUs free; pending calls of 1, 2, 4, 8 and 16 GPUs from 10
groups and 50 users, a tenth with a GPU model constraint; warm workers advertised on a tenth
of the nodes; 10 groups with equal guarantees summing to the cluster. ``balanced``: the
running calls are spread over all groups (no one borrows); ``reclaim``: three groups hold
them all, so the seven others reclaim (the worst case for ``fair``, which then preempts up
to ``max_reclaims`` = 128 times); ``starving``: ``balanced`` with every free GPU taken (a
call per node) and the clock an hour past the last submission plus fair's starvation bound
(12 hours; before session 17 only the hour, so nobody starved there once the bound had
become 12 hours), so every whole-node call has waited past fair's starvation bound and none
fits, each one reserved for by the previous round (so kept beyond the guard's share of the
cluster): the worst case for the guard, which then reserves (``reserved``); ``per model``:
``balanced`` with quotas per GPU model as well (each group guaranteed its share of the A100s
and of the H100s, and borrowing at most 80 H100s), so every placement is kept to the models
its group may still take.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from types import FrameType
from typing import Any

from scheduler import Gpu, NodeCapacity, Pending, Quota, Running, Snapshot, plan
from scheduler.fair import DEFAULT_STARVE_AFTER_S

NODES, GPUS, RUNNING, PENDING, GROUPS = 1000, 8, 5000, 10000, 10


def snapshot(
    nvlink: bool, borrowing: bool, seed: int = 1, starving: bool = False, models: bool = False
) -> Snapshot:
    rng = random.Random(seed)
    nodes = []
    for i in range(NODES):
        model = "H100" if i % 5 == 0 else "A100"
        inventory = tuple(Gpu(g, model, 81920, (g // 4) if nvlink else None) for g in range(GPUS))
        warm = frozenset({(f"u{i % 50}", "train")}) if i % 10 == 0 else frozenset()
        nodes.append(NodeCapacity(i, list(range(GPUS)), 4, inventory, warm=warm))
    running = []
    node = 0
    for r in range(RUNNING):
        gpus = rng.choices([1, 2], [0.9, 0.1])[0]
        while len(nodes[node % NODES].free_gpus) < gpus:
            node += 1
        free = nodes[node % NODES].free_gpus
        taken, nodes[node % NODES].free_gpus = tuple(free[:gpus]), free[gpus:]
        group = f"g{r % 3}" if borrowing else f"g{r % GROUPS}"
        running.append(
            Running(
                f"r{r}", node % NODES, taken, f"u{r % 50}", group,
                start_time=-rng.uniform(0, 36000), expected_s=rng.uniform(600, 72000),
                borrowed=r % 3 == 0,
            )
        )  # fmt: skip
        node += rng.random() < 0.6
    if starving:  # fill every node
        for n in nodes:
            if n.free_gpus:
                running.append(Running(
                    f"fill{n.node_id}", n.node_id, tuple(n.free_gpus), f"u{n.node_id % 50}",
                    f"g{n.node_id % GROUPS}", start_time=-rng.uniform(0, 36000),
                    expected_s=rng.uniform(600, 72000),
                ))  # fmt: skip
                n.free_gpus = []
    pending = [
        Pending(
            f"p{p}",
            rng.choices([1, 2, 4, 8, 16], [0.7, 0.1, 0.1, 0.08, 0.02])[0],
            user=f"u{p % 50}",
            group=f"g{p % GROUPS}",
            function="train",
            gpu_model="H100" if p % 10 == 0 else None,
            priority=1 if p % 100 == 0 else 0,
            submit_time=float(p),
            expected_s=rng.uniform(60, 86400),
        )
        for p in range(PENDING)
    ]
    share = NODES * GPUS // GROUPS
    per_model = (("A100", Quota(share * 4 // 5)), ("H100", Quota(share // 5, 80)))
    quotas = {f"g{g}": Quota(share, None, per_model if models else ()) for g in range(GROUPS)}
    usage = {f"g{g}": rng.uniform(0, 1e7) for g in range(GROUPS)}
    now = PENDING + DEFAULT_STARVE_AFTER_S + 3600.0 if starving else 0.0
    kept = {c.id: now for c in pending if c.gpus >= GPUS} if starving else {}
    return Snapshot(nodes, pending, running, quotas, usage, {}, now=now, reserved=kept)


def bytecodes(snap: Snapshot, policy: str) -> int:
    """Python bytecodes executed by one ``plan()`` of ``snap``."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        count += event == "opcode"
        return tracer

    sys.settrace(tracer)
    try:
        plan(snap, policy)
    finally:
        sys.settrace(None)
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--bytecodes", action="store_true",
                        help="also count the bytecodes one plan executes")  # fmt: skip
    args = parser.parse_args()
    if args.bytecodes and os.environ.get("PYTHONHASHSEED") != "0":
        # (string hashing is salted per process, which reorders sets and so what a plan
        # executes by about 1 %: an exact count needs the same salt each time)
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "PYTHONHASHSEED": "0"})  # fmt: skip
    extra = " bytecodes |" if args.bytecodes else ""
    print("| policy | snapshot | NVLink topology | free GPUs | placed | preempted | reserved "
          f"| plan() ms |{extra}")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.bytecodes else ""))
    variants = ((False, False, False), (True, False, False), (False, True, False),
                (False, False, True))  # fmt: skip
    for borrowing, starving, models in variants:
        for nvlink in (False, True):
            snap = snapshot(nvlink, borrowing, starving=starving, models=models)
            name = "starving" if starving else "reclaim" if borrowing else "balanced"
            name = "per model" if models else name
            free = sum(len(n.free_gpus) for n in snap.nodes)
            for policy in ("fifo", "fair"):
                times = []
                for _ in range(args.runs):
                    start = time.perf_counter()
                    out = plan(snap, policy)
                    times.append(time.perf_counter() - start)
                ms = statistics.median(times) * 1000
                ops = f" {bytecodes(snap, policy) / 1e6:.2f} M |" if args.bytecodes else ""
                print(
                    f"| {policy} | {name} | {'yes' if nvlink else 'no'} | {free} | {len(out)} "
                    f"| {len(out.preemptions)} | {len(out.reserved)} | {ms:.1f} |{ops}"
                )
    print(f"\n(median of {args.runs} runs each; {NODES} nodes x {GPUS} GPUs, {RUNNING} running, "
          f"{PENDING} pending)")  # fmt: skip


if __name__ == "__main__":
    main()
