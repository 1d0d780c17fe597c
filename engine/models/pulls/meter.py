"""The rate of a download and its time left, from the bytes done and the time (pure).

Bytes and a monotonic time come in as the download reports them; the rate is the bytes
gained over the last `window_s` seconds (up to `now`, so a stall lowers it), reported once
`min_span_s` of samples are in; the time left is what remains at that rate. A count that
goes backwards (a download that started over) starts the window again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 10.0
MIN_SPAN_S = 0.5
MAX_SAMPLES = 1024  # far more than a window holds at a few reports a second


@dataclass(frozen=True, slots=True)
class Reading:
    rate_bps: float  # 0.0 while not known
    eta_s: float | None  # None while not known


@dataclass
class Meter:
    window_s: float = WINDOW_S
    min_span_s: float = MIN_SPAN_S
    _samples: deque[tuple[float, int]] = field(
        default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def add(self, now: float, done: int) -> None:
        if self._samples:
            last_t, last_done = self._samples[-1]
            if done < last_done or now < last_t:
                self._samples.clear()
        self._samples.append((now, done))
        # keep the newest sample at or before the window's start: it anchors the span
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def reset(self) -> None:
        """A new phase (another file, a resumed part): what came before is no rate."""
        self._samples.clear()

    def rate(self, now: float) -> float:
        """Bytes a second over the window that ends at ``now``."""
        if len(self._samples) < 2:
            return 0.0
        anchor = self._samples[0]
        for sample in self._samples:
            if sample[0] > now - self.window_s:
                break
            anchor = sample
        span = now - anchor[0]
        if span < self.min_span_s:
            return 0.0
        return (self._samples[-1][1] - anchor[1]) / span

    def reading(self, now: float, total: int) -> Reading:
        rate = self.rate(now)
        if not self._samples or total <= 0:
            return Reading(rate, None)
        left = total - self._samples[-1][1]
        if left <= 0:
            return Reading(rate, 0.0)
        return Reading(rate, left / rate if rate > 0 else None)
