"""One round of bench/compare.py's workloads on Celery (Redis broker + Redis result backend);
run by compare.py under the peers' virtualenv (bench/peers/requirements.txt).

Starts its own ``redis-server`` (Debian package ``redis-server``) on a free 127.0.0.1 port with
``--save "" --appendonly no``, then a worker ``celery -A celery_side worker --pool=prefork -c 2``
(Celery's defaults otherwise; this file is also its task module), and measures: (A)
``noop.delay().get()``, (B) ``group(noop.s() for _ in range(N)).apply_async().get()``, (C)
``torch_step.delay().get()`` on a warm prefork child. Both processes are stopped by PID at the
end. One JSON line per figure on stdout.

Usage: /opt/bulletin-peers/bin/python bench/peers/celery_side.py [--calls-a N] [--skip B] ...
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, HERE)

import workloads as w  # noqa: E402
from celery import Celery, group  # noqa: E402

SYSTEM = "celery"
URL_VARIABLE = "CELERY_SIDE_REDIS_URL"

_url = os.environ.get(URL_VARIABLE, "redis://127.0.0.1:6379")
app = Celery("celery_side", broker=_url + "/0", backend=_url + "/1")
app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)


@app.task(name="compare.noop")
def noop() -> None:
    return w.noop()


@app.task(name="compare.torch_step")
def torch_step() -> dict[str, Any]:
    return w.torch_step()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_redis(tmp: str) -> tuple[subprocess.Popen[bytes], int]:
    import redis

    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server not found: apt-get install -y redis-server")
    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "no", "--daemonize", "no", "--dir", tmp, "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                stop(proc)
                raise RuntimeError("redis-server did not come up") from None
            time.sleep(0.05)


def start_worker(tmp: str, url: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, **{URL_VARIABLE: url})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH", "")]))
    with open(os.path.join(tmp, "worker.log"), "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "celery_side", "worker", "--pool=prefork",
             "-c", "2", "--loglevel=WARNING", "-n", "compare@%h"],
            cwd=HERE, env=env, stdout=log, stderr=log,
        )


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    args = w.side_arguments(__doc__)
    tmp = tempfile.mkdtemp(prefix="compare-celery-")
    redis_proc, port = start_redis(tmp)
    worker: subprocess.Popen[bytes] | None = None
    try:
        import redis

        url = f"redis://127.0.0.1:{port}"
        app.conf.broker_url = url + "/0"
        app.conf.result_backend = url + "/1"
        server_version = redis.Redis(host="127.0.0.1", port=port).info()["redis_version"]
        w.emit(SYSTEM, "info", version=metadata.version("celery"), redis_server=server_version,
               redis_py=metadata.version("redis"), torch=metadata.version("torch"))
        t0 = time.perf_counter()
        worker = start_worker(tmp, url)
        noop.delay().get(timeout=120)
        w.emit(SYSTEM, w.METRIC_BOOT, ms=round((time.perf_counter() - t0) * 1e3, 1),
               what="worker Popen + first no-op")
        for _ in range(args.warmup):
            noop.delay().get(timeout=60)
        if "A" not in args.skip:
            ms = w.seq_latency(lambda: noop.delay().get(timeout=60), args.calls_a)
            w.emit(SYSTEM, w.METRIC_A, **w.lat_stats(ms), api="noop.delay().get()")
        if "B" not in args.skip:

            def fanout(n: int) -> None:
                group(noop.s() for _ in range(n)).apply_async().get(timeout=1200)

            fanout(max(1, args.calls_b // 10))
            w.emit(SYSTEM, w.METRIC_B, **w.fanout_rate(fanout, args.calls_b),
                   api="group(noop.s() for _ in range(N)).apply_async().get()")
        if "C" not in args.skip:
            w.emit(SYSTEM, w.METRIC_C,
                   **w.warm_torch(lambda: torch_step.delay().get(timeout=300), args.warm_calls),
                   api="torch_step.delay().get()")
    finally:
        if worker is not None:
            stop(worker)
        stop(redis_proc)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
