"""The rollout playbook end to end: three booted Debian hosts (systemd-nspawn, a real
systemd each), the real ansible-playbook over SSH, and calls from outside as the users it
made. Needs root, debootstrap and systemd-nspawn (``.ci/run`` installs them); fails, never
skips, without them.

The hosts are one head (PostgreSQL, two gateway replicas) and two GPU nodes with fake GPUs,
sharing one directory as the lab's NAS. The tests run in order on one cluster: roll out,
call, kill a gateway, re-run (nothing changes), upgrade during a long call, remove a node.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import sdk
from tests.deploy import hosts, rollout

pytestmark = pytest.mark.deploy
V1 = "0.1.0"
V2 = "0.1.0+upgrade"


@pytest.fixture(scope="module")
def site() -> Iterator[rollout.Site]:
    if os.geteuid() != 0:
        pytest.fail("the rollout tests boot containers: run them as root (CI does)")
    for tool in ("debootstrap", "systemd-nspawn", "ssh"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: apt-get install debootstrap systemd-container ssh")
    where = Path(tempfile.mkdtemp(prefix="bulletin-deploy-", dir="/var/tmp"))
    try:
        with hosts.hosts(("head", "node1", "node2"), where) as (booted, key, _shared):
            site = rollout.make_site(where, booted, key)
            rollout.wheelhouse(where, V1)
            site.write_inventory(V1)
            site.first = site.play("site.yml")
            yield site
    finally:
        shutil.rmtree(where, ignore_errors=True)


def token(site: rollout.Site, user: str) -> str:
    return (site.tokens / f"{user}.token").read_text().strip()


def connect(site: rollout.Site, user: str) -> None:
    sdk.connect(site.url, token(site, user), ca=site.pki / "ca.pem")


def ssh(site: rollout.Site, host: str, command: str, **kwargs: Any) -> str:
    return site.hosts[host].ssh(command, key=site.key, **kwargs).stdout


def test_site_yml_installs_and_starts_everything(site: rollout.Site) -> None:
    first = site.first
    assert first is not None
    assert first.returncode == 0, rollout.dump(first)
    counts = rollout.recap(first.stdout)
    assert set(counts) >= {"head", "node1", "node2"}
    assert all(c["failed"] == 0 and c["unreachable"] == 0 for c in counts.values()), counts
    assert f"Bulletin is up: {site.url}" in first.stdout
    head_units = [f"bulletin-gateway@{port}" for port in site.gateway_ports]
    head_units += ["postgresql@15-main", "bulletin-backup.timer"]
    assert ssh(site, "head", "systemctl is-active " + " ".join(head_units)).split() == [
        "active"
    ] * len(head_units)
    for node in ("node1", "node2"):
        assert ssh(site, node, "systemctl is-active bulletin-nodelet").strip() == "active"
        assert ssh(site, node, "systemctl is-enabled bulletin-nodelet").strip() == "enabled"
        # The node token is root's alone; the nodelet runs as root, multi-tenant.
        mode = ssh(site, node, "stat -c '%a %U' /etc/bulletin/private /etc/bulletin/private/*")
        assert mode.split() == ["700", "root"] + ["600", "root"] * 2
        env = ssh(site, node, "cat /etc/bulletin/private/nodelet.env")
        assert "BULLETIN_USER_MAPPING=same-name" in env
        assert "BULLETIN_CA_FILE=/etc/bulletin/ca.pem" in env
        assert site.url in env
    gateway_env = ssh(site, "head", "stat -c '%a %U' /etc/bulletin/private/gateway.env")
    assert gateway_env.split() == ["600", "root"]
    assert ssh(site, "head", "stat -c '%a %U' /var/lib/postgresql/bulletin.password").split() == [
        "600",
        "postgres",
    ]
    # pg_hba.conf admits Bulletin's role from the gateway hosts only (and nothing else).
    hba = [
        line.split()
        for line in ssh(site, "head", "cat /etc/postgresql/15/main/pg_hba.conf").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert hba == [
        ["local", "all", "postgres", "peer"],
        ["host", "bulletin", "bulletin", "127.0.0.1/32", "scram-sha-256"],
    ]
    # Every user's token is on the control host, root-only, and never in the play's log.
    for user in rollout.USERS:
        for name in (f"{user}.token", f"{user}.client.toml"):
            info = (site.tokens / name).stat()
            assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == 0, name
        assert token(site, user) not in first.stdout + first.stderr
    password = ssh(site, "head", "cat /var/lib/postgresql/bulletin.password").strip()
    assert password and password not in first.stdout + first.stderr
    # bulletin doctor ran last on every host and found nothing wrong, the NAS included.
    assert first.stdout.count("this node is fit to serve") == 2
    assert first.stdout.count("this head is fit to serve") == 1
    assert first.stdout.count(f"OK    shared dir: {hosts.SHARED_MOUNT} is mounted here") == 2


def probe() -> dict[str, Any]:
    """Runs on a node as the caller's account: who it is, and what it may not read."""
    import os as os_
    import pwd as pwd_
    import socket as socket_

    tried = {}
    shared = "/srv/bulletin-shared/bulletin/users"
    for what, path in {
        "node token": "/etc/bulletin/private/node.token",
        "nodelet env": "/etc/bulletin/private/nodelet.env",
        "bob's dir": f"{shared}/bob",
        "users dir": shared,
    }.items():
        try:
            if os_.path.isdir(path):
                os_.listdir(path)
            else:
                with open(path, "rb") as file:
                    file.read()
            tried[what] = "read"
        except OSError as exc:
            tried[what] = type(exc).__name__
    own = f"{shared}/{pwd_.getpwuid(os_.getuid()).pw_name}"
    info = os_.stat(own)
    return {
        "uid": os_.getuid(),
        "name": pwd_.getpwuid(os_.getuid()).pw_name,
        "host": socket_.gethostname(),
        "tried": tried,
        "own dir": (info.st_uid, oct(info.st_mode & 0o7777)),
    }


