"""An entropy-bonus stage (``actor.entropy_coeff``), off by default: a bounded knob added as one
space class and one safe bound, run by the driver like any other stage."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import methods as M
from benchmarks.run import demo_spec
from verl_sweep.search.views.console import Console
from verl_sweep.search.engine.driver import StudyRunner
from verl_sweep.search.method.stage import Stage
from verl_sweep.search.spec.study_file import default_stages
from verl_sweep.search.database.study_root import save_spec, stored_stage_result
from verl_sweep.search.commands.validate import validate_study
from verl_sweep.spaces import SpaceError, build_space
from verl_sweep.verl_knowledge import Algorithm

pytestmark = pytest.mark.fast

KEY = "actor_rollout_ref.actor.entropy_coeff"


def _spec(**stage: object) -> object:
    spec = demo_spec("default")
    data = spec.model_dump(mode="json")
    data["stop_when_flat"] = 0
    data["stages"] = [{"name": "entropy", "space": "entropy", "budget": {"max_trials": 4}, "confirm_top": 1, **stage}]
    return type(spec).model_validate(data)


def test_the_space_suggests_inside_its_bound_and_reads_verl_s_default() -> None:
    spec = _spec()
    base = spec.baseline_config()
    space = build_space("entropy", model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm, base=base,
                        options={"high": 0.005})
    assert space.explain() == ["entropy: actor_rollout_ref.actor.entropy_coeff — entropy_coeff ∈ [0, 0.005] — "
                               "an entropy bonus up to 0.01 (verl's default 0: none); changed by the study"]
    assert space.incumbent_params(base) == {"entropy_coeff": 0.0}  # verl's default, unset in the baseline
    assert space.starting_points(base, 3) == [{"entropy_coeff": 0.0025}, {"entropy_coeff": 0.005}]
    with pytest.raises(SpaceError, match=r"entropy\.high: must be ≤ 0\.01 \(safe bound: an entropy bonus up to 0\.01"):
        build_space("entropy", model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm, base=base,
                    options={"high": 0.1})


def test_it_is_off_by_default_and_a_study_may_ask_for_it() -> None:
    assert all(s.space != "entropy" for a in Algorithm for s in default_stages(a))
    spec = _spec()
    assert Stage.of(spec, 0).learns and Stage.of(spec, 0).probe_steps == spec.probe.steps
    problems, lines = validate_study(spec, with_verl=False)
    assert problems == [] and "stage 1 entropy (entropy):" in lines


def test_a_study_with_an_entropy_stage_runs_and_decides(tmp_path: Path) -> None:
    import optuna

    spec = _spec()
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/e.db")
    save_spec(storage, spec)
    launcher = M.replay_launcher(tmp_path / "runs", "default")
    StudyRunner(spec, storage, launcher, console=Console(quiet=True), poll_interval_s=M.POLL_S).run()
    result = stored_stage_result(storage, spec, spec.stages[0])
    assert result is not None and result.stage == "entropy"
    study = optuna.load_study(study_name=f"{spec.name}.entropy", storage=storage)
    values = [t.user_attrs["overrides"].get(KEY) for t in study.trials if "overrides" in t.user_attrs]
    assert values and all(v is None or 0.0 <= v <= 0.01 for v in values)
    assert any(v is not None and v > 0 for v in values)  # candidates tried a bonus
