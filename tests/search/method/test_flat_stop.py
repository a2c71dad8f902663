"""stop_when_flat: a study whose first stages found no gain outside the method's band skips
the rest, records why, and a resume from the database reads the same chain without running a
probe."""

from __future__ import annotations

from pathlib import Path

import optuna

from benchmarks import methods as M
from benchmarks.run import demo_spec
from verl_sweep.search.views.console import Console
from verl_sweep.search.engine.driver import StudyRunner
from verl_sweep.search.database.records import FLAT_BAND, Decision, StageResult
from verl_sweep.search.database.study_root import save_spec, stored_stage_result
from verl_sweep.spaces import build_space


def _spec(stop_when_flat: int) -> object:
    spec = demo_spec("default")
    data = spec.model_dump(mode="json")
    data["stop_when_flat"] = stop_when_flat
    # first an lr stage narrowed to half the baseline's lr (1e-6): it cannot find anything
    data["stages"] = [
        {"name": "slow", "space": "lr", "params": {"low": 5e-7, "high": 5.5e-7}, "budget": {"max_trials": 3}},
        {"name": "kl", "space": "kl", "budget": {"max_trials": 3}},
        {"name": "lr", "space": "lr", "budget": {"max_trials": 3}},
    ]
    return type(spec).model_validate(data)


def _run(spec: object, tmp_path: Path, landscape: str = "default") -> tuple[dict, int, object]:
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/flat.db")
    save_spec(storage, spec)
    launcher = M.replay_launcher(tmp_path / "runs", landscape)
    runner = StudyRunner(spec, storage, launcher, console=Console(quiet=True), build_space=build_space,
                         poll_interval_s=M.POLL_S)
    config = runner.run()
    n_probes = len(launcher.usage())
    launcher.close()
    return config, n_probes, storage


def _result(decision: Decision, eta: float) -> StageResult:
    return StageResult(stage="s", decision=decision, winner_trial=None, eta=eta, eta_low=eta, eta_high=eta,
                       summary="", config={}, overrides={})


def test_a_stage_is_flat_when_it_kept_its_incumbent_or_won_by_no_more_than_the_band() -> None:
    assert _result(Decision.KEPT, 1.0).flat
    for won in (Decision.WON, Decision.WON_ON_BALANCE):  # a speed stage's bar is below the band
        assert _result(won, 1 + FLAT_BAND / 2).flat
        assert not _result(won, 1 + FLAT_BAND * 1.5).flat
    for left_a_leader in (Decision.UNDECIDED, Decision.SLOW_START, Decision.SKIPPED):
        assert not _result(left_a_leader, 1.0).flat


def test_stages_after_a_flat_start_are_skipped_and_resume_reads_them(tmp_path: Path) -> None:
    spec = _spec(stop_when_flat=1)
    config, n_probes, storage = _run(spec, tmp_path)
    assert config == spec.baseline_config()
    assert n_probes == 3  # the first stage's two incumbent runs and one candidate, nothing after
    results = [stored_stage_result(storage, spec, stage) for stage in spec.stages]
    assert results[0] is not None and results[0].flat
    for result in results[1:]:
        assert result is not None and result.decision is Decision.SKIPPED and result.config == config
    again, n_again, _ = _run(spec, tmp_path)  # resume: every stage is decided in the database
    assert again == config and n_again == 0


def test_a_small_speed_gain_is_taken_and_leaves_the_study_flat(tmp_path: Path) -> None:
    # flat_optimal (SIMULATED): a larger token budget is ~1.2% faster, the learning knobs are
    # at their optimum. The token-budget stage's 1% bar takes the gain (with the learning
    # stages' 2% it kept the baseline); a gain that small still stops a flat study early.
    spec = demo_spec("flat_optimal")
    data = spec.model_dump(mode="json")
    tokens = next(stage for stage in data["stages"] if stage["space"] == "token_budget")
    assert tokens["stop"]["tolerance"] < 0.02
    data.update(stop_when_flat=1, stages=[tokens, {"name": "kl", "space": "kl", "budget": {"max_trials": 3}}])
    spec = type(spec).model_validate(data)
    config, _, storage = _run(spec, tmp_path, "flat_optimal")
    first, second = (stored_stage_result(storage, spec, stage) for stage in spec.stages)
    assert first.decision is Decision.WON and 1 + tokens["stop"]["tolerance"] < first.eta <= 1 + FLAT_BAND
    assert first.flat and second.decision is Decision.SKIPPED
    assert config == first.config != spec.baseline_config()


def test_off_by_default_every_stage_runs(tmp_path: Path) -> None:
    spec = _spec(stop_when_flat=0)
    _, n_probes, storage = _run(spec, tmp_path)
    assert n_probes > 3
    assert not any(stored_stage_result(storage, spec, s).decision is Decision.SKIPPED for s in spec.stages)


def test_a_definition_stored_before_stop_when_flat_existed_is_the_same_study(tmp_path: Path) -> None:
    from verl_sweep.search.database.records import SPEC_ATTR

    spec = _spec(stop_when_flat=0)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/old.db")
    save_spec(storage, spec)
    root = optuna.load_study(study_name=spec.name, storage=storage)
    old = dict(root.user_attrs[SPEC_ATTR])
    old.pop("stop_when_flat")  # as the versions before stop_when_flat stored it
    root.set_user_attr(SPEC_ATTR, old)
    assert save_spec(storage, spec) == []
