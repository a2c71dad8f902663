"""The stage policy: the method's rules over an immutable view of a stage's trial records.

Pure: no storage, no launcher, no clock of its own (the time is passed in). The driver's
loop asks it whether a trial may start, whether the stage is stable, which confirmations to
queue, which seed a re-run gets, which config leads and what the stage decides.
"""

from __future__ import annotations

from typing import Sequence

from objectives.score import Eta, eta as eta_of
from search.records import Role, TrialRecord

from optuna.trial import TrialState


def incumbent_run_etas(trials: Sequence[TrialRecord]) -> dict[int, Eta]:
    """η of each finished incumbent run against the mean of all of them. (An incumbent run's
    Optuna value is its η against the runs told before it, which depends on their order.)"""
    runs = {t.number: t.score for t in trials
            if t.state == TrialState.COMPLETE and t.role is Role.INCUMBENT and t.score is not None}
    return {number: eta_of(score, list(runs.values())) for number, score in runs.items()}
