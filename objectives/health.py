"""The method's health screen (docs/method.md §1, "three indicators") over a run's metrics so far.

Called by the probe after every batch of new steps; returns the first problem found, or
None. Checks, in order (the first hit wins; thresholds are keyword arguments):

* ``non_finite`` — reward or loss is NaN/inf (``None`` in verl's file) at the last step, or
  the grad norm is non-finite ``max_nonfinite_grad`` steps in a row (verl skips the optimizer
  step on a non-finite grad norm, so a single one is survivable).
* ``kl_divergence`` — KL to the reference above ``kl_max`` (0.3) and rising: the median of the
  last ``kl_window`` steps is above the limit and their trend is upward. The KL key is the
  first present of ``kl_key`` (one key or several: GRPO's ``actor/kl_loss``, PPO's in-reward
  ``actor/reward_kl_penalty``); runs that log none of them skip this check.
* ``grad_explosion`` — the grad norm is above ``grad_high`` (10) in at least
  ``grad_high_fraction`` of the last ``grad_window`` steps ("often above 10").
* ``grad_vanishing`` — the grad norm is below ``grad_low`` (1e-3) in at least 90% of the
  last ``vanish_window`` steps ("long below 1e-3").
* ``plateau`` — over the last ``plateau_steps`` (200) steps the reward neither rose nor
  moved: the fitted linear rise and the change between the window's halves are both below
  ``plateau_tol`` (0.01). With ``plateau_max_rise``, only a run whose level is less than that
  above its first steps' (stuck, not converged: a probe's rate already prices a run that
  rose and then levelled off). Both are trend measures, so per-step noise (a batch mean moves by
  0.02-0.05 step to step) does not hide a flat run, and a run still rising by more than 0.01
  per 200 steps is never called flat.

Detection delays measured in ``tests/objectives/test_health.py``: a KL or grad-norm blow-up is caught
within 15 steps; a plateau within 200-230 steps of its start (the window must fill first).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import numpy as np

from verl_sweep.objectives.metrics import GRAD_KEY, KL_KEYS, LOSS_KEYS, REWARD_KEY, StepMetrics

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HealthVerdict:
    """A problem the screen found: ``kind`` (stable name), ``reason`` (for people), ``step``."""

    kind: str
    reason: str
    step: int


def _values(steps: Sequence[StepMetrics], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that carry ``key`` (None → NaN)."""
    pairs = [(s.step, math.nan if s.data[key] is None else s.data[key]) for s in steps if key in s.data]
    if not pairs:
        return np.empty(0, dtype=int), np.empty(0)
    arr = np.array(pairs, dtype=float)
    return arr[:, 0].astype(int), arr[:, 1]


def _slope(x: np.ndarray, y: np.ndarray) -> float:
    ok = np.isfinite(y)
    x, y = x[ok].astype(float), y[ok]
    if x.size < 3 or np.ptp(x) == 0:
        return 0.0
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


def screen(
    steps: Sequence[StepMetrics],
    *,
    kl_key: Sequence[str] | str = KL_KEYS,
    reward_key: str = REWARD_KEY,
    grad_key: str = GRAD_KEY,
    loss_keys: Sequence[str] = LOSS_KEYS,
    kl_max: float = 0.3,
    kl_window: int = 10,
    grad_high: float = 10.0,
    grad_high_fraction: float = 0.3,
    grad_window: int = 30,
    grad_low: float = 1e-3,
    vanish_window: int = 100,
    max_nonfinite_grad: int = 3,
    plateau_steps: int = 200,
    plateau_tol: float = 0.01,
    plateau_max_rise: float | None = None,
) -> HealthVerdict | None:
    """The first health problem in ``steps`` (ordered or not), or None when the run looks sound.

    Pure function of the steps so far; cheap enough to call after every poll (O(window)).
    """
    if not steps:
        return None
    steps = sorted(steps, key=lambda s: s.step)
    last = steps[-1]
    for check in (
        lambda: _non_finite(steps, reward_key, loss_keys, grad_key, max_nonfinite_grad),
        lambda: _kl(steps, (kl_key,) if isinstance(kl_key, str) else tuple(kl_key), kl_max, kl_window),
        lambda: _grad(steps, grad_key, grad_high, grad_high_fraction, grad_window, grad_low, vanish_window),
        lambda: _plateau(steps, reward_key, plateau_steps, plateau_tol, plateau_max_rise),
    ):
        verdict = check()
        if verdict is not None:
            logger.info("health screen at step %d: %s (%s)", last.step, verdict.kind, verdict.reason)
            return verdict
    return None


