"""Train mode: each learning stage branches its runs from the chain's checkpoint, the chosen
config's branch carries the chain on, and after the last stage the chain trains to the run's
end. Run on the replay launcher (the simulator's model, in-process): the checkpoints, the
steps each run trains and the chain are read from the files the runs leave."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import optuna
import pytest

from benchmarks import methods as M
from benchmarks.run import demo_spec
from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.search.database.records import StageStudyAttrs, records, stage_study_name
from verl_sweep.search.database.study_root import save_spec
from verl_sweep.search.engine.chain import chain_point
from verl_sweep.search.engine.continuation import stored_model
from verl_sweep.search.engine.driver import StudyRunner
from verl_sweep.search.spec.errors import SweepError
from verl_sweep.search.views.console import Console
from verl_sweep.spaces import build_space

pytestmark = pytest.mark.fast

BRANCH = 100
RUN_STEPS = 1755  # the default world's run: 15 epochs of 117 steps


def _spec(**extra: Any) -> Any:
    spec = demo_spec("default")
    data = spec.model_dump(mode="json")
    data.update({"run_steps": RUN_STEPS, "train": {"branch_steps": BRANCH}, "stop_when_flat": 0, "final_check": False,
                 "stages": [{"name": "kl", "space": "kl", "budget": {"max_trials": 3}, "confirm_top": 0},
                            {"name": "lr", "space": "lr", "budget": {"max_trials": 3}, "confirm_top": 0}], **extra})
    return type(spec).model_validate(data)


def _run(spec: Any, tmp_path: Path) -> tuple[dict[str, Any], optuna.storages.RDBStorage]:
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/train.db")
    save_spec(storage, spec)
    launcher = M.replay_launcher(tmp_path / "runs", "default")
    runner = StudyRunner(spec, storage, launcher, console=Console(quiet=True), build_space=build_space,
                         poll_interval_s=M.POLL_S)
    try:
        config = runner.run()
    finally:
        launcher.close()
    return config, storage


def _steps(run_dir: str) -> list[int]:
    lines = RunDir(Path(run_dir)).metrics.read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


def _stage(storage: Any, spec: Any, index: int) -> tuple[StageStudyAttrs, list[Any]]:
    study = optuna.load_study(study_name=stage_study_name(spec, spec.stages[index]), storage=storage)
    return StageStudyAttrs.of(study.user_attrs), records(study.get_trials(deepcopy=False))


def test_each_stage_branches_from_the_chain_and_the_chain_trains_to_the_run_end(tmp_path: Path) -> None:
    spec = _spec()
    config, storage = _run(spec, tmp_path)
    first, first_runs = _stage(storage, spec, 0)
    assert first.branch is not None and first.branch.step == 0 and first.branch.step_dir is None
    for t in first_runs:  # from scratch, saving at the stage's end
        if t.run_dir:
            assert _steps(t.run_dir)[0] == 1 and RunDir(Path(t.run_dir)).step_dir(BRANCH).is_dir()
    second, second_runs = _stage(storage, spec, 1)
    assert second.branch is not None and second.branch.step == BRANCH
    assert second.branch.stage == "kl" and second.branch.step_dir is not None
    assert Path(second.branch.step_dir).is_dir()  # the first stage's chosen run's checkpoint
    ran = [t for t in second_runs if t.run_dir]
    assert ran and all(_steps(t.run_dir)[0] == BRANCH + 1 and _steps(t.run_dir)[-1] >= 2 * BRANCH for t in ran)
    model, attempts = stored_model(storage, spec)
    assert model is not None and model.step == RUN_STEPS and Path(model.step_dir).is_dir()
    assert len(attempts) == 1 and _steps(attempts[0].run_dir)[0] == 2 * BRANCH + 1
    assert chain_point(storage, spec, len(spec.stages)).step == 2 * BRANCH
    assert config == second.base_config or config != spec.baseline_config()


def test_a_branch_trains_at_its_own_lr_not_the_checkpoints(tmp_path: Path) -> None:
    spec = _spec()
    _, storage = _run(spec, tmp_path)
    _, runs = _stage(storage, spec, 1)
    lrs = set()
    for t in runs:
        if not t.run_dir or t.state != optuna.trial.TrialState.COMPLETE:
            continue
        wanted = float(t.overrides.get("actor_rollout_ref.actor.optim.lr", 1e-6))
        logged = {json.loads(line)["data"]["actor/lr"] for line in
                  RunDir(Path(t.run_dir)).metrics.read_text().splitlines() if line.strip()}
        assert max(abs(lr / wanted - 1) for lr in logged) < 1e-9, (t.number, logged, wanted)
        lrs.add(wanted)
    assert len(lrs) > 1  # candidates at other lrs than the chain's ran


def _rows(run_dir: str) -> dict[int, dict[str, Any]]:
    lines = RunDir(Path(run_dir)).metrics.read_text().splitlines()
    return {row["step"]: row["data"] for row in map(json.loads, filter(str.strip, lines))}


def test_a_branch_goes_on_with_the_chains_adaptive_kl_controller(tmp_path: Path) -> None:
    """verl restarts its adaptive in-reward KL controller on resume; a branch with the chain's
    controller settings starts it where the chain's run left it, and the continuation too."""
    spec = _spec(stop_when_flat=0)
    data = spec.model_dump(mode="json")
    data["baseline"] = {**data["baseline"], "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
                        "algorithm.kl_ctrl.kl_coef": 0.002, "algorithm.kl_ctrl.target_kl": 0.01}
    data["stages"] = [{"name": "lr", "space": "lr", "budget": {"max_trials": 3}, "confirm_top": 0},
                      {"name": "lr2", "space": "lr", "budget": {"max_trials": 3}, "confirm_top": 0}]
    spec = type(spec).model_validate(data)
    _, storage = _run(spec, tmp_path)
    point = chain_point(storage, spec, 1)
    assert point.step_dir is not None
    saved = _rows(str(Path(point.step_dir).parents[1]))[BRANCH]  # the chain's run, at the checkpoint's step
    responses = spec.baseline["data.train_batch_size"] * spec.baseline["actor_rollout_ref.rollout.n"]
    error = min(max(saved["actor/reward_kl_penalty"] / 0.01 - 1, -0.2), 0.2)
    carried = saved["actor/reward_kl_penalty_coeff"] * (1 + error * responses / 10000)
    assert abs(carried / 0.002 - 1) > 0.05  # the controller moved from its start over the first window
    _, runs = _stage(storage, spec, 1)
    started = [_rows(t.run_dir)[BRANCH + 1]["actor/reward_kl_penalty_coeff"] for t in runs if t.run_dir]
    assert started and all(c == pytest.approx(carried, rel=1e-9) for c in started), (started, carried)
    last = chain_point(storage, spec, 2)  # where the continuation starts
    assert last.step_dir is not None
    saved = _rows(str(Path(last.step_dir).parents[1]))[2 * BRANCH]
    error = min(max(saved["actor/reward_kl_penalty"] / 0.01 - 1, -0.2), 0.2)
    _, attempts = stored_model(storage, spec)
    run_dir = next(t.run_dir for t in attempts if t.run_dir)
    assert _rows(run_dir)[2 * BRANCH + 1]["actor/reward_kl_penalty_coeff"] == pytest.approx(
        saved["actor/reward_kl_penalty_coeff"] * (1 + error * responses / 10000), rel=1e-9)


