"""Where a blocking no-op call's cost goes: latency, CPU per call of each process, and the
HTTP requests and SQL statements it takes.

Starts its own single-machine cluster (``bulletin up``, 2 fake GPUs, 2 CPU slots) with a
``sitecustomize`` on the cluster's ``PYTHONPATH`` that counts, in the gateway process, every
statement asyncpg sends (``Connection.execute`` without arguments, ``Connection._execute``:
BEGIN and COMMIT count), and dumps the counts on SIGUSR1. Then N sequential
``@sdk.function(gpus=0)`` no-op calls, after a warm-up, and prints:

  * p50 / p90 / p99 of the call as the caller sees it;
  * CPU time per call of the client, the gateway, the nodelet, the workers and PostgreSQL
    (every backend), from ``/proc/PID/stat`` before and after;
  * the sdk's HTTP requests per call (an httpx event hook) and the gateway's SQL statements
    per call, each statement's share.

With ``--map N``: one ``list(fn.map(range(N)))`` instead (calls/s, and the client's and
the gateway's resident memory before and after).

With ``--profile DIR``: py-spy (``pip install py-spy``) samples the gateway, the nodelet and
every worker during the measured part and leaves their collapsed stacks in DIR
(``gateway.txt``...). py-spy samples wall time: a process preempted inside a system call
(a pipe write that wakes the worker on the same core) is counted there.

Usage: python bench/hot_path.py [--calls 300] [--no-place-at-submit] [--map N] [--profile DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import sdk

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import workloads  # bench/peers/workloads.py: quiet(), the machine idle

SITECUSTOMIZE = """
import collections, os, signal
try:
    import asyncpg.connection as _c
except ImportError:
    _c = None
if _c is not None and os.environ.get("BULLETIN_BENCH_COUNT") == "1":
    counts = collections.Counter()
    _execute, _execute_args = _c.Connection.execute, _c.Connection._execute

    async def execute(self, query, *args, **kwargs):
        if not args:
            counts[" ".join(query.split())[:72]] += 1
        return await _execute(self, query, *args, **kwargs)

    async def _execute_counted(self, query, args, *more, **kwargs):
        counts[" ".join(query.split())[:72]] += 1
        return await _execute_args(self, query, args, *more, **kwargs)

    _c.Connection.execute, _c.Connection._execute = execute, _execute_counted

    def dump(*_):
        with open(os.environ["BULLETIN_BENCH_COUNTS"] + f".{os.getpid()}", "w") as out:
            for query, n in counts.items():
                out.write(f"{n}\\t{query}\\n")

    signal.signal(signal.SIGUSR1, dump)
