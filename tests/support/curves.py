"""Synthetic verl-like runs for scorer, health and pruner tests (no simulator needed).

Reward follows the saturating curve R(t) = R0 + (A−R0)/(1+(t_mid/t)^B) in training seconds,
observed with AR(1) noise (batch-mean noise plus slow policy drift); step time is noisy
around ``step_s``. ``true_rate`` is the noise-free chord (R(T) − R(0)) / T over the steps'
training time: the quantity η is meant to compare.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from verl_sweep.objectives.metrics import StepMetrics


@dataclasses.dataclass(frozen=True)
class Curve:
    r0: float = 0.2
    ceiling: float = 0.8
    t_mid_s: float = 4000.0
    b: float = 1.3
    step_s: float = 12.0
    step_jitter: float = 0.05  # relative sd of step time
    noise: float = 0.03  # sd of the per-step reward noise
    ar: float = 0.3  # AR(1) coefficient of the noise

    def reward(self, t: np.ndarray | float) -> np.ndarray:
        t = np.maximum(np.asarray(t, dtype=float), 1e-9)
        return self.r0 + (self.ceiling - self.r0) / (1.0 + (self.t_mid_s / t) ** self.b)

    def true_rate(self, n_steps: int, *, warmup_steps: int = 0) -> float:
        """Noise-free chord rate over steps warmup+1..n at the expected step time."""
        t0 = warmup_steps * self.step_s
        t1 = n_steps * self.step_s
        return float((self.reward(t1) - self.reward(t0)) / (t1 - t0))


def run(curve: Curve, n_steps: int, *, seed: int, extra: dict | None = None) -> list[StepMetrics]:
    """One noisy run of ``n_steps`` steps as StepMetrics (with grad norm, KL, tokens)."""
    rng = np.random.default_rng(seed)
    dts = curve.step_s * np.exp(rng.normal(0.0, curve.step_jitter, n_steps) - curve.step_jitter**2 / 2)
    starts = np.concatenate([[0.0], np.cumsum(dts)[:-1]])
    eps = np.empty(n_steps)
    prev = 0.0
    innov = curve.noise * math.sqrt(1 - curve.ar**2)
    for i in range(n_steps):
        prev = curve.ar * prev + rng.normal(0.0, innov)
        eps[i] = prev
    rewards = curve.reward(starts) + eps
    out = []
    for i in range(n_steps):
        data = {
            "critic/score/mean": float(rewards[i]),
            "timing_s/step": float(dts[i]),
            "actor/grad_norm": float(abs(rng.normal(0.3, 0.05))),
            "actor/kl_loss": float(0.02 + 0.08 * (1 - math.exp(-i / 150)) + rng.normal(0, 0.005)),
            "actor/pg_loss": float(rng.normal(0, 0.01)),
            "perf/total_num_tokens": float(rng.normal(200000, 4000)),
        }
        if extra:
            data.update(extra)
        out.append(StepMetrics(step=i + 1, data=data))
    return out
