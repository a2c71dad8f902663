"""The samplers a stage uses, rebuilt from its saved settings on every resume.

TPE is Optuna's, with the speed-ups of ``search/database/optuna_forks/tpe.py`` where the installed
Optuna has the private code they rely on (``verl_sweep.search.database.optuna_forks.install``), and one
change of what it learns from: a run that ran out of memory counts as a bad point
(``SeesInfeasibleFailures``).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from verl_sweep.search.database import optuna_forks
from verl_sweep.search.spec.errors import BadInputError

if TYPE_CHECKING:
    from verl_sweep.search.spec.study_file import StageSettings

logger = logging.getLogger(__name__)


def build_sampler(stage: "StageSettings", n_existing_trials: int, *,
                  learn_ooms: bool = True) -> optuna.samplers.BaseSampler:
    """``learn_ooms`` False: the stage's space already bounds the knob by the values that ran
    out of memory (``Space.oom_clamped``); TPE then reads only finished runs, as Optuna's."""
    settings = stage.sampler
    # A fixed seed would repeat the same suggestions after a resume and across workers:
    # offset it by what the study already holds.
    seed = None if settings.seed is None else settings.seed + n_existing_trials
    if settings.name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if settings.name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=settings.n_startup_trials)
    if settings.name == "grid":
        raise BadInputError(f"stages {stage.name}: sampler 'grid' is not supported yet; use tpe or random.")
    return (tpe_class() if learn_ooms else optuna_forks.tpe_sampler_class())(
        seed=seed, n_startup_trials=settings.n_startup_trials, constant_liar=True,
        multivariate=settings.multivariate, group=settings.multivariate,
    )


class SeesInfeasibleFailures:
    """TPE that also learns from failed runs with a violated constraint: the runs that ran out
    of memory (``trials.py`` sets the ``oom`` constraint before it fails them).

    Optuna's TPE reads only complete and pruned trials, so it never saw an OOM and kept
    proposing the same region, measuring too few of the rest (docs/method.md, Evidence). Optuna's own constrained TPE already puts
    infeasible trials in the bad group, after every feasible one (``_split_trials``); this
    only lets it see the failed ones. A failure of any other kind still says nothing.

    Not for a space that bounds the knob by its OOMs itself (the token budget): there the
    region is already cut off, and the OOMs in the bad group pulled TPE away from the edge
    where the best budget sits (docs/method.md, Evidence)."""

    def _sample(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        return super()._sample(_WithInfeasibleFailures(study), trial, search_space)  # type: ignore[misc]


class _WithInfeasibleFailures:
    """The study as TPE reads it, with its infeasible failed trials among the complete ones."""

    def __init__(self, study: optuna.Study) -> None:
        self._study = study

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _get_trials(self, deepcopy: bool = True, states: Any = None, use_cache: bool = False) -> list[Any]:
        if states is None or TrialState.COMPLETE not in states:
            return self._study._get_trials(deepcopy, states, use_cache=use_cache)
        trials = self._study._get_trials(deepcopy, (*states, TrialState.FAIL), use_cache=use_cache)
        return [t for t in trials if t.state != TrialState.FAIL or any(v > 0 for v in t.constraints.values())]


@functools.cache
def tpe_class() -> type[optuna.samplers.TPESampler]:
    """The TPE class the stages use: ``SeesInfeasibleFailures`` over the fork or Optuna's.

    The mixin overrides TPE's private ``_sample`` and calls the study's private
    ``_get_trials``: fenced like the forks (whose one log line says so), on an Optuna whose
    private code changed the stages get the base TPE."""
    base = optuna_forks.tpe_sampler_class()
    if not optuna_forks.install():
        return base
    return type(f"InfeasibleAware{base.__name__}", (SeesInfeasibleFailures, base), {})
