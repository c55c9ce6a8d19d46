"""A test may skip only for hardware these machines lack: any other skip fails the run, and
every run lists its skips at the end (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, reason: str) -> subprocess.CompletedProcess[str]:
    test = tmp_path / "test_skipping.py"
    test.write_text(
        "import pytest\n\n"
        "def test_passes():\n    pass\n\n"
        f"def test_skips():\n    pytest.skip({reason!r})\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", str(test)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def test_a_skip_for_want_of_an_account_fails_the_run(tmp_path: Path) -> None:
    done = run(tmp_path, "'nobody' cannot run this Python")
    assert done.returncode == 1, done.stdout
    assert "NOT ALLOWED" in done.stdout and "test_skips" in done.stdout


def test_a_skip_for_want_of_cuda_is_listed_and_allowed(tmp_path: Path) -> None:
    done = run(tmp_path, "needs CUDA and a CUDA torch")
    assert done.returncode == 0, done.stdout
    assert "skipped tests: 1" in done.stdout and "ok          " in done.stdout
