"""Fixtures of the integration tests that run calls as real Unix accounts."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import sdk
from bulletin_core import wire
from tests.accounts import Portable, traversable_dir
from tests.conftest import Cluster
from tests.integration.test_gateway_api import Http

SECRET = "nodelet-secret-8c41"


@dataclass
class Tenants:
    """A gateway and a multi-tenant nodelet, with two users who are Unix accounts."""

    cluster: Cluster
    tokens: dict[str, str]
    #: The node token, root-only (0600), in a directory every account can pass through.
    node_token: Path

    def be(self, user: str) -> sdk.Client:
        """Make ``user`` the sdk's default client (calls keep the client they started with)."""
        client = sdk.connect(self.cluster.url, self.tokens[user])
        client.use_shared_dir = False  # this process is root: its files are not the users'
        return client

    def http(self, user: str) -> Http:
        return Http(self.cluster.url, self.tokens[user])


@pytest.fixture
def tenants(
    gateway: Cluster, portable_python: Portable, unix_accounts: dict[str, int]
) -> Iterator[Tenants]:
    with traversable_dir("bulletin-node-") as secrets_dir, killed_after(unix_accounts):
        tokens = {name: gateway.add_user(name) for name in unix_accounts}
        gateway.start_nodelet(
            python=portable_python,
            token_dir=secrets_dir,
            # What a service is started with: none of it may reach a call.
            env={"SECRET_OF_THE_NODELET": SECRET, "BULLETIN_DATABASE_URL": gateway.database_url},
            **{"user-mapping": "same-name", "spare-workers": "2"},
        )
        yield Tenants(gateway, tokens, secrets_dir / "node-a.token")


@contextlib.contextmanager
def killed_after(accounts: Iterable[str]) -> Iterator[None]:
    """Kill every process of ``accounts`` afterwards: what a call left running (a process
    that left its group) must not outlive the test."""
    try:
        yield
    finally:
        for name in accounts:
            subprocess.run(["pkill", "-KILL", "-u", name], check=False)


def remote(fn: Any, *args: Any, timeout: float = 60) -> Any:
    """Run ``fn(*args)`` as the default client's user and return what it returned."""
    return sdk.function()(fn).spawn(*args).result(timeout=timeout)


def wait_until_running(call: sdk.Call[Any], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while call.status() != wire.State.RUNNING:
        assert time.monotonic() < deadline, f"{call.id} never started"
        time.sleep(0.05)
