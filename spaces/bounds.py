"""The safe bounds of the tuning method (docs/method.md §1), as data, each with the rule it comes from.

A study file may *narrow* a bound (``low``/``high``); widening it past the safe bound needs
``unsafe: true`` on that parameter and is logged as a warning. Everything else is a
:class:`~verl_sweep.spaces.base.SpaceError` naming the field, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Mapping

from verl_sweep.spaces.base import SpaceError

logger = logging.getLogger(__name__)

#: options every bounded parameter accepts in a study file
BOUND_OPTIONS = frozenset({"low", "high", "unsafe"})


@dataclasses.dataclass(frozen=True)
class ParamBound:
    """A closed range ``[low, high]`` for one parameter and the rule it comes from."""

    name: str
    low: float
    high: float
    log: bool
    source: str
    is_int: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or self.low > self.high:
            raise SpaceError(
                f"{self.name}: bound must satisfy low ≤ high, but got low={self.low}, "
                f"high={self.high}. Fix the bound."
            )
        if self.log and self.low <= 0:
            raise SpaceError(
                f"{self.name}: a log-scaled bound must have low > 0, but got {self.low}. "
                "Use a positive low."
            )

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def describe(self) -> str:
        scale = " (log)" if self.log else ""
        return f"{self.name} ∈ [{_fmt(self.low)}, {_fmt(self.high)}]{scale} — {self.source}"

    def narrowed(self, options: Mapping[str, Any], *, where: str = "") -> "ParamBound":
        """Apply a study file's ``low``/``high``/``unsafe`` to this safe bound.

        Raises SpaceError when a value lies outside the safe bound without ``unsafe: true``,
        when low > high, or when a value is not a number.
        """
        prefix = where or self.name
        unsafe = options.get("unsafe", False)
        if not isinstance(unsafe, bool):
            raise SpaceError(f"{prefix}.unsafe: must be true or false, but got {unsafe!r}. Use a boolean.")
        low, high = self.low, self.high
        for side in ("low", "high"):
            if side not in options or options[side] is None:
                continue
            value = options[side]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SpaceError(f"{prefix}.{side}: must be a finite number, but got {value!r}. Give a number.")
            if self.is_int and float(value) != int(value):
                raise SpaceError(f"{prefix}.{side}: must be an integer, but got {value!r}. Give an integer.")
            outside = value > self.high if side == "high" else value < self.low
            if side == "high" and value < self.low and not unsafe:
                outside = True
            if side == "low" and value > self.high and not unsafe:
                outside = True
            if outside and not unsafe:
                relation = (
                    f"≤ {_fmt(self.high)}" if value > self.high else f"≥ {_fmt(self.low)}"
                )
                raise SpaceError(
                    f"{prefix}.{side}: must be {relation} (safe bound: {self.source}), but got "
                    f"{_fmt(value)}. Narrow it, or set unsafe: true on this parameter."
                )
            if outside:
                logger.warning(
                    "%s.%s=%s lies outside the safe bound [%s, %s] (%s); allowed by unsafe: true",
                    prefix, side, _fmt(value), _fmt(self.low), _fmt(self.high), self.source,
                )
            if side == "low":
                low = int(value) if self.is_int else float(value)
            else:
                high = int(value) if self.is_int else float(value)
        if low > high:
            raise SpaceError(
                f"{prefix}: low must be ≤ high, but got low={_fmt(low)}, high={_fmt(high)}. "
                "Swap or fix them."
            )
        if self.log and low <= 0:
            raise SpaceError(f"{prefix}.low: must be > 0 on a log scale, but got {_fmt(low)}. Use a positive low.")
        source = self.source if (low, high) == (self.low, self.high) else f"{self.source}; changed by the study"
        return dataclasses.replace(self, low=low, high=high, source=source)


    def including(self, value: Any) -> "ParamBound":
        """This bound widened to hold the base config's ``value`` when it lies outside (verl's
        own examples start from lr 1e-5 or a memory fraction of 0.25): the search spans the
        safe range and the run the user has. A value that is no positive number (a KL
        coefficient of 0 is KL off) leaves the bound as it is."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value <= 0 or self.contains(value) or (self.is_int and not float(value).is_integer()):
            return self
        value = int(value) if self.is_int else float(value)
        low, high = min(self.low, value), max(self.high, value)
        return dataclasses.replace(self, low=low, high=high,
                                   source=f"{self.source}; widened to the base config's {_fmt(value)}")

    def shared(self, n_sharing: int) -> "ParamBound":
        """This bound for one of ``n_sharing`` probes on one GPU: a fraction of the card
        (the memory fraction) is divided among them."""
        if n_sharing <= 1:
            return self
        return dataclasses.replace(self, low=self.low / n_sharing, high=self.high / n_sharing,
                                   source=f"{self.source}, ÷ {n_sharing} probes per GPU")


