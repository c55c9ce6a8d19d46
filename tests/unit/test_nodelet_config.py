"""NodeletConfig validation: bad settings fail at construction, naming the setting."""

from __future__ import annotations

import os
import socket
from typing import Any

import msgspec
import pytest

from bulletin_core.settings import from_values
from nodelet.config import NodeletConfig

GOOD: dict[str, Any] = {"gateway_url": "http://127.0.0.1:8000", "token": "bn_secret"}


def test_defaults() -> None:
    config = NodeletConfig(**GOOD)
    assert config.name == socket.gethostname()
    assert config.fake_gpus is None
    assert config.spare_workers == 2
    assert config.work_dir == ""
    assert config.http_timeout_s == 10.0
    assert config.log_flush_s == 0.02
    assert config.effective_cpu_slots == os.cpu_count()


def test_spare_shapes_are_parsed() -> None:
    assert NodeletConfig(**GOOD).spare_shapes == (1,)
    assert NodeletConfig(**GOOD, gpu_spare_shapes="8, 2,2").spare_shapes == (2, 8)
    assert NodeletConfig(**GOOD, gpu_spare_shapes="").spare_shapes == ()


def test_explicit_cpu_slots_are_kept() -> None:
    assert NodeletConfig(**GOOD, cpu_slots=3).effective_cpu_slots == 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"gateway_url": "127.0.0.1:8000"}, "gateway_url must start with http:// or https://"),
        ({"token": " "}, "token is empty"),
        ({"name": ""}, "name is empty"),
        ({"fake_gpus": -1}, "fake_gpus must be at least 0, got -1"),
        ({"cpu_slots": -2}, "cpu_slots must be at least 0, got -2"),
        ({"spare_workers": -1}, "spare_workers must be at least 0, got -1"),
        ({"http_timeout_s": 0.0}, "http_timeout_s must be above 0, got 0.0"),
        ({"log_flush_s": -0.5}, "log_flush_s must be above 0, got -0.5"),
        ({"cpu_limit": -1.0}, "cpu_limit must be at least 0, got -1.0"),
        ({"gpu_spare_shapes": "1,x"}, "gpu_spare_shapes must be GPU counts separated by commas"),
        ({"gpu_spare_shapes": "0"}, "gpu_spare_shapes must be GPU counts"),
        (
            {"process_tracking": "cgroups"},
            "process_tracking must be one of auto, cgroup, cgroup2, cgroup1, subreaper, got "
            "'cgroups'",
        ),
        ({"state_dir": "state"}, "state_dir must be an absolute path, got 'state'"),
    ],
)
def test_invalid_settings_are_named(override: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        NodeletConfig(**{**GOOD, **override})
    assert str(info.value).startswith("invalid nodelet config: ")
    assert message in str(info.value)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as info:
        NodeletConfig(gateway_url="ftp://x", token="", spare_workers=-1)
    text = str(info.value)
    assert "gateway_url" in text
    assert "token is empty" in text
    assert "spare_workers" in text


def test_decoding_from_settings_validates_too() -> None:
    # The command line's path (msgspec enforces the field's Meta) fails like construction.
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int` >= 0 - at `\$.cpu_slots`"):
        msgspec.convert({**GOOD, "cpu_slots": -1}, NodeletConfig)
    with pytest.raises(ValueError, match="invalid nodelet config: cpu_slots must be at least 0"):
        from_values(NodeletConfig, {**GOOD, "cpu_slots": -1}, "nodelet")


def test_config_is_frozen() -> None:
    config = NodeletConfig(**GOOD)
    with pytest.raises(AttributeError):
        config.token = "other"  # type: ignore[misc]