def test_a_call_runs_as_its_owners_account_over_tls(
    site: rollout.Site, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The client.toml the playbook wrote for alice, with the CA where it tells her to put it.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".config" / "bulletin").mkdir(parents=True)
    shutil.copy(site.pki / "ca.pem", tmp_path / ".config" / "bulletin" / "ca.pem")
    sdk.connect(config=site.tokens / "alice.client.toml")
    remote = sdk.function(gpus=1)(probe)
    result = remote()
    alice = rollout.USERS["alice"]["uid"]
    assert result["uid"] == alice and result["name"] == "alice"
    assert result["host"] in ("node1", "node2")
    assert result["own dir"] == (alice, "0o700")
    assert result["tried"] == {
        "node token": "PermissionError",
        "nodelet env": "PermissionError",
        "bob's dir": "PermissionError",
        "users dir": "PermissionError",
    }
    # bob's calls run as bob.
    connect(site, "bob")
    assert sdk.function(gpus=0)(probe)()["name"] == "bob"
    # Over plain HTTP the gateway does not answer: it serves TLS only.
    with pytest.raises(httpx.HTTPError):
        httpx.get(site.url.replace("https://", "http://") + "/healthz", timeout=5)


def test_systemd_restarts_a_gateway_killed_with_sigkill(site: rollout.Site) -> None:
    unit = f"bulletin-gateway@{site.gateway_ports[0]}"
    before = ssh(site, "head", f"systemctl show -p MainPID --value {unit}").strip()
    ssh(site, "head", f"kill -KILL {before}")
    deadline = time.monotonic() + 60
    while True:
        now = ssh(site, "head", f"systemctl show -p MainPID --value {unit}").strip()
        try:
            healthy = httpx.get(f"{site.url}/healthz", verify=str(site.pki / "ca.pem"), timeout=2)
            if now not in ("0", before) and healthy.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{unit} was not restarted ({now})"
        time.sleep(0.5)
    connect(site, "alice")
    assert sdk.function(gpus=0)(probe)()["name"] == "alice"


def test_a_second_run_changes_nothing_and_follows_no_users_link(site: rollout.Site) -> None:
    # carol swaps her directory of the NAS for a link to a directory root uses: a play that
    # made users' directories as root would give it to her (and root's PATH with it).
    carol = f"{hosts.SHARED_MOUNT}/bulletin/users/carol"
    swap = f"rmdir {carol} && ln -s /usr/local/sbin {carol}"
    ssh(site, "node1", f"runuser -u carol -- sh -c '{swap}'")
    again = site.play("site.yml")
    assert again.returncode == 0, rollout.dump(again)
    changed = {host: c["changed"] for host, c in rollout.recap(again.stdout).items()}
    assert changed and set(changed.values()) == {0}, rollout.changed_tasks(again.stdout)
    for node in ("node1", "node2"):
        assert ssh(site, node, "stat -c '%a %U' /usr/local/sbin").split() == ["755", "root"]


def handed_back_once(marker: str) -> str:
    """The first run leaves a mark and runs until it is stopped; the next one returns."""
    import os as os_
    import socket as socket_
    import time as time_

    if os_.path.exists(marker):
        return f"run again on {socket_.gethostname()}"
    with open(marker, "w"):
        pass
    time_.sleep(900)
    return "never stopped"


def quick() -> str:
    import socket as socket_

    return f"ran on {socket_.gethostname()}"


