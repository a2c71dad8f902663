"""Score a run: reward gain per second of training time, with a confidence interval.

The method (docs/method.md §1) compares configs by η = (ΔR₁/T₁) / (ΔR₀/T₀): reward gain per second of
training. What we measure, and why:

* **Time** is the sum of ``timing_s/step`` over the scored steps: verl's step timer excludes
  model loading, engine warm-up and validation, which would otherwise swamp a short probe.
* **Gain** is the rise of a trend fitted to ``critic/score/mean`` (the raw task score, before
  any in-reward KL) against cumulative training time, read between the start of the first and
  the end of the last scored step. A trend, not "last minus first": one step's reward is a
  noisy batch mean.
* **Which trend.** The target is the method's ΔR/T: the chord (R(T) − R(0)) / T of the
  noise-free curve. ``estimator="curve"`` (default) fits the saturating curve
  R(t) = R0 + (A−R0)/(1+(t_mid/t)^B) and reads the chord off the fit; ``"ols"`` is the slope
  of a straight line; ``"windows"`` the difference of the means of the first and last fifth
  over the time between their centres. (A quadratic trend's chord equals the OLS slope on
  evenly spaced steps, so it adds nothing.) Once a curve bends, OLS and windows under-state the
  faster config's gain (they weight the flat late part) and misjudge a saturating candidate by
  more than the 5% step the method acts on; only the curve fit stays unbiased, at 1.5-2× the
  spread of OLS, so it is the default (docs/method.md, Evidence). Pass ``estimator="ols"`` for
  runs known to be far from saturation.
* **Interval** by a moving-block bootstrap over steps (blocks of ~1.5·n^⅓ consecutive steps,
  resampled with their times, so autocorrelated noise widens the interval): every resample is
  refitted on the whole (t_mid, B) grid. The standard error is read from the bootstrap's
  central 68% (refits that jump along the fit's ridge give heavy tails).

``ScoreError`` is raised, with a one-line reason, when a run cannot be scored.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import statistics
from typing import Sequence

import numpy as np

from verl_sweep.objectives.metrics import REWARD_KEY, STEP_TIME_KEY, THROUGHPUT_KEY, TOKENS_KEY, StepMetrics
from verl_sweep.objectives.shape import late_gain
from verl_sweep.objectives.trend import block_indices, boot_weights, fit_curve, fit_poly, fit_windows

logger = logging.getLogger(__name__)

#: a learning probe needs this many scored steps (after its warm-up) for a reward rate
MIN_SCORED_STEPS = 10
#: a running rate reported to the pruner needs only this many: it is compared with the
#: incumbent's at the same step, not kept. A short probe must report several times before its
#: last step, or its pruner can never act (docs/method.md, Evidence).
MIN_RUNNING_STEPS = 3
#: a speed-only probe needs this many for a throughput
MIN_SPEED_STEPS = 2

ESTIMATORS = ("curve", "ols", "windows")


class Metric(str, enum.Enum):
    """What a probe is scored on; ``Score.metric`` holds its value."""

    #: reward gain per training second (learning, and the speed it comes at)
    REWARD_RATE = "reward_rate"
    #: tokens per second per GPU (speed alone)
    THROUGHPUT = "throughput"

    @property
    def min_steps(self) -> int:
        """Scored steps (after the warm-up) a finished probe needs for this score."""
        return MIN_SPEED_STEPS if self is Metric.THROUGHPUT else MIN_SCORED_STEPS


class ScoreError(Exception):
    """A run cannot be scored (too few steps, no reward key, all NaN); the message says why."""


@dataclasses.dataclass(frozen=True)
class Score:
    """One run's (or the mean of several runs') rate with its interval.

    ``metric`` is "reward_rate" (rate = reward gain per training second) or "throughput"
    (rate = tokens per second per GPU). ``rate_se`` is the standard error behind the interval.
    """

    rate: float
    gain: float
    train_time_s: float
    n_steps: int
    ci_low: float
    ci_high: float
    rate_se: float
    confidence: float = 0.9
    reward_first: float | None = None
    reward_last: float | None = None
    ceiling: float | None = None
    metric: str = "reward_rate"
    n_runs: int = 1
    #: the rate read to the probe's own last step, where ``rate`` is read further (to the run's
    #: horizon); None where they are the same reading
    probe_rate: float | None = None
    #: the reward's rise in the last quarter of the scored steps over its largest quarter's
    #: (quarter means): ~1 while the curve still accelerates at the probe's end (a slow start,
    #: where a short probe's rate judges early speed, not the run), below ~0.7 once it bends
    late_gain: float | None = None


@dataclasses.dataclass(frozen=True)
class Eta:
    """η = candidate rate ÷ incumbent rate, with its interval (may be infinite: see ``eta``)."""

    value: float
    low: float
    high: float
    confidence: float = 0.9


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), but got {confidence}. Use e.g. 0.9.")
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2.0)


def _series(
    steps: Sequence[StepMetrics], key: str, *, warmup_steps: int, max_step: int | None
) -> tuple[list[StepMetrics], np.ndarray, np.ndarray]:
    """The scored steps, their durations (gaps filled with the median) and ``key`` values."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, but got {warmup_steps}. Pass 0 to score every step.")
    chosen = sorted(
        (s for s in steps if s.step > warmup_steps and (max_step is None or s.step <= max_step)),
        key=lambda s: s.step,
    )
    if not chosen:
        raise ScoreError(
            f"no steps after warm-up ({warmup_steps}) up to step {max_step}: the run logged {len(steps)} steps"
        )
    durations = np.array([_nan(s.get(STEP_TIME_KEY)) for s in chosen], dtype=float)
    known = durations[np.isfinite(durations) & (durations > 0)]
    if known.size == 0:
        raise ScoreError(f"no '{STEP_TIME_KEY}' in the {len(chosen)} scored steps: cannot measure training time")
    # A step without a timing still took time; the median is the least surprising guess.
    durations = np.where(np.isfinite(durations) & (durations > 0), durations, float(np.median(known)))
    values = np.array([_nan(s.get(key)) for s in chosen], dtype=float)
    return chosen, durations, values


