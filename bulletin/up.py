"""``bulletin up``: a whole single-machine cluster in one command.

Starts an embedded PostgreSQL, applies migrations, creates the admin user and a node token
(both reused on the next ``up`` of the same state dir), starts the gateway and one nodelet as
child processes, writes ``<state-dir>/client.toml``, and on Ctrl-C/SIGTERM stops them in
order: nodelet (which kills its workers), gateway, PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bulletin import admin
from bulletin.pgserver import EmbeddedPostgres, free_port

DATABASE = "bulletin"


class UpError(RuntimeError):
    pass


@dataclass(frozen=True)
class UpSettings:
    state_dir: Path
    host: str = "127.0.0.1"
    port: int = 8420  # 0 picks a free port
    fake_gpus: int | None = None
    cpu_slots: int = 0
    log_level: str = "info"


@contextlib.contextmanager
def _exclusive(state_dir: Path) -> Iterator[None]:
    """One ``up`` per state dir; the lock dies with the process, so a crashed one frees it."""
    with open(state_dir / "up.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UpError(f"another 'bulletin up' is running on {state_dir}") from None
        yield


def _token(path: Path, make: Callable[[], Coroutine[Any, Any, str]], database_url: str) -> str:
    """Reuse the token saved at ``path`` if the database still knows it, else make one."""
    if path.exists():
        token = path.read_text().strip()
        if asyncio.run(admin.token_valid(database_url, token)):
            return token
    token = asyncio.run(make())
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def write_client_config(path: Path, url: str, token: str) -> None:
    # JSON string escaping is valid TOML basic-string escaping.
    path.write_text(f"url = {json.dumps(url)}\ntoken = {json.dumps(token)}\n")
    path.chmod(0o600)


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    # Own session: a terminal's Ctrl-C reaches only `up`, which stops children in order.
    return subprocess.Popen(
        [sys.executable, *args], env={**os.environ, **env}, start_new_session=True
    )


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UpError(f"the gateway exited with code {proc.returncode} while starting")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise UpError(f"the gateway did not answer on {url} within {timeout:.0f}s")


def _stop(proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class _Stopper:
    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.requested = True


def run(settings: UpSettings, say: Callable[[str], None] = print) -> int:
    state = settings.state_dir.expanduser().resolve()
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    stopper = _Stopper()
    with _exclusive(state):
        pg = EmbeddedPostgres(state / "pgdata")
        if pg.running_pid() is not None:  # left behind by an `up` that was killed
            pg.stop()
        children: list[subprocess.Popen[bytes]] = []
        try:
            return _run(settings, state, pg, children, stopper, say)
        finally:
            for child in reversed(children):
                _stop(child)
            pg.stop()
            say("Bulletin stopped.")


def _run(
    settings: UpSettings,
    state: Path,
    pg: EmbeddedPostgres,
    children: list[subprocess.Popen[bytes]],
    stopper: _Stopper,
    say: Callable[[str], None],
) -> int:
    asyncio.run(admin.ensure_database(pg.start(), DATABASE))
    database_url = pg.url(DATABASE)
    asyncio.run(admin.migrate(database_url))
    node_name = socket.gethostname()
    user_token = _token(
        state / "admin.token",
        lambda: admin.add_user(database_url, "admin", is_admin=True),
        database_url,
    )
    _token(state / "node.token", lambda: admin.add_node(database_url, node_name), database_url)
    port = settings.port or free_port()
    url = f"http://{settings.host}:{port}"
    env = {"BULLETIN_DATABASE_URL": database_url, "BULLETIN_LOG_LEVEL": settings.log_level}
    # One machine: a directory of the state dir is the shared directory every "node" sees,
    # so big notebook state goes through files instead of the database.
    shared_dir = state / "shared"
    shared_dir.mkdir(exist_ok=True)
    gateway = ["-m", "gateway", "--host", settings.host, "--port", str(port)]
    children.append(_spawn([*gateway, "--shared-dir", str(shared_dir)], env))
    _wait_healthy(url, children[0])
    write_client_config(state / "client.toml", url, user_token)
    nodelet = [
        "-m",
        "nodelet",
        "--gateway",
        url,
        "--token-file",
        str(state / "node.token"),
        "--name",
        node_name,
        "--cpu-slots",
        str(settings.cpu_slots),
    ]
    if settings.fake_gpus is not None:
        nodelet += ["--fake-gpus", str(settings.fake_gpus)]
    children.append(_spawn(nodelet, {"BULLETIN_LOG_LEVEL": settings.log_level}))
    _banner(say, url, state)
    while not stopper.requested:
        for child in children:
            if child.poll() is not None:
                say(f"a Bulletin process exited (code {child.returncode}); stopping everything")
                return 1
        time.sleep(0.2)
    return 0


def _banner(say: Callable[[str], None], url: str, state: Path) -> None:
    config = state / "client.toml"
    say(f"Bulletin is up: gateway {url}")
    say(f"Client config (URL and admin token): {config}")
    say("Connect from Python or a notebook with either of:")
    say(f"    export BULLETIN_CONFIG={config}")
    say(f"    sdk.connect(config={str(config)!r})")
    say("Press Ctrl-C to stop.")
