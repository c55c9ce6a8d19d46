"""The parts of ``bulletin doctor`` that need no cluster: reading env files as systemd does,
the settings they give a component's own command, masking secrets, the report's lines and
exit status, and the GPU check (NVML through the nodelet's tests' stand-in: no GPU here).
The other checks run for real in tests/integration/test_doctor.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import msgspec
import pynvml
import pytest

from bulletin import doctor
from bulletin_core import wire
from nodelet import gpus
from nodelet.config import NodeletConfig
from tests.unit.test_nodelet_gpus import FakeNvml


def test_an_env_file_reads_as_systemd_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "nodelet.env"
    path.write_text(
        "# the playbook's\n"
        "; also a comment\n"
        "\n"
        "BULLETIN_GATEWAY=https://head:8420\n"
        '  BULLETIN_NAME = "gpu 01"  \n'
        "BULLETIN_WORKER_ENV='A=1,B'\n"
        'BULLETIN_TRUSTED_USERS="a\\"b"\n'
        "BULLETIN_CPU_LIMIT=2\\\n"
        ".5\n"
        "export BULLETIN_OOPS=1\n"
        "no assignment here\n"
    )
    values, ignored = doctor.read_env_file(path)
    assert values == {
        "BULLETIN_GATEWAY": "https://head:8420",
        "BULLETIN_NAME": "gpu 01",
        "BULLETIN_WORKER_ENV": "A=1,B",
        "BULLETIN_TRUSTED_USERS": 'a"b',
        "BULLETIN_CPU_LIMIT": "2.5",
    }
    assert ignored == [f"{path} line 10", f"{path} line 11"]


@click.command("toy")
@click.option("--speed", envvar="BULLETIN_SPEED", type=int, required=True)
@click.option("--colour", envvar="BULLETIN_COLOUR", default="red")
def toy(speed: int, colour: str) -> None:
    """A command whose options read BULLETIN_* variables, as a component's do."""


def test_env_file_values_stand_for_variables_and_win_over_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BULLETIN_SPEED", "1")
    monkeypatch.setenv("BULLETIN_COLOUR", "blue")
    report = doctor.Report()
    values = doctor.parsed(report, toy, {"BULLETIN_SPEED": "-3", "BULLETIN_SPEDE": "9"})
    assert values == {"speed": -3, "colour": "blue"}  # a value like an option's is a value
    assert "BULLETIN_SPEDE is no setting of 'bulletin toy'" in capsys.readouterr().out
    assert report.counts["WARN"] == 1


def test_settings_a_command_refuses_fail_with_its_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = doctor.Report()
    assert doctor.parsed(report, toy, {"BULLETIN_SPEED": "fast"}) is None
    out = capsys.readouterr().out
    assert out.startswith("FAIL  settings: Invalid value for '--speed'")
    assert report.finish("node") == 1


def test_a_database_url_is_shown_without_its_password() -> None:
    assert doctor.masked_url("postgresql://bulletin:s%40cret@db:5432/bulletin") == (
        "postgresql://bulletin:***@db:5432/bulletin"
    )
    assert doctor.masked_url("postgresql:///bulletin?host=/run/pg&password=hunter2") == (
        "postgresql:///bulletin?host=/run/pg&password=***"
    )
    assert doctor.masked_url("postgresql://bulletin@db/bulletin") == (
        "postgresql://bulletin@db/bulletin"
    )


def test_no_line_shows_a_secret_and_the_summary_decides_the_status(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = doctor.Report()
    report.secret("bn_tok/en", None, "")
    report.ok("token", "read bn_tok/en from the file")
    report.warn("gateway", "asked with bn_tok%2Fen", "multi\nline   text")
    assert report.finish("node") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "OK    token: read *** from the file",
        "WARN  gateway: asked with *** — multi line text",
        "summary: 1 OK, 1 WARN, 0 FAIL: this node is fit to serve",
    ]
    report.fail("gpus", "none", "install the driver")
    assert report.finish("node") == 1
    assert "1 FAIL: this node is not fit to serve" in capsys.readouterr().out


