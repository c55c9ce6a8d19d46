"""Decayed usage: the meter and the batch formula agree, and halve every half-life."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.fairshare import UsageMeter, decay, decayed_total


def test_a_gpu_second_counts_half_after_one_half_life() -> None:
    assert decay(3600, 3600) == pytest.approx(0.5)
    meter = UsageMeter[str](half_life_s=100)
    meter.change("g", 1, now=0)
    meter.change("g", -1, now=1e-6)
    base = meter.value("g", now=1e-6)
    assert meter.value("g", now=100 + 1e-6) == pytest.approx(base / 2)


intervals = st.lists(
    st.tuples(st.floats(0, 1000), st.floats(0, 1000), st.integers(1, 8)), max_size=8
).map(lambda xs: [(min(a, b), max(a, b), g) for a, b, g in xs])


@given(intervals, st.floats(1, 10_000))
def test_the_meter_integrates_running_calls_like_the_batch_formula(
    spans: list[tuple[float, float, int]], half_life: float
) -> None:
    meter = UsageMeter[str](half_life)
    for t, delta in sorted([(s, g) for s, _, g in spans] + [(e, -g) for _, e, g in spans]):
        meter.change("g", delta, t)
    now = 1500.0
    expected = decayed_total(spans, now, half_life)
    assert meter.value("g", now) == pytest.approx(expected, rel=1e-6, abs=1e-6)
