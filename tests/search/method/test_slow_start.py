"""A slow start: when the first learning stage's incumbent runs show the reward
still rising fastest at the probe's end, that stage keeps its incumbent (its candidates were
ranked by early speed) and the later learning stages probe ``probe.slow_start_factor`` times
longer; a resume reads the same from the database. A world whose curve bends inside the
probe is left alone."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import optuna
import pytest

from benchmarks import methods as M
from benchmarks.run import demo_spec
from verl_sweep.objectives.shape import late_gain
from verl_sweep.search.views.console import Console
from verl_sweep.search.engine.driver import StudyRunner
from verl_sweep.search.method.policy import SLOW_START_LATE_GAIN
from verl_sweep.search.database.records import Decision
from verl_sweep.search.database.records import stage_study_name
from verl_sweep.search.database.study_root import save_spec, stored_stage_result
from verl_sweep.search.engine.stage_study import StageStudyAttrs
from verl_sweep.spaces import build_space


def _logistic(t_mid: float, steepness: float, n: int = 500, *, noise: float = 0.0, seed: int = 0) -> np.ndarray:
    t = np.arange(1, n + 1, dtype=float)
    rng = np.random.default_rng(seed)
    return 0.3 + 0.55 / (1 + (t_mid / t) ** steepness) + rng.normal(0, noise, n)


@pytest.mark.parametrize(("t_mid", "steepness"), [(700, 2.6), (900, 1.5), (1500, 3.0)])
def test_a_curve_whose_midpoint_lies_past_the_probe_reads_slow(t_mid: float, steepness: float) -> None:
    assert late_gain(_logistic(t_mid, steepness, noise=0.015)) >= SLOW_START_LATE_GAIN


@pytest.mark.parametrize(("t_mid", "steepness"), [(150, 1.5), (260, 1.5), (300, 2.6), (120, 3.0)])
def test_a_curve_that_bends_inside_the_probe_does_not(t_mid: float, steepness: float) -> None:
    assert late_gain(_logistic(t_mid, steepness, noise=0.015)) < 0.7


def test_too_few_steps_or_no_rise_give_no_reading() -> None:
    assert late_gain(_logistic(700, 2.6, n=12)) is None
    assert late_gain(np.full(100, 0.3)) is None
    assert late_gain([math.nan] * 50 + list(_logistic(700, 2.6, n=10))) is None


def _spec(landscape: str, **probe: object) -> object:
    spec = demo_spec(landscape)
    data = spec.model_dump(mode="json")
    data["probe"] = {**data["probe"], **probe}
    data["stop_when_flat"] = 0
    data["stages"] = [{"name": "minibatch", "space": "mini_batch", "budget": {"max_trials": 3}, "confirm_top": 1},
                      {"name": "lr", "space": "lr", "budget": {"max_trials": 3}, "confirm_top": 1}]
    return type(spec).model_validate(data)


def _run(spec: object, landscape: str, tmp_path: Path) -> tuple[object, int]:
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/slow.db")
    save_spec(storage, spec)
    launcher = M.replay_launcher(tmp_path / "runs", landscape)
    runner = StudyRunner(spec, storage, launcher, console=Console(quiet=True), build_space=build_space,
                         poll_interval_s=M.POLL_S)
    runner.run()
    n_probes = len(launcher.usage())
    launcher.close()
    return storage, n_probes


def _probe_steps(storage: object, spec: object, index: int) -> int:
    study = optuna.load_study(study_name=stage_study_name(spec, spec.stages[index]), storage=storage)
    return StageStudyAttrs.of(study.user_attrs).probe_steps


def test_a_slow_start_keeps_the_incumbent_and_lengthens_later_probes(tmp_path: Path) -> None:
    spec = _spec("slow_start")
    storage, _ = _run(spec, "slow_start", tmp_path)
    first = stored_stage_result(storage, spec, spec.stages[0])
    assert first is not None and first.decision is Decision.SLOW_START and first.winner_trial is None
    assert _probe_steps(storage, spec, 0) == 500
    assert _probe_steps(storage, spec, 1) == 500 * spec.probe.slow_start_factor
    _, n_again = _run(spec, "slow_start", tmp_path)  # resume: every stage decided, nothing re-run
    assert n_again == 0


def test_factor_one_never_lengthens(tmp_path: Path) -> None:
    spec = _spec("slow_start", slow_start_factor=1)
    storage, _ = _run(spec, "slow_start", tmp_path)
    assert stored_stage_result(storage, spec, spec.stages[0]).decision is not Decision.SLOW_START
    assert _probe_steps(storage, spec, 1) == 500


def test_a_world_that_bends_inside_the_probe_is_left_alone(tmp_path: Path) -> None:
    spec = _spec("default")
    storage, _ = _run(spec, "default", tmp_path)
    assert stored_stage_result(storage, spec, spec.stages[0]).decision is not Decision.SLOW_START
    assert _probe_steps(storage, spec, 1) == 500