def _robust_sd(values: np.ndarray) -> float:
    """Standard deviation read from the central 68% (a refit that jumps along the curve's
    (t_mid, B) ridge gives the bootstrap heavy tails, which inflate a plain sd)."""
    if values.size < 2:
        return math.inf
    if values.size < 20:
        return float(values.std(ddof=1))
    lo, hi = np.quantile(values, [0.158655, 0.841345])
    return float(hi - lo) / 2.0


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def score_reward_rate(
    steps: Sequence[StepMetrics],
    *,
    max_step: int | None = None,
    warmup_steps: int = 0,
    confidence: float = 0.9,
    n_boot: int = 500,
    seed: int = 0,
    fit_ceiling: bool = False,
    estimator: str = "curve",
    reward_key: str = REWARD_KEY,
    min_steps: int = MIN_SCORED_STEPS,
    horizon_steps: int | None = None,
) -> Score:
    """Reward gain per second of training over steps ``warmup_steps+1 .. max_step``.

    Raises ``ScoreError`` when fewer than ``min_steps`` scored steps have a finite reward,
    when the reward key is absent, or when no step reports its time. ``ceiling`` is filled
    only with ``fit_ceiling`` and when the curve bends enough to identify it. ``n_boot=0``
    gives the rate alone, with an infinite interval (what a running report reads).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, but got {estimator!r}.")
    _z(confidence)
    if n_boot < 0 or n_boot == 1:
        raise ValueError(f"n_boot must be 0 (the rate alone) or >= 2, but got {n_boot}. Use 500 for a stable interval.")
    chosen, durations, rewards = _series(steps, reward_key, warmup_steps=warmup_steps, max_step=max_step)
    if not any(reward_key in s.data for s in chosen):
        raise ScoreError(f"no '{reward_key}' in the metrics: is the reward function logging a score?")
    # Reward of step i is measured on rollouts of the policy *before* update i: its time is
    # the start of step i on the training clock.
    starts = np.concatenate([[0.0], np.cumsum(durations)[:-1]])
    train_time = float(durations.sum())
    finite = np.isfinite(rewards)
    n_finite = int(finite.sum())
    if n_finite < min_steps:
        raise ScoreError(
            f"only {n_finite} of {len(chosen)} scored steps have a finite '{reward_key}' (need {min_steps})"
        )
    x = starts[finite] / train_time  # unit time axis keeps the sums well scaled
    y = rewards[finite]
    weights = np.vstack([np.ones((1, x.size)), boot_weights(x.size, n_boot, seed)])
    # Training time before the scored window (warm-up steps) positions it on the curve.
    before = [s for s in steps if 1 <= s.step <= warmup_steps]
    warm_s = sum(_nan(s.get(STEP_TIME_KEY)) for s in before if s.get(STEP_TIME_KEY) is not None)
    warm_s += (warmup_steps - sum(1 for s in before if s.get(STEP_TIME_KEY) is not None)) * float(
        np.median(durations)
    )
    warm_x = warm_s / train_time
    # The chord ends at the horizon: the probe's last step, or the run's (read off the fitted
    # curve, the steps still to come timed as the probe's last quarter was).
    extra_steps = 0 if horizon_steps is None or estimator != "curve" else max(0, horizon_steps - chosen[-1].step)
    tail = durations[-max(1, durations.size // 4):]
    end_x = warm_x + 1.0 + extra_steps * float(tail.mean()) / train_time
    ceiling_x: float | None = None
    if estimator == "curve" or fit_ceiling:
        curve = fit_curve(x + warm_x, y, weights, warm_x, end_x)
        ceiling_x = curve.ceiling
    if estimator == "curve":
        fit = curve
    elif estimator == "ols":
        fit = fit_poly(x, y, weights)
    else:
        fit = fit_windows(x, y, weights)

    window_s = (end_x - warm_x) * train_time if estimator == "curve" else train_time
    rate = fit.chord / window_s
    boot = fit.boot[np.isfinite(fit.boot)] / window_s
    se = _robust_sd(boot)
    alpha = (1.0 - confidence) / 2.0
    if boot.size >= 20:
        # Basic (reflected percentile) interval: corrects the bootstrap's own bias around rate.
        lo_q, hi_q = np.quantile(boot, [alpha, 1.0 - alpha])
        ci_low, ci_high = 2 * rate - float(hi_q), 2 * rate - float(lo_q)
    else:
        z = _z(confidence)
        ci_low, ci_high = rate - z * se, rate + z * se
    return Score(
        rate=rate,
        gain=fit.chord,
        train_time_s=train_time,
        n_steps=len(chosen),
        ci_low=ci_low,
        ci_high=ci_high,
        rate_se=se,
        confidence=confidence,
        reward_first=fit.first,
        reward_last=fit.last,
        ceiling=ceiling_x if fit_ceiling else None,
        late_gain=late_gain(y),
        probe_rate=fit.chord_over(warm_x, warm_x + 1.0) / train_time if extra_steps else None,
    )


def fit_saturating(t: Sequence[float] | np.ndarray, r: Sequence[float] | np.ndarray,
                   *, max_extrapolation: float = 3.0) -> float | None:
    """Ceiling A of R(t) = R0 + (A−R0)/(1+(t_mid/t)^B) (t: time since training began).

    Least squares over a (t_mid, B) grid with a closed-form (R0, A) at each point (no scipy).
    None when the data never bend towards a ceiling: t_mid beyond ``max_extrapolation`` ×
    the observed time, or on the grid's edge.
    """
    t_arr, r_arr = np.asarray(t, dtype=float), np.asarray(r, dtype=float)
    ok = np.isfinite(t_arr) & np.isfinite(r_arr) & (t_arr >= 0)
    t_arr, r_arr = t_arr[ok], r_arr[ok]
    if t_arr.size < 10:
        return None
    scale = float(t_arr.max())
    fit = fit_curve(t_arr / scale, r_arr, np.ones((1, t_arr.size)), 0.0, 1.0,
                     max_extrapolation=max_extrapolation)
    return fit.ceiling


def score_throughput(steps: Sequence[StepMetrics], *, warmup_steps: int = 3, n_gpus: int = 1,
                     confidence: float = 0.9, n_boot: int = 500, seed: int = 0) -> Score:
    """Tokens per second per GPU over the steps after ``warmup_steps`` (speed-only stages).

    Rate = Σ tokens ÷ Σ step time ÷ ``n_gpus`` (a ratio of sums, so long steps weigh what
    they cost). Without ``perf/total_num_tokens`` it falls back to verl's ``perf/throughput``
    (already per GPU), time-weighted. ``gain`` holds the tokens processed.
    """
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, but got {n_gpus}. Pass the run's GPU count.")
    z = _z(confidence)
    chosen, durations, tokens = _series(steps, TOKENS_KEY, warmup_steps=warmup_steps, max_step=None)
    if np.isfinite(tokens).sum() >= 2:
        ok = np.isfinite(tokens)
        per_gpu_tokens = tokens[ok] / n_gpus
        times = durations[ok]
    else:
        tput = np.array([_nan(s.get(THROUGHPUT_KEY)) for s in chosen], dtype=float)
        ok = np.isfinite(tput)
        if ok.sum() < 2:
            raise ScoreError(
                f"neither '{TOKENS_KEY}' nor '{THROUGHPUT_KEY}' in {len(chosen)} steps after warm-up {warmup_steps}"
            )
        times = durations[ok]
        per_gpu_tokens = tput[ok] * times
    rate = float(per_gpu_tokens.sum() / times.sum())
    rng = np.random.default_rng(seed)
    idx = block_indices(times.size, n_boot, rng)
    boot = per_gpu_tokens[idx].sum(axis=1) / times[idx].sum(axis=1)
    se = float(boot.std(ddof=1)) if boot.size > 1 else math.inf
    alpha = (1.0 - confidence) / 2.0
    lo_q, hi_q = np.quantile(boot, [alpha, 1.0 - alpha]) if boot.size else (-math.inf, math.inf)
    del z
    return Score(
        rate=rate,
        gain=float(per_gpu_tokens.sum() * n_gpus),
        train_time_s=float(times.sum()),
        n_steps=int(times.size),
        ci_low=2 * rate - float(hi_q),
        ci_high=2 * rate - float(lo_q),
        rate_se=se,
        confidence=confidence,
        metric="throughput",
    )


def throughput_settled(steps: Sequence[StepMetrics], *, warmup_steps: int, tolerance: float) -> bool:
    """True once two steps in a row after ``warmup_steps`` processed tokens at rates within
    ``tolerance`` of their mean (a speed probe may end there: more steps would cost minutes
    each on real hardware and move the rate by less)."""
    return settled_at(steps, warmup_steps=warmup_steps, tolerance=tolerance) is not None


def settled_at(steps: Sequence[StepMetrics], *, warmup_steps: int, tolerance: float) -> int | None:
    """The first step at which ``throughput_settled`` holds for the steps up to it (None: not
    yet): where a driver reading each step as it comes ends the probe."""
    rates: list[float] = []
    for s in steps:
        if s.step <= warmup_steps:
            continue
        tokens, seconds = _nan(s.get(TOKENS_KEY)), _nan(s.get(STEP_TIME_KEY))
        if not (math.isfinite(tokens) and math.isfinite(seconds) and seconds > 0):
            continue
        rates.append(tokens / seconds)
        a, b = rates[-2:] if len(rates) >= 2 else (math.nan, math.nan)
        if len(rates) >= MIN_SPEED_STEPS and abs(a - b) <= tolerance * (a + b) / 2:
            return s.step
    return None


def _run_var(score: Score, rel_seed_var: float) -> float:
    """Variance of one run's rate across seeds: its own bootstrap variance plus the seed
    component (a combined score already carries the seed component in its ``rate_se``)."""
    seed_var = rel_seed_var * score.rate**2 if score.n_runs == 1 else 0.0
    return score.rate_se**2 + seed_var


def _seed_var(scores: Sequence[Score], seed_sd: float) -> float:
    """Relative seed variance: ``seed_sd``² as a floor, or what the repeats' spread shows."""
    if seed_sd < 0:
        raise ValueError(f"seed_sd must be >= 0, but got {seed_sd}. Pass 0 to trust each run's own interval.")
    rel = seed_sd**2
    if len(scores) >= 2:
        rates = np.array([s.rate for s in scores])
        mean = float(rates.mean())
        excess = float(rates.var(ddof=1)) - float(np.mean([s.rate_se**2 for s in scores]))
        if mean != 0 and excess > 0:
            rel = max(rel, excess / mean**2)
    return rel


