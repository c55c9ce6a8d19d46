"""Calls run as their owner's Unix account on a node with a user mapping (the nodelet runs
as root): through a real cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import sdk
from tests.conftest import Cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a user mapping needs root")


def who() -> tuple[int, str]:
    import os

    return os.getuid(), os.environ["USER"]


def test_a_user_without_an_account_is_refused_clearly(gateway: Cluster, tmp_path: Path) -> None:
    mapping = tmp_path / "users"
    mapping.write_text("someone-else nobody\n")
    gateway.start_nodelet(**{"user-mapping": str(mapping)})
    sdk.connect(gateway.url, gateway.token)
    with pytest.raises(sdk.RemoteError, match="'alice' is not in this node's user mapping"):
        sdk.function()(who)()


def test_a_call_runs_as_its_owners_account(gateway: Cluster, tmp_path: Path) -> None:
    probe = subprocess.run(
        ["su", "-s", "/bin/sh", "nobody", "-c", f"{sys.executable} -c pass"],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"'nobody' cannot run this Python ({sys.executable}): {probe.stderr!r}")
    mapping = tmp_path / "users"
    mapping.write_text("alice nobody\n")
    gateway.start_nodelet(**{"user-mapping": str(mapping)})
    sdk.connect(gateway.url, gateway.token)
    uid, user = sdk.function()(who)()
    assert user == "nobody" and uid != 0