def test_a_run_that_changes_the_kl_controller_starts_its_own(tmp_path: Path) -> None:
    from verl_sweep.search.database.records import ChainPoint
    from verl_sweep.search.engine.chain import carried_kl

    run = RunDir(tmp_path / "chain")
    run.step_dir(BRANCH).mkdir(parents=True)
    run.metrics.write_text(json.dumps({"step": BRANCH, "data": {"actor/reward_kl_penalty": 0.02,
                                                                "actor/reward_kl_penalty_coeff": 0.004}}) + "\n")
    chain = {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.002,
             "algorithm.kl_ctrl.target_kl": 0.01, "data.train_batch_size": 64, "actor_rollout_ref.rollout.n": 8}
    point = ChainPoint(step=BRANCH, step_dir=str(run.step_dir(BRANCH)))
    # KL at twice the target: the error clips at +0.2, over 512 responses of a 10,000 horizon
    assert carried_kl(point, chain, chain) == {"algorithm.kl_ctrl.kl_coef": pytest.approx(0.004 * (1 + 0.2 * 512 / 10000))}
    assert carried_kl(point, {**chain, "algorithm.kl_ctrl.kl_coef": 0.005}, chain) == {}  # its own start is the change
    assert carried_kl(point, {**chain, "algorithm.kl_ctrl.type": "fixed"}, {**chain, "algorithm.kl_ctrl.type": "fixed"}) == {}
    assert carried_kl(ChainPoint(step=0), chain, chain) == {}  # from scratch
    assert carried_kl(ChainPoint(step=BRANCH + 1, step_dir=str(run.step_dir(BRANCH))), chain, chain) == {}  # not logged


