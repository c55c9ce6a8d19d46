"""``bulletin doctor``, run as the admin's playbook runs it: the real command in a subprocess,
against a real gateway (plain HTTP on loopback, and HTTPS with a shared directory), real
node tokens and a real PostgreSQL. Only the GPUs are fake, where a test asks for them."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from bulletin.pgserver import EmbeddedPostgres, free_port
from gateway import db
from tests.conftest import Cluster
from tests.integration import test_tls

BULLETIN = str(Path(sys.executable).parent / "bulletin")


@dataclass
class Run:
    returncode: int
    output: str

    def line(self, start: str) -> str:
        """The one output line that starts with ``start``."""
        found = [line for line in self.output.splitlines() if line.startswith(start)]
        assert len(found) == 1, f"no single line starting {start!r} in:\n{self.output}"
        return found[0]


def doctor(*args: str, env: dict[str, str] | None = None, files: Sequence[Path] = ()) -> Run:
    command = [BULLETIN, "doctor", *args]
    for path in files:
        command += ["--env-file", str(path)]
    done = subprocess.run(
        command,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return Run(done.returncode, done.stdout + done.stderr)


def env_file(path: Path, values: dict[str, str]) -> Path:
    """``values`` as a systemd EnvironmentFile, with a comment and quotes as admins write it."""
    lines = ["# written by the playbook"]
    lines += [f'{key}="{value}"' for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Node:
    """A node's settings for the doctor: an env file of them, and its token."""

    dir: Path
    token_file: Path
    settings: dict[str, str]

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def env_file(self, **more: str) -> Path:
        return env_file(self.dir / "nodelet.env", {**self.settings, **more})


def node_of(cluster: Cluster, directory: Path, name: str) -> Node:
    token_file = cluster.node_token(name, directory)
    settings = {
        "BULLETIN_GATEWAY": cluster.url,
        "BULLETIN_TOKEN_FILE": str(token_file),
        "BULLETIN_NAME": name,
        "BULLETIN_STATE_DIR": str(directory / "state"),
        "BULLETIN_HTTP_TIMEOUT_S": "5",
    }
    if cluster.ca:
        settings["BULLETIN_CA_FILE"] = cluster.ca
    return Node(directory, token_file, settings)


@pytest.fixture
def node(module_gateway: Cluster, tmp_path: Path) -> Node:
    return node_of(module_gateway, tmp_path, f"doc-{secrets.token_hex(3)}")


def nvml_works() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


# --------------------------------------------------------------------------- node


def test_a_node_without_gpus_or_fakes_fails_naming_nvml(node: Node) -> None:
    if nvml_works():
        pytest.skip("this machine has NVIDIA GPUs: the nodelet would use them")
    run = doctor("node", files=[node.env_file()])
    assert run.returncode == 1, run.output
    # The nodelet would fall back to 2 fake GPUs; a node nobody asked fakes of is not fit.
    assert run.line("FAIL  gpus: no NVIDIA GPU usable: NVML")
    assert "install the NVIDIA driver" in run.line("FAIL  gpus:")
    assert run.output.splitlines()[-1].startswith("summary: ")


def test_a_fit_node_passes_and_never_shows_its_token(node: Node, module_gateway: Cluster) -> None:
    run = doctor("node", files=[node.env_file(BULLETIN_FAKE_GPUS="2")])
    assert run.returncode == 0, run.output
    assert not [line for line in run.output.splitlines() if line.startswith("FAIL")]
    assert "2 fake GPUs configured" in run.line("OK    gpus:")
    name = node.settings["BULLETIN_NAME"]
    assert f"accepts it as the node token of {name}" in run.line("OK    token:")
    assert run.line("OK    gateway:").endswith("answers /healthz")
    assert "none configured" in run.line("OK    shared dir:")
    assert run.line("OK    state dir:")
    assert run.line("OK    limits: process tracking:")
    # Single-tenant: it works, but every call could read the node token.
    assert "can read the node token" in run.line("WARN  user mapping:")
    assert run.output.splitlines()[-1].startswith("summary: ")
    assert node.token not in run.output and module_gateway.token not in run.output


def test_a_token_made_for_another_node_fails_naming_both(node: Node) -> None:
    made_for = node.settings["BULLETIN_NAME"]
    run = doctor("node", files=[node.env_file(BULLETIN_FAKE_GPUS="1", BULLETIN_NAME="doc-other")])
    assert run.returncode == 1, run.output
    line = run.line("FAIL  token:")
    assert f"the token is node {made_for}'s, not this node's (doc-other)" in line
    assert "'bulletin node add doc-other'" in line
    # The gateway answered the token all the same: the shared directory was still checked.
    assert "none configured" in run.line("OK    shared dir:")
    assert node.token not in run.output


