"""What runs cost, read from their stored probe records, and train mode's cost cap.

R is one full run of the baseline: the run's steps at the baseline's measured seconds a step,
on the study's GPUs. A probe's seconds a step are its GPU time spread over its GPUs, less its
start-up, over the steps it ran (a speed probe's first step, slower, is in it: a little high).

Train mode with ``train.max_cost_r``: before each learning stage the driver prices what the
study would cost all told if the stage ran — spent so far, the stage (its budget of runs at
the mean cost of the learning runs so far), and the chain's config training on from the
chain's checkpoint to the run's end — and skips the stage, and so every later one, when that
passes the cap. A stage that cannot pay for itself inside the cap leaves the model to the
config the chain has, which has already earned its place.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Mapping, Sequence

from optuna.trial import TrialState

from verl_sweep.search.database.records import Role, TrialRecord
from verl_sweep.verl_knowledge import Config, merge


def probe_step_s(probe: Mapping[str, Any], n_gpus: int, start_step: int = 0) -> float | None:
    """A finished probe's seconds a training step, start-up left out (None: nothing ran);
    ``start_step``: where a branch started (its steps run are ``last_step - start_step``)."""
    steps = (probe.get("last_step") or 0) - start_step
    gpu_s = probe.get("gpu_time_s") or 0.0
    if steps <= 0 or gpu_s <= 0:
        return None
    return max(gpu_s / max(1, n_gpus) - (probe.get("startup_s") or 0.0), 0.0) / steps or None


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


@dataclasses.dataclass(frozen=True)
class StageCost:
    """A stage as the cost cap reads it: its trials, the config it started from, where its
    branches started, whether it is a learning stage that ran (not skipped)."""

    trials: list[TrialRecord]
    base: Config
    start_step: int
    ran_learning: bool


@dataclasses.dataclass(frozen=True)
class Projection:
    """The study's cost all told if the next learning stage ran, in GPU-seconds."""

    spent_s: float
    stage_s: float
    rest_s: float
    rest_steps: int
    full_run_s: float

    @property
    def total_r(self) -> float:
        return (self.spent_s + self.stage_s + self.rest_s) / self.full_run_s

    def why_skipped(self, cap: float) -> str:
        r = self.full_run_s
        return (f"skipped: the cost cap (train.max_cost_r {cap:g} R): spent {self.spent_s / r:.2f} R, this stage "
                f"~{self.stage_s / r:.2f} R and the run's last {self.rest_steps:,} steps ~{self.rest_s / r:.2f} R "
                f"would come to {self.total_r:.2f} R; the chain's config trains on")


def project(stages: Sequence[StageCost], *, n_gpus: int, run_steps: int, chain_step: int, base: Config,
            runs: int, branch_steps: int) -> Projection | None:
    """The cost all told if a learning stage of ``runs`` runs (its budget) of ``branch_steps``
    steps opened now from ``base`` at ``chain_step`` (``stages``: every stage before it), each at
    the mean cost of the learning runs so far (pruned ones included), else a whole branch at the
    chain's speed. Before any run, priced in steps; None where runs ran but none of the
    baseline finished."""
    done = [t for s in stages for t in s.trials]
    first = stages[0] if stages else None
    baseline_s = None if first is None else _mean(
        [probe_step_s(t.probe, n_gpus, first.start_step) for t in first.trials
         if t.role is Role.INCUMBENT and t.state is TrialState.COMPLETE])
    if baseline_s is None or first is None:
        if done:
            return None
        # Nothing ran yet: priced in steps (start-ups, unknown, left out).
        rest = max(run_steps - chain_step, 0)
        return Projection(spent_s=0.0, stage_s=float(runs * branch_steps), rest_s=float(rest), rest_steps=rest,
                          full_run_s=float(run_steps))
    startup_s = _mean([t.probe.get("startup_s") for t in first.trials if t.state is TrialState.COMPLETE]) or 0.0
    # The chain's config: its latest stage's finished runs of it.
    step_s = None
    for s in reversed(stages):
        step_s = _mean([probe_step_s(t.probe, n_gpus, s.start_step) for t in s.trials
                        if t.state is TrialState.COMPLETE and merge(s.base, t.overrides) == base])
        if step_s is not None:
            break
    step_s = step_s or baseline_s
    learning = [t.probe["gpu_time_s"] for s in stages if s.ran_learning for t in s.trials if t.probe.get("gpu_time_s")]
    per_run_s = statistics.fmean(learning) if learning else (branch_steps * step_s + startup_s) * n_gpus
    rest = max(run_steps - chain_step, 0)
    return Projection(spent_s=sum(t.probe.get("gpu_time_s") or 0.0 for t in done), stage_s=runs * per_run_s,
                      rest_s=(rest * step_s + startup_s) * n_gpus if rest else 0.0, rest_steps=rest,
                      full_run_s=run_steps * baseline_s * n_gpus)