def _non_finite(
    steps: list[StepMetrics], reward_key: str, loss_keys: Sequence[str], grad_key: str, max_grad: int
) -> HealthVerdict | None:
    last = steps[-1]
    for key in (reward_key, *loss_keys):
        if key in last.data and last.data[key] is None:
            return HealthVerdict("non_finite", f"{key} is NaN/inf at step {last.step}", last.step)
    _, grads = _values(steps[-max_grad:], grad_key)
    if grads.size >= max_grad and not np.isfinite(grads[-max_grad:]).any():
        first = steps[-max_grad].step
        return HealthVerdict(
            "non_finite",
            f"{grad_key} is NaN/inf for {max_grad} steps in a row (steps {first}-{last.step})",
            last.step,
        )
    return None


def _kl(steps: list[StepMetrics], kl_keys: tuple[str, ...], kl_max: float, window: int) -> HealthVerdict | None:
    key = next((k for k in kl_keys if any(k in s.data for s in steps[-window:])), None)
    if key is None:
        return None
    at, kl = _values(steps[-window:], key)
    finite = kl[np.isfinite(kl)]
    if finite.size < max(3, window // 2):
        return None
    level = float(np.median(finite))
    slope = _slope(at, kl)
    if level > kl_max and slope > 0:
        return HealthVerdict(
            "kl_divergence",
            f"KL ({key}) {level:.3g} > {kl_max:g} and rising over steps {at[0]}-{at[-1]} "
            f"(+{slope * window:.3g} per {window} steps): the KL penalty is too weak or the actor "
            "updates too large",
            steps[-1].step,
        )
    return None


def _grad(
    steps: list[StepMetrics],
    key: str,
    high: float,
    high_fraction: float,
    window: int,
    low: float,
    vanish_window: int,
) -> HealthVerdict | None:
    at, grad = _values(steps[-window:], key)
    finite = grad[np.isfinite(grad)]
    if finite.size >= max(5, window // 2):
        share = float((finite > high).mean())
        if share >= high_fraction:
            return HealthVerdict(
                "grad_explosion",
                f"grad norm above {high:g} in {share:.0%} of steps {at[0]}-{at[-1]} "
                f"(max {finite.max():.3g}): exploding gradients",
                steps[-1].step,
            )
    at, grad = _values(steps[-vanish_window:], key)
    finite = grad[np.isfinite(grad)]
    if at.size and at[-1] - at[0] + 1 >= vanish_window and finite.size >= vanish_window * 0.9:
        share = float((finite < low).mean())
        if share >= 0.9:
            return HealthVerdict(
                "grad_vanishing",
                f"grad norm below {low:g} in {share:.0%} of steps {at[0]}-{at[-1]} "
                f"(median {np.median(finite):.2g}): vanishing gradients, the actor has stopped learning",
                steps[-1].step,
            )
    return None


def _plateau(steps: list[StepMetrics], key: str, window: int, tol: float,
             max_rise: float | None) -> HealthVerdict | None:
    last_step = steps[-1].step
    recent = [s for s in steps if s.step > last_step - window]
    at, reward = _values(recent, key)
    ok = np.isfinite(reward)
    # The window must be (nearly) full: a plateau is "no rise for 200 steps", not fewer.
    if at.size == 0 or last_step - window + 1 < 1 or ok.sum() < 0.8 * window:
        return None
    at, reward = at[ok], reward[ok]
    rise = _slope(at, reward) * window
    half = at > last_step - window / 2
    shift = float(reward[half].mean() - reward[~half].mean())
    if rise < tol and abs(shift) < tol:
        if max_rise is not None:
            _, start = _values(steps[: max(1, window // 10)], key)
            start = start[np.isfinite(start)]
            if start.size and float(reward.mean() - start.mean()) >= max_rise:
                return None  # it rose, then levelled off: converged, not stuck
        return HealthVerdict(
            "plateau",
            f"reward flat over steps {at[0]}-{last_step}: fitted rise {rise:+.3g} and half-to-half "
            f"change {shift:+.3g}, both below {tol:g} (level {reward.mean():.3g}); often a KL problem",
            last_step,
        )
    return None
