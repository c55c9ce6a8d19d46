"""How long the rollout playbook takes: booting the three test hosts, a first site.yml, a run
that changes nothing, and an upgrade, on this machine (as root; tests/deploy/hosts.py).

    .venv/bin/python bench/rollout.py [--rounds N]

Prints one line per step and round; the base image is made first if it is not cached.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.deploy import hosts, rollout


@contextlib.contextmanager
def stopwatch(what: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    print(f"{what}: {time.monotonic() - started:.1f} s", flush=True)


def one_round(label: str) -> None:
    where = Path(tempfile.mkdtemp(prefix="bulletin-bench-rollout-", dir="/var/tmp"))
    try:
        with contextlib.ExitStack() as stack:
            with stopwatch(f"{label} boot 3 hosts"):
                booted, key, _ = stack.enter_context(
                    hosts.hosts(("head", "node1", "node2"), where)
                )
            site = rollout.make_site(where, booted, key)
            with stopwatch(f"{label} wheelhouse"):
                rollout.wheelhouse(where, "0.1.0")
            for step, version in (
                ("first site.yml", "0.1.0"),
                ("unchanged site.yml", "0.1.0"),
                ("upgrade site.yml", "0.1.0+bench"),
            ):
                if version != "0.1.0":
                    rollout.wheelhouse(where, version)
                site.write_inventory(version)
                with stopwatch(f"{label} {step}"):
                    result = site.play("site.yml")
                if result.returncode != 0:
                    raise SystemExit(rollout.dump(result))
                print(f"    {rollout.recap(result.stdout)}", flush=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    with stopwatch("base image (cached if already made)"):
        hosts.base_image()
    for n in range(args.rounds):
        one_round(f"[{n}]")


if __name__ == "__main__":
    main()
