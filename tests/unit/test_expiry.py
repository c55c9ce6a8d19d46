"""The leader's rule for expiring leases (gateway/expiry.py): node faults, not storms."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from gateway.expiry import Outages, Silence, Thresholds, allowance, is_storm

LIMITS = Thresholds(fraction=0.5, min_nodes=2, hold_s=300, per_round=20)


def test_one_silent_node_among_many_is_a_node_fault() -> None:
    assert allowance(Silence(holding=10, silent=1), LIMITS, None, 0.0) == (20, None)


def test_a_lone_node_that_goes_silent_is_expired() -> None:
    # One node is never a storm: in a one-node cluster the node is what failed.
    assert allowance(Silence(holding=1, silent=1), LIMITS, None, 0.0) == (20, None)


def test_most_nodes_silent_at_once_holds_expiry_until_the_hold_runs_out() -> None:
    silence = Silence(holding=4, silent=3)
    assert allowance(silence, LIMITS, None, 100.0) == (0, 100.0)
    assert allowance(silence, LIMITS, 100.0, 399.0) == (0, 100.0)
    # Then it resumes, capped per round; the storm is still remembered.
    assert allowance(silence, LIMITS, 100.0, 400.0) == (20, 100.0)


def test_nodes_coming_back_end_the_storm() -> None:
    assert allowance(Silence(holding=4, silent=1), LIMITS, 100.0, 150.0) == (20, None)


@given(
    holding=st.integers(1, 1000),
    silent=st.integers(0, 1000),
    since=st.none() | st.floats(0, 1e6),
    elapsed=st.floats(0, 1e6),
)
def test_expiry_is_never_more_than_the_cap_and_held_only_in_a_storm(
    holding: int, silent: int, since: float | None, elapsed: float
) -> None:
    silence = Silence(holding=holding, silent=min(silent, holding))
    now = (since or 0.0) + elapsed
    most, storm_since = allowance(silence, LIMITS, since, now)
    assert 0 <= most <= LIMITS.per_round
    assert (storm_since is not None) == is_storm(silence, LIMITS)
    if most == 0:
        assert storm_since is not None and now - storm_since < LIMITS.hold_s


def test_outages_remember_when_the_database_was_last_away() -> None:
    outages = Outages()
    assert not outages.within(30)
    outages.note()
    assert outages.within(30)
    outages.last = time.monotonic() - 31
    assert not outages.within(30)
