"""The control plane at scale: many simulated nodes against one gateway and PostgreSQL.

Starts ``bulletin up`` (its own nodelet gets no GPU, so it takes none of the calls), adds N
node tokens, and runs N simulated nodes in a few processes. Each registers with 8 fake GPUs,
heartbeats and long-polls exactly as a nodelet does (``nodelet.client.GatewayClient``), and
"runs" every call it is given at once: it notes when the call arrived and completes it. One
submitter sends ``gpus=1`` calls at a fixed rate in batches over plain HTTP. Printed for each
N: calls/s completed, p50 / p99 from the submission being sent to a node receiving the call
(every call of a batch alike), the gateway's CPU (share of one core), and the gateway's SQL
statements per second (counted in the gateway process, as ``bench/hot_path.py`` does).

Usage: python bench/control_plane.py [--nodes 10,100,1000] [--rate 200] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).parent))
from hot_path import HZ, counted_cluster, statements

from bulletin import admin
from bulletin_core import wire

GPUS_PER_NODE = 8
BATCH = 25  # calls per submission request


def simulate(url: str, tokens: list[tuple[str, str]], out: str, seconds: float) -> None:
    """One process's simulated nodes, until ``seconds`` pass; arrivals to ``out``."""
    from nodelet.client import GatewayClient
    from nodelet.errors import GatewayUnavailable

    arrived: list[tuple[str, float]] = []
    registering = asyncio.Semaphore(16)  # per process: a thundering herd times out

    async def node(name: str, token: str) -> None:
        client = GatewayClient(url, token)
        try:
            gpus = [
                wire.GpuInfo(
                    index=i, uuid=f"GPU-{name}-{i}", name="Sim", memory_mb=81920, fake=True
                )
                for i in range(GPUS_PER_NODE)
            ]
            request = wire.RegisterRequest(name=name, gpus=gpus, cpu_slots=0)
            deadline = time.monotonic() + seconds
            for attempt in range(30):  # as a nodelet does: a storm of them is answered late
                try:
                    async with registering:
                        reg = await client.register(request)
                    break
                except GatewayUnavailable:
                    await asyncio.sleep(1.0 + attempt)
            else:
                raise RuntimeError(f"{name} could not register")
            beat = time.monotonic()
            while time.monotonic() < deadline:
                try:
                    answer = await client.poll([], hold_s=min(reg.long_poll_s, 5.0))
                except GatewayUnavailable:
                    await asyncio.sleep(0.5)
                    continue
                now = time.time()
                for work in answer.assignments:
                    arrived.append((work.invocation_id, now))
                    done = wire.CompleteRequest(epoch=work.epoch, state="succeeded", result=b"r")
                    await client.complete(work.invocation_id, done)
                if time.monotonic() - beat > reg.heartbeat_s:
                    await client.heartbeat([])
                    beat = time.monotonic()
        finally:
            await client.aclose()

    async def main() -> None:
        ended = await asyncio.gather(*(node(n, t) for n, t in tokens), return_exceptions=True)
        failed = [e for e in ended if isinstance(e, BaseException)]
        if failed:
            kinds = {repr(e)[:160] for e in failed}
            print(f"{len(failed)} simulated nodes failed: {sorted(kinds)[:4]}", file=sys.stderr)

    asyncio.run(main())
    Path(out).write_text(json.dumps(arrived))