def combine(scores: Sequence[Score], *, seed_sd: float = 0.02) -> Score:
    """The mean of repeated runs of one config (fresh seeds) as one Score.

    Its standard error is that of a mean of runs whose rates vary by their own bootstrap
    error plus a seed component (see ``eta``); ``n_steps`` is the total over the runs.
    """
    if not scores:
        raise ScoreError("combine needs at least one score, but got none")
    metrics = {s.metric for s in scores}
    if len(metrics) > 1:
        raise ScoreError(f"cannot combine scores of different metrics {sorted(metrics)}")
    if len(scores) == 1:
        return scores[0]
    k = len(scores)
    confidence = scores[0].confidence
    mean_rate = float(np.mean([s.rate for s in scores]))
    rel = _seed_var(scores, seed_sd)
    se = math.sqrt(float(np.mean([_run_var(s, rel) for s in scores])) / k)
    z = _z(confidence)

    def mean_of(values: list[float | None]) -> float | None:
        return None if any(v is None for v in values) else float(np.mean([v for v in values if v is not None]))

    return Score(
        rate=mean_rate,
        gain=float(np.mean([s.gain for s in scores])),
        train_time_s=float(np.mean([s.train_time_s for s in scores])),
        n_steps=sum(s.n_steps for s in scores),
        ci_low=mean_rate - z * se,
        ci_high=mean_rate + z * se,
        rate_se=se,
        confidence=confidence,
        reward_first=mean_of([s.reward_first for s in scores]),
        reward_last=mean_of([s.reward_last for s in scores]),
        ceiling=mean_of([s.ceiling for s in scores]),
        metric=scores[0].metric,
        n_runs=sum(s.n_runs for s in scores),
        late_gain=mean_of([s.late_gain for s in scores]),
        probe_rate=mean_of([s.probe_rate for s in scores]),
    )


