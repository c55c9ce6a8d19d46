"""The one retry schedule: exponential caps, full jitter, so that retries do not march in
lockstep after a shared outage."""

from __future__ import annotations

import random
import statistics

import pytest

from bulletin_core.backoff import Backoff


def test_delays_stay_under_a_cap_that_doubles_to_the_maximum() -> None:
    backoff = Backoff(0.1, 1.0, rng=random.Random(1))
    caps = []
    for _ in range(8):
        cap = backoff.cap
        delay = backoff.next_delay()
        assert 0 <= delay <= cap
        caps.append(cap)
    assert caps == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    backoff.reset()
    assert backoff.cap == 0.1


def test_clients_that_failed_together_do_not_retry_together() -> None:
    # 200 nodelets lose the gateway at the same moment and back off four times each: their
    # retries must spread over the window, not land on the same instants.
    retry_at = []
    for seed in range(200):
        backoff = Backoff(0.1, 2.0, rng=random.Random(seed))
        retry_at.append(sum(backoff.next_delay() for _ in range(4)))
    assert len({round(t, 2) for t in retry_at}) > 80  # 10 ms buckets over ~1.5 s
    assert statistics.pstdev(retry_at) > 0.2
    # Full jitter: on average half of each cap (0.1 + 0.2 + 0.4 + 0.8) / 2.
    assert statistics.mean(retry_at) == pytest.approx(0.75, rel=0.15)


def test_a_server_asked_wait_is_a_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    slept = []
    monkeypatch.setattr("bulletin_core.backoff.time.sleep", slept.append)
    backoff = Backoff(0.01, 0.02, rng=random.Random(0))
    backoff.sleep_sync(at_least_s=3.0)
    backoff.sleep_sync()
    assert slept[0] == 3.0
    assert 0 <= slept[1] <= 0.02


@pytest.mark.parametrize(("first", "most"), [(0, 1), (2, 1), (-1, 1)])
def test_a_schedule_that_cannot_work_is_refused(first: float, most: float) -> None:
    with pytest.raises(ValueError, match="first_s"):
        Backoff(first, most)
