"""Prefill priced by length (pure)."""

from __future__ import annotations

import pytest

from engine.runtimes.prefill_fit import PrefillCost, PrefillFit, prefill_seconds


def test_the_fit_recovers_a_cost_that_grows_with_the_context() -> None:
    truth = PrefillCost(a=0.002, b=1e-7)
    fit = PrefillFit()
    for n, c in [(100, 0), (2000, 0), (500, 3000), (8000, 0), (300, 12000)]:
        fit.add(n, c, prefill_seconds(truth, n, c))
    got = fit.fit()
    assert got.a == pytest.approx(truth.a, rel=1e-6)
    assert got.b == pytest.approx(truth.b, rel=1e-6)
    # a 20,000-token prompt costs far more than 200 times a 100-token one
    assert prefill_seconds(got, 20_000) > 1.4 * 200 * prefill_seconds(got, 100)


def test_too_few_samples_say_nothing_and_one_length_gives_a_flat_rate() -> None:
    fit = PrefillFit()
    fit.add(100, 0, 0.1)
    fit.add(100, 0, 0.1)
    assert fit.fit() == PrefillCost(0.0, 0.0)
    fit.add(100, 0, 0.1)
    assert fit.fit().a == pytest.approx(0.001) and fit.fit().b == 0.0
