"""Real Unix accounts, and a Python every account can run, for tests of calls that run as
their owners and of one user attacking another.

The suite runs as root from an interpreter under ``/root`` (0700 here): a worker that
switched to a user's account could not import anything more from it. So these tests run
the nodelet from a virtual environment built from Debian's ``/usr/bin/python3.11`` under
``/opt`` (made once per set of dependency versions, and reused), with a copy of this
checkout's packages on its ``PYTHONPATH`` (made afresh per test session), both readable by
every account. The accounts are made with ``useradd`` when missing. Nothing here skips:
a test that needs it fails, saying why, when it cannot be set up.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = Path("/opt/bulletin-test")
#: An interpreter every account may run (the default one lives under /root).
SYSTEM_PYTHON = "/usr/bin/python3.11"
#: This checkout's packages: every top-level directory with an __init__.py but the tests'
#: and the benchmarks'.
PACKAGES = tuple(
    sorted(
        p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name not in ("tests", "bench")
    )
)


class SetupFailed(RuntimeError):
    """The accounts or the portable Python cannot be set up on this machine."""


@dataclass(frozen=True)
class Portable:
    """A Python any account can run, and the PYTHONPATH with this checkout's packages."""

    python: str
    pythonpath: str

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": self.pythonpath}

    def run_as(
        self, account: str, args: list[str], *, env: dict[str, str], timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run ``python ARGS`` as ``account`` (its own uid, gid and groups) with only ``env``
        and this Python's path."""
        command = ["runuser", "-u", account, "--", "env", "-i"]
        command += [f"{k}={v}" for k, v in {**env, **self.env()}.items()]
        return subprocess.run(
            [*command, self.python, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/",
            check=False,
        )


def requirements() -> list[str]:
    """The runtime dependencies, pinned to the versions installed here: pickles must cross
    between this interpreter and that one (cloudpickle, msgspec alike on both sides)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = []
    for requirement in project["dependencies"]:
        name = requirement.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip()
        pinned.append(f"{name}=={metadata.version(name)}")
    return sorted(pinned)


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SetupFailed(f"{what} failed ({' '.join(command)}): {done.stderr[-2000:]}")


def ensure_venv() -> Path:
    """The virtual environment with the pinned dependencies, made if missing."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        raise SetupFailed(f"{SYSTEM_PYTHON} is missing: apt-get install python3.11-venv")
    pinned = requirements()
    key = hashlib.sha256("\n".join([SYSTEM_PYTHON, *pinned]).encode()).hexdigest()[:12]
    venv = BASE / f"venv-{key}"
    if (venv / "ready").exists():
        return venv
    BASE.mkdir(parents=True, exist_ok=True)
    BASE.chmod(0o755)
    building = Path(tempfile.mkdtemp(prefix="venv-building-", dir=BASE))
    try:
        _run([SYSTEM_PYTHON, "-m", "venv", str(building)], "making a virtual environment")
        pip = [str(building / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        _run([*pip, "--disable-pip-version-check", *pinned], "installing the dependencies")
        # A venv records its own path in its scripts; only the python symlink is used here.
        (building / "ready").write_text("\n".join(pinned) + "\n")
        building.chmod(0o755)
        with contextlib.suppress(OSError):  # another session made it meanwhile: use theirs
            building.rename(venv)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    if not (venv / "ready").exists():
        raise SetupFailed(f"{venv} could not be made")
    return venv


def copy_source() -> Path:
    """A copy of this checkout's packages that every account can read."""
    target = BASE / f"src-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, target / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    for directory, _, files in os.walk(target):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)
    return target


def portable() -> tuple[Portable, Path]:
    """The portable Python and the source copy (to remove after the session)."""
    if os.geteuid() != 0:
        raise SetupFailed(
            "tests of calls that run as their owners' accounts need root (CI runs as root); "
            f"this runs as uid {os.geteuid()}"
        )
    venv = ensure_venv()
    source = copy_source()
    return Portable(str(venv / "bin" / "python"), str(source)), source


def ensure_account(name: str) -> pwd.struct_passwd:
    """Unix account ``name`` with a private home, made if missing."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    home = Path("/home") / name
    _run(
        ["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/sh", name],
        f"making account {name}",
    )
    home.chmod(0o700)
    return pwd.getpwnam(name)


@contextlib.contextmanager
def traversable_dir(prefix: str) -> Iterator[Path]:
    """A new directory under /tmp that every account (a call's, PostgreSQL's system account)
    can pass through but not list, removed afterwards: pytest's own temporary directories
    live under /tmp/pytest-of-root, which is 0700, and nothing widens it."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        path.chmod(0o711)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


ACCOUNTS = ("bt-alice", "bt-bob")


def main() -> None:
    """``python -m tests.accounts`` (scripts/test, as root): make the accounts and the
    portable Python before the tests run, so that a failure to install shows as such."""
    for name in ACCOUNTS:
        ensure_account(name)
    print(f"accounts {', '.join(ACCOUNTS)}; portable Python in {ensure_venv()}")


if __name__ == "__main__":
    sys.exit(main())
