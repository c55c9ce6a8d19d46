"""Round trip of a big tensor held in notebook state: sent with the call, touched remotely
(``big.add_(1)``), and brought back into the caller's tensor in place.

Starts its own single-machine cluster (``bulletin up`` in a temporary state dir, whose
shared directory is on the same filesystem) and measures, for the shared-directory path and
for the HTTP path (``Client.use_shared_dir = False``: streamed through the gateway and
PostgreSQL), the wall time of the call and the peak resident memory of the caller, the
gateway, PostgreSQL and the worker. The reference is the limit of the same machine:
``torch.save`` then ``torch.load`` of the same tensor on the same filesystem.
With ``--read-only`` the call only reads the tensor (``float(big.sum())``): nothing changed
comes back, the case the issue compares with one save + load.

Usage: python bench/state_roundtrip.py [--mib 1024] [--skip-http] [--read-only]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
from roundtrip import start_cluster  # type: ignore[import-not-found]

import sdk

MiB = 1024 * 1024


class PeakMemory:
    """Samples the resident memory of the cluster's processes every 10 ms."""

    def __init__(self, root: int) -> None:
        self._root = psutil.Process(root)
        self.peaks: dict[str, int] = {}
        self.before: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._sample(self.before)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self._sample(self.peaks)

    def _sample(self, into: dict[str, int]) -> None:
        into["caller"] = max(into.get("caller", 0), psutil.Process().memory_info().rss)
        for proc in self._root.children(recursive=True):
            try:
                role = _role(proc.cmdline())
                rss = proc.memory_info().rss
            except psutil.Error:
                continue
            if role is not None:  # the largest of each role (postgres has several)
                into[role] = max(into.get(role, 0), rss)

    def report(self, nbytes: int) -> str:
        parts = []
        for role, peak in sorted(self.peaks.items()):
            grew = peak - self.before.get(role, 0)
            parts.append(f"{role} {peak / MiB:.0f} MiB (+{grew / MiB:.0f} = {grew / nbytes:.2f}x)")
        return ", ".join(parts)


def _role(cmdline: list[str]) -> str | None:
    line = " ".join(cmdline)
    if "nodelet.worker_main" in line:
        return "worker"
    if "-m gateway" in line:
        return "gateway"
    if "-m nodelet" in line:
        return "nodelet"
    if "postgres" in line:
        return "postgres"
    return None


def reference(tensor: torch.Tensor, directory: Path) -> float:
    path = directory / "reference.pt"
    started = time.perf_counter()
    torch.save(tensor, path)
    loaded = torch.load(path)
    elapsed = time.perf_counter() - started
    assert torch.equal(loaded, tensor)
    path.unlink()
    del loaded
    return elapsed


def by_hand(tensor: torch.Tensor, directory: Path) -> float:
    """The same round trip done by hand through files: save, load, touch, save, load."""
    there, back = directory / "there.pt", directory / "back.pt"
    started = time.perf_counter()
    torch.save(tensor, there)
    remote = torch.load(there)
    remote.add_(1)
    torch.save(remote, back)
    result = torch.load(back)
    elapsed = time.perf_counter() - started
    assert bool(result[0] == tensor[0] + 1)
    there.unlink()
    back.unlink()
    return elapsed


def round_trip(
    client: sdk.Client, label: str, mib: int, root_pid: int, shared: bool, read_only: bool
) -> tuple[float, str]:
    client.use_shared_dir = shared
    big = torch.zeros(mib * MiB // 4)
    namespace = {"big": big, "torch": torch}
    body = "    float(big.sum())\n" if read_only else "    big.add_(1)\n"
    exec(f"def touch():\n{body}    return big.numel()\n", namespace)
    touch = sdk.function(gpus=1)(namespace["touch"])
    gc.collect()
    with PeakMemory(root_pid) as peak:
        started = time.perf_counter()
        call = touch.spawn()
        assert call.result() == big.numel()
        elapsed = time.perf_counter() - started
    want = 0.0 if read_only else 1.0
    assert namespace["big"] is big and float(big[0]) == want and float(big[-1]) == want
    info = call.info()
    how = "shared file" if info.result_file else "blob" if info.result_blob else "inline"
    rate = 2 * mib / elapsed
    print(
        f"{label}: {elapsed:.2f} s for {mib} MiB there and back ({rate:.0f} MiB/s), result as {how}"
    )
    return elapsed, peak.report(mib * MiB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--read-only", action="store_true", help="the call only reads it")
    args = parser.parse_args()
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        os.chmod(tmp, 0o711)  # as root, PostgreSQL's system account must traverse it
        state = Path(tmp) / "state"
        proc = start_cluster(state)
        try:
            client = sdk.connect(config=state / "client.toml")
            tensor = torch.randn(args.mib * MiB // 4)
            limits = sorted(reference(tensor, state) for _ in range(args.repeat))
            limit = statistics.median(limits)
            print(
                f"reference: torch.save + torch.load of {args.mib} MiB: "
                f"median {limit:.2f} s, best {limits[0]:.2f} s of {args.repeat}"
            )
            manual = sorted(by_hand(tensor, state) for _ in range(args.repeat))
            by_hand_median = statistics.median(manual)
            print(
                f"by hand: save, load, add_(1), save, load of {args.mib} MiB: "
                f"median {by_hand_median:.2f} s, best {manual[0]:.2f} s"
            )
            del tensor
            gc.collect()
            runs = [("shared directory", True)] + ([] if args.skip_http else [("HTTP", False)])
            for label, shared in runs:
                warm_up = f"{label} (warm-up)"
                round_trip(client, warm_up, min(args.mib, 64), proc.pid, shared, args.read_only)
                times = []
                for _ in range(args.repeat):
                    elapsed, memory = round_trip(
                        client, label, args.mib, proc.pid, shared, args.read_only
                    )
                    times.append(elapsed)
                    print(f"  peak RSS during the call (growth, in tensor sizes): {memory}")
                median = statistics.median(times)
                print(
                    f"  {label}: median {median:.2f} s, best {min(times):.2f} s = "
                    f"{median / limit:.2f}x the save+load median (target for the shared "
                    f"directory: 1.5x), {median / by_hand_median:.2f}x the round trip by hand"
                )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
