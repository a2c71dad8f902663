"""What a landscape says about one config: its noise-free expectation, how it fails, and
the records of its simulated steps (the types :mod:`verl_sweep.launchers.simulator.landscape` returns)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from verl_sweep.launchers.simulator.config import DEFAULTS, ConfigError, get


class LandscapeError(ValueError):
    """A landscape file that cannot be used."""


@dataclasses.dataclass(frozen=True)
class Failure:
    """How a run fails: ``kind`` is ``oom`` or ``hang``; ``at_step`` is the step it dies in."""

    kind: str
    reason: str
    at_step: int
    message: str


@dataclasses.dataclass(frozen=True)
class Expectation:
    """Noise-free facts of one config (what a run would show without seeds).

    ``step_time_s`` is the simulated seconds of step 1; phases are in ``phases_s``.
    ``diverge_step`` is the step where a diverging run blows up (None when stable).
    """

    step_time_s: float
    phases_s: Mapping[str, float]
    tokens_per_step: float
    throughput: float  # tokens/s/GPU at step 1
    gpu_util: float  # percent, cluster mean
    r0: float
    ceiling: float
    t_mid: float
    steepness: float
    steps_to_converge: float  # t where R reaches R0 + 0.9 (A - R0)
    instability: float  # lr × updates-per-step, relative to the landscape's reference
    unstable: bool
    diverges: bool
    diverge_step: int | None
    failure: Failure | None
    reward_sd: float
    startup_s: float
    steps_per_epoch: int
    total_steps: int
    n_gpus: int

    @property
    def oom(self) -> bool:
        return self.failure is not None and self.failure.kind == "oom"

    @property
    def hang(self) -> bool:
        return self.failure is not None and self.failure.kind == "hang"

    def reward(self, step: float) -> float:
        """Noise-free reward after ``step`` steps (before any divergence)."""
        if step <= 0:
            return self.r0
        return self.r0 + (self.ceiling - self.r0) / (1.0 + (self.t_mid / step) ** self.steepness)

    def steps_at(self, reward: float) -> float:
        """The inverse of :meth:`reward`: the steps after which this curve reaches ``reward``;
        0 at or below R0, ``inf`` at or above the ceiling (the curve's closest points), NaN for NaN."""
        f = (reward - self.r0) / (self.ceiling - self.r0)
        if f <= 0.0:
            return 0.0
        if f >= 1.0:
            return math.inf
        return self.t_mid * (f / (1.0 - f)) ** (1.0 / self.steepness) if f == f else math.nan


@dataclasses.dataclass(frozen=True)
class CheckpointState:
    """What a simulated verl checkpoint holds (``global_step_N``): the model stands in for the
    weights with the reward they reach, noise-free; the optimizer and scheduler with the lr
    verl restores (``base_lr`` is the scheduler's ``base_lrs``, ``lr`` its last lr).

    ``elapsed_s`` counts simulated seconds from the first run's start over every run that led
    here (start-ups, loads, steps, saves). ``diverging_since`` is the first step trained under
    a config that diverges, while the runs since have all diverged (None otherwise).
    ``config`` is the flat config the saving run was given.
    """

    step: int
    reward: float
    lr: float
    base_lr: float
    optimizer_steps: int
    samples_seen: int  # prompts the dataloader has yielded in the current epoch
    elapsed_s: float
    diverging_since: int | None
    config: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One simulated training step: its metrics (NaN allowed) and its GPU picture."""

    step: int
    step_time_s: float
    metrics: Mapping[str, float | int]
    gpu_util: float
    mem_used_gb: float
    checkpoint: CheckpointState | None = None  # saved at the end of this step


def number(section: Mapping[str, Any], key: str) -> float:
    """A landscape section's number at ``key``; LandscapeError naming it when there is none."""
    try:
        return float(section[key])
    except (KeyError, TypeError, ValueError) as e:
        raise LandscapeError(f"landscape needs a number at {key!r}, but got {section.get(key)!r}.") from e


def value(config: Mapping[str, Any], key: str) -> Any:
    """A flat verl config's value at ``key``, verl's default where it sets none."""
    found = get(config, key)
    if found is None and key not in DEFAULTS:
        raise ConfigError(f"the simulator has no default for {key!r}; set it in the config.")
    return found
