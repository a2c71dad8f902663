"""stop_when_flat: a study whose first stages found nothing skips the rest, records
why, and a resume from the database reads the same chain without running a probe."""

from __future__ import annotations

from pathlib import Path

import optuna

from benchmarks import methods as M
from benchmarks.run import demo_spec
from search.console import Console
from search.driver import StudyRunner
from search.records import Decision
from search.study_root import save_spec, stored_stage_result
from spaces import build_space


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


def _run(spec: object, tmp_path: Path) -> tuple[dict, int, object]:
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/flat.db")
    save_spec(storage, spec)
    launcher = M.replay_launcher(tmp_path / "runs", "default")
    runner = StudyRunner(spec, storage, launcher, console=Console(quiet=True), build_space=build_space,
                         poll_interval_s=M.POLL_S)
    config = runner.run()
    n_probes = len(launcher.usage())
    launcher.close()
    return config, n_probes, storage


def test_only_a_stage_that_kept_its_incumbent_with_nothing_above_the_tolerance_found_nothing() -> None:
    assert [d for d in Decision if d.found_nothing] == [Decision.KEPT]


def test_stages_after_a_flat_start_are_skipped_and_resume_reads_them(tmp_path: Path) -> None:
    spec = _spec(stop_when_flat=1)
    config, n_probes, storage = _run(spec, tmp_path)
    assert config == spec.baseline_config()
    assert n_probes == 3  # the first stage's two incumbent runs and one candidate, nothing after
    results = [stored_stage_result(storage, spec, stage) for stage in spec.stages]
    assert results[0] is not None and results[0].decision.found_nothing
    for result in results[1:]:
        assert result is not None and result.decision is Decision.SKIPPED and result.config == config
    again, n_again, _ = _run(spec, tmp_path)  # resume: every stage is decided in the database
    assert again == config and n_again == 0


def test_off_by_default_every_stage_runs(tmp_path: Path) -> None:
    spec = _spec(stop_when_flat=0)
    _, n_probes, storage = _run(spec, tmp_path)
    assert n_probes > 3
    assert not any(stored_stage_result(storage, spec, s).decision is Decision.SKIPPED for s in spec.stages)


def test_a_definition_stored_before_stop_when_flat_existed_is_the_same_study(tmp_path: Path) -> None:
    from search.records import SPEC_ATTR

    spec = _spec(stop_when_flat=0)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/old.db")
    save_spec(storage, spec)
    root = optuna.load_study(study_name=spec.name, storage=storage)
    old = dict(root.user_attrs[SPEC_ATTR])
    old.pop("stop_when_flat")  # as the versions before stop_when_flat stored it
    root.set_user_attr(SPEC_ATTR, old)
    assert save_spec(storage, spec) == []