def test_an_upgrade_during_a_long_call_loses_nothing(site: rollout.Site) -> None:
    rollout.wheelhouse(site.where, V2)
    # A drain that waits 8 s: the long call is still running then, so the upgrade hands it
    # back, and it runs again elsewhere; with no retries to spend, that must not spend one.
    site.write_inventory(V2, bulletin_drain_timeout_s=8)
    connect(site, "alice")
    marker = f"{hosts.SHARED_MOUNT}/bulletin/users/alice/upgrade-marker"
    long = sdk.function(gpus=1, max_retries=0)(handed_back_once).spawn(marker)
    deadline = time.monotonic() + 60
    while long.status() != "running":
        assert time.monotonic() < deadline, long.status()
        time.sleep(0.2)
    outcome: dict[str, Any] = {}

    def upgrade() -> None:
        outcome["play"] = site.play("site.yml")

    player = threading.Thread(target=upgrade)
    player.start()
    time.sleep(5)  # the play is installing, migrating, restarting gateways by now
    submitted_during = sdk.function(gpus=1, max_retries=0)(quick).spawn()
    player.join()
    play = outcome["play"]
    assert play.returncode == 0, rollout.dump(play)
    assert long.result(timeout=120).startswith("run again on node")
    assert submitted_during.result(timeout=120).startswith("ran on node")
    for node in ("node1", "node2"):
        pid = ssh(site, node, "systemctl show -p MainPID --value bulletin-nodelet").strip()
        assert f"/venvs/{V2}/" in ssh(site, node, f"tr '\\0' ' ' < /proc/{pid}/cmdline")
    listing = ssh(site, "head", "bulletin-admin node list")
    assert listing.count("in service") == 2, listing  # drained for the upgrade, then undrained
    assert "0 GPUs" not in listing


def test_a_node_without_a_usable_gpu_fails_the_play_saying_what_to_do(site: rollout.Site) -> None:
    # The test hosts have no NVIDIA driver: asked for real GPUs, the play stops there.
    refused = site.play(
        "site.yml", "-e", "bulletin_fake_gpus=0",
        "--start-at-task", "Check that the NVIDIA driver and NVML work",
    )  # fmt: skip
    assert refused.returncode != 0
    assert "has no usable NVIDIA GPU" in refused.stdout
    assert "Install the NVIDIA driver" in refused.stdout
    env = ssh(site, "node1", "cat /etc/bulletin/private/nodelet.env")
    assert "BULLETIN_FAKE_GPUS=2" in env, "nothing of the node was changed"


def test_a_shared_directory_others_may_write_to_is_refused(site: rollout.Site) -> None:
    # Whoever may rename entries of the NAS root may swap bulletin/ for a directory of their
    # own: the play refuses to trust, or write into, such a root.
    shared = site.where / "shared"
    shared.chmod(0o777)
    try:
        refused = site.play("site.yml", "--start-at-task", "Check the shared directory")
    finally:
        shared.chmod(0o755)
    assert refused.returncode != 0
    assert "may be changed by other accounts" in refused.stdout
    assert ssh(site, "head", f"stat -c '%a %U' {hosts.SHARED_MOUNT}/bulletin").split() == [
        "755",
        "bulletin",
    ]


def test_remove_node_yml_drains_stops_and_deregisters_a_node(site: rollout.Site) -> None:
    removed = site.play("remove-node.yml", "-e", "bulletin_remove_node=node2")
    assert removed.returncode == 0, rollout.dump(removed)
    state = ssh(site, "node2", "systemctl is-active bulletin-nodelet; systemctl is-enabled "
                "bulletin-nodelet", check=False)
    assert state.split() == ["inactive", "disabled"]
    listing = ssh(site, "head", "bulletin-admin node list")
    assert "node1" in listing and "node2" not in listing
    connect(site, "alice")
    assert sdk.function(gpus=1)(probe)()["host"] == "node1"



def test_a_play_without_the_clusters_pki_dir_refuses_to_mint_another_ca(
    site: rollout.Site,
) -> None:
    # Another admin's checkout, or a lost pki/: a new CA would cut every node and user off.
    elsewhere = site.where / "other-pki"
    site.write_inventory(V2, bulletin_pki_dir=str(elsewhere))
    refused = site.play("site.yml")
    assert refused.returncode != 0
    assert "Refuse to replace the cluster's CA" in refused.stdout
    assert "copy its pki/ directory here" in refused.stdout
    assert not (elsewhere / "ca.pem").exists()
    ours = hashlib.sha256((site.pki / "ca.pem").read_bytes()).hexdigest()
    for host in ("head", "node1"):
        assert ssh(site, host, "sha256sum /etc/bulletin/ca.pem").split()[0] == ours
    site.write_inventory(V2)
