"""Scoring: rates, intervals, η and its coverage, on synthetic curves and the simulator."""

from __future__ import annotations

import math

import numpy as np
import pytest

from support import REPO
from support.curves import Curve, run

from verl_sweep.objectives.metrics import StepMetrics, read_all
from verl_sweep.objectives.score import (
    Score,
    ScoreError,
    combine,
    eta,
    fit_saturating,
    score_reward_rate,
    score_throughput,
)

DATA = REPO / "tests" / "data"


def test_rate_close_to_true_chord_and_interval_holds_it() -> None:
    curve = Curve(t_mid_s=3000)
    score = score_reward_rate(run(curve, 500, seed=11))
    true = curve.true_rate(500)
    assert score.ci_low <= true <= score.ci_high
    assert score.rate == pytest.approx(true, rel=0.1)
    assert score.train_time_s == pytest.approx(500 * curve.step_s, rel=0.02)
    assert score.gain == pytest.approx(score.rate * score.train_time_s)
    assert score.reward_first == pytest.approx(curve.reward(0.0), abs=0.03)
    assert score.n_steps == 500 and score.n_runs == 1


@pytest.mark.parametrize("t_mid_s", [800, 3000, 20000])
def test_the_rate_does_not_depend_on_the_bootstrap(t_mid_s: float) -> None:
    # Running reports and the benchmark's peers read only the rate and score without resamples
    # (n_boot=0): the fit that gives the rate is made on the data alone (equal to rounding:
    # the matrix products over 1, 3 or 501 rows sum in different orders).
    steps = run(Curve(t_mid_s=t_mid_s), 500, seed=5)
    full = score_reward_rate(steps, n_boot=500)
    for n_boot in (0, 2):
        cheap = score_reward_rate(steps, n_boot=n_boot)
        for key in ("rate", "gain", "reward_first", "reward_last"):
            assert getattr(cheap, key) == pytest.approx(getattr(full, key), rel=1e-12), key
        assert cheap.ci_high - cheap.ci_low != pytest.approx(full.ci_high - full.ci_low, rel=1e-3)  # the interval does
    rate_only = score_reward_rate(steps, n_boot=0)
    assert (rate_only.ci_low, rate_only.ci_high, rate_only.rate_se) == (-math.inf, math.inf, math.inf)
    speed = score_throughput(steps, n_boot=0)
    assert speed.rate == score_throughput(steps, n_boot=50).rate and speed.ci_high == math.inf
    with pytest.raises(ValueError, match=r"n_boot must be 0 \(the rate alone\) or >= 2, but got 1"):
        score_reward_rate(steps, n_boot=1)


def test_time_is_training_time_only() -> None:
    # Doubling each step's time halves the rate: start-up never enters (it is not a step).
    steps = run(Curve(), 300, seed=1)
    slow = [StepMetrics(s.step, {**s.data, "timing_s/step": 2 * s.data["timing_s/step"]}) for s in steps]  # type: ignore[operator]
    a, b = score_reward_rate(steps, n_boot=50), score_reward_rate(slow, n_boot=50)
    assert b.rate == pytest.approx(a.rate / 2, rel=1e-6)


def test_max_step_and_warmup_select_steps() -> None:
    steps = run(Curve(), 500, seed=2)
    score = score_reward_rate(steps, max_step=300, warmup_steps=20, n_boot=50)
    assert score.n_steps == 280


def test_nan_rewards_are_skipped_and_missing_timing_imputed() -> None:
    steps = run(Curve(), 200, seed=3)
    holed = [
        StepMetrics(s.step, {**s.data, "critic/score/mean": None if s.step % 7 == 0 else s.data["critic/score/mean"]})
        for s in steps
    ]
    holed = [StepMetrics(s.step, {k: v for k, v in s.data.items() if not (k == "timing_s/step" and s.step == 5)}) for s in holed]
    score = score_reward_rate(holed, n_boot=50)
    assert score.n_steps == 200 and math.isfinite(score.rate)


@pytest.mark.parametrize(
    ("steps", "match"),
    [
        ([], "no steps after warm-up"),
        ([StepMetrics(i, {"timing_s/step": 1.0}) for i in range(1, 50)], "no 'critic/score/mean' in the metrics"),
        ([StepMetrics(i, {"timing_s/step": 1.0, "critic/score/mean": None}) for i in range(1, 50)], "only 0 of 49"),
        ([StepMetrics(i, {"critic/score/mean": 0.1}) for i in range(1, 50)], "no 'timing_s/step'"),
        ([StepMetrics(i, {"timing_s/step": 1.0, "critic/score/mean": 0.1 * i}) for i in range(1, 5)], "only 4 of 4"),
    ],
)
def test_score_errors(steps: list[StepMetrics], match: str) -> None:
    with pytest.raises(ScoreError, match=match):
        score_reward_rate(steps)


