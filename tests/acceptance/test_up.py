"""`bulletin up` as a user runs it: a real single-machine cluster, a call through the sdk
from a separate Python process, a clean stop, and a second start on the same data."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from bulletin.pgserver import EmbeddedPostgres
from tests.conftest import ROOT, wait_until

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
    python: str, state: Path, log: Path, cwd: Path = ROOT, prefix: list[str] | None = None
) -> subprocess.Popen[bytes]:
    command = prefix or [python, "-m", "bulletin", "up"]
    proc = subprocess.Popen(
        [*command, "--state-dir", str(state), "--port", "0", "--fake-gpus", "1"],
        stdout=open(log, "wb"),  # noqa: SIM115 (the child keeps it)
        stderr=subprocess.STDOUT,
        cwd=cwd,
    )
    wait_until(
        lambda: (state / "client.toml").exists() or proc.poll() is not None, 300, "client.toml"
    )
    assert proc.poll() is None, log.read_text()
    wait_until(lambda: "Press Ctrl-C" in log.read_text(), 60, "the up banner")
    return proc


def run_call(python: str, state: Path, *args: str) -> str:
    env = {**os.environ, "BULLETIN_CONFIG": str(state / "client.toml")}
    env.pop("BULLETIN_URL", None)
    done = subprocess.run(
        [python, "-c", CALL, *args], env=env, capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


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


def test_up_serves_calls_stops_cleanly_and_reuses_its_data(tmp_path: Path) -> None:
    state, log = tmp_path / "state", tmp_path / "up.log"
    proc = start_up(sys.executable, state, log)
    try:
        out = run_call(sys.executable, state)
        assert "working on 21" in out and "result: 42" in out
        assert "big: 6291456" in out and f"shared: {state / 'shared'}" in out
        call_id = out.split("id: ", 1)[1].split()[0]
        stop_and_check_nothing_is_left(proc, state)
        assert "Bulletin stopped." in log.read_text()
        proc = start_up(sys.executable, state, log)
        # Same data, same token: the earlier call is still there, fetched by id.
        assert "again: 42" in run_call(sys.executable, state, call_id)
        stop_and_check_nothing_is_left(proc, state)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_readme_up_command_works_on_a_fresh_clone_in_a_fresh_venv(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
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
    state, log = tmp_path / "state", tmp_path / "up.log"
    proc = start_up("", state, log, cwd=clone, prefix=["./scripts/up"])
    try:
        python = str(clone / ".venv" / "bin" / "python")
        assert "result: 42" in run_call(python, state)
        stop_and_check_nothing_is_left(proc, state)
    finally:
        if proc.poll() is None:
            proc.kill()
