"""Gateways and nodelets as child processes of this machine: how they are started, found
healthy and stopped. The one harness of ``bulletin up`` (:mod:`bulletin.up`) and of the tests
(``tests/conftest.py``).

A child leads its own session (a terminal's Ctrl-C reaches only its parent, which stops the
children in order). It inherits the parent's environment, ``BULLETIN_*`` settings included
(``BULLETIN_PROCESS_TRACKING=subreaper bulletin up`` sets the nodelet's), but none of the
secrets in :data:`SECRETS`: a child gets those only when it is given them, so a database URL
in the parent's environment never reaches a nodelet, or the workers that run users' code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from bulletin_core import tls


class ChildExited(RuntimeError):
    """A child exited while it was being waited for; ``returncode`` is its status."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


#: Settings that hold secrets: never inherited by a child (the gateway is given its
#: database URL; a nodelet reads its token from a file).
SECRETS = frozenset({"BULLETIN_DATABASE_URL", "BULLETIN_SUPERUSER_URL", "BULLETIN_TOKEN"})


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without :data:`SECRETS`, plus ``env``."""
    inherited = {k: v for k, v in os.environ.items() if k not in SECRETS}
    return {**inherited, **env}


def spawn(
    args: list[str],
    env: Mapping[str, str],
    *,
    python: str = sys.executable,
    log: Path | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``python args`` in its own session, its output appended to ``log`` if given."""
    out = open(log, "ab") if log is not None else None  # noqa: SIM115 (the child holds it)
    try:
        return subprocess.Popen(
            [python, *args],
            env=child_env(env),
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,
            cwd=cwd,
        )
    finally:
        if out is not None:
            out.close()


def options_args(options: Mapping[str, str]) -> list[str]:
    """``{"lease-s": "3"}`` as ``["--lease-s", "3"]``."""
    return [item for key, value in options.items() for item in (f"--{key}", value)]


def gateway_args(host: str, port: int, options: Mapping[str, str] = {}) -> list[str]:
    return ["-m", "gateway", "--host", host, "--port", str(port), *options_args(options)]


def nodelet_args(
    gateway_url: str, token_file: Path, name: str, options: Mapping[str, str] = {}
) -> list[str]:
    return [
        "-m",
        "nodelet",
        "--gateway",
        gateway_url,
        "--token-file",
        str(token_file),
        "--name",
        name,
        *options_args(options),
    ]


def healthy(url: str, verify: ssl.SSLContext | bool = True) -> bool:
    """Whether the gateway at ``url`` answers ``/healthz`` (over HTTPS, trusting what
    ``verify`` says: :func:`bulletin_core.tls.verify`)."""
    try:
        return httpx.get(f"{url}/healthz", timeout=1, verify=verify).status_code == 200
    except httpx.TransportError:
        return False


def wait_healthy(
    url: str, proc: subprocess.Popen[bytes], timeout: float = 60, ca: str = ""
) -> None:
    """Return once the gateway ``proc`` answers ``/healthz`` on ``url``; raise
    :class:`ChildExited` if it exits first, ``TimeoutError`` if it takes ``timeout``."""
    verify = tls.verify(ca)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ChildExited(
                f"the gateway exited with code {proc.returncode} while starting", proc.returncode
            )
        if healthy(url, verify):
            return
        time.sleep(0.05)
    raise TimeoutError(f"the gateway did not answer on {url} within {timeout:.0f}s")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15) -> int:
    """Stop ``proc`` with ``sig``; after ``timeout`` SIGKILL its whole process group.
    Returns its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode
