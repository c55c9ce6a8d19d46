"""Calls run as their owners' Unix accounts, and one user cannot reach another's work or the
node's secrets: written as the attacks, through a real cluster.

The nodelet runs as root with ``--user-mapping same-name`` from a Python every account can
run (tests/accounts.py); Bulletin users ``bt-alice`` and ``bt-bob`` are real Unix accounts.
Bob's calls try what a malicious user would; each test asserts the attack fails and
Alice's work is untouched. These never skip: CI runs as root and builds what they need.
"""

from __future__ import annotations

import pwd
from pathlib import Path
from typing import Any

import pytest

import sdk
from tests.accounts import Portable
from tests.conftest import Cluster
from tests.integration.conftest import SECRET, Tenants, remote, wait_until_running
from tests.integration.test_gateway_api import status

# --------------------------------------------------------------- run by the worker, as a user


def identity(paths: list[str]) -> dict[str, Any]:
    """Who the call runs as, what it inherited, and which of ``paths`` it can read."""
    import ctypes
    import os

    mask = os.umask(0)
    os.umask(mask)
    readable = {}
    for path in paths:
        try:
            with open(path, "rb") as file:
                readable[path] = file.read(64).decode(errors="replace")
        except OSError as exc:
            readable[path] = f"refused: {type(exc).__name__}"
    # The attack on its own process: make it dumpable again and read the environment it
    # was started with (as root, before it switched accounts), and the nodelet's.
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
    for path in ("/proc/self/environ", f"/proc/{os.getppid()}/environ"):
        try:
            with open(path, "rb") as file:
                readable[path] = file.read().decode(errors="replace")
        except OSError as exc:
            readable[path] = f"refused: {type(exc).__name__}"
    return {
        "ids": (os.getresuid(), os.getresgid(), sorted(os.getgroups())),
        "env": dict(os.environ),
        "umask": mask,
        "cwd": os.getcwd(),
        "readable": readable,
    }


def hold(seconds: float, secret: str) -> str:
    """Alice's call: keeps a secret in memory for a while, then returns it."""
    import time

    kept = secret * 10
    time.sleep(seconds)
    return kept[: len(secret)]


def go_after(owner: str) -> dict[str, str]:
    """Bob's call: find the other account's processes and try to read, trace or kill them.

    It looks for a while: the other call counts as running once its worker has it, a moment
    before that worker has switched to its owner's account."""
    import os
    import pwd
    import signal
    import time

    uid = pwd.getpwnam(owner).pw_uid
    tried: dict[str, str] = {}
    deadline = time.monotonic() + 10
    pids: list[int] = []
    while not pids and time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except OSError:
                continue
        time.sleep(0.05)
    for pid in pids:
        entry = str(pid)
        for what, attempt in (
            ("environ", lambda pid=pid: open(f"/proc/{pid}/environ", "rb").read()),  # noqa: SIM115
            ("mem", lambda pid=pid: open(f"/proc/{pid}/mem", "rb").read(1)),  # noqa: SIM115
            ("kill", lambda pid=pid: os.kill(pid, signal.SIGKILL)),
        ):
            try:
                attempt()
                tried[f"{entry}/{what}"] = "done"
            except OSError as exc:
                tried[f"{entry}/{what}"] = type(exc).__name__
    return tried


# ------------------------------------------------------------------------------------ tests


