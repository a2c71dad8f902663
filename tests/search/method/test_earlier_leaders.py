"""The polish stage first tries the leaders earlier stages could not decide, moved
onto the chain's winner; a stage that found nothing, or decided, hands nothing on."""

from __future__ import annotations

import types
from pathlib import Path

import optuna
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial
import pytest

from benchmarks.run import demo_spec
from verl_sweep.search.database.records import Decision, Role, StageResult, records, result_attr
from verl_sweep.search.method.stage import Stage
from verl_sweep.search.engine.stage_loop import undecided_leaders
from verl_sweep.search.engine.stage_study import StageStudy
from verl_sweep.search.database.storage import open_storage
from verl_sweep.spaces import build_space
from verl_sweep import verl_knowledge as L

pytestmark = pytest.mark.fast

SPEC = demo_spec("default")
MB = L.MINI_BATCH


def _scored(study: optuna.Study, role: str, rate: float, seed: int, mini_batch: int | None = None,
            **attrs: object) -> None:
    score = {"rate": rate, "gain": rate * 100, "train_time_s": 100.0, "n_steps": 500, "ci_low": rate * 0.95,
             "ci_high": rate * 1.05, "rate_se": rate * 0.03}
    params = {} if mini_batch is None else {"mini_batch": mini_batch}
    dists = {} if mini_batch is None else {"mini_batch": IntDistribution(384, 640, step=8)}
    overrides = {} if mini_batch is None else {MB: mini_batch}
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=rate, params=params, distributions=dists,
                                 user_attrs={"role": role, "seed": seed, "score": score, "overrides": overrides,
                                             **attrs}))  # fmt: skip


def _minibatch_stage(storage: optuna.storages.RDBStorage, decision: Decision, winner: int | None) -> None:
    base = SPEC.baseline_config()
    study = optuna.create_study(study_name=f"{SPEC.name}.minibatch", storage=storage, direction="maximize")
    for seed in (11, 12):
        _scored(study, "incumbent", 1.0, seed)
    _scored(study, "candidate", 1.05, 11, mini_batch=416)
    leader = study.get_trials(deepcopy=False)[-1].number
    _scored(study, "rerun", 1.04, 13, mini_batch=416, rerun_of=leader)
    _scored(study, "candidate", 0.9, 11, mini_batch=600)
    result = StageResult(stage="minibatch", decision=decision, winner_trial=winner, eta=1.0, eta_low=1.0,
                         eta_high=1.0, summary=f"{decision}", config=base, overrides={})
    for key, value in result_attr(result).items():
        study.set_user_attr(key, value)


def _ctx(storage: optuna.storages.RDBStorage) -> object:
    return types.SimpleNamespace(spec=SPEC, storage=storage)


def test_an_undecided_leader_is_the_polish_stages_first_candidate(tmp_path: Path) -> None:
    storage = open_storage(f"sqlite:///{tmp_path}/l.db")
    _minibatch_stage(storage, Decision.UNDECIDED, None)
    polish = next(i for i, s in enumerate(SPEC.stages) if s.space == "polish")
    leaders = undecided_leaders(_ctx(storage), polish)
    assert leaders == [("minibatch", {MB: 416})]
    base = {**SPEC.baseline_config(), L.LR: 3e-6}  # the chain moved on since
    space = build_space("polish", model=SPEC.model, hardware=SPEC.hardware, algorithm=SPEC.algorithm, base=base,
                        options={}, baseline=SPEC.baseline_config())
    study = optuna.create_study(study_name=f"{SPEC.name}.polish", storage=storage, direction="maximize")
    StageStudy(study, storage).enqueue_initial(Stage.of(SPEC, polish), space, base, carried={}, leaders=leaders)
    raw = {t.number: t.user_attrs.get("origin") for t in study.get_trials(deepcopy=False)}
    candidates = [t for t in records(study.get_trials(deepcopy=False)) if t.role is Role.CANDIDATE]
    assert raw[candidates[0].number] == "leader of minibatch"
    assert candidates[0].point == {"mini_batch": 416, "lr": 3e-6, "use_kl": False}
    assert all(raw[t.number] == "start" for t in candidates[1:]) and len(candidates) > 1


def test_a_stage_that_found_nothing_or_decided_hands_nothing_on(tmp_path: Path) -> None:
    for decision, winner in ((Decision.KEPT, None), (Decision.WON, 2), (Decision.SKIPPED, None)):
        storage = open_storage(f"sqlite:///{tmp_path}/{decision.name}.db")
        _minibatch_stage(storage, decision, winner)
        assert undecided_leaders(_ctx(storage), len(SPEC.stages) - 1) == []
