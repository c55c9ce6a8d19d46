"""How long the entry points take to import: what a nodelet, a worker, `bulletin nodelet
--help` and `import sdk` cost before they do anything.

Each is timed in a fresh interpreter, N times; the median and the fastest are printed, with
how many of our modules it loaded. ``--root`` times another checkout (e.g. an older commit
made with ``git worktree add``), with this interpreter and its installed dependencies.
Usage: python bench/imports.py [--runs 15] [--root PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

OURS = ("bulletin_core", "bulletin", "gateway", "scheduler", "nodelet", "sdk")

#: name -> code to run. Each older layout is tried in turn where the module moved.
ENTRY_POINTS = {
    "import nodelet.agent": ["import nodelet.agent"],
    "import sdk": ["import sdk"],
    "worker process imports": ["import nodelet.worker_main", "import nodelet.worker"],
    "bulletin nodelet --help": [
        "from bulletin import main\ntry: main(['nodelet', '--help'])\nexcept SystemExit: pass",
        "from bulletin.cli import main\ntry: main(['nodelet', '--help'])\nexcept SystemExit: pass",
    ],
    "bulletin gateway --help": [
        "from bulletin import main\ntry: main(['gateway', '--help'])\nexcept SystemExit: pass",
        "from bulletin.cli import main\ntry: main(['gateway', '--help'])\nexcept SystemExit: pass",
    ],
}

PROBE = """
import sys, time
sys.path.insert(0, {root!r})
start = time.perf_counter()
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):
    exec({code!r})
took = time.perf_counter() - start
ours = [m for m in sys.modules if m.split('.')[0] in {ours!r}]
# A module of another checkout (this interpreter's editable install) does not count.
files = [getattr(sys.modules[m], '__file__', None) or {root!r} for m in ours]
assert all(f.startswith({root!r}) for f in files)
print({{"s": took, "ours": len(ours)}}.__repr__())
"""


def once(root: Path, code: str) -> dict[str, float] | None:
    probe = PROBE.format(root=str(root), code=code, ours=OURS)
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=root, env=os.environ
    )
    if done.returncode != 0:
        return None
    return eval(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    root = args.root.resolve()
    print(f"# {root} on {platform.node()}, Python {platform.python_version()}")
    results = {}
    for name, tries in ENTRY_POINTS.items():
        for code in tries:
            if once(root, code) is None:
                continue
            runs = [once(root, code) for _ in range(args.runs)]
            times = sorted(r["s"] * 1000 for r in runs if r)
            ours = int(runs[0]["ours"]) if runs[0] else 0
            results[name] = {
                "median_ms": round(statistics.median(times), 1),
                "min_ms": round(times[0], 1),
                "our_modules": ours,
            }
            break
        else:
            results[name] = None
    for name, figures in results.items():
        if figures is None:
            print(f"{name:28} (not in this checkout)")
        else:
            print(
                f"{name:28} median {figures['median_ms']:6.1f} ms, fastest "
                f"{figures['min_ms']:6.1f} ms, {figures['our_modules']:3d} of our modules"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