def eta(
    candidate: Score,
    incumbents: Sequence[Score],
    *,
    confidence: float | None = None,
    seed_sd: float = 0.02,
) -> Eta:
    """η = candidate.rate ÷ mean incumbent rate, with Fieller's interval for a ratio.

    A run's bootstrap interval sees only the noise inside that run; a fresh seed also moves
    the whole curve (RL is as seed-sensitive as it is hyperparameter-sensitive). Each run's
    variance therefore gets a seed component: ``seed_sd`` (relative sd of a run's rate across
    seeds; 2% by default, what the simulator's default landscape shows) as a floor, raised
    to what the incumbent's repeats show when they spread more than their own intervals
    admit. The incumbent counts as the mean of its repeats. Without the seed component a 90%
    interval covers far less than 90% (docs/method.md, Evidence). Fieller's interval is exact for a ratio of normal estimates and becomes
    unbounded (low=-inf, high=inf) when the incumbent's rate is not clearly above zero.
    """
    if not incumbents:
        raise ScoreError("eta needs at least one incumbent score, but got none")
    metrics = {candidate.metric, *(s.metric for s in incumbents)}
    if len(metrics) > 1:
        raise ScoreError(f"cannot compare scores of different metrics {sorted(metrics)}")
    confidence = candidate.confidence if confidence is None else confidence
    z = _z(confidence)
    k = len(incumbents)
    b = float(np.mean([s.rate for s in incumbents]))
    if not b > 0:
        raise ScoreError(f"the incumbent's rate must be > 0 to form a ratio, but got {b:.3g}")
    rel = _seed_var(incumbents, seed_sd)
    sb = math.sqrt(float(np.mean([_run_var(s, rel) for s in incumbents])) / k)
    a = candidate.rate
    sa = math.sqrt(_run_var(candidate, rel))
    value = a / b
    # Fieller: {η : (a − η b)² ≤ z² (sa² + η² sb²)} → q2 η² − 2 a b η + q0 ≤ 0.
    q2 = b * b - z * z * sb * sb
    q0 = a * a - z * z * sa * sa
    disc = (a * b) ** 2 - q2 * q0
    if q2 <= 0 or disc < 0:
        return Eta(value=value, low=-math.inf, high=math.inf, confidence=confidence)
    root = math.sqrt(disc)
    return Eta(value=value, low=(a * b - root) / q2, high=(a * b + root) / q2, confidence=confidence)