def test_a_call_runs_as_its_owner_with_a_minimal_environment(tenants: Tenants) -> None:
    tenants.be("bt-alice")
    probe = ["/etc/shadow", str(tenants.node_token), "/home/bt-bob/.profile"]
    seen = remote(identity, probe)
    alice = pwd.getpwnam("bt-alice")
    (ruid, euid, suid), (rgid, egid, sgid), groups = seen["ids"]
    assert (ruid, euid, suid) == (alice.pw_uid,) * 3  # no way back to root
    assert (rgid, egid, sgid) == (alice.pw_gid,) * 3
    assert 0 not in groups and alice.pw_gid in groups
    env = seen["env"]
    assert (env["HOME"], env["USER"], env["LOGNAME"]) == (alice.pw_dir, "bt-alice", "bt-alice")
    assert seen["umask"] == 0o077
    # Nothing of the nodelet's environment but the allowed few: no secret, no settings.
    assert not [k for k in env if k.startswith("BULLETIN_") and k != "BULLETIN_WARM_TORCH"]
    assert "SECRET_OF_THE_NODELET" not in env
    allowed = {"PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "HOME", "USER", "LOGNAME"}
    allowed |= {"CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES", "LANG", "LANGUAGE", "TZ"}
    assert {k for k in env if not k.startswith("LC_")} <= allowed, sorted(env)
    for path in probe:
        assert seen["readable"][path] == "refused: PermissionError", path
    # Not even in the memory of its own process, from before it switched accounts.
    assert SECRET not in seen["readable"]["/proc/self/environ"]
    assert "BULLETIN_DATABASE_URL" not in seen["readable"]["/proc/self/environ"]
    nodelet_environ = [v for k, v in seen["readable"].items() if k.endswith("/environ")][1]
    assert nodelet_environ == "refused: PermissionError"
    # Its working directory is its own, inside the attempt's.
    assert seen["cwd"].endswith("/out")


def test_a_user_cannot_read_trace_or_kill_another_users_running_call(tenants: Tenants) -> None:
    tenants.be("bt-alice")
    alices = sdk.function()(hold).spawn(4.0, "alices-secret")
    wait_until_running(alices)
    tenants.be("bt-bob")
    tried = remote(go_after, "bt-alice")
    assert tried, "Alice's worker was not found: the attack proved nothing"
    assert set(tried.values()) == {"PermissionError"}, tried
    assert alices.result(timeout=60) == "alices-secret"
    assert status(tenants.http("bt-alice"), alices.id).attempts == 1


def test_a_user_without_an_account_is_refused_clearly(
    gateway: Cluster, portable_python: Portable, tmp_path: Path
) -> None:
    mapping = tmp_path / "users"
    mapping.write_text("someone-else nobody\n")
    gateway.start_nodelet(python=portable_python, **{"user-mapping": str(mapping)})
    sdk.connect(gateway.url, gateway.token)
    with pytest.raises(sdk.RemoteError, match="'alice' is not in this node's user mapping"):
        remote(identity, [])


def test_a_mapping_node_refuses_to_start_with_a_python_other_accounts_cannot_run(
    gateway: Cluster,
) -> None:
    # The suite's own interpreter lives under /root (0700): a worker switched to a user's
    # account could not import anything more. The nodelet says so instead of serving.
    node = gateway.start_nodelet(**{"user-mapping": "same-name"})
    assert node.wait(30) == 1
    log = (gateway.dir / "node-a.log").read_text()
    assert "workers switch to their users' accounts, which cannot reach" in log
    assert "install Bulletin in a virtual environment every account can read" in log


# ------------------------------------------------------------------ single-tenant nodes


def forge(token_file: str, url: str, victim: str, ran: str) -> str:
    """Mallory's call on a node that runs calls as its own account: read the node token and
    complete another user's running call with a result of Mallory's choosing."""
    from pathlib import Path

    import httpx
    import msgspec

    from bulletin_core import wire

    Path(ran).touch()
    token = Path(token_file).read_text().strip()
    forged = wire.CompleteRequest(epoch=1, state="succeeded", result=b"forged")
    r = httpx.post(
        f"{url}/v1/node/invocations/{victim}/complete",
        content=msgspec.json.encode(forged),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    return f"forged: {r.status_code}"


def test_a_single_tenant_node_runs_only_trusted_users_calls(
    gateway: Cluster, tmp_path: Path
) -> None:
    admin_token = gateway.add_user("lab-admin", is_admin=True)
    mallory_token = gateway.add_user("mallory")
    token_file = gateway.node_token("node-a")
    # No user mapping and no --trusted-users: only administrators' calls run here.
    gateway.start_nodelet(**{"trusted-users": ""})
    sdk.connect(gateway.url, admin_token)
    admins = sdk.function()(hold).spawn(3.0, "the admin's result")
    wait_until_running(admins)
    sdk.connect(gateway.url, mallory_token)
    ran = tmp_path / "mallory-ran"
    attack = sdk.function()(forge).spawn(str(token_file), gateway.url, admins.id, str(ran))
    with pytest.raises(sdk.RemoteError) as refused:
        attack.result(timeout=60)
    message = str(refused.value)
    assert "single-tenant" in message and "'mallory'" in message
    assert "--user-mapping same-name" in message and "--trusted-users" in message
    assert not ran.exists(), "Mallory's code ran on the single-tenant node"
    assert admins.result(timeout=60) == "the admin's result"
    # The fixtures' user alice is no administrator either.
    sdk.connect(gateway.url, gateway.token)
    with pytest.raises(sdk.RemoteError, match="not 'alice''s"):
        remote(hold, 0.0, "x")


@pytest.mark.parametrize("name", ["../etc", "a/b", "", ".hidden", "x" * 65, "al ice", "é"])
def test_a_user_name_that_could_name_another_path_is_refused(database_url: str, name: str) -> None:
    # A user name names a directory of the shared directory and, on nodes mapping same-name,
    # a Unix account: nothing else may be made of it.
    import asyncio

    from bulletin import admin

    with pytest.raises(admin.AdminError, match="is not one: use letters, digits"):
        asyncio.run(admin.add_user(database_url, name))
