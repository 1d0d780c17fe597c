from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.head.access.limits import Bucket, fresh, take


def test_burst_then_refused_with_retry_after() -> None:
    b = fresh(0.0, burst=3.0)
    for _ in range(3):
        ok, b, wait = take(b, 0.0, rate_per_s=2.0, burst=3.0)
        assert ok and wait == 0.0
    ok, b, wait = take(b, 0.0, rate_per_s=2.0, burst=3.0)
    assert not ok
    assert wait == pytest.approx(0.5)


def test_refills_at_rate_up_to_burst() -> None:
    b = Bucket(tokens=0.0, stamp=0.0)
    ok, b2, _ = take(b, 0.25, rate_per_s=2.0, burst=3.0)
    assert not ok and b2.tokens == pytest.approx(0.5)
    ok, b3, _ = take(b2, 0.5, rate_per_s=2.0, burst=3.0)
    assert ok and b3.tokens == pytest.approx(0.0)
    _, b4, _ = take(b3, 1000.0, rate_per_s=2.0, burst=3.0)
    assert b4.tokens == pytest.approx(2.0)  # capped at burst, minus the one taken


def test_refill_is_not_lost_to_float_drift() -> None:
    b = Bucket(tokens=0.0, stamp=1.2)
    ok, _, wait = take(b, 1.3, rate_per_s=10.0, burst=1.0)  # 1.3 - 1.2 < 0.1 in floats
    assert ok and wait == 0.0


def test_clock_going_backwards_refills_nothing() -> None:
    b = Bucket(tokens=0.0, stamp=10.0)
    ok, b2, wait = take(b, 5.0, rate_per_s=1.0, burst=5.0)
    assert not ok and b2 == Bucket(0.0, 10.0)
    assert wait == pytest.approx(1.0)


def test_cost_larger_than_one() -> None:
    b = fresh(0.0, burst=10.0)
    ok, b, _ = take(b, 0.0, 1.0, 10.0, cost=7.0)
    assert ok and b.tokens == pytest.approx(3.0)
    ok, b, wait = take(b, 0.0, 1.0, 10.0, cost=7.0)
    assert not ok and wait == pytest.approx(4.0)


def test_impossible_requests_wait_forever() -> None:
    ok, _, wait = take(Bucket(0.0, 0.0), 0.0, rate_per_s=0.0, burst=5.0)
    assert not ok and wait == math.inf
    ok, _, wait = take(fresh(0.0, 5.0), 0.0, rate_per_s=1.0, burst=5.0, cost=6.0)
    assert not ok and wait == math.inf


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.1, 100.0),
    burst=st.integers(1, 20),
    gaps=st.lists(st.floats(0.0, 2.0), min_size=1, max_size=200),
)
def test_never_grants_more_than_burst_plus_refill(
    rate: float, burst: int, gaps: list[float]
) -> None:
    b, now, granted = fresh(0.0, float(burst)), 0.0, 0
    for gap in gaps:
        now += gap
        ok, b, wait = take(b, now, rate, float(burst))
        granted += ok
        assert 0.0 <= b.tokens <= burst
        assert (wait == 0.0) if ok else (wait > 0.0)
    assert granted <= burst + now * rate + 1e-6