def paired_eta(
    candidate: Sequence[tuple[int | None, Score]],
    incumbents: Sequence[tuple[int | None, Score]],
    *,
    confidence: float | None = None,
    seed_sd: float = 0.02,
) -> Eta:
    """η of a config's runs ``(seed, score)`` over the incumbent's, pairing runs on one seed.

    A seed moves a whole curve (data order, the first rollouts), and moves it alike for two
    configs: a run compared with the incumbent's run on its own seed leaves that shared part
    out. Each pair gives d = log(a/b); its variance is the median over the pairs of the two
    runs' own (bootstrap) relative variances summed, or, with two or more pairs, their observed
    spread if larger (where seeds share little, pairing then gains nothing). Runs without a
    partner are compared with the incumbent's mean, seed variance included, as in ``eta``. The
    two means of d are pooled by inverse variance; the interval is normal on the log scale.
    Without a pair, or with a rate that is not positive, this is ``eta`` on the combined runs.
    """
    if not candidate:
        raise ScoreError("paired_eta needs at least one candidate run, but got none")
    inc_scores = [s for _, s in incumbents]
    by_seed: dict[int, Score] = {}
    for seed, score in incumbents:
        if seed is not None:
            by_seed.setdefault(seed, score)
    pairs = [(score, by_seed[seed]) for seed, score in candidate if seed is not None and seed in by_seed]
    alone = [score for seed, score in candidate if seed is None or seed not in by_seed]
    cand_scores = [s for _, s in candidate]
    if not pairs or any(s.rate <= 0 for s in cand_scores + inc_scores):
        return eta(combine(cand_scores) if len(cand_scores) > 1 else cand_scores[0], inc_scores,
                   confidence=confidence, seed_sd=seed_sd)
    confidence = cand_scores[0].confidence if confidence is None else confidence
    z = _z(confidence)

    def rel_var(s: Score) -> float:
        return (s.rate_se / s.rate) ** 2

    d = np.array([math.log(a.rate / b.rate) for a, b in pairs])
    # The median: one run with an unidentified fit (±100%) must not set every pair's floor.
    floor = float(np.median([rel_var(a) + rel_var(b) for a, b in pairs]))
    spread = float(d.var(ddof=1)) if d.size >= 2 else 0.0
    means = [(float(d.mean()), max(floor, spread) / d.size)]
    if alone:
        rel = _seed_var(inc_scores, seed_sd)
        b = float(np.mean([s.rate for s in inc_scores]))
        var_b = float(np.mean([_run_var(s, rel) for s in inc_scores])) / len(inc_scores) / b**2
        d_alone = [math.log(s.rate / b) for s in alone]
        var_alone = float(np.mean([rel_var(s) + rel for s in alone])) / len(alone) + var_b
        means.append((float(np.mean(d_alone)), var_alone))
    weights = [1.0 / max(v, 1e-12) for _, v in means]
    mean = sum(w * m for w, (m, _) in zip(weights, means)) / sum(weights)
    se = math.sqrt(1.0 / sum(weights))
    return Eta(value=_exp(mean), low=_exp(mean - z * se), high=_exp(mean + z * se), confidence=confidence)


def _exp(x: float) -> float:
    """e^x, infinite past a float's range (an interval as wide as that is unbounded)."""
    return math.exp(x) if x < 709.0 else math.inf