def test_a_first_stage_of_its_own_length_then_branches_off_its_grid(tmp_path: Path) -> None:
    """A stage's probe_steps sets its branches' length; the next stage's windows start off
    their own length's grid (step 150 for 100-step branches) and still save at their end."""
    first = 3 * BRANCH // 2
    spec = _spec()
    data = spec.model_dump(mode="json")
    data["stages"][0]["probe_steps"] = first
    data["train"]["max_cost_r"] = None  # the check is the chain's steps, not the cap
    spec = type(spec).model_validate(data)
    _, storage = _run(spec, tmp_path)
    second, runs = _stage(storage, spec, 1)
    assert second.branch is not None and second.branch.step == first
    assert all(_steps(t.run_dir)[0] == first + 1 for t in runs if t.run_dir)
    end = chain_point(storage, spec, 2)
    assert end.step == first + BRANCH and end.step_dir is not None and Path(end.step_dir).is_dir()
    model, _ = stored_model(storage, spec)
    assert model is not None and model.step == RUN_STEPS


def test_the_cap_prices_a_branch_at_its_own_length_after_a_longer_first_stage(tmp_path: Path) -> None:
    """A first stage of 400-step runs: the cap prices the next stage's 100-step branches near
    what they then cost, not at the first stage's runs' whole length (which left it no room)."""
    from statistics import fmean

    from verl_sweep.search.engine.chain import cap_projection

    spec = _spec()
    data = spec.model_dump(mode="json")
    data["stages"][0]["probe_steps"] = 4 * BRANCH
    data["train"]["max_cost_r"] = 100.0  # priced, never binding
    spec = type(spec).model_validate(data)
    _, storage = _run(spec, tmp_path)
    second, runs = _stage(storage, spec, 1)
    projection = cap_projection(storage, spec, 1, second.base_config or {})
    _, first_runs = _stage(storage, spec, 0)
    long_s = fmean(t.probe["gpu_time_s"] for t in first_runs if t.probe.get("gpu_time_s"))
    branch_s = fmean(t.probe["gpu_time_s"] for t in runs if t.probe.get("gpu_time_s"))
    assert projection is not None and long_s > 2 * branch_s
    assert 0.75 * branch_s <= projection.per_run_s <= 1.33 * branch_s, (projection.per_run_s, branch_s, long_s)


def test_a_missing_chain_checkpoint_stops_the_study_with_its_path(tmp_path: Path) -> None:
    spec = _spec()
    _, storage = _run(spec, tmp_path)
    gone = [p for p in (tmp_path / "runs").rglob(f"global_step_{BRANCH}") if p.parent.name == "checkpoints"]
    assert gone
    for step_dir in gone:  # every run of the first stage loses its checkpoint at its end
        shutil.rmtree(step_dir)
    with pytest.raises(SweepError, match=f"stage kl: no run of its chosen config left a checkpoint at step {BRANCH}"):
        chain_point(storage, spec, 1)


def test_validate_refuses_a_train_mode_whose_run_length_is_unknown_or_too_short() -> None:
    from verl_sweep.search.commands.validate import train_problems

    assert train_problems(_spec()) == []
    short = train_problems(_spec(run_steps=2 * BRANCH))
    assert short and short[0].startswith(f"train.branch_steps: 2 learning stages of {BRANCH} steps reach step {2 * BRANCH}")
    spec = _spec()
    data = spec.model_dump(mode="json")
    data["run_steps"] = None
    data["baseline"].pop("trainer.total_training_steps", None)
    unknown = train_problems(type(spec).model_validate(data))
    assert unknown and "the run's length is unknown: set run_steps" in unknown[0], unknown


