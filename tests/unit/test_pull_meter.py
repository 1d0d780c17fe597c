"""The pull meter: bytes and a monotonic time in, the rate over a sliding window and the
time left out (engine/models/pulls/meter.py), as tables."""

from __future__ import annotations

import pytest

from engine.models.pulls.meter import Meter, Reading

MB = 1 << 20


@pytest.mark.parametrize(
    ("samples", "now", "total", "expected"),
    [
        # nothing yet, or one sample: no rate, no time left
        ([], 0.0, 100 * MB, Reading(0.0, None)),
        ([(0.0, 0)], 1.0, 100 * MB, Reading(0.0, None)),
        # under the shortest span: too early to say
        ([(0.0, 0), (0.2, 2 * MB)], 0.2, 100 * MB, Reading(0.0, None)),
        # a steady 10 MiB/s: 90 MiB left is 9 s
        ([(0.0, 0), (1.0, 10 * MB)], 1.0, 100 * MB, Reading(10.0 * MB, 9.0)),
        ([(0.0, 0), (0.5, 5 * MB), (1.0, 10 * MB)], 1.0, 100 * MB, Reading(10.0 * MB, 9.0)),
        # the window forgets the fast start: only the last 10 s count (anchor at t=10)
        ([(0.0, 0), (10.0, 90 * MB), (20.0, 100 * MB)], 20.0, 200 * MB,
         Reading(1.0 * MB, 100.0)),
        # a stall lowers the rate: 10 MiB over the 2 s since the first sample
        ([(0.0, 0), (1.0, 10 * MB)], 2.0, 100 * MB, Reading(5.0 * MB, 18.0)),
        # no bytes for a whole window: no rate, no time left
        ([(0.0, 0), (1.0, 10 * MB)], 12.0, 100 * MB, Reading(0.0, None)),
        # done: nothing left, whatever the rate
        ([(0.0, 0), (1.0, 100 * MB)], 1.0, 100 * MB, Reading(100.0 * MB, 0.0)),
        # the total unknown: a rate, no time left
        ([(0.0, 0), (1.0, 10 * MB)], 1.0, 0, Reading(10.0 * MB, None)),
        # the count went back (the download started over): the window starts again
        ([(0.0, 0), (1.0, 50 * MB), (2.0, 1 * MB)], 2.0, 100 * MB, Reading(0.0, None)),
        # a resumed download: only the bytes gained count, not the 60 MiB it began at
        ([(5.0, 60 * MB), (6.0, 70 * MB)], 6.0, 100 * MB, Reading(10.0 * MB, 3.0)),
    ],
)
def test_the_meter(samples: list[tuple[float, int]], now: float, total: int,
                   expected: Reading) -> None:
    meter = Meter()
    for t, done in samples:
        meter.add(t, done)
    assert meter.reading(now, total) == expected


def test_reset_forgets_what_came_before() -> None:
    meter = Meter()
    meter.add(0.0, 0)
    meter.add(1.0, 50 * MB)
    meter.reset()
    meter.add(2.0, 50 * MB)
    assert meter.reading(2.0, 100 * MB) == Reading(0.0, None)
    meter.add(3.0, 60 * MB)
    assert meter.reading(3.0, 100 * MB) == Reading(10.0 * MB, 4.0)


def test_a_long_download_keeps_a_bounded_window() -> None:
    meter = Meter()
    for i in range(10_000):  # ten a second for 1000 s at 1 MiB/s
        meter.add(i / 10, i * MB // 10)
    assert len(meter._samples) <= 102
    assert meter.rate(999.9) == pytest.approx(1.0 * MB)