def test_a_token_file_others_may_read_fails_naming_chmod(node: Node) -> None:
    node.token_file.chmod(0o644)
    run = doctor("node", files=[node.env_file(BULLETIN_FAKE_GPUS="1")])
    assert run.returncode == 1
    assert f"chmod 600 {node.token_file}" in run.line("FAIL  token:")
    assert node.token not in run.output


def test_a_token_the_gateway_does_not_know_fails(node: Node) -> None:
    unknown = "bn_" + secrets.token_urlsafe(32)
    node.token_file.write_text(unknown + "\n")
    run = doctor("node", files=[node.env_file(BULLETIN_FAKE_GPUS="1")])
    assert run.returncode == 1
    assert "the gateway refused the token" in run.line("FAIL  token:")
    assert "bulletin node add" in run.line("FAIL  token:")
    assert "not checked: the gateway did not answer" in run.line("WARN  shared dir:")
    assert unknown not in run.output


def test_a_gateway_that_is_down_fails(node: Node) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    run = doctor("node", files=[node.env_file(BULLETIN_FAKE_GPUS="1", BULLETIN_GATEWAY=down)])
    assert run.returncode == 1
    assert "cannot be reached" in run.line("FAIL  gateway:")


def test_plain_http_to_another_host_fails(node: Node) -> None:
    # 192.0.2.1 is TEST-NET-1: never routed, and never asked, nor sent the token.
    elsewhere = node.env_file(BULLETIN_FAKE_GPUS="1", BULLETIN_GATEWAY="http://192.0.2.1:8420")
    run = doctor("node", files=[elsewhere])
    assert run.returncode == 1
    line = run.line("FAIL  gateway:")
    assert "plain HTTP to another host" in line and "https://" in line


def test_bad_settings_fail_with_the_settings_own_message(node: Node) -> None:
    # From the environment this time, as a shell sets them; the file's values win over it.
    env = {**node.settings, "BULLETIN_MEMORY_LIMIT_MB": "-5"}
    run = doctor("node", env=env)
    assert run.returncode == 1
    line = run.line("FAIL  settings:")
    assert "memory_limit_mb must be at least 0, got -5" in line
    assert "BULLETIN_MEMORY_LIMIT_MB" in line
    fixed = doctor("node", env=env, files=[node.env_file(BULLETIN_MEMORY_LIMIT_MB="0")])
    assert "FAIL  settings" not in fixed.output


def test_a_mapping_to_an_account_that_does_not_exist_fails(node: Node) -> None:
    if os.geteuid() != 0:
        pytest.fail("a user mapping needs root: run the tests as root, as CI does")
    mapping = node.dir / "users.map"
    mapping.write_text("# bulletin user, unix account\nalice bt-no-such-account\n")
    run = doctor("node", files=[node.env_file(BULLETIN_USER_MAPPING=str(mapping))])
    assert run.returncode == 1
    assert "has no Unix account 'bt-no-such-account'" in run.output


# --------------------------------------------------------------------------- https, NAS

# The lab's own CA and a gateway it certifies, as tests/integration/test_tls.py makes them.
pki = test_tls.pki
https_gateway = test_tls.https_gateway


def test_an_untrusted_certificate_fails_naming_the_ca_option(
    https_gateway: Cluster, tmp_path: Path
) -> None:
    node = node_of(https_gateway, tmp_path, "doc-tls")
    ca_file = node.settings.pop("BULLETIN_CA_FILE")
    run = doctor("node", files=[node.env_file(BULLETIN_FAKE_GPUS="1")])
    assert run.returncode == 1
    line = run.line("FAIL  gateway:")
    assert "not trusted" in line and "--ca-file / BULLETIN_CA_FILE" in line
    with_ca = node.env_file(BULLETIN_FAKE_GPUS="1", BULLETIN_CA_FILE=ca_file)
    trusted = doctor("node", files=[with_ca])
    assert "(TLS verified with" in trusted.line("OK    gateway:")
    assert "accepts it as the node token of doc-tls" in trusted.line("OK    token:")


