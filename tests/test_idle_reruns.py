"""Confirmations queued by idle workers at the same moment: no two runs of a point share a
seed, a duplicate required re-run is dropped, and extra re-runs stop when the fresh seeds of
the point are used up (issue 7)."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from search.console import Console
from search.driver import StudyRunner
from search.storage import open_storage
from search.study_file import load_study

REPO = Path(__file__).resolve().parent.parent


def _runner(tmp_path: Path) -> tuple[StudyRunner, optuna.Study]:
    spec = load_study(REPO / "studies" / "demo.yaml")  # seeds 11-16, incumbent on 11 and 12
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    runner = StudyRunner(spec, storage, None, console=Console(quiet=True),  # type: ignore[arg-type]
                         build_space=lambda *a, **k: None, poll_interval_s=1.0)
    study = optuna.create_study(study_name="demo.lr", storage=storage, direction="maximize")
    study.add_trial(create_trial(
        state=TrialState.COMPLETE, value=1.2, params={"lr": 2e-6},
        distributions={"lr": FloatDistribution(1e-7, 1e-5, log=True)},
        user_attrs={"role": "candidate", "seed": 11, "run_id": "r0"},
    ))
    return runner, study


def _queue(study: optuna.Study, seed: int, *, extra: bool) -> None:
    study.enqueue_trial({"lr": 2e-6}, user_attrs={"role": "rerun", "rerun_of": 0, "seed": seed, "extra": extra},
                        skip_if_exists=False)


def _start(runner: StudyRunner, study: optuna.Study) -> int | None:
    trial = study.ask()
    seed = runner._rerun_seed(study, trial)
    if seed is not None:
        trial.set_user_attr("seed", seed)
        trial.suggest_float("lr", 1e-7, 1e-5, log=True)
    else:
        study.tell(trial, state=TrialState.FAIL)
    return seed


def test_reruns_queued_together_get_distinct_fresh_seeds(tmp_path: Path) -> None:
    runner, study = _runner(tmp_path)
    _queue(study, 13, extra=False)
    _queue(study, 13, extra=False)  # a second worker queued the same required re-run
    for _ in range(5):
        _queue(study, 13, extra=True)  # idle workers all picked the same seed
    seeds = [_start(runner, study) for _ in range(7)]
    assert seeds == [13, None, 14, 15, 16, None, None]


def test_extra_reruns_stop_when_the_fresh_seeds_are_used(tmp_path: Path) -> None:
    runner, study = _runner(tmp_path)
    trials = study.get_trials(deepcopy=False)
    assert runner._unused_fresh_seeds({"lr": 2e-6}, trials) == [13, 14, 15, 16]
    for seed in (13, 14):
        _queue(study, seed, extra=True)
    trials = study.get_trials(deepcopy=False)
    assert runner._unused_fresh_seeds({"lr": 2e-6}, trials) == [15, 16]  # queued ones count


def test_a_required_rerun_runs_even_when_twins_used_the_fresh_seeds(tmp_path: Path) -> None:
    runner, study = _runner(tmp_path)
    for number, seed in enumerate((13, 14, 15, 16), start=1):  # the sampler proposed the point 4 more times
        study.add_trial(create_trial(
            state=TrialState.COMPLETE, value=1.1, params={"lr": 2e-6},
            distributions={"lr": FloatDistribution(1e-7, 1e-5, log=True)},
            user_attrs={"role": "candidate", "seed": seed, "run_id": f"r{number}"},
        ))
    _queue(study, 13, extra=True)
    _queue(study, 13, extra=False)
    assert [_start(runner, study) for _ in range(2)] == [None, 13]  # else it would be queued forever