def test_a_study_stopped_mid_stage_resumes_its_chain(tmp_path: Path) -> None:
    from verl_sweep.search.engine.events import StudyListener
    from verl_sweep.search.spec.errors import Interrupted

    spec = _spec()
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/train.db")
    save_spec(storage, spec)

    class StopInLr(StudyListener):
        def trial_finished(self, study: Any, number: int, role: Any, overrides: dict[str, Any], **details: Any) -> None:
            if study.study_name.endswith(".lr"):
                runner.request_stop("a test")

    launcher = M.replay_launcher(tmp_path / "runs", "default")
    runner = StudyRunner(spec, storage, launcher, console=Console(quiet=True), listeners=[StopInLr()],
                         build_space=build_space, poll_interval_s=M.POLL_S)
    with pytest.raises(Interrupted):
        runner.run()
    launcher.close()
    stopped, _ = _stage(storage, spec, 1)
    assert stopped.result is None and stopped.branch is not None and stopped.branch.step == BRANCH
    assert stored_model(storage, spec)[0] is None
    launcher = M.replay_launcher(tmp_path / "runs", "default")  # resume: a new process, the same database and files
    StudyRunner(spec, storage, launcher, console=Console(quiet=True), build_space=build_space,
                poll_interval_s=M.POLL_S).run()
    launcher.close()
    resumed, runs = _stage(storage, spec, 1)
    assert resumed.branch == stopped.branch and resumed.result is not None
    assert all(_steps(t.run_dir)[0] == BRANCH + 1 for t in runs if t.run_dir and RunDir(Path(t.run_dir)).metrics.is_file())
    model, _ = stored_model(storage, spec)
    assert model is not None and model.step == RUN_STEPS


def test_the_model_is_saved_at_run_steps_when_the_configs_own_run_is_longer(tmp_path: Path) -> None:
    spec = _spec(run_steps=1010)  # not a multiple of the branches' 100 steps
    data = spec.model_dump(mode="json")
    data["baseline"]["trainer.total_epochs"] = 10**6  # the config alone would run far past it
    _, storage = _run(type(spec).model_validate(data), tmp_path)
    model, _ = stored_model(storage, spec)
    assert model is not None and model.step == 1010 and Path(model.step_dir).name == "global_step_1010"


def test_a_stage_that_would_pass_the_cost_cap_is_skipped_and_the_chain_trains_on(tmp_path: Path) -> None:
    from verl_sweep.search.database.records import Decision

    # The kl stage's runs and the run's 1,755 steps fit in 1.3 R for 5 runs of 100 steps (priced
    # in steps: nothing has measured the baseline's speed), not its budget's 8; after it, the lr
    # stage's fewest 4 runs do not fit.
    stages = [{"name": "kl", "space": "kl", "budget": {"max_trials": 8}, "confirm_top": 0},
              {"name": "lr", "space": "lr", "budget": {"max_trials": 3}, "confirm_top": 0}]
    capped = _spec(train={"branch_steps": BRANCH, "max_cost_r": 1.3}, stages=stages)
    (tmp_path / "capped").mkdir()
    (tmp_path / "uncapped").mkdir()
    _, storage = _run(capped, tmp_path / "capped")
    first, first_runs = _stage(storage, capped, 0)
    assert first.result is not None and first.result.decision is not Decision.SKIPPED
    assert 4 <= sum(t.started for t in first_runs) <= 5, [(t.number, t.state) for t in first_runs]
    second, second_runs = _stage(storage, capped, 1)
    assert second.result is not None and second.result.decision is Decision.SKIPPED and second_runs == []
    assert second.result.summary.startswith("skipped: the cost cap (train.max_cost_r 1.3 R)"), second.result.summary
    model, attempts = stored_model(storage, capped)
    assert model is not None and model.step == RUN_STEPS and _steps(attempts[0].run_dir)[0] == BRANCH + 1
    uncapped = _spec(train={"branch_steps": BRANCH, "max_cost_r": None}, stages=stages)
    _, storage = _run(uncapped, tmp_path / "uncapped")
    second, second_runs = _stage(storage, uncapped, 1)
    assert second.result is not None and second.result.decision is not Decision.SKIPPED and second_runs


def test_a_continuation_too_short_to_score_still_trains_the_model(tmp_path: Path) -> None:
    # 3 steps after the last stage: fewer than a score needs (no cap: at this length it skips the stages)
    spec = _spec(run_steps=2 * BRANCH + 3, train={"branch_steps": BRANCH, "max_cost_r": None})
    _, storage = _run(spec, tmp_path)
    model, attempts = stored_model(storage, spec)
    assert _steps(attempts[0].run_dir)[0] == 2 * BRANCH + 1
    assert model is not None and model.step == 2 * BRANCH + 3, [(t.number, t.state, t.reason) for t in attempts]
    assert [t.state for t in attempts] == [optuna.trial.TrialState.COMPLETE]


