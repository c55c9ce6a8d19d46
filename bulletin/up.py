"""``bulletin up``: a whole single-machine cluster in one command.

Starts an embedded PostgreSQL, makes the database role the gateway connects as (a plain
role that owns the ``bulletin`` database, not a superuser), applies migrations as that role,
creates the admin user and a node token (both reused on the next ``up`` of the same state
dir), starts the gateway and one nodelet as child processes, writes
``<state-dir>/client.toml``, and on Ctrl-C/SIGTERM stops them in order: nodelet (which kills
its workers), gateway, PostgreSQL.

The state dir holds secrets, each file 0600 from the moment it exists (``secretfiles``):
``pg.password`` (the superuser's, for maintenance only), ``bulletin.password`` (the role's),
``database.url`` (the role's URL, for ``bulletin user add`` and friends), ``admin.token``,
``node.token`` and ``client.toml``. As root, PostgreSQL runs as a system account, so the
state dir is made 0711 (that account reaches ``pgdata`` through it, nobody may list it);
``up`` changes the mode of no directory it did not create, and fails, naming the directory,
when one in the way cannot be traversed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import pwd
import secrets
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import platformdirs

from bulletin import admin, local
from bulletin.pgserver import EmbeddedPostgres, PostgresError, free_port
from bulletin.secretfiles import write_secret

DATABASE = "bulletin"
#: The role the gateway, the migrations and the admin commands connect as.
ROLE = "bulletin"


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
    #: The nodelet's --user-mapping: "" (single-tenant), "same-name" or a mapping file.
    user_mapping: str = ""
    #: The nodelet's --trusted-users (comma-separated user names, "*": all); None: not given.
    trusted_users: str | None = None


def check_host(host: str) -> None:
    """Fail fast if the gateway would refuse to serve plain HTTP on ``host``."""
    from gateway.config import is_loopback

    if not is_loopback(host):
        raise UpError(
            f"'bulletin up' serves plain HTTP, which the gateway allows only on a loopback "
            f"address, not on {host!r}: leave --host at 127.0.0.1 (reach it from elsewhere "
            "through an SSH tunnel), or run a gateway with --tls-cert-file and --tls-key-file "
            "(README, 'A real cluster')."
        )


def check_user_mapping(setting: str, euid: int | None = None) -> None:
    """Fail fast, saying what to do, if the nodelet could not use this user mapping."""
    if not setting:
        return
    if (os.geteuid() if euid is None else euid) != 0:
        raise UpError(
            f"--user-mapping {setting} needs 'bulletin up' to run as root: the nodelet "
            "switches each call to its owner's Unix account. Run it as root, or leave "
            "--user-mapping out for a single-tenant node (calls run as your own account)."
        )
    if setting != "same-name" and not os.path.isfile(setting):
        raise UpError(
            f"--user-mapping {setting!r} is neither 'same-name' nor a mapping file "
            "(lines 'bulletin-user unix-account')"
        )


def _check_worker_python() -> None:
    """The nodelet would refuse to start with a Python other accounts cannot run: say so now."""
    from nodelet.accounts import Accounts

    try:
        Accounts.check_interpreter()
    except ValueError as exc:
        raise UpError(str(exc)) from None


def make_state_dir(state: Path, for_other_account: bool) -> None:
    """Create ``state`` and its missing parents. With ``for_other_account`` (PostgreSQL runs
    as a system account) each directory made here is 0711: traversable, not listable.
    Directories that already exist keep their modes."""
    if not for_other_account:
        state.mkdir(parents=True, exist_ok=True, mode=0o700)
    else:
        for directory in [*reversed(state.parents), state]:
            with contextlib.suppress(FileExistsError):
                directory.mkdir(mode=0o711)
                directory.chmod(0o711)  # the umask may have taken the x bits; this one is ours
    st = state.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UpError(f"the state dir {state} is not a directory of this account: choose another")
    if st.st_mode & 0o022:
        raise UpError(
            f"others may write to the state dir {state} (mode {stat.S_IMODE(st.st_mode):04o}), "
            f"which holds secrets: choose another, or 'chmod go-w {state}'"
        )


@contextlib.contextmanager
def _exclusive(state_dir: Path) -> Iterator[None]:
    """One ``up`` per state dir; the lock dies with the process, so a crashed one frees it."""
    fd = os.open(state_dir / "up.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as lock:
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
    write_secret(path, token + "\n")
    return token


def _role_password(path: Path) -> str:
    if path.exists():
        return path.read_text().strip()
    password = secrets.token_urlsafe(24)
    write_secret(path, password + "\n")
    return password


def write_client_config(path: Path, url: str, token: str) -> None:
    # JSON string escaping is valid TOML basic-string escaping.
    write_secret(path, f"url = {json.dumps(url)}\ntoken = {json.dumps(token)}\n")


class _Stopper:
    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.requested = True


def run(settings: UpSettings, say: Callable[[str], None] = print) -> int:
    state = settings.state_dir.expanduser().resolve()
    check_host(settings.host)
    check_user_mapping(settings.user_mapping)
    if settings.user_mapping:
        _check_worker_python()
    pg = EmbeddedPostgres(state / "pgdata", unix_socket=True)
    try:
        pg.check_reachable()  # before anything is made: nothing to undo
    except PostgresError as exc:
        raise UpError(str(exc)) from None
    make_state_dir(state, pg.account is not None)
    stopper = _Stopper()
    with _exclusive(state):
        if pg.running_pid() is not None:  # left behind by an `up` that was killed
            pg.stop()
        children: list[subprocess.Popen[bytes]] = []
        try:
            return _run(settings, state, pg, children, stopper, say)
        finally:
            for child in reversed(children):
                local.stop(child)
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
    superuser_url = pg.start()
    password = _role_password(state / "bulletin.password")
    asyncio.run(admin.ensure_role(superuser_url, ROLE, password, DATABASE))
    database_url = admin.role_url(superuser_url, ROLE, DATABASE, password)
    write_secret(state / "database.url", database_url + "\n")
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
    with contextlib.suppress(FileExistsError):
        shared_dir.mkdir()
        shared_dir.chmod(0o755)  # every user of the node reaches their payloads through it
    gateway = local.gateway_args(settings.host, port, {"shared-dir": str(shared_dir)})
    children.append(local.spawn(gateway, env))
    try:
        local.wait_healthy(url, children[0])
    except (local.ChildExited, TimeoutError) as exc:
        raise UpError(str(exc)) from None
    write_client_config(state / "client.toml", url, user_token)
    nodelet_options = {
        "cpu-slots": str(settings.cpu_slots),
        # Given, not inherited: our own BULLETIN_STATE_DIR is not the nodelet's.
        "state-dir": str(state / "nodelet"),
        "user-mapping": settings.user_mapping,
    }
    if settings.fake_gpus is not None:
        nodelet_options["fake-gpus"] = str(settings.fake_gpus)
    if settings.trusted_users is not None:
        nodelet_options["trusted-users"] = settings.trusted_users
    nodelet = local.nodelet_args(url, state / "node.token", node_name, nodelet_options)
    children.append(local.spawn(nodelet, {"BULLETIN_LOG_LEVEL": settings.log_level}))
    _banner(say, url, state, settings)
    while not stopper.requested:
        for child in children:
            if child.poll() is not None:
                say(f"a Bulletin process exited (code {child.returncode}); stopping everything")
                return 1
        time.sleep(0.2)
    return 0


def node_mode(settings: UpSettings) -> list[str]:
    """What the banner says about whose account runs calls, and whose calls run."""
    if settings.user_mapping:
        return [
            "This node is multi-tenant: each call runs as its owner's Unix account "
            f"(--user-mapping {settings.user_mapping}); a user without one is refused."
        ]
    trusted = settings.trusted_users or ""
    whose = {
        "": "administrators only",
        "*": "every user (--trusted-users '*')",
    }.get(trusted.strip(), f"administrators and the trusted users {trusted}")
    return [
        "This node is single-tenant: every call runs as this node's own account "
        f"({pwd.getpwuid(os.geteuid()).pw_name}), so it runs the calls of {whose}.",
        "Other users' calls are refused here unless you trust them (--trusted-users NAME,...)"
        " or, as root, map them to their Unix accounts (--user-mapping same-name).",
    ]


def _banner(say: Callable[[str], None], url: str, state: Path, settings: UpSettings) -> None:
    config = state / "client.toml"
    say(f"Bulletin is up: gateway {url}")
    say(f"Client config (URL and admin token): {config}")
    say("Connect from Python or a notebook with either of:")
    say(f"    export BULLETIN_CONFIG={config}")
    say(f"    sdk.connect(config={str(config)!r})")
    for line in node_mode(settings):
        say(line)
    say("Add a user (prints their token; they connect with BULLETIN_URL and BULLETIN_TOKEN):")
    say(f"    BULLETIN_DATABASE_URL=$(cat {state / 'database.url'}) bulletin user add NAME")
    say("Press Ctrl-C to stop.")


def default_state_dir() -> Path:
    """Root's is a system path (FHS): PostgreSQL then runs as a system account, which must
    traverse every directory above it, and /root is not traversable."""
    if os.geteuid() == 0:
        return Path("/var/lib/bulletin")
    return Path(platformdirs.user_data_dir("bulletin"))


@click.command("up")
@click.option(
    "--state-dir",
    envvar="BULLETIN_STATE_DIR",
    show_envvar=True,
    type=click.Path(path_type=Path),
    default=default_state_dir,
    show_default="/var/lib/bulletin as root, else a per-user data dir",
    help="Database, tokens and client.toml live here (as root: under directories every "
    "account may traverse, since PostgreSQL runs as a system account).",
)
@click.option(
    "--host",
    envvar="BULLETIN_HOST",
    default="127.0.0.1",
    show_default=True,
    help="Address the gateway listens on.",
)
@click.option(
    "--port",
    envvar="BULLETIN_PORT",
    type=int,
    default=8420,
    show_default=True,
    help="Gateway port; 0 picks a free one.",
)
@click.option(
    "--fake-gpus",
    envvar="BULLETIN_FAKE_GPUS",
    type=click.IntRange(0),
    default=None,
    help="Offer N CPU-backed fake GPUs [default: the NVIDIA GPUs found, else 2 fakes]",
)
@click.option(
    "--cpu-slots",
    envvar="BULLETIN_CPU_SLOTS",
    type=click.IntRange(0),
    default=0,
    help="CPU-only call slots [default: the number of cores]",
)
@click.option(
    "--user-mapping",
    envvar="BULLETIN_USER_MAPPING",
    show_envvar=True,
    default="",
    help="Run each call as its owner's Unix account: 'same-name', or a file of "
    "'bulletin-user unix-account' lines (needs root) [default: single-tenant, calls run as "
    "this account].",
)
@click.option(
    "--trusted-users",
    envvar="BULLETIN_TRUSTED_USERS",
    show_envvar=True,
    default=None,
    help="On a single-tenant node, whose calls run besides administrators': user names, "
    "comma-separated, or '*' for all [default: administrators only].",
)
@click.pass_context
def command(
    ctx: click.Context,
    state_dir: Path,
    host: str,
    port: int,
    fake_gpus: int | None,
    cpu_slots: int,
    user_mapping: str,
    trusted_users: str | None,
) -> None:
    """Start a single-machine cluster: PostgreSQL, gateway, scheduler and one nodelet."""
    # What `bulletin --log-level` set, for the children too.
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    settings = UpSettings(
        state_dir, host, port, fake_gpus, cpu_slots, level, user_mapping, trusted_users
    )
    try:
        ctx.exit(run(settings, lambda line: click.echo(line)))
    except UpError as exc:
        raise click.ClickException(str(exc)) from None
