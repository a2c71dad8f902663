"""What a landscape says about one config: its noise-free expectation, how it fails, and
the records of its simulated steps (the types :mod:`verl_sweep.launchers.simulator.landscape` returns)."""

from __future__ import annotations

import dataclasses
from typing import Mapping


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


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One simulated training step: its metrics (NaN allowed) and its GPU picture."""

    step: int
    step_time_s: float
    metrics: Mapping[str, float | int]
    gpu_util: float
    mem_used_gb: float
