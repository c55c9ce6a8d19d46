"""The README's registered-function example, run as written: the Python block registers
the function through the sdk, and each ``curl`` command of the shell block runs against a
real cluster (only the address is changed to the test gateway's)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Any

import pytest

import sdk
from tests.conftest import ROOT, Cluster

SECTION = "## Registered functions"


def blocks() -> tuple[str, list[str]]:
    """The section's Python block, and its shell commands (continuations joined)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", 1)]
    python = re.search(r"```python\n(.*?)```", section, re.S)
    shell = re.search(r"```bash\n(.*?)```", section, re.S)
    assert python and shell
    commands = [
        line.strip()
        for line in shell.group(1).replace("\\\n", " ").splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    return python.group(1), commands


def run(command: str, cluster: Cluster, **env: str) -> str:
    command = command.replace("http://127.0.0.1:8420", cluster.url)
    done = subprocess.run(
        ["bash", "-c", command],
        env={**os.environ, "TOKEN": cluster.token, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


@pytest.mark.skipif(not os.path.exists("/usr/bin/curl"), reason="curl is not installed")
def test_the_readme_registers_by_sdk_and_invokes_polls_and_streams_with_curl(
    cluster: Cluster,
) -> None:
    python, commands = blocks()
    namespace: dict[str, Any] = {"__name__": "notebook", "sdk": sdk}
    exec(compile(python, "README.md", "exec"), namespace)
    [embed] = sdk.functions()
    assert embed.name == "embed" and embed.visibility == "group"

    assert commands[0].startswith("H=")
    header, invoke_wait, invoke_async, get, logs, shared = commands
    prefix = header + "; "
    result = json.loads(run(prefix + invoke_wait, cluster))
    assert result["state"] == "succeeded" and result["result_json"] == {"lengths": [2, 6]}

    location = run(prefix + invoke_async, cluster)
    match = re.search(r"/v1/invocations/([0-9a-f-]{36})", location, re.I)
    assert match, location
    invocation_id = match.group(1)
    got = json.loads(run(prefix + get, cluster, ID=invocation_id))
    assert got["id"] == invocation_id and "timeline" in got
    stream = run(prefix + logs, cluster, ID=invocation_id)
    assert "event: end" in stream and "succeeded" in stream

    old = json.loads(run(prefix + shared, cluster, V=embed.version))
    assert old["function_version"] == embed.version and old["result_json"] == {"lengths": [1]}
