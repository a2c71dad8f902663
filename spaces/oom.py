"""Learning from OOM: the driver marks a trial that died of OOM with the user attrs
``failure_kind="oom"`` and ``hardware=hardware_tag(hardware)`` (and
``trial.set_constraint("oom", 1.0)``); every later ``suggest`` in that study keeps the
memory-bound parameters below the smallest value that OOMed: the token budget always, the
memory fraction for the same layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from verl_sweep.verl_knowledge import HardwareFacts

if TYPE_CHECKING:
    import optuna

OOM_KIND = "oom"
FAILURE_KIND_ATTR = "failure_kind"
HARDWARE_ATTR = "hardware"


def hardware_tag(hardware: HardwareFacts) -> str:
    """Identifies the hardware an OOM happened on (OOM limits do not carry across GPUs)."""
    return f"{hardware.nodes}x{hardware.gpus_per_node}x{hardware.gpu_memory_gb:g}GB"


def oom_ceiling(
    trials: Iterable["optuna.trial.FrozenTrial"], param: str, *, hardware: str | None = None
) -> float | None:
    """The smallest value of ``param`` among trials that died of OOM (on ``hardware``), or None.

    Trials without a ``hardware`` attr count on every hardware (the cautious reading).
    """
    ceiling: float | None = None
    for t in trials:
        if t.user_attrs.get(FAILURE_KIND_ATTR) != OOM_KIND or param not in t.params:
            continue
        tag = t.user_attrs.get(HARDWARE_ATTR)
        if hardware is not None and tag is not None and tag != hardware:
            continue
        value = t.params[param]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            ceiling = value if ceiling is None else min(ceiling, value)
    return ceiling


def highest_that_ran(trials: Iterable["optuna.trial.FrozenTrial"], param: str, *, below: float) -> float | None:
    """The largest value of ``param`` below ``below`` among trials that ran to a score (finished
    or stopped by the pruner: either got past its start without running out of memory)."""
    import optuna

    ran = [t.params[param] for t in trials
           if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
           and isinstance(t.params.get(param), (int, float)) and not isinstance(t.params[param], bool)
           and t.params[param] < below]
    return max(ran) if ran else None


#: Optuna's system attr in which ``enqueue_trial`` keeps the point it fixes for a trial
FIXED_PARAMS_ATTR = "fixed_params"


@dataclass(frozen=True)
class TrialHistory:
    """What a suggest reads of its study, in one read: the study's other trials, and the point
    an enqueue fixed for this trial (empty where the sampler draws every value)."""

    others: list["optuna.trial.FrozenTrial"]
    fixed: Mapping[str, Any]


def trial_history(trial: "optuna.trial.BaseTrial") -> TrialHistory:
    study = getattr(trial, "study", None)
    if study is None:  # FixedTrial / FrozenTrial: no history to learn from
        return TrialHistory([], {})
    own = getattr(trial, "number", None)
    others, fixed = [], {}
    for t in study.get_trials(deepcopy=False):
        if t.number == own:
            fixed = t.system_attrs.get(FIXED_PARAMS_ATTR, {})
        else:
            others.append(t)
    return TrialHistory(others, fixed)


def asked_range(fixed: Mapping[str, Any], param: str, low: float, high: float) -> tuple[float, float]:
    """The range to ask ``param`` over: ``[low, high]`` (narrowed by OOMs or the memory
    estimate), widened to hold the value an enqueued point fixed (``TrialHistory.fixed``: a
    starting point, a leader's re-run). That point keeps its value either way; asked over a
    range without it, Optuna warns on every such trial."""
    value = fixed.get(param)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return low, high
    return min(low, value), max(high, value)
