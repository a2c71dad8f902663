"""A run's steps as another layout would have timed them.

The speed stages change how a step is computed (parallelism, micro-batching, memory, vLLM's
budget), not what it learns. So a learning run at the tuned layout tells how the baseline's
learning goes step by step, and the baseline's own layout only changes each step's seconds.
Those are not one factor: a step's phases (generation, the log-prob passes, the update) speed
up each by its own, and as responses lengthen the mix of phases moves, so a step-1 speed ratio
misreads a long run's (on the simulator's default world 2.28 at step 3, 2.39 at step 2,000).
``PhaseRatios`` holds each phase's ratio, read off the two layouts' speed probes on the same
seeds and steps; ``retimed`` applies them to each step of a run at the tuned layout.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Mapping, Sequence

from verl_sweep.objectives.metrics import STEP_TIME_KEY, StepMetrics
from verl_sweep.objectives.score import Eta

#: verl's timings of a step's phases (``timing_s/*``) that a layout speeds up each by its own
#: factor; the rest of the step (reward, advantages, the weights' sync) is one more part
PHASES = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/values",
          "timing_s/update_critic", "timing_s/update_actor")
REST = "rest"
#: a rest shorter than this share of the steps is read with the whole step's ratio: the
#: difference of two sums, it is mostly their noise
MIN_REST_SHARE = 0.05
#: paired steps a ratio needs: one pair cannot tell how much its steps' noise moved it
MIN_PAIRS = 2


def _parts(step: StepMetrics) -> dict[str, float] | None:
    """A step's seconds by phase and the rest (None: it logged no step time)."""
    total = step.get(STEP_TIME_KEY)
    if total is None or total <= 0:
        return None
    parts = {p: v for p in PHASES if (v := step.get(p)) is not None and v >= 0}
    parts[REST] = total - sum(parts.values())
    return parts


@dataclasses.dataclass(frozen=True)
class PhaseRatios:
    """Seconds at the slower layout over seconds at the faster one, by phase (``REST``: the
    rest of the step), and the whole step's, from ``pairs`` paired steps; ``log_se``: the
    standard error of the whole step's log ratio, from the pairs' spread (what a reading
    re-timed by them is uncertain by beyond its own noise)."""

    ratios: Mapping[str, float]
    step: float
    pairs: int
    log_se: float = 0.0

    @classmethod
    def of(cls, slow: Mapping[tuple[int, int], StepMetrics], fast: Mapping[tuple[int, int], StepMetrics]
           ) -> PhaseRatios | None:
        """From the two layouts' steps keyed by (seed, step): the sums of each phase over the
        keys both have. None with fewer than ``MIN_PAIRS`` pairs, or where a phase the faster
        layout ran took no time."""
        sums_slow: dict[str, float] = {}
        sums_fast: dict[str, float] = {}
        logs: list[float] = []
        for key in sorted(set(slow) & set(fast)):
            a, b = _parts(slow[key]), _parts(fast[key])
            if a is None or b is None:
                continue
            logs.append(math.log(sum(a.values()) / sum(b.values())))
            for part in set(a) | set(b):
                sums_slow[part] = sums_slow.get(part, 0.0) + a.get(part, 0.0)
                sums_fast[part] = sums_fast.get(part, 0.0) + b.get(part, 0.0)
        pairs = len(logs)
        if pairs < MIN_PAIRS:
            return None
        log_se = statistics.stdev(logs) / math.sqrt(pairs)
        total_slow, total_fast = sum(sums_slow.values()), sum(sums_fast.values())
        step = total_slow / total_fast
        ratios = {}
        for part, seconds in sums_fast.items():
            if part == REST and abs(seconds) < MIN_REST_SHARE * total_fast:
                ratios[part] = step
            elif seconds > 0:
                ratios[part] = sums_slow[part] / seconds
            elif sums_slow[part] > 0:
                return None
        if not all(math.isfinite(r) and r > 0 for r in (step, *ratios.values())):
            return None
        return cls(ratios, step, pairs, log_se)

    def widen(self, e: Eta) -> Eta:
        """``e``, a gain against runs re-timed by these ratios, with its interval widened by
        their uncertainty (log half-widths added in quadrature)."""
        if not (math.isfinite(e.low) and math.isfinite(e.high)) or e.low <= 0:
            return e
        extra = statistics.NormalDist().inv_cdf(0.5 + e.confidence / 2.0) * self.log_se
        below = math.hypot(math.log(e.value / e.low), extra)
        above = math.hypot(math.log(e.high / e.value), extra)
        return dataclasses.replace(e, low=e.value * math.exp(-below), high=e.value * math.exp(above))

    def to_attr(self) -> dict[str, Any]:
        return {"ratios": dict(self.ratios), "step": self.step, "pairs": self.pairs, "log_se": self.log_se}

    @classmethod
    def from_attr(cls, attr: Mapping[str, Any]) -> PhaseRatios:
        return cls({str(k): float(v) for k, v in attr["ratios"].items()}, float(attr["step"]), int(attr["pairs"]),
                   float(attr.get("log_se", 0.0)))


def retimed(steps: Sequence[StepMetrics], ratios: PhaseRatios) -> list[StepMetrics]:
    """``steps`` with each step's seconds as the slower layout would have taken: each phase
    times its ratio (a phase the ratios never saw, the whole step's)."""
    out = []
    for step in steps:
        parts = _parts(step)
        if parts is None:
            out.append(step)
            continue
        seconds = sum(ratios.ratios.get(part, ratios.step) * s for part, s in parts.items())
        out.append(StepMetrics(step.step, {**step.data, STEP_TIME_KEY: seconds}))
    return out


def seconds(steps: Sequence[StepMetrics]) -> float:
    """The steps' logged seconds, summed (a step without a time counts none)."""
    return sum(s.get(STEP_TIME_KEY) or 0.0 for s in steps)


def time_ratio(slow: Sequence[StepMetrics], steps: Sequence[StepMetrics]) -> float:
    """How many times longer ``slow`` (``steps`` re-timed) takes than ``steps``."""
    return seconds(slow) / max(1e-12, seconds(steps))