# --------------------------------------------------------------------------- gpus


def node_config(**settings: Any) -> NodeletConfig:
    return NodeletConfig(gateway_url="http://127.0.0.1:1", token="bn_x", name="n", **settings)


class Nvml(FakeNvml):
    """The NVML stand-in of the nodelet's tests, with what discovery also asks: names, ids,
    the bus (no NVLink) and the driver's version."""

    NVML_NVLINK_MAX_LINKS = 4

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{handle}"

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA H200"  # older nvidia-ml-py releases answer bytes

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(busId=f"00000000:{handle:02x}:00.0")

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def test_real_gpus_are_listed_with_the_driver_version(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    nvml = Nvml(2)
    monkeypatch.setattr(gpus, "pynvml", nvml)
    report = doctor.Report()
    provider = doctor.check_gpus(report, node_config())
    assert isinstance(provider, gpus.NvmlProvider)
    assert capsys.readouterr().out.splitlines() == [
        "OK    gpus: NVIDIA driver 550.54.15, 2 GPUs: GPU 0: NVIDIA H200, 81920 MiB; "
        "GPU 1: NVIDIA H200, 81920 MiB"
    ]
    assert nvml.initialised == 0  # NVML is shut down again


def test_a_gpu_that_must_leave_service_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    faults = tmp_path / "faults"
    faults.write_text("1 ecc 3\n")
    report = doctor.Report()
    doctor.check_gpus(report, node_config(fake_gpus=2, fake_gpu_faults=str(faults)))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "OK    gpus: 2 fake GPUs configured (fake_gpus; not real GPUs)"
    assert lines[1].startswith("FAIL  gpu health: GPU 1: CRITICAL: 3 uncorrectable ECC errors")
    assert report.counts["FAIL"] == 1


# --------------------------------------------------------------------------- token, shared dir


def test_the_gateways_answer_decides_the_token_and_shared_dir_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``GET /v1/node/cluster`` answered (``doctor.ask_cluster``): whose token it is, and
    the shared directory to look for here; or why it answered nothing."""
    token = tmp_path / "node.token"
    token.write_text("bn_x\n")
    token.chmod(0o600)
    config = node_config()  # node "n"
    gone = str(tmp_path / "nas")

    def lines(asked: doctor.Asked | None) -> list[str]:
        report = doctor.Report()
        doctor.check_token(report, config, token, asked)
        doctor.check_shared_dir(report, asked)
        return capsys.readouterr().out.splitlines()

    info = wire.ClusterInfo(inline_limit=1, max_state_bytes=2, node="n")
    assert lines(info) == [
        f"OK    token: {token} is a regular file of mode 0600; the gateway accepts it as the "
        "node token of n",
        "OK    shared dir: none configured (big state goes through the gateway)",
    ]
    other = msgspec.structs.replace(info, node="m", shared_dir=gone, shared_dir_id="c1")
    token_line, shared_line = lines(other)
    assert token_line.startswith("FAIL  token: the token is node m's, not this node's (n) — ")
    assert "'bulletin node add n'" in token_line
    assert shared_line.startswith(f"FAIL  shared dir: {gone}, the cluster's shared directory, is")
    refused = ("the gateway refused the token (unknown)", "make a new one")
    assert lines(refused) == [
        "FAIL  token: the gateway refused the token (unknown) — make a new one",
        "WARN  shared dir: not checked: the gateway did not answer the node token — see the "
        "token check",
    ]
    assert lines(None)[-1] == (
        "WARN  shared dir: not checked: the gateway cannot be reached — see the gateway check"
    )
    token.chmod(0o640)  # the file fails; the gateway's answer still counts
    file_line, token_line, shared_line = lines(other)
    assert file_line.startswith(f"FAIL  token: {token} (mode 0640) may be read by its group")
    assert token_line.startswith("FAIL  token: the token is node m's")
    file_line, shared_line = lines(info)  # no OK token line beside the FAIL
    assert file_line.startswith(f"FAIL  token: {token} (mode 0640)")
    assert shared_line.startswith("OK    shared dir: none configured")
