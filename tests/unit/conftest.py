"""Fixtures of the unit tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator

import pytest


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts (each leading its own session); killed afterwards, with
    their process groups."""
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
