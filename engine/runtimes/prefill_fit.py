"""Prefill time priced by length: a least-squares fit over a node's recent prompts.

Prefilling ``n`` tokens after ``c`` tokens of context costs about
``n * a + b * n * (c + n / 2)`` seconds: ``a`` for the weights each token passes,
``b`` for attention over the context before it (each token looks back at
everything before it, so the cost grows with the context). A 20,000-token agent
prompt is priced at its true cost, not at the rate of short chat turns.

Pure: the engine adds one sample per prefill (tokens, context before, seconds).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

RECENT = 64
MIN_SAMPLES = 3


class PrefillCost(NamedTuple):
    """What a prefill costs, as fitted: ``a`` and ``b`` of the formula above."""

    a: float  # seconds per token
    b: float  # seconds per token per token of context before it


def prefill_seconds(fit: PrefillCost, tokens: int, context: int = 0) -> float:
    return tokens * fit.a + fit.b * tokens * (context + tokens / 2)


class PrefillFit:
    def __init__(self) -> None:
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=RECENT)

    def add(self, tokens: int, context: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._samples.append((float(tokens), tokens * (context + tokens / 2), seconds))

    def fit(self) -> PrefillCost:
        """The fit, or (0, 0) until there are enough samples to say.

        With too little spread in length to tell ``b`` apart, ``b`` is 0 and ``a`` the
        mean cost per token; a negative term (noise) is clamped to 0 and the other refit.
        """
        if len(self._samples) < MIN_SAMPLES:
            return PrefillCost(0.0, 0.0)
        sxx = sxy = syy = sxt = syt = 0.0
        for x, y, t in self._samples:
            sxx += x * x
            sxy += x * y
            syy += y * y
            sxt += x * t
            syt += y * t
        det = sxx * syy - sxy * sxy
        if det > 1e-9 * sxx * syy:
            a = (sxt * syy - syt * sxy) / det
            b = (syt * sxx - sxt * sxy) / det
            if a >= 0 and b >= 0:
                return PrefillCost(a, b)
            if a < 0 and syy > 0:
                return PrefillCost(0.0, max(syt / syy, 0.0))
        return PrefillCost(max(sxt / sxx, 0.0), 0.0)
