"""The samplers a stage uses, rebuilt from its saved settings on every resume.

TPE is Optuna's, with the speed-ups of ``search/_optuna_forks/tpe.py`` where the installed
Optuna is the one they were written against (``search._optuna_forks.install``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import optuna

from search import _optuna_forks
from search.errors import BadInputError

if TYPE_CHECKING:
    from search.study_file import StageSettings


def build_sampler(stage: "StageSettings", n_existing_trials: int) -> optuna.samplers.BaseSampler:
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
    return _optuna_forks.tpe_sampler(
        seed=seed, n_startup_trials=settings.n_startup_trials, constant_liar=True,
        multivariate=settings.multivariate, group=settings.multivariate,
    )