def _fmt(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 1):
        return f"{int(value):,}"
    return f"{value:g}"


# The method's fixed ranges (docs/method.md §1 table; §2 for the memory fraction; §1 health screen for
# the adaptive controller's target).
KL_COEF = ParamBound("kl", 0.0005, 0.01, True, "the method's KL range 0.0005-0.01")
LR = ParamBound("lr", 5e-7, 5e-6, True, "the method's lr range 5e-7 - 5e-6")
LAM = ParamBound("lam", 0.95, 0.99, False, "the method's λ range 0.95-0.99")
GPU_MEMORY_UTILIZATION = ParamBound(
    "gpu_memory_utilization", 0.3, 0.9, False, "the method's memory fraction range 0.3-0.9"
)
TARGET_KL = ParamBound("target_kl", 0.05, 0.15, False, "the method's healthy KL 0.05-0.15")
KL_HORIZON = ParamBound("horizon", 1000, 20000, True, "verl kl_ctrl.horizon must be > 0 (default 10000)", True)
#: not one of the method's knobs: a small entropy bonus may keep the policy exploring; larger
#: ones keep it from settling
ENTROPY_COEFF = ParamBound("entropy_coeff", 0.0, 0.01, False, "an entropy bonus up to 0.01 (verl's default 0: none)")
MINI_BATCH_FRACTION = 0.25

SAFE_BOUNDS: dict[str, ParamBound] = {
    b.name: b for b in (KL_COEF, LR, LAM, GPU_MEMORY_UTILIZATION, TARGET_KL, KL_HORIZON, ENTROPY_COEFF)
}


#: the largest mini-batch (prompts per update) a study may start from
MAX_MINI_BATCH = 1 << 20


def mini_batch_bound(baseline: int) -> ParamBound:
    """Baseline ±25% (docs/method.md §1: 'mini-batch baseline ±25%')."""
    if baseline < 1:
        raise SpaceError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size must be ≥ 1, but got {baseline}. "
            "Fix the base config."
        )
    if baseline > MAX_MINI_BATCH:
        # The space enumerates every size in its range: no real run has a larger mini-batch.
        raise SpaceError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size must be ≤ {MAX_MINI_BATCH:,}, but got {baseline}. "
            "Fix the base config."
        )
    return ParamBound(
        "mini_batch",
        math.ceil(baseline * (1 - MINI_BATCH_FRACTION)),
        math.floor(baseline * (1 + MINI_BATCH_FRACTION)),
        False,
        f"the method's mini-batch baseline ±25% (baseline {baseline})",
        is_int=True,
    )


def token_budget_bound(floor: int, ceiling: int, arithmetic: str) -> ParamBound:
    """``[max(2048, prompt+response), memory bound]`` (docs/method.md §1: 'token budget ≤ memory')."""
    if floor > ceiling:
        raise SpaceError(
            f"token budget: the memory bound must be ≥ the floor max(2048, prompt+response) = "
            f"{floor:,}, but got {ceiling:,} ({arithmetic}). Use a larger memory fraction or "
            "rollout TP, or shorter sequences."
        )
    return ParamBound(
        "token_budget", floor, ceiling, True, f"the method's token budget ≤ memory bound ({arithmetic})", True
    )
