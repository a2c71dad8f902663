"""Paired η: a candidate's run is compared with the incumbent's run on its own
seed, so what a seed does to both curves cancels; runs without a partner fall back to the
incumbent's mean, and without any pair it is ``eta`` itself."""

from __future__ import annotations

import math

import numpy as np
import pytest

from verl_sweep.objectives.score import Score, combine, eta, paired_eta

pytestmark = pytest.mark.fast


def _score(rate: float, se_rel: float = 0.01) -> Score:
    return Score(rate=rate, gain=rate * 100, train_time_s=100.0, n_steps=500, ci_low=rate * (1 - 1.645 * se_rel),
                 ci_high=rate * (1 + 1.645 * se_rel), rate_se=rate * se_rel)


def test_without_a_pair_it_is_eta() -> None:
    cand = [(13, _score(1.05)), (14, _score(1.07))]
    inc = [(11, _score(1.0)), (12, _score(0.98))]
    got = paired_eta(cand, inc)
    want = eta(combine([s for _, s in cand]), [s for _, s in inc])
    assert (got.value, got.low, got.high) == pytest.approx((want.value, want.low, want.high))


def test_a_shared_seed_effect_cancels() -> None:
    # Each seed moves both configs' rates by the same factor (±10%); the true η is 1.05.
    rng = np.random.default_rng(0)
    hits, widths_paired, widths_plain = 0, [], []
    for _ in range(200):
        factors = np.exp(rng.normal(0, 0.10, 3))
        inc = [(s, _score(1.0 * f * math.exp(rng.normal(0, 0.01)))) for s, f in zip((11, 12, 13), factors)]
        cand = [(s, _score(1.05 * f * math.exp(rng.normal(0, 0.01)))) for s, f in zip((11, 12), factors[:2])]
        e = paired_eta(cand, inc)
        plain = eta(combine([s for _, s in cand]), [s for _, s in inc])
        hits += e.low <= 1.05 <= e.high
        widths_paired.append(e.high - e.low)
        widths_plain.append(plain.high - plain.low)
    assert hits >= 0.85 * 200  # the 90% interval holds its level
    assert np.median(widths_paired) < 0.3 * np.median(widths_plain)


def test_seeds_that_share_nothing_keep_the_interval_wide() -> None:
    # Independent seeds: the pairs' observed spread, not the runs' own small errors, sets the width.
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(200):
        inc = [(s, _score(math.exp(rng.normal(0, 0.10)))) for s in (11, 12, 13, 14)]
        cand = [(s, _score(1.05 * math.exp(rng.normal(0, 0.10)))) for s in (11, 12, 13, 14)]
        e = paired_eta(cand, inc)
        hits += e.low <= 1.05 <= e.high
    assert hits >= 0.75 * 200  # 4 pairs, a normal interval on an estimated spread: a little below 90%


def test_unpaired_runs_count_beside_the_pairs() -> None:
    inc = [(11, _score(1.0)), (12, _score(1.0))]
    paired_only = paired_eta([(11, _score(1.10))], inc)
    with_more = paired_eta([(11, _score(1.10)), (15, _score(1.10)), (16, _score(1.10))], inc)
    assert with_more.value == pytest.approx(1.10, rel=1e-6)
    assert with_more.high - with_more.low < paired_only.high - paired_only.low


def test_a_rate_that_is_not_positive_falls_back_to_fieller() -> None:
    inc = [(11, _score(1.0)), (12, _score(1.0))]
    got = paired_eta([(11, _score(-0.2, 0.5))], inc)
    want = eta(_score(-0.2, 0.5), [s for _, s in inc])
    assert (got.value, got.low, got.high) == pytest.approx((want.value, want.low, want.high))


def test_one_run_with_an_unidentified_fit_does_not_widen_every_pair() -> None:
    # noisy_hetero rep 3: one of five paired runs had a ±100% bootstrap interval (its curve fit
    # was unidentified); as the mean of the pairs' variances it set the floor of all of them.
    inc = [(s, _score(1.0 + 0.01 * i)) for i, s in enumerate((11, 12, 13, 14, 15))]
    steady = [(s, _score(1.06 * (1.0 + 0.01 * i) * (1 + 0.004 * (-1) ** i))) for i, s in enumerate((11, 12, 13, 14, 15))]
    wild = steady[:1] + [(12, _score(steady[1][1].rate, se_rel=0.6))] + steady[2:]
    plain, hit = paired_eta(steady, inc), paired_eta(wild, inc)
    assert hit.value == pytest.approx(plain.value)
    assert hit.low > 1.02 and (hit.high - hit.low) < 1.5 * (plain.high - plain.low)
    # The observed spread still counts every pair: one pair far off widens the interval.
    off = steady[:1] + [(12, _score(steady[1][1].rate * 0.8))] + steady[2:]
    assert paired_eta(off, inc).high - paired_eta(off, inc).low > 3 * (plain.high - plain.low)


def test_an_interval_past_a_float_s_range_is_unbounded_not_an_error() -> None:
    # A rate read far past its data can carry a standard error thousands of times the rate.
    result = paired_eta([(1, _score(1.0, se_rel=1e6))], [(1, _score(1.0))])
    assert result.high == math.inf and result.low == 0.0 and result.value == pytest.approx(1.0)
