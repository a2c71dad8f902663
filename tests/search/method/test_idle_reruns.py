"""Confirmations queued by idle workers at the same moment: no two runs of a point share a
seed, a duplicate required re-run is dropped, and extra re-runs stop when the fresh seeds of
the point are used up."""

from __future__ import annotations

import datetime
from pathlib import Path

import optuna
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial
import pytest

from support import REPO

from verl_sweep.search.method.policy import StagePolicy
from verl_sweep.search.method.stage import Stage
from verl_sweep.search.database.records import Decision, TrialRecord, records
from verl_sweep.search.database.storage import open_storage
from verl_sweep.search.spec.study_file import Budget, StageSettings, load_study

pytestmark = pytest.mark.fast

SPEC = load_study(REPO / "studies" / "demo.yaml")  # seeds 11-16, incumbent on 11 and 12


def _policy(stage: StageSettings | None = None) -> StagePolicy:
    spec = SPEC if stage is None else SPEC.model_copy(update={"stages": [stage]})
    return StagePolicy(Stage.of(spec, 0))


def _trials(study: optuna.Study) -> list[TrialRecord]:
    return records(study.get_trials(deepcopy=False))


def _policy_and_study(tmp_path: Path) -> tuple[StagePolicy, optuna.Study]:
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    study = optuna.create_study(study_name="demo.lr", storage=storage, direction="maximize")
    study.add_trial(create_trial(
        state=TrialState.COMPLETE, value=1.2, params={"lr": 2e-6},
        distributions={"lr": FloatDistribution(1e-7, 1e-5, log=True)},
        user_attrs={"role": "candidate", "seed": 11, "run_id": "r0"},
    ))
    return _policy(), study


def _queue(study: optuna.Study, seed: int, *, extra: bool) -> None:
    study.enqueue_trial({"lr": 2e-6}, user_attrs={"role": "rerun", "rerun_of": 0, "seed": seed, "extra": extra},
                        skip_if_exists=False)


def _start(policy: StagePolicy, study: optuna.Study) -> int | None:
    trial = study.ask()
    trials = _trials(study)
    seed = policy.rerun_seed(next(t for t in trials if t.number == trial.number), trials)
    if seed is not None:
        trial.set_user_attr("seed", seed)
        trial.suggest_float("lr", 1e-7, 1e-5, log=True)
    else:
        study.tell(trial, state=TrialState.FAIL)
    return seed


def test_reruns_queued_together_get_distinct_fresh_seeds(tmp_path: Path) -> None:
    policy, study = _policy_and_study(tmp_path)
    _queue(study, 13, extra=False)
    _queue(study, 13, extra=False)  # a second worker queued the same required re-run
    for _ in range(5):
        _queue(study, 13, extra=True)  # idle workers all picked the same seed
    seeds = [_start(policy, study) for _ in range(7)]
    # the incumbent's other seed first (its run there pairs with the re-run), then the rest
    assert seeds == [12, None, 13, 14, 15, 16, None]


def test_extra_reruns_stop_when_the_fresh_seeds_are_used(tmp_path: Path) -> None:
    policy, study = _policy_and_study(tmp_path)
    assert policy.unused_fresh_seeds({"lr": 2e-6}, _trials(study)) == [12, 13, 14, 15, 16]
    for seed in (13, 14):
        _queue(study, seed, extra=True)
    assert policy.unused_fresh_seeds({"lr": 2e-6}, _trials(study)) == [12, 15, 16]  # queued ones count


def test_a_required_rerun_runs_even_when_twins_used_the_fresh_seeds(tmp_path: Path) -> None:
    policy, study = _policy_and_study(tmp_path)
    for number, seed in enumerate((12, 13, 14, 15, 16), start=1):  # the sampler proposed the point 5 more times
        study.add_trial(create_trial(
            state=TrialState.COMPLETE, value=1.1, params={"lr": 2e-6},
            distributions={"lr": FloatDistribution(1e-7, 1e-5, log=True)},
            user_attrs={"role": "candidate", "seed": seed, "run_id": f"r{number}"},
        ))
    _queue(study, 13, extra=True)
    _queue(study, 13, extra=False)
    assert [_start(policy, study) for _ in range(2)] == [None, 13]  # else it would be queued forever


def _scored(study: optuna.Study, role: str, rate: float, seed: int, **attrs: object) -> None:
    score = {"rate": rate, "gain": rate * 100, "train_time_s": 100.0, "n_steps": 500, "ci_low": rate * 0.95,
             "ci_high": rate * 1.05, "rate_se": rate * 0.03}
    params = {} if role == "incumbent" else {"lr": 3e-6}
    dists = {} if role == "incumbent" else {"lr": FloatDistribution(1e-7, 1e-5, log=True)}
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=rate, params=params, distributions=dists,
                                 user_attrs={"role": role, "seed": seed, "score": score, **attrs}))


def _scored_study(tmp_path: Path) -> optuna.Study:
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    return optuna.create_study(study_name="demo.polish", storage=storage, direction="maximize")


