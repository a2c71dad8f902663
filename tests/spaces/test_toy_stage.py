"""A new stage, added from this module alone: a space that declares its knob (its kind, its
verl key, its safe bound, what it moves) and registers itself; the simulator's response to the
knob comes from a landscape file's ``knobs`` section. The driver then validates, runs and
decides the stage as any other, and the winner is exported with the knob set."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import yaml

from benchmarks import methods as M
from benchmarks.run import demo_spec
from verl_sweep.search.commands.validate import validate_study
from verl_sweep.search.database.records import Decision
from verl_sweep.search.database.study_root import save_spec, stored_stage_result
from verl_sweep.search.engine.driver import StudyRunner
from verl_sweep.search.method.stage import Stage
from verl_sweep.search.views.console import Console
from verl_sweep.spaces import SPACES, BoundedSpace, Moves, ParamBound, SpaceError, build_space, register_space

pytestmark = pytest.mark.fast

KEY = "actor_rollout_ref.actor.clip_ratio"


class ClipRatioSpace(BoundedSpace):
    """PPO's clip ratio in 0.1-0.3: the whole of a new stage."""

    kind = "toy_clip_ratio"
    param = "clip_ratio"
    key = KEY
    BOUND = ParamBound("clip_ratio", 0.1, 0.3, False, "a toy bound on PPO's clip ratio")
    moves = Moves.LEARNING


@pytest.fixture
def registered() -> Iterator[type[ClipRatioSpace]]:
    register_space(ClipRatioSpace)
    yield ClipRatioSpace
    SPACES.pop(ClipRatioSpace.kind)


def _world(tmp_path: Path) -> str:
    """The default world, where a clip ratio of 0.28 learns best (the baseline runs 0.2)."""
    path = tmp_path / "clip_world.yaml"
    path.write_text(yaml.safe_dump({"extends": "default", "name": "clip_world",
                                    "knobs": {KEY: {"optimum": 0.28, "width": 0.08, "penalty": 0.06}}}))
    return str(path)


def _spec() -> object:
    spec = demo_spec("default")
    data = spec.model_dump(mode="json")
    data["stop_when_flat"] = 0
    data["baseline"][KEY] = 0.2
    data["stages"] = [{"name": "clip", "space": ClipRatioSpace.kind, "budget": {"max_trials": 8}, "confirm_top": 1}]
    return type(spec).model_validate(data)


def test_the_space_asks_inside_its_bound_and_maps_the_incumbent(registered: type[ClipRatioSpace]) -> None:
    spec = _spec()
    base = spec.baseline_config()
    space = build_space(ClipRatioSpace.kind, model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm,
                        base=base, options={"high": 0.25})
    assert space.incumbent_params(base) == {"clip_ratio": 0.2}
    assert all(0.1 <= p["clip_ratio"] <= 0.25 for p in space.starting_points(base, 3))
    with pytest.raises(SpaceError, match=r"toy_clip_ratio\.high: must be ≤ 0\.3"):
        build_space(ClipRatioSpace.kind, model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm,
                    base=base, options={"high": 0.5})


def test_a_study_file_names_it_only_while_it_is_registered(registered: type[ClipRatioSpace]) -> None:
    spec = _spec()
    assert Stage.of(spec, 0).learns and Stage.of(spec, 0).probe_steps == spec.probe.steps
    problems, lines = validate_study(spec, with_verl=False)
    assert problems == [] and f"stage 1 clip ({ClipRatioSpace.kind}):" in lines
    SPACES.pop(ClipRatioSpace.kind)
    try:
        with pytest.raises(Exception, match="space must be one of"):
            Stage.of(spec, 0)
    finally:
        register_space(ClipRatioSpace)


def test_a_study_with_the_new_stage_runs_and_finds_the_better_clip_ratio(
        registered: type[ClipRatioSpace], tmp_path: Path) -> None:
    import optuna

    spec = _spec()
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/toy.db")
    save_spec(storage, spec)
    launcher = M.replay_launcher(tmp_path / "runs", _world(tmp_path))
    StudyRunner(spec, storage, launcher, console=Console(quiet=True), poll_interval_s=M.POLL_S).run()
    result = stored_stage_result(storage, spec, spec.stages[0])
    assert result is not None and result.decision is Decision.WON, result
    assert 0.2 < result.overrides[KEY] <= 0.3  # towards the world's optimum, inside the bound