def test_a_driver_that_died_after_the_last_checkpoint_leaves_a_model_to_resume(tmp_path: Path, monkeypatch: Any) -> None:
    from verl_sweep.search.engine import continuation
    from verl_sweep.search.spec.errors import Interrupted

    spec = _spec()

    def dies(*args: Any, **kwargs: Any) -> bool:
        raise Interrupted("the driver died before it noted the model")

    with monkeypatch.context() as m:
        m.setattr(continuation.Continuation, "_finish", dies)
        with pytest.raises(Interrupted):
            _run(spec, tmp_path)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/train.db")
    model, attempts = stored_model(storage, spec)
    assert model is None and len(attempts) == 1 and RunDir(Path(attempts[0].run_dir)).step_dir(RUN_STEPS).is_dir()
    _run(spec, tmp_path)  # resume: the checkpoint at the run's end is the model, no run from it to itself
    model, attempts = stored_model(storage, spec)
    assert model is not None and model.step == RUN_STEPS and model.step_dir.startswith(attempts[0].run_dir)
    assert len(attempts) == 1, [(t.number, t.state, t.reason) for t in attempts]



@pytest.mark.parametrize("runner", ["continuation", "final check"])
def test_a_resumed_run_after_the_stages_kills_the_run_its_dead_driver_left(tmp_path: Path, runner: str) -> None:
    """A driver SIGKILLed during the continuation or the final check leaves its run alive
    (verl under the local launcher outlives it): the resume closes the attempt and kills that
    run before it starts another beside it on the same GPUs."""
    import subprocess
    import sys

    from support.launcher_contract import FAKE_PROBE

    from verl_sweep.launchers import process as proc_mod
    from verl_sweep.launchers.local import LocalLauncher
    from verl_sweep.search.database.records import ChainPoint, Role, started_attrs
    from verl_sweep.search.engine.continuation import Continuation, continuation_study_name
    from verl_sweep.search.engine.final_check import FinalCheck, final_probe, final_study_name
    from verl_sweep.verl_knowledge import LR, merge

    spec = _spec() if runner == "continuation" else _spec(final_check={"runs": 2}, train=None)
    name = continuation_study_name(spec) if runner == "continuation" else final_study_name(spec)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/train.db")
    run_id, runs = f"{name}.t0000", tmp_path / "runs"
    code = (
        "import sys, time\n"
        "from verl_sweep.launchers.local import LocalLauncher\n"
        "from verl_sweep.launchers.base import RunSpec\n"
        f"l = LocalLauncher(sys.argv[1], gpu_ids=[0], command={FAKE_PROBE!r})\n"
        f"l.start(RunSpec(run_id={run_id!r}, overrides=('actor_rollout_ref.rollout.name=vllm', 'trainer.total_training_steps=100000')))\n"
        "print('started', flush=True); time.sleep(60)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", code, str(runs)], stdout=subprocess.PIPE, text=True)
    assert driver.stdout is not None and driver.stdout.readline().strip() == "started"
    attempt = optuna.create_study(study_name=name, storage=storage, direction="maximize").ask()
    for key, value in started_attrs(role=Role.CANDIDATE, seed=1, overrides={}, run_id=run_id,
                                    run_dir=str(runs / run_id)).items():
        attempt.set_user_attr(key, value)
    driver.kill()
    driver.wait()
    record = proc_mod.read_record(runs / run_id)
    assert record is not None and proc_mod.is_alive(record)
    launcher = LocalLauncher(runs, gpu_ids=[0], command=FAKE_PROBE, kill_grace_s=1.0)
    try:
        if runner == "continuation":
            Continuation.open(storage, spec, spec.baseline_config(), ChainPoint(step=200), launcher, Console(quiet=True))
        else:
            final = merge(spec.baseline_config(), {LR: 2e-6})
            FinalCheck.open(storage, spec, final, launcher, Console(quiet=True), probe=final_probe(spec))
        assert not proc_mod.is_alive(record) and proc_mod.find_marked(record.markers) == []
    finally:
        if proc_mod.is_alive(record):
            proc_mod.kill_tree(record, grace_s=0.0)
    trials = optuna.load_study(study_name=name, storage=storage).trials
    assert trials[0].state is optuna.trial.TrialState.FAIL
