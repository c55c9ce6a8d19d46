"""Bulletin side by side with Ray and Celery: the same workloads, in one run, alternating.

Each round runs every system once, one at a time, from a fresh start (round 1: bulletin, ray,
celery; round 2: ray, celery, bulletin; ...), so that slow drifts of the machine's load fall
on every system alike. The workloads (bench/peers/workloads.py; the definitions of
../shared/peer-bench):

  (A)  sequential no-op round trip, submit + wait, p50/p99 (nearest rank) after a warm-up;
       each workload starts once the machine is idle (workloads.quiet: what a system
       started in the background, such as spare workers importing torch, is not measured);
  (A') Bulletin only: the same over plain HTTP, ``POST /v1/functions/noop/invoke?wait=30``
       of a registered no-op with a JSON body, as curl would;
  (B)  fan-out of N no-op calls: calls/s = N / (first submit -> last result);
  (C)  warm torch step round trip (import torch; Linear(64, 64); SGD(lr=0.1); forward 32x64;
       backward; step; return loss), p50 of calls landing on a worker that already ran it.

``OMP_NUM_THREADS=1`` for everyone. Bulletin runs under this interpreter (the project's, with
torch): each round starts its own ``bulletin up --port 0 --fake-gpus 0 --cpu-slots 2`` in a
temporary state dir; its calls are ``@sdk.function(gpus=0)``. Ray (``ray.init(num_cpus=2)``)
and Celery (Redis broker and backend, ``--pool=prefork -c 2``; needs ``redis-server``) run as
subprocesses under the peers' own virtualenv (bench/peers/requirements.txt says how to make
it). Everything listens on 127.0.0.1 only. The end is a Markdown table of the medians over
rounds and the ratios Bulletin / peer, and one of each round with its load average.

Usage:
  .venv/bin/python bench/compare.py                       # 3 rounds, ~10 min on 2 cores
  .venv/bin/python bench/compare.py --quick               # smoke test, ~2 min
  .venv/bin/python bench/compare.py --rounds 2 --calls-b 2000 --out results.jsonl
  .venv/bin/python bench/compare.py --only bulletin,ray --skip C
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
REPO = HERE.parent
sys.path.insert(0, str(PEERS))

import workloads as w  # noqa: E402

SYSTEMS = ("bulletin", "ray", "celery")
SIDE_SCRIPTS = {"ray": PEERS / "ray_side.py", "celery": PEERS / "celery_side.py"}
DEFAULT_PEERS_PYTHON = Path("/opt/bulletin-peers/bin/python")
PEERS_SETUP = f"""\
The peers' virtualenv is missing or incomplete ({{python}}). Create it (Python 3.11):
  python3.11 -m venv {DEFAULT_PEERS_PYTHON.parent.parent}
  {DEFAULT_PEERS_PYTHON.parent}/pip install torch==2.13.0
  {DEFAULT_PEERS_PYTHON.parent}/pip install -r {PEERS / "requirements.txt"}
