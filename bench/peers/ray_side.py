"""One round of bench/compare.py's workloads on Ray (local, single node); run by compare.py
under the peers' virtualenv (bench/peers/requirements.txt).

Boots ``ray.init(num_cpus=2, include_dashboard=False)`` from nothing, then: (A)
``ray.get(noop.remote())``, (B) ``ray.get([noop.remote() for _ in range(N)])``, (C)
``ray.get(torch_step.remote())`` on a warm worker; ``ray.shutdown()``. One JSON line per
figure on stdout. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes a local ray.init bind and
advertise 127.0.0.1 (Ray's macOS default) instead of the host's interface address; usage stats
are off. The remote functions live in workloads.py, which the workers import (PYTHONPATH).

Usage: /opt/bulletin-peers/bin/python bench/peers/ray_side.py [--calls-a N] [--skip B,C] ...
"""

from __future__ import annotations

import logging
import os
import sys
import time
from importlib import metadata
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [HERE, os.environ.get("PYTHONPATH", "")])
)
sys.path.insert(0, HERE)

import workloads as w  # noqa: E402

SYSTEM = "ray"


def main() -> None:
    args = w.side_arguments(__doc__)
    import ray

    w.emit(SYSTEM, "info", version=ray.__version__, torch=metadata.version("torch"))
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        rnoop = ray.remote(w.noop)
        ray.get(rnoop.remote())
        w.emit(SYSTEM, w.METRIC_BOOT, ms=round((time.perf_counter() - t0) * 1e3, 1),
               what="ray.init + first no-op")
        for _ in range(args.warmup):
            ray.get(rnoop.remote())
        if "A" not in args.skip:
            ms = w.seq_latency(lambda: ray.get(rnoop.remote()), args.calls_a)
            w.emit(SYSTEM, w.METRIC_A, **w.lat_stats(ms), api="ray.get(f.remote())")
        if "B" not in args.skip:

            def fanout(n: int) -> None:
                ray.get([rnoop.remote() for _ in range(n)])

            fanout(max(1, args.calls_b // 10))
            w.emit(SYSTEM, w.METRIC_B, **w.fanout_rate(fanout, args.calls_b),
                   api="ray.get([f.remote() for _ in range(N)])")
        if "C" not in args.skip:
            rstep = ray.remote(w.torch_step)
            w.emit(SYSTEM, w.METRIC_C, **w.warm_torch(lambda: ray.get(rstep.remote()),
                                                       args.warm_calls),
                   api="ray.get(torch_step.remote())")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