def test_the_shared_directory_must_be_the_gateways(
    shared_gateway: Cluster, tmp_path: Path
) -> None:
    """Checked with the node token alone: the gateway tells it the directory
    (``GET /v1/node/cluster``), no user's client.toml needed."""
    node = node_of(shared_gateway, tmp_path, "doc-nas")
    files = [node.env_file(BULLETIN_FAKE_GPUS="1")]
    args = ("node",)
    nas = shared_gateway.shared_dir
    assert nas is not None
    assert "is mounted here" in doctor(*args, files=files).line("OK    shared dir:")

    users = nas / "bulletin" / "users"
    users.chmod(0o755)
    try:
        assert f"chmod 1733 {users}" in doctor(*args, files=files).line("FAIL  shared dir:")
    finally:
        users.chmod(0o1733)

    marker = nas / "bulletin" / "cluster-id"
    cluster_id = marker.read_text()
    marker.write_text("another-cluster\n")
    try:
        assert "holds another cluster's id" in doctor(*args, files=files).line("FAIL  shared dir:")
    finally:
        marker.write_text(cluster_id)

    away = nas.with_name("nas-unmounted")
    nas.rename(away)
    try:
        run = doctor(*args, files=files)
        assert run.returncode == 1
        assert "is not here" in run.line("FAIL  shared dir:")
    finally:
        away.rename(nas)
    assert shared_gateway.token not in run.output and node.token not in run.output


# --------------------------------------------------------------------------- head


def password_of(url: str) -> str:
    password = urllib.parse.urlsplit(url).password
    assert password, "the test server's URLs carry a password"
    return urllib.parse.unquote(password)


def test_head_with_a_migrated_database_passes(database_url: str, tmp_path: Path) -> None:
    files = [env_file(tmp_path / "gateway.env", {"BULLETIN_DATABASE_URL": database_url})]
    run = doctor("head", files=files)
    assert run.returncode == 0, run.output
    assert "PostgreSQL" in run.line("OK    database:")
    assert run.line("OK    migrations: all")
    assert run.line("OK    tls: not configured")
    assert password_of(database_url) not in run.output
    assert ":***@" in run.line("OK    database:")


def test_head_with_an_unmigrated_database_says_to_migrate(
    pg_server: EmbeddedPostgres, tmp_path: Path
) -> None:
    name = f"t_bare_{secrets.token_hex(6)}"

    async def create() -> None:
        conn = await asyncpg.connect(pg_server.url("postgres"))
        try:
            await db.ensure_database(conn, name)
        finally:
            await conn.close()

    asyncio.run(create())
    url = pg_server.url(name)
    env = {"BULLETIN_DATABASE_URL": url}
    run = doctor("head", env=env)
    assert run.returncode == 1
    assert "run `bulletin migrate`" in run.line("FAIL  migrations:")
    assert password_of(url) not in run.output
    migrate = [BULLETIN, "migrate"]
    subprocess.run(migrate, env={**os.environ, **env}, check=True, capture_output=True)
    assert doctor("head", env=env).returncode == 0


def test_head_without_its_database_fails_without_its_password(
    database_url: str, tmp_path: Path
) -> None:
    parts = urllib.parse.urlsplit(database_url)
    elsewhere = parts._replace(netloc=f"{parts.netloc.rpartition(':')[0]}:{free_port()}")
    url = urllib.parse.urlunsplit(elsewhere)
    run = doctor("head", env={"BULLETIN_DATABASE_URL": url})
    assert run.returncode == 1
    assert "cannot connect" in run.line("FAIL  database:")
    assert password_of(url) not in run.output


def test_head_checks_its_tls_key_and_gateway(
    database_url: str, https_gateway: Cluster, pki: test_tls.Pki, tmp_path: Path
) -> None:
    key = tmp_path / "head.key"  # a copy the test may open up to others
    shutil.copy(pki.key, key)
    key.chmod(0o644)
    env = {
        "BULLETIN_DATABASE_URL": database_url,
        "BULLETIN_TLS_CERT_FILE": pki.cert,
        "BULLETIN_TLS_KEY_FILE": str(key),
    }
    check_gateway = ("--gateway", https_gateway.url, "--ca-file", pki.ca)
    run = doctor("head", *check_gateway, env=env)
    assert run.returncode == 1
    assert f"chmod 600 {key}" in run.line("FAIL  tls:")
    assert "answers /healthz (TLS verified" in run.line("OK    gateway:")
    key.chmod(0o600)
    assert doctor("head", *check_gateway, env=env).returncode == 0
