"""The playbooks pass ansible-lint's production profile and Ansible's own syntax check."""

from __future__ import annotations

import os
import subprocess

from tests.deploy.rollout import BIN, PLAYBOOKS


def test_ansible_lint_production_profile_passes() -> None:
    result = subprocess.run(
        [str(BIN / "ansible-lint"), "--offline", "--profile", "production", "--nocolor"],
        cwd=PLAYBOOKS, capture_output=True, text=True,
        env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "NO_COLOR": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


def test_the_playbooks_pass_the_syntax_check() -> None:
    for playbook in ("site.yml", "remove-node.yml"):
        result = subprocess.run(
            [str(BIN / "ansible-playbook"), "--syntax-check", "-i", "inventory.example.yml",
             playbook],
            cwd=PLAYBOOKS, capture_output=True, text=True,
            env={**os.environ, "ANSIBLE_CONFIG": str(PLAYBOOKS / "ansible.cfg")},
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
