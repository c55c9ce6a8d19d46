"""Two checkouts side by side on one machine: both clusters up at once, batches alternating.

The 2-core VMs these figures come from drift by a factor of two within an hour (the same
code's blocking call took 10.7 and 20.6 ms an hour apart), so runs made one after the other
compare the machine's moods as much as the code. Here each checkout (``A`` and ``B``: e.g. a
``git worktree`` of the commit before a change, and the working tree) runs its own
``bulletin up`` (``bench/hot_path.py``'s cluster: 2 fake GPUs, 2 CPU slots) and its own
client process, both started before the first batch; the driver then asks each in turn
(ABBA...) for a batch of sequential no-op calls or one ``map``, so slow and fast minutes fall
on both alike. The idle cluster costs the other little (its nodelet's polls and heartbeats).

Printed per checkout: latency percentiles over all its calls (``calls``) or the median
calls/s of its maps (``map``), and the median CPU per call of each kind of process (of both
clusters: the idle one's share is small and the same for both sides).

Usage:
  git worktree add /tmp/before HEAD~3
  .venv/bin/python bench/ab.py /tmp/before . calls --n 100 --rounds 6
  .venv/bin/python bench/ab.py /tmp/before . map --n 2000 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("client", "gateway", "nodelet", "workers", "postgres")


def side(root: Path) -> None:
    """One checkout's client (run as a subprocess of the driver): starts its cluster, then
    answers each command line of stdin (``calls N``, ``map N``, ``quit``) with one JSON line."""
    sys.path[:0] = [str(root), str(root / "bench")]
    from hot_path import counted_cluster, cpu_by_process, noop

    import sdk

    tmp = Path(tempfile.mkdtemp(prefix="ab-"))
    cluster, state, _ = counted_cluster(tmp, fake_gpus=2, settings={"PYTHONPATH": str(root)})
    try:
        sdk.connect(config=state / "client.toml")
        fn = sdk.function(gpus=0)(noop)
        for i in range(30):
            fn(i)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            what, _, count = line.strip().partition(" ")
            if what == "quit":
                break
            n = int(count)
            before = cpu_by_process()
            answer: dict[str, object] = {}
            if what == "calls":
                latency = []
                for i in range(n):
                    started = time.perf_counter()
                    fn(i)
                    latency.append((time.perf_counter() - started) * 1000)
                answer["latency"] = latency
            else:
                started = time.perf_counter()
                if list(fn.map(range(n))) != list(range(n)):
                    raise AssertionError("map returned wrong results")
                answer["rate"] = n / (time.perf_counter() - started)
            after = cpu_by_process()
            answer["cpu"] = {k: (after[k] - before[k]) * 1000 / n for k in KINDS}
            print(json.dumps(answer), flush=True)
    finally:
        cluster.send_signal(signal.SIGTERM)
        cluster.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("a", type=Path, help="checkout A (e.g. the commit before)")
    parser.add_argument("b", type=Path, help="checkout B (e.g. the working tree)")
    parser.add_argument("what", choices=["calls", "map"])
    parser.add_argument("--n", type=int, default=100, help="calls per batch, or items per map")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--side", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sides = {name: _start(root.resolve()) for name, root in (("A", args.a), ("B", args.b))}
    results: dict[str, list[float]] = {"A": [], "B": []}
    cpus: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    try:
        for r in range(args.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                process = sides[name]
                assert process.stdin is not None and process.stdout is not None
                process.stdin.write(f"{args.what} {args.n}\n")
                process.stdin.flush()
                answer = json.loads(process.stdout.readline())
                results[name] += answer["latency"] if args.what == "calls" else [answer["rate"]]
                cpus[name].append(answer["cpu"])
    finally:
        for process in sides.values():
            if process.stdin is not None:
                process.stdin.write("quit\n")
                process.stdin.close()
            process.wait(120)
    for name, root in (("A", args.a), ("B", args.b)):
        found = sorted(results[name])
        if args.what == "calls":
            p50, p90, p99 = (
                found[min(len(found) - 1, int(q * len(found)))] for q in (0.5, 0.9, 0.99)
            )
            print(
                f"{name} {root}: p50 {p50:.2f} ms, p90 {p90:.2f} ms, p99 {p99:.2f} ms "
                f"(n={len(found)})"
            )
        else:
            rates = ", ".join(f"{x:.0f}" for x in results[name])
            print(f"{name} {root}: map {statistics.median(found):.0f} calls/s (runs {rates})")
        per_call = {k: statistics.median(c[k] for c in cpus[name]) for k in KINDS}
        shares = ", ".join(f"{k} {v:.2f}" for k, v in per_call.items())
        print(
            f"   CPU per call (ms, medians of the batches): {shares}; "
            f"total {sum(per_call.values()):.2f}"
        )


def _start(root: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--side", str(root), "x", "x", "calls"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert process.stdout is not None
    if not json.loads(process.stdout.readline()).get("ready"):
        raise SystemExit(f"the cluster of {root} did not start")
    return process


if __name__ == "__main__":
    if "--side" in sys.argv:
        side(Path(sys.argv[sys.argv.index("--side") + 1]))
    else:
        main()
