"""A leader that has had every run it may get and is still undecided gets the incumbent run
on its unpaired seeds, outside the budget, once per seed (on the simulated 3x-noise world a
true +6% lr gain was kept out because 3 of its 5 runs were compared with a 2-run incumbent
mean, one of them on a seed that was bad for every config)."""

from __future__ import annotations

import datetime
from pathlib import Path

import optuna
from optuna.trial import TrialState
import pytest

from verl_sweep.search.database.records import Role
from test_idle_reruns import SPEC, _policy, _scored, _scored_study, _trials

pytestmark = pytest.mark.fast


def _noisy_leader(study: optuna.Study) -> optuna.trial.FrozenTrial:
    """A noisy world: the incumbent at rates 0.84 and 1.16 on seeds 11 and 12; a candidate at
    0.86 on seed 11 whose re-runs on seeds 13 and 14 measured 0.92 and 1.24: η 1.025 over 3
    runs, its interval [0.957, 1.098]."""
    _scored(study, "incumbent", 0.84, 11)
    _scored(study, "incumbent", 1.16, 12)
    _scored(study, "candidate", 0.86, 11)
    leader = study.get_trials(deepcopy=False)[-1]
    _scored(study, "rerun", 0.92, 13, rerun_of=leader.number)
    _scored(study, "rerun", 1.24, 14, rerun_of=leader.number)
    return leader


def test_an_undecided_leader_at_its_last_run_is_paired_with_the_incumbent(tmp_path: Path) -> None:
    study = _scored_study(tmp_path)
    policy = _policy(SPEC.stages[-2].model_copy(update={"confirm_max_runs": 3}))
    leader = _noisy_leader(study)
    base = SPEC.baseline_config()
    before = policy.decide(_trials(study), base)
    assert before.winner_trial is None, before.decision
    assert policy.undecided_leader(_trials(study)) == []  # 3 runs: no more of its own
    partners = policy.confirmations(_trials(study), extra=False, now=datetime.datetime.now())
    assert [(r.assignment.role, r.assignment.seed) for r in partners] == [(Role.INCUMBENT, 13), (Role.INCUMBENT, 14)]
    assert all(r.of.role is Role.INCUMBENT for r in partners)  # queued with the incumbent's params
    counted = policy.counted(_trials(study))
    # The seeds move both configs alike: paired, the leader is clearly ahead (η 1.076 [1.033, 1.121]).
    _scored(study, "incumbent", 0.83, 13)
    _scored(study, "incumbent", 1.13, 14)
    trials = _trials(study)
    assert policy.counted(trials) == counted  # outside the search budget
    after = policy.decide(trials, base)
    assert after.winner_trial == leader.number, after.decision
    assert after.eta_low > before.eta_low
    # Every seed of the leader now has an incumbent run: nothing more to queue.
    assert policy.confirmations(trials, extra=False, now=datetime.datetime.now()) == []


def test_no_partner_for_a_leader_no_better_than_the_incumbent(tmp_path: Path) -> None:
    study = _scored_study(tmp_path)
    policy = _policy(SPEC.stages[-2].model_copy(update={"confirm_max_runs": 3}))
    for seed in (11, 12):
        _scored(study, "incumbent", 1.0, seed)
    _scored(study, "candidate", 0.99, 11)
    leader = study.get_trials(deepcopy=False)[-1]
    for seed in (13, 14):
        _scored(study, "rerun", 0.99, seed, rerun_of=leader.number)
    assert policy.incumbent_partners(_trials(study)) == []


def test_a_partner_queued_twice_runs_once(tmp_path: Path) -> None:
    study = _scored_study(tmp_path)
    policy = _policy(SPEC.stages[-2].model_copy(update={"confirm_max_runs": 3}))
    _noisy_leader(study)
    (first, _) = policy.confirmations(_trials(study), extra=False, now=datetime.datetime.now())
    for _ in range(2):  # two workers queued the same partner
        study.enqueue_trial(first.of.params, user_attrs=first.assignment.user_attrs(), skip_if_exists=False)
    queued = [t for t in _trials(study) if t.state == TrialState.WAITING]
    assert [policy.redundant_incumbent_run(t, _trials(study)) for t in queued] == [False, True]
    # The incumbent's own runs are never redundant.
    own = [t for t in _trials(study) if t.role is Role.INCUMBENT and t.state == TrialState.COMPLETE]
    assert not any(policy.redundant_incumbent_run(t, _trials(study)) for t in own)
