"""The shape of a run's reward curve, read off its scored rewards.

``late_gain`` tells a curve still accelerating at the probe's end (a slow start, where a short
probe's rate judges early speed, not the run) from one that bends inside it
(``verl_sweep.search.method.policy.slow_start`` reads it).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: quarters of at least this many rewards for ``late_gain`` (a quarter's mean must beat the noise)
MIN_QUARTER_STEPS = 5


def late_gain(rewards: Sequence[float] | np.ndarray) -> float | None:
    """The rise of the last quarter's mean reward over the largest rise between consecutive
    quarters. None when the quarters are too short, or the reward never rises."""
    y = np.asarray(rewards, dtype=float)
    y = y[np.isfinite(y)]
    q = y.size // 4
    if q < MIN_QUARTER_STEPS:
        return None
    means = [float(y[k * q:(k + 1) * q].mean()) for k in range(3)] + [float(y[3 * q:].mean())]
    rises = [b - a for a, b in zip(means, means[1:])]
    largest = max(rises)
    return rises[-1] / largest if largest > 0 else None
