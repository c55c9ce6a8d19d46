"""The gateway's settings are checked when it starts, naming the bad one."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfig

URL = "postgresql://localhost/bulletin"


def test_scheduling_defaults() -> None:
    config = GatewayConfig(database_url=URL)
    assert config.scheduler_policy == "fair"
    assert config.preemption_grace_s == 30.0
    assert config.fair_share_half_life_s == 86400.0


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            {"scheduler_policy": "lottery"},
            "scheduler_policy 'lottery' is not one of ['fair', 'fifo']",
        ),
        ({"preemption_grace_s": -1.0}, "preemption_grace_s must be 0 or more seconds"),
        ({"fair_share_half_life_s": 0.0}, "fair_share_half_life_s must be a positive number"),
    ],
)
def test_bad_scheduling_settings_are_named(setting: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        GatewayConfig(database_url=URL, **setting)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_the_policy_can_be_fifo() -> None:
    assert GatewayConfig(database_url=URL, scheduler_policy="fifo").policy().name == "fifo"


def test_the_fair_starvation_guard_reaches_the_policy() -> None:
    assert GatewayConfig(database_url=URL).policy().starve_after_s is None  # type: ignore[attr-defined]
    guarded = GatewayConfig(database_url=URL, fair_starve_after_s=3600).policy()
    assert guarded.starve_after_s == 3600  # type: ignore[attr-defined]