def _leader_over_two_runs(study: optuna.Study) -> "optuna.trial.FrozenTrial":
    """Two incumbent runs at η 1, and a candidate at η 1.06 with one re-run: the leader."""
    for seed in (11, 12):
        _scored(study, "incumbent", 1.0, seed)
    _scored(study, "candidate", 1.06, 11)
    leader = study.get_trials(deepcopy=False)[-1]
    _scored(study, "rerun", 1.06, 13, rerun_of=leader.number)
    return leader


def test_an_undecided_leader_is_rerun_until_its_interval_decides(tmp_path: Path) -> None:
    """η 1.06 with a ±5% interval neither clears the 2% rule nor falls within it: the leader
    gets one more fresh seed per pass, up to ``confirm_max_runs`` runs."""
    study = _scored_study(tmp_path)
    policy = _policy(SPEC.stages[-2].model_copy(update={"confirm_max_runs": 3}))
    leader = _leader_over_two_runs(study)
    trials = _trials(study)
    assert [t.number for t in policy.undecided_leader(trials)] == [leader.number]
    (rerun,) = policy.confirmations(trials, extra=False, now=datetime.datetime.now())  # run 3
    assert rerun.of.number == leader.number and rerun.assignment.extra
    study.enqueue_trial(rerun.of.params, user_attrs=rerun.assignment.user_attrs(), skip_if_exists=False)
    trials = _trials(study)
    assert policy.undecided_leader(trials) == []  # its re-run is pending
    queued = [t for t in trials if t.state == TrialState.WAITING]
    assert [t.extra for t in queued] == [True]
    study.tell(study.ask(), state=TrialState.FAIL)  # the queued run: drop it, then score run 3
    _scored(study, "rerun", 1.06, 14, rerun_of=leader.number)
    assert policy.undecided_leader(_trials(study)) == []  # 3 runs: no more


def test_a_leader_within_the_tolerance_is_not_rerun(tmp_path: Path) -> None:
    study = _scored_study(tmp_path)
    policy = _policy(SPEC.stages[-2])
    for seed in (11, 12):
        _scored(study, "incumbent", 1.0, seed)
    _scored(study, "candidate", 1.01, 11)
    _scored(study, "rerun", 1.01, 13, rerun_of=study.get_trials(deepcopy=False)[-1].number)
    assert policy.undecided_leader(_trials(study)) == []


def test_a_failure_queued_again_takes_its_own_place_in_the_budget(tmp_path: Path) -> None:
    """A stage at its budget whose last candidate died (SIGKILL) and was queued again: the
    retry fills that candidate's place, and one more fresh candidate would not fit."""
    from verl_sweep.search.database import liveness

    study = _scored_study(tmp_path)
    policy = _policy(SPEC.stages[-2].model_copy(update={"budget": Budget(max_trials=3)}))
    _scored(study, "incumbent", 1.0, 11)
    _scored(study, "candidate", 1.1, 11)
    dead = study.ask({"lr": FloatDistribution(1e-7, 1e-5, log=True)})
    dead.set_user_attr("role", "candidate")
    study.tell(dead, state=TrialState.FAIL)
    liveness.requeue(study, study.get_trials(deepcopy=False)[-1], reason="its driver process died")

    retry = study.ask()
    assert study._storage.get_trial(retry._trial_id).system_attrs["retry_history"] == [dead.number]
    assert not policy.over_budget(_trials(study), retry.number)
    study.tell(retry, 1.05)
    fresh = study.ask()
    assert policy.over_budget(_trials(study), fresh.number)


def test_a_leader_clear_of_the_incumbent_wins_once_it_has_three_runs(tmp_path: Path) -> None:
    """η 1.06 whose interval clears the incumbent (η 1) but still reaches 1 + 2%
    is undecided over 2 runs (it gets a third) and wins over 3; before, it was kept out."""
    study = _scored_study(tmp_path)
    policy = _policy(SPEC.stages[-2].model_copy(update={"confirm_max_runs": 5}))
    leader = _leader_over_two_runs(study)
    base = SPEC.baseline_config()
    two = policy.decide(_trials(study), base)
    assert two.winner_trial is None and two.decision is Decision.UNDECIDED
    assert [t.number for t in policy.undecided_leader(_trials(study))] == [leader.number]
    _scored(study, "rerun", 1.06, 14, rerun_of=leader.number)
    three = policy.decide(_trials(study), base)
    assert 1.0 < three.eta_low <= policy.threshold  # the new rule decided it, not the old one
    assert three.winner_trial == leader.number
    assert policy.undecided_leader(_trials(study)) == []  # decided: no fourth run


def test_a_leader_whose_interval_reaches_the_incumbent_keeps_it() -> None:
    policy = _policy()
    assert not policy.significant(0.999, 5)
    assert not policy.significant(1.01, 2)
    assert policy.significant(1.01, 3)
    assert policy.significant(1.03, 2)
