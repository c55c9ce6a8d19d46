"""The fault suite's GPU watch (tests/faults.py) sees a GPU held by two live processes."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults import History


def test_a_gpu_held_by_two_live_processes_fails_the_watch(tmp_path: Path) -> None:
    history = History(tmp_path)
    other = subprocess.Popen(["sleep", "30"])
    try:
        watching = history.gpus_never_shared(every_s=0.01)
        with pytest.raises(AssertionError, match="a GPU held by two live attempts"), watching:
            (tmp_path / "gpus").write_text(f"{os.getpid()} node-a 0\n{other.pid} node-a 0\n")
            time.sleep(0.1)
    finally:
        other.kill()
        other.wait()


def test_the_same_gpu_of_two_nodes_or_after_a_death_is_not_shared(tmp_path: Path) -> None:
    history = History(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    other = subprocess.Popen(["sleep", "30"])
    try:
        with history.gpus_never_shared(every_s=0.01):
            (tmp_path / "gpus").write_text(
                f"{dead.pid} node-a 0\n{os.getpid()} node-a 0\n{other.pid} node-b 0\n"
            )
            time.sleep(0.1)
    finally:
        other.kill()
        other.wait()
