"""Pruning against the incumbent, with paired seeds.

Candidates and the incumbent run on the same seeds (same data order), so at a given step the
candidate's running rate and the incumbent's on that seed share most of their noise. A
candidate that stays clearly below the incumbent cannot win the stage (only η > 1.02 can), so
it is stopped: that is the method's "stop hopeless runs", without the false alarms of a plain
median rule on jittery curves.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Sequence

import optuna
from optuna.trial import TrialState

from verl_sweep.search.database.records import Role, probe_rate_of, role_of, seed_of

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

    from verl_sweep.search.spec.study_file import PrunerSettings


@dataclasses.dataclass(frozen=True)
class Pace:
    """Which trial params make a run start at another pace than the incumbent: a change of any
    of ``alone``, or of every one of ``together`` (a coupled move). The stage says which
    (``verl_sweep.search.method.stage.PACE``); the pruner knows no space."""

    alone: frozenset[str] = frozenset()
    together: tuple[str, ...] = ()

    def differs(self, params: dict[str, object], incumbent: dict[str, object]) -> bool:
        """Does a candidate start at another pace than the incumbent, so that its early running
        rate misreads its end?"""
        if any(params.get(p) != incumbent.get(p) for p in self.alone):
            return True
        return bool(self.together) and all(p in params and params[p] != incumbent.get(p) for p in self.together)


class IncumbentPruner(optuna.pruners.BasePruner):
    """Prune a candidate at step s when its intermediate value is more than ``margin`` below
    the incumbent's at s (the run on the same seed if there is one, else their mean), or below
    the stage's best finished candidate's, for ``patience`` reports in a row. Where the reports
    read to the run's horizon, the candidate must also be that far below the incumbent read to
    its own last step (``_ahead_so_far``).
    Incumbents and confirmation re-runs are never pruned: a re-run checks a candidate that
    already ran to step N, and an early running rate must not overrule that evidence.
    A candidate paced otherwise (``pace``: one that changes the KL pull, or the mini-batch and
    lr both) is not pruned before ``late_from``: it starts slower and may end higher
    (docs/method.md, Evidence)."""

    def __init__(self, *, margin: float = 0.03, n_warmup_steps: int = 100, patience: int = 2,
                 late_from: int = 0, pace: Pace = Pace()) -> None:
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), but got {margin}.")
        self.margin = margin
        self.n_warmup_steps = n_warmup_steps
        self.patience = patience
        self.late_from = late_from
        self.pace = pace
        #: the stage's finished and running trials as its loop holds them
        #: (``StageStudy.pruning_trials``); None: read them from the study
        self.trials: Callable[[], Sequence[FrozenTrial]] | None = None

    def prune(self, study: "optuna.Study", trial: "FrozenTrial") -> bool:
        if role_of(trial) is not Role.CANDIDATE:
            return False
        steps = sorted(s for s in trial.intermediate_values if s >= self.n_warmup_steps)
        if len(steps) < self.patience:
            return False  # before reading the study
        trials = (self.trials() if self.trials is not None
                  else study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)))
        incumbents = [t for t in trials if role_of(t) is Role.INCUMBENT]
        if incumbents and self.pace.differs(trial.params, incumbents[0].params):
            steps = [s for s in steps if s >= self.late_from]
            if len(steps) < self.patience:
                return False
        # The stage's best finished candidate so far: a run clearly below it cannot win either,
        done = [t for t in trials if t.state == TrialState.COMPLETE and role_of(t) is Role.CANDIDATE
                and t.value is not None and t.number != trial.number]
        leaders = [max(done, key=lambda t: float(t.value))] if done else []  # type: ignore[arg-type]
        # ... once it beat the incumbent by more than the margin: closer, its curve is the
        # incumbent's within noise, and the incumbent's bar has the margin (docs/method.md, Evidence).
        leaders = [t for t in leaders if float(t.value) > 1 + self.margin]  # type: ignore[arg-type]
        seed = seed_of(trial)
        # Below the leader alone stops a run only from the probe's middle, and not while it is
        # closing in on it: neighbours of the leader often start slower and end higher
        # (couplings: a larger mini-batch at a larger lr), and early running rates of two
        # configs a few percent apart differ by their noise (docs/method.md, Evidence), so the
        # candidate's ratio to the leader is projected to the leader's last step.
        overtakes = self._overtakes(trial, leaders, steps, seed)
        # Probes that run side by side are a step or two apart: compare at the candidate's
        # latest steps that a reference run has reached too, not only at its very latest.
        compared = 0
        for step in reversed(steps):
            bar = self._bar(incumbents, [] if overtakes else leaders, step, seed)
            if bar is None:
                continue
            if trial.intermediate_values[step] >= bar or self._ahead_so_far(trial, incumbents, step, seed):
                return False
            compared += 1
            if compared == self.patience:
                return True
        return False

    def _bar(self, incumbents: Sequence["FrozenTrial"], leaders: Sequence["FrozenTrial"], step: int,
             seed: object) -> float | None:
        """The value a candidate must reach at ``step`` to run on; None when no reference has it.
        The margin applies to the incumbent: a candidate within it may be a slow starter (KL on)
        that ends above. The leader already beat the incumbent by more than it on a whole run."""
        incumbent = self._reference(incumbents, step, seed)
        references = [r for r in (None if incumbent is None else incumbent * (1 - self.margin),
                                  self._reference(leaders, step, seed)) if r is not None]
        return max(references) if references else None

    def _overtakes(self, trial: "FrozenTrial", leaders: Sequence["FrozenTrial"], steps: Sequence[int],
                   seed: object) -> bool:
        """Whether the candidate's running rate over the leader's, a straight line fitted to its
        reports since the warm-up, reaches 1 by the leader's last report (with fewer than three
        reports the line is mostly noise: it may), or the candidate is not past the middle."""
        if not leaders:
            return False
        end = max(max(t.intermediate_values) for t in leaders)
        points = [(step, trial.intermediate_values[step] / ref) for step in steps
                  if (ref := self._reference(leaders, step, seed))]
        if len(points) < 3 or points[-1][0] < end / 2:
            return True
        mean_s = sum(s for s, _ in points) / len(points)
        mean_q = sum(q for _, q in points) / len(points)
        slope = (sum((s - mean_s) * (q - mean_q) for s, q in points)
                 / sum((s - mean_s) ** 2 for s, _ in points))
        return mean_q + slope * (end - mean_s) >= 1.0

    def _ahead_so_far(self, trial: "FrozenTrial", incumbents: Sequence["FrozenTrial"], step: int,
                      seed: object) -> bool:
        """Whether a candidate whose reports read to the run's horizon is, read to its own last
        step, within the margin of the incumbent or above it. Stopped is a run behind on both
        readings: the far reading of a curve that has not bent yet is mostly noise, and the
        near one misranks a run that starts slower and ends higher (docs/method.md, Evidence)."""
        own = probe_rate_of(trial, step)
        if own is None:
            return False
        values = [(rate, seed_of(t)) for t in incumbents if (rate := probe_rate_of(t, step)) is not None]
        chosen = [rate for rate, s in values if s == seed] or [rate for rate, _ in values]
        return bool(chosen) and own >= sum(chosen) / len(chosen) * (1 - self.margin)

    @staticmethod
    def _reference(incumbents: Sequence["FrozenTrial"], step: int, seed: object) -> float | None:
        values = [t.intermediate_values[step] for t in incumbents if step in t.intermediate_values]
        paired = [t.intermediate_values[step] for t in incumbents
                  if step in t.intermediate_values and seed_of(t) == seed]
        chosen = paired or values
        return sum(chosen) / len(chosen) if chosen else None


# -- building a stage's pruner by name (``pruner.name`` in a study file) ---------------------------
def _percentile(p: "PrunerSettings", warmup: int) -> optuna.pruners.BasePruner:
    return optuna.pruners.PatientPruner(
        optuna.pruners.PercentilePruner(p.percentile, n_startup_trials=p.n_startup_trials, n_warmup_steps=warmup),
        patience=p.patience,
    )


#: pruner name -> how to build it from the stage's settings and the step pruning may start at
PRUNERS: dict[str, Callable[["PrunerSettings", int, int, Pace], optuna.pruners.BasePruner]] = {
    "none": lambda p, warmup, late, pace: optuna.pruners.NopPruner(),
    "incumbent": lambda p, warmup, late, pace: IncumbentPruner(margin=p.margin, n_warmup_steps=warmup,
                                                               patience=p.patience, late_from=late, pace=pace),
    "median": lambda p, warmup, late, pace: optuna.pruners.MedianPruner(n_startup_trials=p.n_startup_trials,
                                                                        n_warmup_steps=warmup),
    "wilcoxon": lambda p, warmup, late, pace: optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=warmup),
    "patient": lambda p, warmup, late, pace: _percentile(p, warmup),
}


def reports_to_prune(settings: "PrunerSettings") -> int:
    """How many reports in a row below the bar the pruner needs before it stops a run."""
    return settings.patience if settings.name in ("incumbent", "patient") else 1


def build_pruner(settings: "PrunerSettings", *, prune_from: int, late_from: int = 0,
                 pace: Pace = Pace()) -> optuna.pruners.BasePruner:
    """The stage's pruner, rebuilt from its saved settings on every resume; ``prune_from``: no
    pruning before this step (``verl_sweep.search.method.stage.Stage.prune_from``); ``late_from``: nor before this one
    for a candidate paced otherwise (``pace``; the incumbent pruner)."""
    try:
        make = PRUNERS[settings.name]
    except KeyError:
        raise ValueError(f"pruner must be one of {', '.join(sorted(PRUNERS))}, but got {settings.name!r}.") from None
    return make(settings, prune_from, late_from, pace)