async def _registered(database_url: str, want: int, timeout_s: float) -> int:
    """Wait until ``want`` simulated nodes have registered; how many did."""
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            n = await conn.fetchval(
                "SELECT count(*) FROM nodes WHERE name LIKE 'sim-%' AND last_heartbeat "
                "> clock_timestamp() - interval '60 seconds'"
            )
            if n >= want or time.monotonic() > deadline:
                return int(n)
            await asyncio.sleep(0.5)
    finally:
        await conn.close()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def measure(n_nodes: int, rate: float, seconds: float, procs: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = {
            # Submissions are the benchmark's load, not an abuse: no per-user rate limit; and
            # every simulated node shares one address (real nodes have one each), whose
            # budget for tokens the gateway has not seen yet 1,000 registrations would spend.
            "BULLETIN_RATE_LIMIT_PER_S": "0",
            "BULLETIN_AUTH_FAILURE_RATE_PER_S": "0",
        }
        cluster, state, counts = counted_cluster(Path(tmp), fake_gpus=0, settings=settings)
        sides: list[subprocess.Popen[bytes]] = []
        try:
            database_url = (state / "database.url").read_text().strip()
            config = (state / "client.toml").read_text()
            url = config.split('url = "', 1)[1].split('"', 1)[0]
            token = config.split('token = "', 1)[1].split('"', 1)[0]

            async def tokens() -> list[tuple[str, str]]:
                return [(f"sim-{i}", await admin.add_node(database_url, f"sim-{i}"))
                        for i in range(n_nodes)]  # fmt: skip

            made = asyncio.run(tokens())
            run_s = seconds + 15 + n_nodes / 20  # registering 1,000 takes a while
            for p in range(procs):
                mine = made[p::procs]
                if not mine:
                    continue
                spec = Path(tmp) / f"side-{p}.json"
                spec.write_text(json.dumps(mine))
                sides.append(subprocess.Popen(
                    [sys.executable, __file__, "--side", str(spec), "--url", url,
                     "--seconds", str(run_s)],
                ))  # fmt: skip
            gateway = int(subprocess.check_output(
                ["pgrep", "-f", "--", f"-m gateway .*{state}"]).split()[0])  # fmt: skip
            registered = asyncio.run(_registered(database_url, n_nodes, 180))
            if registered < n_nodes:
                raise SystemExit(f"only {registered} of {n_nodes} simulated nodes registered")
            time.sleep(2)  # their first polls are in
            submitted: dict[str, float] = {}
            encoder = msgspec.json.Encoder()
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as http:
                before_sql, before_cpu = statements(counts, gateway), cpu_seconds(gateway)
                started = time.monotonic()
                sent = 0
                while (elapsed := time.monotonic() - started) < seconds:
                    due = int(elapsed * rate) + BATCH
                    if sent >= due - BATCH:
                        time.sleep(BATCH / rate / 4)
                        continue
                    calls = [
                        wire.CallSpec(idempotency_key=uuid.uuid4().hex, payload=b"x", gpus=1)
                        for _ in range(BATCH)
                    ]
                    at = time.time()  # the submission is sent: the clock starts
                    r = http.post("/v1/invocations", content=encoder.encode(
                        wire.SubmitRequest(calls=calls)),
                        headers={"Content-Type": "application/json"})  # fmt: skip
                    if r.status_code != 201:
                        raise SystemExit(f"submission refused: {r.status_code} {r.text}")
                    for i in r.json()["ids"]:
                        submitted[i] = at
                    sent += BATCH
                took = time.monotonic() - started
                after_cpu, after_sql = cpu_seconds(gateway), statements(counts, gateway)
            for side in sides:
                side.wait(run_s + 60)
            arrived: dict[str, float] = {}
            for p in range(procs):
                out = Path(tmp) / f"side-{p}.json.out"
                if out.exists():
                    arrived.update(dict(json.loads(out.read_text())))
        finally:
            for side in sides:
                if side.poll() is None:
                    side.kill()
            cluster.send_signal(signal.SIGTERM)
            cluster.wait(60)
    waits = sorted((arrived[i] - t) * 1000 for i, t in submitted.items() if i in arrived)
    n = len(waits)
    sql = sum(after_sql.values()) - sum(before_sql.values())
    return {
        "nodes": n_nodes,
        "submitted": len(submitted),
        "received": n,
        "calls_per_s": n / took,
        "p50_ms": waits[n // 2] if n else float("nan"),
        "p99_ms": waits[min(n - 1, int(n * 0.99))] if n else float("nan"),
        "mean_ms": statistics.fmean(waits) if n else float("nan"),
        "gateway_cpu": (after_cpu - before_cpu) / took,
        "sql_per_s": sql / took,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", default="10,100,1000")
    parser.add_argument("--rate", type=float, default=200.0, help="calls submitted per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--procs", type=int, default=4, help="processes of simulated nodes")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        tokens = [tuple(t) for t in json.loads(Path(args.side).read_text())]
        simulate(args.url, tokens, args.side + ".out", args.seconds)  # type: ignore[arg-type]
        return
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; {args.rate:g} calls/s for {args.seconds:g} s"
    )
    print("| nodes | calls/s received | submit -> node p50 / p99 | gateway CPU | SQL/s |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.nodes.split(",")):
        r = measure(n, args.rate, args.seconds, args.procs)
        print(
            f"| {n} | {r['calls_per_s']:.0f} ({r['received']}/{r['submitted']}) | "
            f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f} ms | "
            f"{r['gateway_cpu'] * 100:.0f} % of a core | {r['sql_per_s']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