"""

HZ = os.sysconf("SC_CLK_TCK")


def noop(x: int) -> int:
    return x


def cpu_by_process() -> Counter[str]:
    """Seconds of CPU so far of each kind of process of the cluster, and of this one."""
    used: Counter[str] = Counter()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(pid) == os.getpid():
            kind = "client"
        elif "-m gateway" in cmd:
            kind = "gateway"
        elif "-m nodelet.worker_main" in cmd:
            kind = "workers"
        elif "-m nodelet" in cmd:
            kind = "nodelet"
            # Workers it reaped (recycled, crashed) took their CPU time with them: it is
            # counted in the nodelet's children's time (cutime, cstime).
            used["workers"] += (int(fields[13]) + int(fields[14])) / HZ
        elif cmd.startswith("postgres"):
            kind = "postgres"
        else:
            continue
        used[kind] += (int(fields[11]) + int(fields[12])) / HZ
    return used


def rss_mib(pid: int) -> float:
    """A process's resident memory now (MiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def statements(counts: Path, gateway_pid: int) -> Counter[str]:
    os.kill(gateway_pid, signal.SIGUSR1)
    dumped = Path(f"{counts}.{gateway_pid}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.3)
        if dumped.exists():
            break
    found: Counter[str] = Counter()
    for line in dumped.read_text().splitlines():
        n, _, query = line.partition("\t")
        found[query] = int(n)
    dumped.unlink()
    return found


def counted_cluster(
    tmp: Path, *, fake_gpus: int, settings: dict[str, str]
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """``bulletin up`` in ``tmp`` (with ``settings``, BULLETIN_* variables, for its
    processes) whose gateway counts its statements (SITECUSTOMIZE), once it serves: the
    process, its state dir and where the counts go (:func:`statements`)."""
    os.chmod(tmp, 0o711)  # as root, PostgreSQL's system account must traverse it
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    counts = tmp / "counts"
    env = {
        **os.environ,
        "PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}",
        "BULLETIN_BENCH_COUNT": "1",
        "BULLETIN_BENCH_COUNTS": str(counts),
        **settings,
    }
    state = tmp / "state"
    cluster = subprocess.Popen(
        [sys.executable, "-m", "bulletin", "--log-level", "warning", "up", "--state-dir",
         str(state), "--port", "0", "--fake-gpus", str(fake_gpus)],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (state / "client.toml").exists():
        if cluster.poll() is not None or time.monotonic() > deadline:
            cluster.kill()
            raise SystemExit("bulletin up did not start")
        time.sleep(0.2)
    time.sleep(1.0)
    return cluster, state, counts


def profile(into: Path, state: Path) -> list[subprocess.Popen[bytes]]:
    """py-spy recorders (collapsed stacks, native frames left out) on the gateway, the
    nodelet and each worker of the cluster whose state dir is ``state``."""
    into.mkdir(parents=True, exist_ok=True)
    targets = {"gateway": f"-m gateway .*{state}", "nodelet": f"-m nodelet .*{state}"}
    pids = {
        who: subprocess.check_output(["pgrep", "-f", "--", pattern]).split()[0].decode()
        for who, pattern in targets.items()
    }
    workers = subprocess.check_output(["pgrep", "-P", pids["nodelet"]]).split()
    pids |= {f"worker-{pid.decode()}": pid.decode() for pid in workers}
    spy = Path(sys.executable).parent / "py-spy"
    spies = []
    for who, pid in pids.items():
        command = [str(spy), "record", "--pid", pid, "--rate", "200", "--format", "raw",
                   "--output", str(into / f"{who}.txt"), "--nonblocking"]  # fmt: skip
        quiet = subprocess.DEVNULL
        spies.append(subprocess.Popen(command, stdout=quiet, stderr=quiet))
    return spies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--no-place-at-submit", action="store_true")
    parser.add_argument("--map", type=int, default=0, metavar="N",
                        help="measure one list(fn.map(range(N))) instead of sequential calls")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="py-spy the cluster's processes into DIR during the measurement")
    args = parser.parse_args()
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        settings = {"BULLETIN_PLACE_AT_SUBMIT": "false"} if args.no_place_at_submit else {}
        cluster, state, counts = counted_cluster(Path(tmp), fake_gpus=2, settings=settings)
        try:
            client = sdk.connect(config=state / "client.toml")
            fn = sdk.function(gpus=0)(noop)
            for i in range(50):
                fn(i)
            if args.map:
                # Both slots' workers warm for the function, and the spare that the map's
                # second slot took started again (importing torch takes seconds of CPU):
                # the steady state a researcher's next map finds.
                list(fn.map(range(min(args.map, 500))))
            workloads.quiet()  # what the warm-up started (a spare importing torch) is done
            found = subprocess.check_output(["pgrep", "-f", "--", f"-m gateway .*{state}"])
            gateway = int(found.split()[0])
            requests: list[str] = []
            client.request_hooks.append(lambda _, path: requests.append(path.split("?")[0]))
            before_sql, before_cpu = statements(counts, gateway), cpu_by_process()
            spies = profile(args.profile, state) if args.profile else []
            latency = []
            if args.map:
                memory = {"client": rss_mib(os.getpid()), "gateway": rss_mib(gateway)}
                started = time.perf_counter()
                for i, result in enumerate(fn.map(range(args.map))):
                    assert result == i
                took = time.perf_counter() - started
                memory = {
                    who: (before, rss_mib(os.getpid() if who == "client" else gateway))
                    for who, before in memory.items()
                }
            else:
                for i in range(args.calls):
                    started = time.perf_counter()
                    assert fn(i) == i
                    latency.append((time.perf_counter() - started) * 1000)
            after_cpu, after_sql = cpu_by_process(), statements(counts, gateway)
            for spy in spies:
                spy.send_signal(signal.SIGINT)
            for spy in spies:
                spy.wait(60)
        finally:
            cluster.send_signal(signal.SIGTERM)
            cluster.wait(60)
    if args.map:
        n = args.map
        print(f"map of {n} items: {took:.2f} s, {n / took:.0f} calls/s")
        for who, (before, after) in memory.items():
            print(f"  {who} resident memory: {before:.0f} MiB before, {after:.0f} MiB after")
    else:
        n = args.calls
        ordered = sorted(latency)
        pick = lambda q: ordered[min(n - 1, int(q * n))]  # noqa: E731
        print(
            f"{n} calls: p50 {pick(0.5):.2f} ms, p90 {pick(0.9):.2f} ms, "
            f"p99 {pick(0.99):.2f} ms, mean {statistics.fmean(latency):.2f} ms"
        )
    print("CPU per call:")
    for kind in ("client", "gateway", "nodelet", "workers", "postgres"):
        print(f"  {kind:9s} {(after_cpu[kind] - before_cpu[kind]) / n * 1000:6.2f} ms")
    total = sum(after_cpu.values()) - sum(before_cpu.values())
    print(f"  {'total':9s} {total / n * 1000:6.2f} ms")
    print(f"sdk HTTP requests per call: {len(requests) / n:.2f} ({Counter(requests)})")
    per_call = {q: (after_sql[q] - before_sql.get(q, 0)) / n for q in after_sql}
    print(f"gateway SQL statements per call: {sum(per_call.values()):.2f}")
    for query, share in sorted(per_call.items(), key=lambda kv: -kv[1]):
        if share >= 0.05:
            print(f"  {share:5.2f}  {query}")


if __name__ == "__main__":
    main()
