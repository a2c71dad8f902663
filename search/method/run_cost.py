"""What runs cost, read from their stored probe records, and train mode's cost cap.

R is one full run of the baseline: the run's steps at the baseline's measured seconds a step,
on the study's GPUs. A probe's seconds a step are its GPU time spread over its GPUs, less its
start-up, over the steps it ran (a speed probe's first step, slower, is in it: a little high).

Train mode with ``train.max_cost_r``: before each learning stage the driver prices what the
study has spent, a run of the stage (the mean cost of the learning runs so far) and the
chain's config training on from the chain's checkpoint to the run's end. The room left under
the cap is the stage's most runs: it starts no run past them and decides on what it measured
(as at its wall-clock budget). A stage whose room does not hold its fewest runs (the
incumbent's and two candidates') is skipped, and the chain's config, which already earned its
place, trains on.
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
    return max(gpu_s / max(1, n_gpus) - (probe.get("startup_s") or 0.0), 0.0) / steps


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _at_length(probe: Mapping[str, Any], n_gpus: int, steps: int | None, branch_steps: int) -> float:
    """A learning run's GPU-seconds had its stage run ``branch_steps`` steps, not ``steps``: its
    training scaled, its start-up as it was (a 500-step first stage prices the 150-step
    branches after it at 150 steps). A run stopped early stays as short, in proportion."""
    gpu_s = probe["gpu_time_s"]
    if not steps or steps == branch_steps:
        return gpu_s
    startup_s = min(probe.get("startup_s") or 0.0, gpu_s / max(1, n_gpus))
    return (startup_s + (gpu_s / max(1, n_gpus) - startup_s) * branch_steps / steps) * n_gpus


@dataclasses.dataclass(frozen=True)
class StageCost:
    """A stage as the cost cap reads it: its trials, the config it started from, where its
    branches started, whether it is a learning stage that ran (not skipped), its runs' steps."""

    trials: list[TrialRecord]
    base: Config
    start_step: int
    ran_learning: bool
    probe_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class Projection:
    """What the study has spent, what a learning stage's run costs, and what the chain's
    config training on to the run's end costs, in GPU-seconds, under the cap ``cap`` R."""

    cap: float
    spent_s: float
    per_run_s: float
    rest_s: float
    rest_steps: int
    full_run_s: float

    def runs_within(self) -> int:
        """The most runs a stage may make before the study all told would pass the cap."""
        room = self.cap * self.full_run_s - self.spent_s - self.rest_s
        return max(int(room // self.per_run_s), 0) if self.per_run_s > 0 else 0

    def why_skipped(self, fewest: int) -> str:
        r = self.full_run_s
        total = (self.spent_s + fewest * self.per_run_s + self.rest_s) / r
        return (f"skipped: the cost cap (train.max_cost_r {self.cap:g} R): spent {self.spent_s / r:.2f} R, "
                f"its fewest {fewest} runs ~{fewest * self.per_run_s / r:.2f} R and the run's last "
                f"{self.rest_steps:,} steps ~{self.rest_s / r:.2f} R would come to {total:.2f} R; "
                "the chain's config trains on")


def project(stages: Sequence[StageCost], *, cap: float, n_gpus: int, run_steps: int, chain_step: int,
            base: Config, branch_steps: int) -> Projection | None:
    """The prices for a learning stage of ``branch_steps``-step runs opened now from ``base``
    at ``chain_step`` (``stages``: every stage before it): a run at the mean cost of the
    learning runs so far (pruned ones included), else a whole branch at the chain's speed.
    Before any run, priced in steps; None where runs ran but none of the baseline finished."""
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
        return Projection(cap=cap, spent_s=0.0, per_run_s=float(branch_steps), rest_s=float(rest), rest_steps=rest,
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
    learning = [_at_length(t.probe, n_gpus, s.probe_steps, branch_steps)
                for s in stages if s.ran_learning for t in s.trials if t.probe.get("gpu_time_s")]
    per_run_s = statistics.fmean(learning) if learning else (branch_steps * step_s + startup_s) * n_gpus
    rest = max(run_steps - chain_step, 0)
    return Projection(cap=cap, spent_s=sum(t.probe.get("gpu_time_s") or 0.0 for t in done), per_run_s=per_run_s,
                      rest_s=(rest * step_s + startup_s) * n_gpus if rest else 0.0, rest_steps=rest,
                      full_run_s=run_steps * baseline_s * n_gpus)
