"""The local-cluster harness (bulletin/local.py) that `bulletin up` and the tests share: what a
child inherits, how it is found healthy and stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bulletin import local


def test_a_child_inherits_settings_but_no_secret_it_is_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A database URL (a secret) in the parent's environment must not reach a nodelet, and
    # so the workers that run users' code; a setting meant for the children does.
    monkeypatch.setenv("BULLETIN_DATABASE_URL", "postgresql://bulletin:secret@db/bulletin")
    monkeypatch.setenv("BULLETIN_TOKEN", "bu_secret")
    monkeypatch.setenv("BULLETIN_PROCESS_TRACKING", "subreaper")
    monkeypatch.setenv("LANG", "C.UTF-8")
    env = local.child_env({"BULLETIN_LOG_LEVEL": "debug"})
    assert "BULLETIN_DATABASE_URL" not in env and "BULLETIN_TOKEN" not in env
    assert env["BULLETIN_PROCESS_TRACKING"] == "subreaper"
    assert env["BULLETIN_LOG_LEVEL"] == "debug" and env["LANG"] == "C.UTF-8"
    given = local.child_env({"BULLETIN_DATABASE_URL": "postgresql:///given"})
    assert given["BULLETIN_DATABASE_URL"] == "postgresql:///given"


def test_a_gateway_that_exits_while_starting_is_reported_with_its_status(
    tmp_path: Path,
) -> None:
    proc = local.spawn(["-c", "raise SystemExit(4)"], {}, log=tmp_path / "child.log")
    with pytest.raises(local.ChildExited) as info:
        local.wait_healthy("http://127.0.0.1:9", proc, timeout=30)
    assert info.value.returncode == 4


def test_stop_kills_the_group_of_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    proc = local.spawn(["-c", ignore], {}, log=tmp_path / "child.log")
    time.sleep(0.5)  # let it install its handler
    assert local.stop(proc, timeout=1) == -signal.SIGKILL


def test_options_become_arguments() -> None:
    args = local.gateway_args("127.0.0.1", 8420, {"lease-s": "3"})
    assert args == ["-m", "gateway", "--host", "127.0.0.1", "--port", "8420", "--lease-s", "3"]
    node = local.nodelet_args("http://h:1", Path("/t"), "n1", {"cpu-slots": "2"})
    assert node[-2:] == ["--cpu-slots", "2"] and node[:2] == ["-m", "nodelet"]
    helped = subprocess.run([sys.executable, *args[:2], "--help"], capture_output=True)
    assert helped.returncode == 0 and b"--lease-s" in helped.stdout