and for Celery: apt-get install -y redis-server
(or pass --peers-python PATH, or --only bulletin)."""


# ------------------------------------------------------------------------- the Bulletin side


def bulletin_side(args: argparse.Namespace) -> None:
    """One round on Bulletin (run as a subprocess of the driver, like the peers' sides)."""
    import sdk

    system = "bulletin"
    head = _git("rev-parse", "--short", "HEAD")
    dirty = len(_git("status", "--porcelain", "--untracked-files=no").splitlines())
    w.emit(system, "info", version=head, uncommitted_files=dirty, torch=_version("torch"))
    tmp = Path(tempfile.mkdtemp(prefix="compare-bulletin-"))
    os.chmod(tmp, 0o711)  # as root, PostgreSQL's system account must traverse it
    state = tmp / "state"
    log_path = tmp / "up.log"
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bulletin", "--log-level", "warning", "up", "--state-dir",
             str(state), "--port", "0", "--fake-gpus", "0", "--cpu-slots", "2"],
            start_new_session=True, stdout=log, stderr=subprocess.STDOUT,
            # The harness's OMP_NUM_THREADS=1 reaches the peers' workers by inheritance;
            # Bulletin's workers get a minimal environment, so the nodelet passes it on.
            env={**os.environ, "BULLETIN_WORKER_ENV": "OMP_NUM_THREADS"},
        )
    try:
        config = state / "client.toml"
        deadline = time.monotonic() + 180
        while not config.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("bulletin up did not start")
            time.sleep(0.02)
        sdk.connect(config=config)
        fn = sdk.function(gpus=0)(w.noop)
        while True:
            try:
                fn()
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        w.emit(system, w.METRIC_BOOT, ms=round((time.perf_counter() - t0) * 1e3, 1),
               what="bulletin up + first no-op")
        for _ in range(args.warmup):
            fn()
        if "A" not in args.skip:
            ms = w.seq_latency(fn, args.calls_a)
            w.emit(system, w.METRIC_A, **w.lat_stats(ms), api="f() with @sdk.function(gpus=0)")
        if "A'" not in args.skip:
            w.emit(system, w.METRIC_AH, **w.lat_stats(_json_invoke(config, args)),
                   api="POST /v1/functions/noop/invoke?wait=30 (httpx, keep-alive)")
        if "B" not in args.skip:
            mapped = sdk.function(gpus=0)(w.item_noop)

            def fanout(n: int) -> None:
                if list(mapped.map(range(n))) != list(range(n)):
                    raise AssertionError("map returned wrong results")

            fanout(max(1, args.calls_b // 10))
            w.emit(system, w.METRIC_B, **w.fanout_rate(fanout, args.calls_b),
                   api="list(f.map(range(N)))")
        if "C" not in args.skip:
            step = sdk.function(gpus=0)(w.torch_step)
            w.emit(system, w.METRIC_C, **w.warm_torch(step, args.warm_calls),
                   api="torch_step() with @sdk.function(gpus=0)")
    except BaseException:
        sys.stderr.write(f"--- bulletin up log ({log_path}):\n")
        sys.stderr.write(log_path.read_text(errors="replace")[-6000:])
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _json_invoke(config: Path, args: argparse.Namespace) -> list[float]:
    """(A'): register a no-op as ``noop`` and invoke it with JSON over plain HTTP."""
    import tomllib

    import httpx

    import sdk

    sdk.function(gpus=0)(w.item_noop).register("noop")
    settings = tomllib.loads(config.read_text())
    headers = {"Authorization": f"Bearer {settings['token']}"}
    samples: list[float] = []
    w.quiet()
    with httpx.Client(base_url=settings["url"], headers=headers, timeout=60) as client:
        for i in range(args.warmup + args.calls_a):
            started = time.perf_counter()
            answer = client.post("/v1/functions/noop/invoke?wait=30", json={"args": [i]})
            elapsed = (time.perf_counter() - started) * 1e3
            if answer.status_code != 200 or answer.json().get("result_json") != i:
                raise RuntimeError(f"invoke answered {answer.status_code}: {answer.text[:500]}")
            if i >= args.warmup:
                samples.append(elapsed)
    return samples


def _git(*argv: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True)
    return done.stdout.strip()


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------- the driver


@dataclass
class SideRun:
    """One system's round: its result lines, the machine's load around it, or its error."""

    round: int
    position: int
    system: str
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    idle_busy: float = 0.0
    wall_s: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class Row:
    """A line of the summary table: a workload's figure, where it is and which way is better."""

    label: str
    metric: str
    key: str
    higher_is_better: bool


ROWS = (
    Row("(A) no-op round trip p50, ms", w.METRIC_A, "p50_ms", False),
    Row("(A) no-op round trip p99, ms", w.METRIC_A, "p99_ms", False),
    Row("(A') JSON invoke over HTTP p50, ms", w.METRIC_AH, "p50_ms", False),
    Row("(A') JSON invoke over HTTP p99, ms", w.METRIC_AH, "p99_ms", False),
    Row("(B) fan-out no-op, calls/s", w.METRIC_B, "calls_per_s", True),
    Row("(C) warm torch step round trip p50, ms", w.METRIC_C, "p50_ms", False),
    Row("boot to first no-op, ms (info)", w.METRIC_BOOT, "ms", False),
)


def busy_fraction(seconds: float = 1.0) -> float:
    """Share of all cores busy over ``seconds`` (/proc/stat), measured while nothing of this
    benchmark runs: the load of others on the machine."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except OSError:
        return float("nan")
    total = total1 - total0
    return 1.0 - (idle1 - idle0) / total if total else 0.0


def side_command(system: str, args: argparse.Namespace) -> list[str]:
    calls_b = min(args.calls_b, args.bulletin_calls_b) if system == "bulletin" else args.calls_b
    counts = ["--warmup", str(args.warmup), "--calls-a", str(args.calls_a),
              "--calls-b", str(calls_b), "--warm-calls", str(args.warm_calls),
              "--skip", ",".join(sorted(args.skip))]
    if system == "bulletin":
        return [sys.executable, str(Path(__file__).resolve()), "--side", "bulletin", *counts]
    return [str(args.peers_python), str(SIDE_SCRIPTS[system]), *counts]


def side_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PEERS), env.get("PYTHONPATH", "")]))
    return env


def run_side(run: SideRun, args: argparse.Namespace, logdir: Path,
             report: Callable[[SideRun, dict[str, Any]], None]) -> None:
    """Run one system's round as a subprocess; collect its JSON lines into ``run``."""
    run.idle_busy = busy_fraction()
    run.load_before = os.getloadavg()
    log_path = logdir / f"round{run.round}-{run.system}.stderr"
    started = time.perf_counter()
    timed_out = threading.Event()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(side_command(run.system, args), stdout=subprocess.PIPE,
                                stderr=log, env=side_env(), cwd=REPO, text=True,
                                start_new_session=True)

    def stop(timeout: bool = False) -> None:
        """SIGTERM to the side's process group (a side stops what it started), then KILL."""
        if timeout:
            timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(args.side_timeout, stop, kwargs={"timeout": True})
    watchdog.daemon = True
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                record = json.loads(line)
                run.results[record["metric"]] = record
                report(run, record)
        rc = proc.wait()
    except BaseException:
        stop()
        raise
    finally:
        watchdog.cancel()
    run.wall_s = time.perf_counter() - started
    run.load_after = os.getloadavg()
    if timed_out.is_set():
        run.error = f"timed out after {args.side_timeout:.0f} s (--side-timeout)"
    if rc != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-25:]
        run.error = (run.error or f"exit status {rc}") + (
            f"; stderr ({log_path}):\n    " + "\n    ".join(tail))


def figure(record: dict[str, Any]) -> str:
    metric = record["metric"]
    if metric == w.METRIC_B:
        return f"{record['calls_per_s']:,.1f} calls/s (n={record['n']}, {record['total_s']} s)"
    if metric == w.METRIC_BOOT:
        return f"{record['ms']:,.0f} ms ({record['what']})"
    if "p50_ms" in record:
        extra = ""
        if metric == w.METRIC_C:
            extra = (f", {record['cold_calls']} cold call(s) not counted, first "
                     f"{record['cold_first_ms']:,.0f} ms, in-body step p50 "
                     f"{record['step_ms_in_body_p50']} ms")
        return (f"p50 {record['p50_ms']:.2f} ms, p99 {record['p99_ms']:.2f} ms "
                f"(n={record['n']}{extra})")
    return json.dumps({k: v for k, v in record.items() if k not in ("system", "metric")})


def median_of(runs: list[SideRun], system: str, row: Row) -> float | None:
    values = [run.results[row.metric][row.key] for run in runs
              if run.system == system and row.metric in run.results]
    return statistics.median(values) if values else None


def cell(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def summary_table(runs: list[SideRun], systems: list[str]) -> str:
    peers = [s for s in systems if s != "bulletin"]
    head = ["workload (median over rounds)", *systems]
    if "bulletin" in systems:
        head += [f"Bulletin / {p.capitalize()}" for p in peers]
    head.append("better")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in ROWS:
        values = {s: median_of(runs, s, row) for s in systems}
        if all(v is None for v in values.values()):
            continue
        cells = [row.label, *(cell(values[s]) for s in systems)]
        if "bulletin" in systems:
            ours = values["bulletin"]
            for p in peers:
                theirs = values[p]
                cells.append(f"{ours / theirs:.2f}x" if ours is not None and theirs else "n/a")
        if row.higher_is_better:
            cells.append("higher (ratio < 1: Bulletin slower)")
        else:
            cells.append("lower (ratio > 1: Bulletin slower)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rounds_table(runs: list[SideRun]) -> str:
    head = ["round", "#", "system", "A p50 ms", "A p99 ms", "A' p50 ms", "B calls/s",
            "C p50 ms", "load 1m before -> after", "others' CPU before", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        def get(metric: str, key: str, run: SideRun = run) -> str:
            record = run.results.get(metric)
            return cell(record.get(key)) if record else ("failed" if run.error else "-")

        lines.append("| " + " | ".join([
            str(run.round), str(run.position), run.system,
            get(w.METRIC_A, "p50_ms"), get(w.METRIC_A, "p99_ms"), get(w.METRIC_AH, "p50_ms"),
            get(w.METRIC_B, "calls_per_s"), get(w.METRIC_C, "p50_ms"),
            f"{run.load_before[0]:.2f} -> {run.load_after[0]:.2f}",
            f"{run.idle_busy:.0%} of {os.cpu_count()} cores", f"{run.wall_s:.0f}",
        ]) + " |")
    return "\n".join(lines)


def check_peers(args: argparse.Namespace, systems: list[str]) -> None:
    """Stop with how to set up what is missing, before anything is measured."""
    peers = [s for s in systems if s != "bulletin"]
    if peers:
        python = Path(args.peers_python)
        modules = {"ray": "ray", "celery": "celery, redis"}
        probe = "import torch, " + ", ".join(modules[p] for p in peers)
        ok = os.access(python, os.X_OK) and subprocess.run(
            [str(python), "-c", probe], capture_output=True).returncode == 0
        if not ok:
            raise SystemExit(PEERS_SETUP.format(python=python))
    if "celery" in systems and shutil.which("redis-server") is None:
        raise SystemExit("Celery needs redis-server: apt-get install -y redis-server "
                         "(or --only bulletin,ray)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-python", type=Path, default=DEFAULT_PEERS_PYTHON,
                        help="the peers' virtualenv interpreter (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds, each system once per round (default 3; --quick: 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="no-op calls before (A) and (A') (default 100)")
    parser.add_argument("--calls-a", type=int, default=None,
                        help="(A) and (A') calls recorded per round (default 1000)")
    parser.add_argument("--calls-b", type=int, default=None,
                        help="(B) calls in the fan-out (default 5000)")
    parser.add_argument("--bulletin-calls-b", type=int, default=None,
                        help="cap on (B) calls for Bulletin (a smaller N for a quicker run); "
                        "calls/s stays comparable (default 5000)")
    parser.add_argument("--warm-calls", type=int, default=None,
                        help="(C) warm torch calls recorded per round (default 20)")
    parser.add_argument("--quick", action="store_true",
                        help="small counts, a smoke test (defaults 2 rounds, 20 warm-up, 50 A, "
                        "500 B, Bulletin B 200, 5 C)")
    parser.add_argument("--only", default=",".join(SYSTEMS),
                        help="comma list of systems (default: %(default)s)")
    parser.add_argument("--skip", default="", help="comma list of workloads to skip: A,A',B,C")
    parser.add_argument("--out", type=Path, help="append every result as JSON lines here")
    parser.add_argument("--side-timeout", type=float, default=1800,
                        help="seconds one system's round may take (default %(default)s)")
    parser.add_argument("--side", choices=["bulletin"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    quick = {"rounds": 2, "warmup": 20, "calls_a": 50, "calls_b": 500, "bulletin_calls_b": 200,
             "warm_calls": 5}
    full = {"rounds": 3, "warmup": 100, "calls_a": 1000, "calls_b": 5000,
            "bulletin_calls_b": 5000, "warm_calls": 20}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.skip = {part.strip().upper() for part in args.skip.split(",") if part.strip()}
    if unknown := args.skip - set(w.WORKLOADS):
        parser.error(f"--skip: unknown workload(s) {', '.join(sorted(unknown))}; "
                     f"choose from {','.join(w.WORKLOADS)}")
    args.systems = [s.strip().lower() for s in args.only.split(",") if s.strip()]
    if bad := set(args.systems) - set(SYSTEMS):
        parser.error(f"--only: unknown system(s) {', '.join(sorted(bad))}")
    return args


def main() -> None:
    args = parse_args()
    if args.side == "bulletin":
        bulletin_side(args)
        return
    systems: list[str] = args.systems
    check_peers(args, systems)
    os.environ["OMP_NUM_THREADS"] = "1"
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - kept open for the run

    def write(record: dict[str, Any]) -> None:
        if out is not None:
            out.write(json.dumps({"run": run_id, **record}) + "\n")
            out.flush()

    def report(run: SideRun, record: dict[str, Any]) -> None:
        print(f"  {run.system:<8} {record['metric']:<26} {figure(record)}", flush=True)
        write({"round": run.round, "position": run.position, **record})

    cap = min(args.calls_b, args.bulletin_calls_b)
    print(f"compare: {len(systems)} systems x {args.rounds} rounds, {os.cpu_count()} cores; "
          f"A/A' {args.calls_a} calls after {args.warmup} warm-up, B {args.calls_b} calls"
          + (f" (Bulletin: {cap}, --bulletin-calls-b)" if "bulletin" in systems
             and cap < args.calls_b else "")
          + f", C {args.warm_calls} warm calls; skip: {','.join(sorted(args.skip)) or 'none'}")
    write({"metric": "config", **{k: (sorted(v) if isinstance(v, set) else str(v)
                                      if isinstance(v, Path) else v)
                                  for k, v in vars(args).items()}})
    runs: list[SideRun] = []
    logdir = Path(tempfile.mkdtemp(prefix="compare-logs-"))
    try:
        for r in range(args.rounds):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            print(f"round {r + 1}/{args.rounds}: {', '.join(order)}; load average "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
            for position, system in enumerate(order, 1):
                run = SideRun(r + 1, position, system)
                runs.append(run)
                run_side(run, args, logdir, report)
                write({"round": run.round, "position": position, "system": system,
                       "metric": "side", "load_before": run.load_before,
                       "load_after": run.load_after, "others_cpu_busy_before": run.idle_busy,
                       "wall_s": round(run.wall_s, 1), "error": run.error})
                if run.error:
                    print(f"  {system:<8} FAILED: {run.error}", flush=True)
    finally:
        if out is not None:
            out.close()
    print()
    if "bulletin" in systems and cap < args.calls_b and "B" not in args.skip:
        print(f"(B) Bulletin fans out {cap} calls, the peers {args.calls_b}; the figure is "
              "calls/s either way.")
    print(summary_table(runs, systems))
    print()
    print("Per round (load average 1 min before and after each system's round; others' CPU: "
          "share of all cores busy during 1 s just before it, while none of ours ran):")
    print(rounds_table(runs))
    versions = {run.system: run.results["info"] for run in runs if "info" in run.results}
    print()
    print("Versions: " + "; ".join(
        f"{s} {v.get('version')}" + (f" ({v['uncommitted_files']} uncommitted files)"
                                     if v.get("uncommitted_files") else "")
        + (f", redis-server {v['redis_server']}" if v.get("redis_server") else "")
        + f", torch {v.get('torch')}" for s, v in versions.items()))
    failed = [run for run in runs if run.error]
    if failed:
        print(f"{len(failed)} system round(s) failed: "
              + ", ".join(f"round {run.round} {run.system}" for run in failed))
        sys.exit(1)
    shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    main()
