"""A leader that used every run it may get and is still undecided wins on balance when it
beats the incumbent with probability >= LIKELY_BETTER (noisy worlds)."""

from __future__ import annotations

import math

import pytest

from verl_sweep.search.method.policy import LIKELY_BETTER, likely_better

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(("value", "low", "expected"), [
    (1.045, 0.970, True),    # noisy_hetero's lr leader over 5 runs: p ≈ 0.83
    (1.037, 0.958, False),   # p ≈ 0.77
    (1.100, 1.010, True),    # decided anyway
    (0.990, 0.900, False),   # below the incumbent
    (1.030, -math.inf, False),  # an unbounded interval says nothing
])
def test_probability_read_off_the_interval(value: float, low: float, expected: bool) -> None:
    assert likely_better(value, low) is expected


def test_the_bar_is_the_constant() -> None:
    # value and low such that P(η > 1) is just above / below the bar
    z90 = 1.6448536269514722
    from statistics import NormalDist
    z = NormalDist().inv_cdf(LIKELY_BETTER)
    for margin, expected in ((1.02, True), (0.98, False)):
        se = math.log(1.05) / (z * margin)
        low = math.exp(math.log(1.05) - z90 * se)
        assert likely_better(1.05, low) is expected
