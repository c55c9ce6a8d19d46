"""The gateway's settings are checked when it starts, naming the bad one; and the per-user
rate limiter they configure."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from bulletin import cli
from gateway.config import GatewayConfig
from gateway.ratelimit import MAX_BUCKETS, RateLimiter

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
        ({"preemption_grace_s": -1.0}, "preemption_grace_s must be at least 0, got -1.0"),
        ({"fair_share_half_life_s": 0.0}, "fair_share_half_life_s must be above 0, got 0.0"),
        ({"heartbeat_s": 16.0}, "heartbeat_s must be at most half of lease_s"),
        ({"node_timeout_s": 31.0}, "node_timeout_s must be at most lease_s"),
        ({"silent_fraction": 0.0}, "silent_fraction must be above 0 and at most 1, got 0.0"),
        ({"caller_timeout_s": -1.0}, "caller_timeout_s must be at least 0, got -1.0"),
        ({"max_expiries_per_round": 0}, "max_expiries_per_round must be at least 1, got 0"),
        ({"fair_share_margin": 0.0}, "fair_share_margin must be above 0, got 0.0"),
    ],
)
def test_bad_scheduling_settings_are_named(setting: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        GatewayConfig(database_url=URL, **setting)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_the_policy_can_be_fifo() -> None:
    assert GatewayConfig(database_url=URL, scheduler_policy="fifo").policy().name == "fifo"


def test_the_fair_starvation_guard_reaches_the_policy() -> None:
    assert GatewayConfig(database_url=URL).policy().starve_after_s == 43_200  # type: ignore[attr-defined]
    guarded = GatewayConfig(database_url=URL, fair_starve_after_s=600).policy()
    assert guarded.starve_after_s == 600  # type: ignore[attr-defined]
    off = GatewayConfig(database_url=URL, fair_starve_after_s=0).policy()
    assert off.starve_after_s is None  # type: ignore[attr-defined]


def test_the_whole_node_shelter_reaches_the_policy() -> None:
    assert GatewayConfig(database_url=URL).policy().shelter_whole_nodes  # type: ignore[attr-defined]
    bare = GatewayConfig(database_url=URL, fair_shelter_whole_nodes=False).policy()
    assert bare.shelter_whole_nodes is False  # type: ignore[attr-defined]


def test_fair_share_among_borrowers_reaches_the_policy() -> None:
    policy = GatewayConfig(database_url=URL).policy()
    assert policy.share_preemption and policy.share_margin == 8.0  # type: ignore[attr-defined]
    off = GatewayConfig(database_url=URL, fair_share_preemption=False, fair_share_margin=2).policy()
    assert (off.share_preemption, off.share_margin) == (False, 2)  # type: ignore[attr-defined]


def test_shortest_first_reaches_the_policy() -> None:
    assert GatewayConfig(database_url=URL).policy().shortest_first  # type: ignore[attr-defined]
    off = GatewayConfig(database_url=URL, fair_shortest_first=False).policy()
    assert off.shortest_first is False  # type: ignore[attr-defined]


def test_request_handling_defaults() -> None:
    config = GatewayConfig(database_url=URL)
    assert (config.rate_limit_per_s, config.rate_limit_burst) == (500.0, 1000)
    assert config.max_wait_s == 60.0
    assert config.retention_s == 7 * 24 * 3600
    assert config.purge_interval_s == 60.0


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"rate_limit_per_s": -1.0}, "rate_limit_per_s must be at least 0, got -1.0"),
        ({"rate_limit_per_s": math.inf}, "rate_limit_per_s must be a finite number at least 0"),
        ({"rate_limit_per_s": math.nan}, "rate_limit_per_s must be a finite number at least 0"),
        ({"rate_limit_burst": 0}, "rate_limit_burst must be at least 1, got 0"),
        ({"max_wait_s": 0.0}, "max_wait_s must be above 0, got 0.0"),
        ({"retention_s": -1.0}, "retention_s must be above 0, got -1.0"),
        ({"retention_s": math.nan}, "retention_s must be a finite number above 0, got nan"),
        ({"purge_interval_s": 0.0}, "purge_interval_s must be above 0, got 0.0"),
    ],
)
def test_bad_request_handling_settings_are_named(setting: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        GatewayConfig(database_url=URL, **setting)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_a_rate_limit_of_0_is_off() -> None:
    assert GatewayConfig(database_url=URL, rate_limit_per_s=0).rate_limit_per_s == 0
    limiter = RateLimiter(0, 1)
    assert not limiter.enabled
    assert all(limiter.take("alice") == 0 for _ in range(1000))


def test_the_new_settings_are_gateway_options() -> None:
    result = CliRunner().invoke(cli, ["gateway", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for option in (
        "--rate-limit-per-s",
        "--rate-limit-burst",
        "--max-wait-s",
        "--retention-s",
        "--purge-interval-s",
    ):
        assert option in result.output


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_allows_a_burst_then_the_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(2.0, 3, clock=clock)
    assert [limiter.take("alice") for _ in range(3)] == [0, 0, 0]
    assert limiter.take("alice") == pytest.approx(0.5)  # a token is back in 1/2 s
    assert limiter.take("bob") == 0  # one bucket per user
    clock.now += 0.25
    assert limiter.take("alice") == pytest.approx(0.25)  # refused requests take nothing
    clock.now += 0.25
    assert limiter.take("alice") == 0
    assert limiter.take("alice") == pytest.approx(0.5)
    clock.now += 100  # refills up to the burst, no further
    assert [limiter.take("alice") for _ in range(4)][-1] > 0


def test_idle_buckets_are_forgotten_when_there_are_many() -> None:
    clock = Clock()
    limiter = RateLimiter(1.0, 2, clock=clock)
    for user in range(MAX_BUCKETS):
        limiter.take(user)
    limiter.take("busy")
    limiter.take("busy")
    clock.now += 10  # every bucket but the next ones' is full again
    limiter.take("new")
    assert len(limiter._buckets) == 1
    assert limiter.take("new") == 0 and limiter.take("new") > 0


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.53"])
def test_plain_http_is_served_on_loopback(host: str) -> None:
    GatewayConfig(database_url=URL, host=host)  # accepted without TLS


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "head.lab.example", "::"])
def test_plain_http_is_refused_anywhere_else(host: str) -> None:
    with pytest.raises(ValueError, match="plain HTTP only on a loopback address"):
        GatewayConfig(database_url=URL, host=host)


def test_https_needs_both_files_and_may_listen_anywhere(tmp_path: Path) -> None:
    cert, key = tmp_path / "gateway.pem", tmp_path / "gateway.key"
    cert.write_text("pem")
    key.write_text("pem")
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file go together"):
        GatewayConfig(database_url=URL, tls_cert_file=str(cert))
    with pytest.raises(ValueError, match="is not a file"):
        GatewayConfig(database_url=URL, tls_cert_file=str(cert), tls_key_file="/nonexistent")
    files = {"tls_cert_file": str(cert), "tls_key_file": str(key)}
    GatewayConfig(database_url=URL, host="0.0.0.0", **files)  # accepted: it serves HTTPS
