"""Run the real playbook (deploy/ansible) against the booted test hosts of :mod:`hosts`.

The hosts install Bulletin from a wheelhouse built here from this checkout (``pip wheel``;
another version is the same tree with another version number), so what the playbook
installs is the code under test and the hosts need no package index.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bulletin.pgserver import free_port
from tests.deploy.hosts import SHARED_MOUNT, Host

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOKS = ROOT / "deploy" / "ansible"
BIN = Path(sys.executable).parent
#: The users and groups the test inventory asks for (local accounts, fixed uids).
USERS = {
    "alice": {"group": "vision", "uid": 2101},
    "bob": {"group": "nlp", "uid": 2102},
    "carol": {"group": "vision", "admin": True, "uid": 2103},
}
GROUPS = {"vision": {"guaranteed": 2, "borrow_limit": 4}, "nlp": {"guaranteed": 1}}


def wheelhouse(where: Path, version: str) -> Path:
    """A directory of wheels: Bulletin at ``version`` built from this checkout, and its
    dependencies."""
    source = where / f"src-{version}"
    if source.exists():
        shutil.rmtree(source)
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if not (ROOT / name).is_file() or name.startswith(("tests/", "bench/", "docs/")):
            continue
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name, follow_symlinks=True)
    project = source / "pyproject.toml"
    text, count = re.subn(
        r'(?m)^version = "[^"]*"$', f'version = "{version}"', project.read_text()
    )
    assert count == 1, "pyproject.toml has no version line"
    project.write_text(text)
    wheels = where / "wheelhouse"
    wheels.mkdir(exist_ok=True)
    subprocess.run(
        [str(BIN / "python"), "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
         "--wheel-dir", str(wheels), str(source)],
        check=True,
    )  # fmt: skip
    shutil.rmtree(source)
    return wheels


@dataclass
class Site:
    """The test cluster's inventory and where its secrets land on this (the control) host."""

    where: Path
    hosts: Mapping[str, Host]
    key: Path
    db_port: int
    gateway_ports: tuple[int, int]
    #: The first run of site.yml, which the tests' fixture makes.
    first: subprocess.CompletedProcess[str] | None = None

    @property
    def inventory(self) -> Path:
        return self.where / "inventory.yml"

    @property
    def tokens(self) -> Path:
        return self.where / "tokens"

    @property
    def pki(self) -> Path:
        return self.where / "pki"

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.gateway_ports[0]}"

    def write_inventory(self, version: str, **extra: Any) -> None:
        def host(name: str) -> dict[str, Any]:
            return {name: {"ansible_port": self.hosts[name].ssh_port}}

        variables: dict[str, Any] = {
            "ansible_user": "root",
            "ansible_host": "127.0.0.1",
            "ansible_ssh_private_key_file": str(self.key),
            "ansible_ssh_common_args": (
                "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
            ),
            "bulletin_version": version,
            "bulletin_wheelhouse": str(self.where / "wheelhouse"),
            # The base image's package lists are as old as the image: never refresh them.
            "bulletin_apt_cache_valid_time": 10**9,
            "bulletin_db_port": self.db_port,
            "bulletin_db_listen_addresses": "127.0.0.1",
            "bulletin_gateway_listen": "127.0.0.1",
            "bulletin_gateway_ports": list(self.gateway_ports),
            "bulletin_shared_dir": SHARED_MOUNT,
            "bulletin_fake_gpus": 2,
            "bulletin_pki_dir": str(self.pki),
            "bulletin_token_dir": str(self.tokens),
            "bulletin_groups": GROUPS,
            "bulletin_users": USERS,
            "bulletin_create_accounts": True,
            "bulletin_drain_timeout_s": 120,
            **extra,
        }
        names = [n for n in self.hosts if n != "head"]
        inventory = {
            "all": {
                "vars": variables,
                "children": {
                    "bulletin_database": {"hosts": host("head")},
                    "bulletin_gateways": {"hosts": host("head")},
                    "bulletin_nodes": {"hosts": {k: v for n in names for k, v in host(n).items()}},
                },
            }
        }
        self.inventory.write_text(yaml.safe_dump(inventory, sort_keys=False))

    def play(
        self, playbook: str, *args: str, timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        """Run ``playbook`` with the real ansible-playbook; its output is in the result."""
        env = {
            **os.environ,
            "ANSIBLE_CONFIG": str(PLAYBOOKS / "ansible.cfg"),
            "ANSIBLE_FORCE_COLOR": "0",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_LOCAL_TEMP": str(self.where / "ansible-tmp"),
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.where / "cp"),
            "PATH": f"{BIN}:{os.environ['PATH']}",
        }
        env.pop("ANSIBLE_STDOUT_CALLBACK", None)
        return subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", str(self.inventory), playbook, *args],
            cwd=PLAYBOOKS, env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip


def make_site(where: Path, hosts: Sequence[Host], key: Path) -> Site:
    return Site(
        where=where,
        hosts={h.name: h for h in hosts},
        key=key,
        db_port=free_port(),
        gateway_ports=(free_port(), free_port()),
    )


RECAP = re.compile(
    r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.MULTILINE
)


def recap(output: str) -> dict[str, dict[str, int]]:
    """The PLAY RECAP: per host, its ok/changed/unreachable/failed counts."""
    return {
        m[1]: {"ok": int(m[2]), "changed": int(m[3]), "unreachable": int(m[4]), "failed": int(m[5])}
        for m in RECAP.finditer(output)
    }


def changed_tasks(output: str) -> list[str]:
    """The tasks that reported a change, with their hosts (for a failure message)."""
    task = ""
    found = []
    for line in output.splitlines():
        if line.startswith("TASK ["):
            task = line
        elif line.startswith("changed:"):
            found.append(f"{task} {line}")
    return found


def dump(result: subprocess.CompletedProcess[str]) -> str:
    """The end of a play's output, for a failure message."""
    return f"exit status {result.returncode}\n{result.stdout[-8000:]}\n{result.stderr[-4000:]}"