def test_bad_arguments() -> None:
    steps = run(Curve(), 50, seed=0)
    with pytest.raises(ValueError, match="estimator must be one of"):
        score_reward_rate(steps, estimator="median")
    with pytest.raises(ValueError, match="confidence must be in \\(0, 1\\), but got 1.5"):
        score_reward_rate(steps, confidence=1.5)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        score_reward_rate(steps, warmup_steps=-1)


def test_ceiling_fit_found_when_curve_bends_and_not_when_linear() -> None:
    bent = Curve(t_mid_s=1500, ceiling=0.7, noise=0.01)
    score = score_reward_rate(run(bent, 500, seed=4), fit_ceiling=True, n_boot=50)
    assert score.ceiling == pytest.approx(0.7, abs=0.05)
    t = np.linspace(1, 1000, 300)
    assert fit_saturating(t, 0.1 + 1e-4 * t) is None  # a straight line has no ceiling
    assert score_reward_rate(run(bent, 500, seed=4), n_boot=50).ceiling is None  # not asked


def test_recorded_stream_scores() -> None:
    score = score_reward_rate(read_all(DATA / "metrics_grpo.jsonl"), fit_ceiling=True)
    assert score.rate > 0 and score.ci_low < score.rate < score.ci_high
    assert score.n_steps == 200


def test_throughput() -> None:
    steps = [
        StepMetrics(i, {"timing_s/step": 10.0 if i > 3 else 60.0, "perf/total_num_tokens": 80000.0})
        for i in range(1, 41)
    ]
    score = score_throughput(steps, warmup_steps=3, n_gpus=8)
    assert score.rate == pytest.approx(1000.0) and score.metric == "throughput"
    assert score.n_steps == 37
    only_tput = [StepMetrics(i, {"timing_s/step": 10.0, "perf/throughput": 500.0}) for i in range(1, 20)]
    assert score_throughput(only_tput).rate == pytest.approx(500.0)
    with pytest.raises(ScoreError, match="neither 'perf/total_num_tokens' nor 'perf/throughput'"):
        score_throughput([StepMetrics(i, {"timing_s/step": 1.0}) for i in range(1, 20)])
    with pytest.raises(ValueError, match="n_gpus must be >= 1"):
        score_throughput(steps, n_gpus=0)


def _score(rate: float, se: float, **kw: object) -> Score:
    return Score(rate=rate, gain=rate, train_time_s=1.0, n_steps=100, ci_low=rate - se, ci_high=rate + se,
                 rate_se=se, **kw)  # type: ignore[arg-type]


def test_eta_interval_properties() -> None:
    inc = [_score(1.0, 0.01), _score(1.02, 0.01)]
    e = eta(_score(1.2, 0.01), inc)
    assert e.value == pytest.approx(1.2 / 1.01)
    assert e.low < e.value < e.high
    wider = eta(_score(1.2, 0.05), inc)
    assert wider.low < e.low and wider.high > e.high
    # Repeats that disagree widen the interval beyond their own errors.
    spread = eta(_score(1.2, 0.01), [_score(0.9, 0.01), _score(1.12, 0.01)])
    assert spread.high - spread.low > e.high - e.low
    # An incumbent whose rate is not clearly above zero gives an unbounded interval.
    assert eta(_score(1.0, 0.1), [_score(0.05, 0.1)]).high == math.inf
    with pytest.raises(ScoreError, match="incumbent's rate must be > 0"):
        eta(_score(1.0, 0.1), [_score(-0.5, 0.1)])
    with pytest.raises(ScoreError, match="at least one incumbent"):
        eta(_score(1.0, 0.1), [])
    with pytest.raises(ScoreError, match="different metrics"):
        eta(_score(1.0, 0.1, metric="throughput"), inc)


def test_combine() -> None:
    runs = [_score(1.0, 0.02), _score(1.1, 0.02), _score(0.9, 0.02)]
    both = combine(runs)
    assert both.rate == pytest.approx(1.0) and both.n_runs == 3 and both.n_steps == 300
    # Spread (sd 0.1) dominates the runs' own errors (0.02): se ≈ 0.1/√3.
    assert both.rate_se == pytest.approx(0.1 / math.sqrt(3), rel=0.05)
    assert combine(runs[:1]) == runs[0]
    with pytest.raises(ScoreError, match="at least one score"):
        combine([])


