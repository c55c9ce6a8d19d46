"""A legitimate user's latency while someone floods the gateway with unknown tokens.

Starts an embedded PostgreSQL and one gateway (no nodelet: nothing but the HTTP path and
the token lookups), then measures p50/p90/p99 of a user's GET /v1/cluster, one every 20 ms
  * alone, and
  * while --flood requests with distinct well-formed unknown tokens (default 3,000) arrive
    over --connections raw kept-alive sockets (default 32) from the same address,
and how the flood was answered (401 looked up, 429 refused without a lookup) and how fast.
--limits off starts the gateway with the failure limit and the unknown-token memory turned
off (--auth-failure-rate-per-s 0 --auth-negative-cache-s 0): every bad token is looked up,
as before they existed; --limits no-hold keeps them but answers refusals at once
(--auth-failure-delay-s 0).
Usage: python bench/bad_tokens.py [--flood 3000] [--connections 32] [--limits on|off|no-hold]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from bulletin import admin, local
from bulletin.pgserver import EmbeddedPostgres, free_port


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(label: str, samples: list[float]) -> None:
    ms = [s * 1000 for s in samples]
    print(
        f"{label}: n={len(ms)} p50={percentile(ms, 0.5):.1f} ms p90={percentile(ms, 0.9):.1f} ms "
        f"p99={percentile(ms, 0.99):.1f} ms mean={statistics.fmean(ms):.1f} ms"
    )


LIMITS = {
    "on": [],
    "off": ["--auth-failure-rate-per-s", "0", "--auth-negative-cache-s", "0"],
    "no-hold": ["--auth-failure-delay-s", "0"],
}


def start_gateway(database_url: str, port: int, limits: str, log: Path) -> subprocess.Popen[bytes]:
    """One gateway on ``port`` through the harness `bulletin up` and the tests use."""
    args = local.gateway_args("127.0.0.1", port)
    env = {"BULLETIN_DATABASE_URL": database_url, "BULLETIN_LOG_LEVEL": "warning"}
    proc = local.spawn([*args, *LIMITS[limits]], env, log=log)
    try:
        local.wait_healthy(f"http://127.0.0.1:{port}", proc)
    except (local.ChildExited, TimeoutError) as exc:
        raise SystemExit(f"{exc}; see {log}") from None
    return proc


def read_status(sock: socket.socket, pending: bytearray) -> int:
    """Read one answer (with a Content-Length) off a kept-alive socket; its status."""
    while b"\r\n\r\n" not in pending:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the gateway closed the connection")
        pending += data
    head, _, rest = bytes(pending).partition(b"\r\n\r\n")
    length = 0
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(rest) < length:
        rest += sock.recv(65536)
    pending[:] = rest[length:]
    return int(head.split(b" ", 2)[1])


def flood(port: int, requests: int, connections: int, answers: Counter[int]) -> None:
    """Send ``requests`` GET /v1/cluster with distinct unknown tokens over ``connections``
    sockets, one request in flight on each."""
    per = [requests // connections + (i < requests % connections) for i in range(connections)]
    lock = threading.Lock()

    def one(count: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            pending = bytearray()
            seen: Counter[int] = Counter()
            for _ in range(count):
                token = "bu_" + secrets.token_urlsafe(32)
                sock.sendall(
                    b"GET /v1/cluster HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Authorization: Bearer " + token.encode() + b"\r\n\r\n"
                )
                seen[read_status(sock, pending)] += 1
        with lock:
            answers.update(seen)

    threads = [threading.Thread(target=one, args=(n,)) for n in per if n]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


#: The user's pace: a request every 20 ms, well within the per-user rate limit (100/s).
PACE_S = 0.02


def user_latency(url: str, token: str, calls: int | None, stop: threading.Event) -> list[float]:
    samples: list[float] = []
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {token}"}) as client:
        assert client.get("/v1/cluster").status_code == 200  # warm the connection
        while (calls is None and not stop.is_set()) or (calls is not None and len(samples) < calls):
            started = time.perf_counter()
            r = client.get("/v1/cluster")
            samples.append(time.perf_counter() - started)
            assert r.status_code == 200, r.text
            time.sleep(max(0.0, PACE_S - samples[-1]))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flood", type=int, default=3000)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--alone", type=int, default=300, help="user requests alone")
    parser.add_argument("--limits", choices=sorted(LIMITS), default="on")
    parser.add_argument("--attack", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attack:
        answers: Counter[int] = Counter()
        started = time.perf_counter()
        flood(args.attack, args.flood, args.connections, answers)
        elapsed = time.perf_counter() - started
        print(
            f"flood: {args.flood} unknown tokens over {args.connections} connections in "
            f"{elapsed:.2f} s ({args.flood / elapsed:.0f}/s); answers "
            + ", ".join(f"{status}: {n}" for status, n in sorted(answers.items()))
        )
        return
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; limits {args.limits}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)  # as root, PostgreSQL runs as its own account: it must get in
        pg = EmbeddedPostgres(Path(tmp) / "pgdata")
        pg.start()
        gateway = None
        try:
            url = pg.url("postgres")
            asyncio.run(admin.migrate(url))
            token = asyncio.run(admin.add_user(url, "alice"))
            port = free_port()
            gateway = start_gateway(url, port, args.limits, Path(tmp) / "gateway.log")
            base = f"http://127.0.0.1:{port}"
            report("user alone", user_latency(base, token, args.alone, threading.Event()))

            stop = threading.Event()
            during: list[float] = []
            user = threading.Thread(
                target=lambda: during.extend(user_latency(base, token, None, stop))
            )
            user.start()
            time.sleep(0.2)
            # The attacker is another process, so that its threads do not hold this one's GIL.
            attack = [sys.executable, __file__, "--attack", str(port)]
            attack += ["--flood", str(args.flood), "--connections", str(args.connections)]
            answered = subprocess.run(attack, check=True, capture_output=True, text=True)
            stop.set()
            user.join()
            report("user during the flood", during)
            print(answered.stdout.strip())
        finally:
            if gateway is not None:
                local.stop(gateway, timeout=30)
            pg.stop()


if __name__ == "__main__":
    main()
