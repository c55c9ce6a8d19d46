"""One source for every setting: the rule and description in a config field's msgspec.Meta
drive construction, the command line (and its environment variables) and --help alike."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from bulletin import cli
from bulletin_core import meta, settings
from gateway.config import GatewayConfig
from nodelet.config import NodeletConfig

REQUIRED: dict[type, dict[str, Any]] = {
    GatewayConfig: {"database_url": "postgresql://localhost/bulletin"},
    NodeletConfig: {"gateway_url": "http://127.0.0.1:1", "token": "bn_x"},
}
WHAT = {GatewayConfig: "gateway", NodeletConfig: "nodelet"}


def ruled_fields() -> list[tuple[type, str, Any]]:
    """(config, field, a value that breaks the field's rule) for every ruled field."""
    cases = []
    for config in REQUIRED:
        for field in msgspec.inspect.type_info(config).fields:  # type: ignore[attr-defined]
            kind = meta.bare(field.type)
            bound = next(
                (getattr(kind, a) for a in ("gt", "ge") if getattr(kind, a, None) is not None),
                None,
            )
            if bound is not None:
                bad = bound - 1 if isinstance(kind, msgspec.inspect.IntType) else bound - 0.5
                cases.append((config, field.name, bad))
    return cases


@pytest.mark.parametrize(("config", "name", "bad"), ruled_fields())
def test_a_rule_holds_whichever_way_the_setting_arrives(config: type, name: str, bad: Any) -> None:
    expected = f"invalid {WHAT[config]} config: {name} must be"
    with pytest.raises(ValueError, match=expected):
        config(**REQUIRED[config], **{name: bad})
    with pytest.raises(ValueError, match=expected):
        settings.from_values(config, {**REQUIRED[config], name: bad}, WHAT[config])


def test_every_setting_is_described_once_and_published() -> None:
    for config in REQUIRED:
        fields = msgspec.inspect.type_info(config).fields  # type: ignore[attr-defined]
        missing = [f.name for f in fields if not meta.description(f.type)]
        assert not missing, f"{config.__name__} fields without a description: {missing}"
        schema = msgspec.json.schema(config)["$defs"][config.__name__]["properties"]
        assert schema["cpu_slots" if config is NodeletConfig else "lease_s"]["description"]
    lease = msgspec.json.schema(GatewayConfig)["$defs"]["GatewayConfig"]["properties"]["lease_s"]
    assert lease["exclusiveMinimum"] == 0


def test_help_shows_the_description_the_rule_and_the_default() -> None:
    result = CliRunner().invoke(cli, ["gateway", "--help"], terminal_width=400)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "--lease-s" in line)
    fields = msgspec.inspect.type_info(GatewayConfig).fields  # type: ignore[attr-defined]
    lease = next(f for f in fields if f.name == "lease_s")
    assert meta.description(lease.type) in line
    assert "Must be above 0." in line and "[default: 30.0]" in line
    assert "BULLETIN_LEASE_S" in line


def test_a_bad_option_names_the_option_and_its_variable() -> None:
    result = CliRunner().invoke(
        cli, ["gateway", "--database-url", "postgresql:///x", "--lease-s", "-1"]
    )
    assert result.exit_code == 2
    assert "--lease-s / BULLETIN_LEASE_S" in result.output
    assert "lease_s must be above 0, got -1.0" in result.output
    # From the environment, the same rule and the same words.
    result = CliRunner().invoke(
        cli,
        ["gateway"],
        env={"BULLETIN_DATABASE_URL": "postgresql:///x", "BULLETIN_HEARTBEAT_S": "nan"},
    )
    assert result.exit_code == 2
    assert "heartbeat_s must be" in result.output


def test_rules_between_settings_are_reported_with_the_others() -> None:
    with pytest.raises(ValueError) as info:
        GatewayConfig(**REQUIRED[GatewayConfig], lease_s=4.0, heartbeat_s=3.0, pool_size=0)
    text = str(info.value)
    assert "pool_size must be at least 1, got 0" in text
    assert "heartbeat_s must be at most half of lease_s" in text


def test_floats_that_are_not_finite_are_refused() -> None:
    for value in (math.inf, math.nan):
        with pytest.raises(ValueError, match="must be a finite number"):
            GatewayConfig(**REQUIRED[GatewayConfig], rate_limit_per_s=value)


def test_the_log_level_given_on_the_command_line_wins_over_the_environment() -> None:
    import logging

    from bulletin_core.settings import env_log_level

    def level_after(args: list[str], env: dict[str, str]) -> int:
        # --help stops before the command runs, after every eager option was applied.
        result = CliRunner().invoke(cli, [*args, "gateway", "--help"], env=env)
        assert result.exit_code == 0, result.output
        return logging.getLogger().level

    root = logging.getLogger()
    saved = root.level
    try:
        env = {"BULLETIN_LOG_LEVEL": "debug"}
        assert level_after(["--log-level", "warning"], env) == logging.WARNING
        assert level_after([], env) == logging.DEBUG
        assert level_after([], {}) == logging.INFO
    finally:
        root.setLevel(saved)
    assert env_log_level({"BULLETIN_LOG_LEVEL": "ERROR"}) == "error"
    with pytest.raises(ValueError, match="BULLETIN_LOG_LEVEL must be one of"):
        env_log_level({"BULLETIN_LOG_LEVEL": "loud"})
