"""The pure parts of the gateway's cheap refusals: failure budgets per address with the
known-good and unknown tokens (``gateway/badtokens.py``), the allowed-hosts match
(``gateway/hosts.py``), and the settings that configure them."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
from starlette.requests import Request

from gateway import ratelimit
from gateway.badtokens import (
    KNOWN_GOOD_S,
    MAX_HELD,
    MAX_UNKNOWN,
    BadTokens,
    charge,
    client_key,
)
from gateway.config import GatewayConfig
from gateway.errors import TooManyRequests
from gateway.hosts import allows, host_name
from gateway.ratelimit import RateLimiter

URL = "postgresql://localhost/bulletin"
ADDRESS = "203.0.113.7"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def bad_tokens(clock: Clock, rate: float = 1.0, burst: int = 3, ttl: float = 5.0) -> BadTokens:
    return BadTokens(rate, burst, ttl, clock=clock)


def guess(bad: BadTokens, name: str, address: str = ADDRESS) -> float | None:
    """A request with an unknown token, as ``auth.principal`` judges it: the charge's answer
    (None: exempt; 0: looked up, and it failed; more: refused)."""
    wait = bad.charge(address, digest(name))
    if wait is not None and wait > 0:
        return wait
    bad.failed(address, digest(name), charged=wait is not None)
    return wait


def test_an_address_over_its_failures_waits_unless_its_token_worked_recently() -> None:
    clock = Clock()
    bad = bad_tokens(clock)
    bad.worked(ADDRESS, digest("alice"), charged=False)
    assert [guess(bad, f"guess{n}") for n in range(3)] == [0, 0, 0]
    assert guess(bad, "guess") == pytest.approx(1.0)
    assert bad.charge(ADDRESS, None) == pytest.approx(1.0)  # no token at all
    assert bad.charge(ADDRESS, digest("alice")) is None  # still looked up: known good
    assert guess(bad, "bob", "198.51.100.1") == 0  # another address has its own budget
    clock.now += KNOWN_GOOD_S
    assert [guess(bad, f"later{n}") for n in range(3)] == [0, 0, 0]
    assert bad.charge(ADDRESS, digest("alice")) == pytest.approx(1.0)  # not for ever


def test_a_token_that_works_gives_its_charge_back() -> None:
    clock = Clock()
    bad = bad_tokens(clock, burst=1)
    for _ in range(5):  # a new user's first requests, each charged, each refunded
        assert bad.charge(ADDRESS, digest("new")) == 0
        bad.worked(ADDRESS, digest("new"), charged=True)
        bad._good.clear()
    assert guess(bad, "guess") == 0
    assert guess(bad, "guess2") == pytest.approx(1.0)


def test_a_lookup_that_could_not_be_made_is_not_a_failure() -> None:
    bad = bad_tokens(Clock(), burst=1)
    for _ in range(5):  # the database is away: 503s, not failures of the token
        assert bad.charge(ADDRESS, digest("new")) == 0
        bad.unjudged(ADDRESS, charged=True)
    assert guess(bad, "guess") == 0


def test_concurrent_requests_cannot_all_pass_a_budget_with_room_for_one() -> None:
    bad = bad_tokens(Clock(), burst=2)
    # Many requests judged at once, before any lookup has answered: two get through.
    waits = [bad.charge(ADDRESS, digest(f"guess{n}")) for n in range(50)]
    assert waits[:2] == [0, 0] and all(w and w > 0 for w in waits[2:])


def test_a_client_that_mistypes_its_token_is_not_locked_out_for_long() -> None:
    clock = Clock()
    bad = BadTokens(1.0, 30, 5.0, clock=clock)  # the defaults
    defaults = GatewayConfig(database_url=URL)
    assert (defaults.auth_failure_rate_per_s, defaults.auth_failure_burst) == (1.0, 30)
    assert all(guess(bad, f"typo{n}") == 0 for n in range(30))
    wait = guess(bad, "right")
    assert wait is not None and 0 < wait <= 1.0
    clock.now += 1.0
    assert bad.charge(ADDRESS, digest("right")) == 0


def test_a_token_that_failed_is_remembered_as_unknown_briefly() -> None:
    clock = Clock()
    bad = bad_tokens(clock, ttl=5.0)
    guess(bad, "guess")
    assert bad.is_unknown(digest("guess")) and not bad.is_unknown(digest("other"))
    clock.now += 5.0
    assert not bad.is_unknown(digest("guess"))
    off = bad_tokens(clock, ttl=0)
    guess(off, "guess")
    assert not off.is_unknown(digest("guess"))


def test_a_token_that_stops_working_loses_its_exemption_at_once() -> None:
    clock = Clock()
    bad = bad_tokens(clock, burst=1)
    bad.worked(ADDRESS, digest("revoked"), charged=False)
    assert bad.charge(ADDRESS, digest("revoked")) is None
    bad.failed(ADDRESS, digest("revoked"), charged=False)  # revoked since: counted now
    assert bad.charge(ADDRESS, digest("revoked")) == pytest.approx(1.0)
    assert bad.is_unknown(digest("revoked"))
    bad.worked(ADDRESS, digest("revoked"), charged=False)  # only the database says otherwise
    assert not bad.is_unknown(digest("revoked"))


def test_the_memory_of_unknown_tokens_is_bounded() -> None:
    clock = Clock()
    bad = bad_tokens(clock, rate=0)
    for n in range(MAX_UNKNOWN + 10):
        bad.failed(ADDRESS, n.to_bytes(32, "big"), charged=True)
    assert len(bad._unknown) == MAX_UNKNOWN
    assert not bad.is_unknown((0).to_bytes(32, "big"))  # the oldest went first
    assert bad.is_unknown((MAX_UNKNOWN + 9).to_bytes(32, "big"))


def test_refusals_are_held_but_only_so_many_at_once() -> None:
    bad = BadTokens(1.0, 1, 5.0, delay_s=0.2)
    request = Request({"type": "http", "client": (ADDRESS, 1234), "headers": []})

    async def refused() -> tuple[float, TooManyRequests]:
        started = time.monotonic()
        with pytest.raises(TooManyRequests) as info:
            await charge(request, bad, digest("guess"), "user@peer")
        return time.monotonic() - started, info.value

    first = asyncio.run(charge(request, bad, digest("first"), "user@peer"))
    assert first is True  # charged, judged
    took, error = asyncio.run(refused())
    assert took >= 0.2 and error.code == "auth_rate_limited"
    assert error.headers["Retry-After"] == "1" and bad.held == 0
    bad.held = MAX_HELD  # as many as may be held already: answered at once
    took, _ = asyncio.run(refused())
    assert took < 0.1


def test_no_limit_when_the_rate_is_0() -> None:
    bad = bad_tokens(Clock(), rate=0, burst=1)
    assert all(guess(bad, f"guess{n}") == 0 for n in range(100))


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),  # the same /64: one budget
        ("::ffff:203.0.113.7", "203.0.113.7"),
        (None, ""),
        ("testclient", "testclient"),
    ],
)
def test_addresses_are_keyed_by_host_and_ipv6_by_its_64(host: str | None, key: str) -> None:
    assert client_key(host) == key


def test_the_rate_limiter_can_give_a_token_back() -> None:
    clock = Clock()
    limiter = RateLimiter(1.0, 2, clock=clock)
    limiter.take("k")
    limiter.take("k")
    limiter.refund("k")
    assert limiter.take("k") == 0 and limiter.take("k") == pytest.approx(1.0)
    for _ in range(5):
        limiter.refund("k")
    assert [limiter.take("k") for _ in range(3)][-1] > 0  # never past the bucket's size


def test_many_keys_cannot_grow_the_rate_limiter_without_bound() -> None:
    limiter = RateLimiter(1e-9, 1, clock=Clock())  # nothing refills: no bucket is ever full
    for n in range(ratelimit.MAX_BUCKETS * 3):
        limiter.take(n)
    assert len(limiter._buckets) <= 2 * ratelimit.MAX_BUCKETS


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("Bulletin.Example.org:8420", "bulletin.example.org"),
        ("bulletin.example.org", "bulletin.example.org"),
        ("[::1]:8420", "::1"),
        ("[::1]", "::1"),
        ("127.0.0.1:80", "127.0.0.1"),
        ("", ""),
    ],
)
def test_the_host_of_a_host_header(header: str, name: str) -> None:
    assert host_name(header) == name


def test_allowed_hosts_match_names_subdomains_and_any() -> None:
    hosts = GatewayConfig(database_url=URL, allowed_hosts=" Head.lab , *.gpu.lab,[::1]").hosts
    assert hosts == ["head.lab", "*.gpu.lab", "[::1]"]
    assert allows(hosts, "head.lab") and allows(hosts, "n1.gpu.lab") and allows(hosts, "::1")
    assert not allows(hosts, "gpu.lab") and not allows(hosts, "evil.lab")
    assert not allows(hosts, "head.lab.evil.org") and not allows(hosts, "")
    assert allows(["*"], "anything")
    assert GatewayConfig(database_url=URL).hosts == []  # the default: any


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"auth_failure_rate_per_s": -1.0}, "auth_failure_rate_per_s must be at least 0, got -1.0"),
        ({"auth_failure_burst": 0}, "auth_failure_burst must be at least 1, got 0"),
        ({"auth_negative_cache_s": -1.0}, "auth_negative_cache_s must be at least 0, got -1.0"),
        ({"auth_failure_delay_s": 61.0}, "auth_failure_delay_s must be at least 0 and at most 60"),
        ({"header_timeout_s": 0.0}, "header_timeout_s must be above 0, got 0.0"),
        ({"idle_timeout_s": 0.0}, "idle_timeout_s must be above 0, got 0.0"),
        ({"user_storage_mb": -1}, "user_storage_mb must be at least 0, got -1"),
        ({"allowed_hosts": "a.lab,,b.lab"}, "allowed_hosts 'a.lab,,b.lab' has an empty name"),
    ],
)
def test_bad_refusal_settings_are_named(setting: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        GatewayConfig(database_url=URL, **setting)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_refusal_defaults() -> None:
    config = GatewayConfig(database_url=URL)
    assert (config.auth_negative_cache_s, config.auth_failure_delay_s) == (5.0, 1.0)
    assert (config.header_timeout_s, config.idle_timeout_s) == (10.0, 5.0)
    assert config.user_storage_bytes == 64 << 30
    assert GatewayConfig(database_url=URL, user_storage_mb=0).user_storage_bytes is None