def _eta_coverage(cand_steps, inc_steps, true: float, n_boot: int = 300) -> tuple[int, list[float]]:
    hits, values = 0, []
    for rep, (c, incs) in enumerate(zip(cand_steps, inc_steps)):
        e = eta(score_reward_rate(c, n_boot=n_boot, seed=rep), [score_reward_rate(s, n_boot=n_boot, seed=rep) for s in incs])
        hits += e.low <= true <= e.high
        values.append(e.value)
    return hits, values


def test_eta_coverage_synthetic() -> None:
    cand, inc = Curve(t_mid_s=3000), Curve(t_mid_s=3600)
    true = cand.true_rate(500) / inc.true_rate(500)
    hits, values = _eta_coverage(
        [run(cand, 500, seed=100 + 3 * r) for r in range(20)],
        [[run(inc, 500, seed=100 + 3 * r + j) for j in (1, 2)] for r in range(20)],
        true,
    )
    assert hits >= 16, f"90% interval held the true η {true:.3f} only {hits}/20 times"
    assert abs(np.mean(values) - true) < 0.03


@pytest.mark.slow
@pytest.mark.parametrize("mini_batch", [512, 358])
def test_eta_coverage_on_simulator(mini_batch: int) -> None:
    """Acceptance: 20 repeated evaluations of one config on the simulator (noise on), candidate
    one run vs the baseline's two repeats: the 90% interval holds the true η ≥ 16 times."""
    simulator = pytest.importorskip("verl_sweep.launchers.simulator")
    landscape = simulator.load_landscape("default")
    base = dict(landscape.baseline)
    config = {**base, "actor_rollout_ref.actor.ppo_mini_batch_size": mini_batch}
    true = landscape.eta(config, base)

    def sim(cfg: dict, seed: int) -> list[StepMetrics]:
        return [
            StepMetrics(r.step, {k: None if not math.isfinite(v) else float(v) for k, v in r.metrics.items()})
            for r in landscape.simulate({**cfg, "data.seed": seed}, max_steps=500)
        ]

    hits, values = _eta_coverage(
        [sim(config, 5000 + 3 * r) for r in range(20)],
        [[sim(base, 5000 + 3 * r + j) for j in (1, 2)] for r in range(20)],
        true,
    )
    assert hits >= 16, f"90% interval held the true η {true:.3f} only {hits}/20 times"
    assert abs(np.mean(values) - true) < 0.03


def test_a_probe_read_to_the_run_horizon_ranks_configs_as_the_run_does() -> None:
    # Two curves that cross: the fast starter leads over a 500-step probe, the higher ceiling
    # over a 2,000-step run. Read to the run's horizon, each rate is the run's own chord
    # (fitted on 500 steps) and the ranking is the run's; read to the probe's end, it is the
    # probe's.
    fast, high = Curve(t_mid_s=2500, ceiling=0.7, b=2.0), Curve(t_mid_s=5000, ceiling=0.8, b=2.0)
    assert fast.true_rate(500) > high.true_rate(500) and fast.true_rate(2000) < high.true_rate(2000)
    for curve in (fast, high):
        rates = [score_reward_rate(run(curve, 500, seed=s), n_boot=0, horizon_steps=2000).rate for s in range(4)]
        assert float(np.mean(rates)) == pytest.approx(curve.true_rate(2000), rel=0.06)
    probe, horizon = [], []
    for seed in range(10):
        probe.append(np.divide(*[score_reward_rate(run(c, 500, seed=seed), n_boot=0).rate for c in (fast, high)]))
        horizon.append(np.divide(*[score_reward_rate(run(c, 500, seed=seed), n_boot=0, horizon_steps=2000).rate
                                   for c in (fast, high)]))
    assert min(probe) > 1.1  # every probe ranks the fast starter first
    assert sum(h < 1 for h in horizon) >= 8  # the run's horizon ranks the higher ceiling first
    assert float(np.median(horizon)) == pytest.approx(fast.true_rate(2000) / high.true_rate(2000), rel=0.1)


def test_a_horizon_inside_the_probe_reads_the_probe_and_the_interval_holds_the_run() -> None:
    curve = Curve(t_mid_s=3000)
    steps = run(curve, 500, seed=3)
    assert score_reward_rate(steps, horizon_steps=400).rate == score_reward_rate(steps).rate
    far = score_reward_rate(steps, horizon_steps=2000)
    assert far.ci_low <= curve.true_rate(2000) <= far.ci_high
    near = score_reward_rate(steps)
    assert near.probe_rate is None and far.probe_rate == pytest.approx(near.rate, rel=0.05)  # one fit, two readings
    # reading further than the data is less certain: a wider interval, relative to the rate
    assert (far.ci_high - far.ci_low) / far.rate > (near.ci_high - near.ci_low) / near.rate
