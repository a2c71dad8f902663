"""Idle workers run the next stage ahead from the current leader. When another
config wins, that stage is moved aside: its runs are closed as wasted (a dead owner's probe
killed), its name freed, and the stage opens afresh from the winner."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
from optuna.trial import TrialState

from support import REPO

from verl_sweep.launchers import make_launcher
from verl_sweep.launchers import process as proc_mod
from verl_sweep.launchers.base import RunSpec
from verl_sweep.search.views.console import Console
from verl_sweep.search.engine.driver import StudyRunner
from verl_sweep.search.method.stage import Stage
from verl_sweep.search.database.records import CloseReason, records
from verl_sweep.search.engine.stage_study import TRIALS_REFRESH_S, StageStudy
from verl_sweep.search.database.storage import open_storage
from verl_sweep.search.spec.study_file import load_study
from verl_sweep.spaces import build_space
from verl_sweep.verl_knowledge import merge



def _dead_owner() -> dict[str, object]:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return {"host": socket.gethostname(), "pid": gone.pid, "started": 0.0}


def test_a_stage_run_ahead_from_a_leader_that_lost_is_moved_aside(tmp_path: Path) -> None:
    spec = load_study(REPO / "studies" / "demo.yaml")
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    launcher = make_launcher("sim", tmp_path / "runs", max_concurrent=2)
    stage, before = spec.stages[1], spec.stages[0].name
    plan = Stage.of(spec, 1)
    baseline = spec.baseline_config()
    leader = merge(baseline, {"actor_rollout_ref.actor.optim.lr": 2e-6})

    def open_stage(base: dict[str, object], ahead_of: str | None = None) -> tuple[StageStudy, bool] | None:
        return StageStudy.open(storage, plan, base, ahead_of=ahead_of, launcher=launcher)

    opened = open_stage(leader, ahead_of=f"demo.{before}")
    assert opened is not None and opened[1]
    ahead_study = opened[0]
    ahead_study.mark_initialized()  # as StageLoop.open does once the first trials are queued
    ahead = ahead_study.study
    assert ahead_study.attrs().run_prefix == f"demo.{stage.name}.ahead{ahead._study_id}"
    # Another idle worker whose leader is the incumbent does not take the name over.
    assert open_stage(baseline, ahead_of=f"demo.{before}") is None
    # One run ahead in flight whose worker died (SIGKILL), one queued.
    handle = launcher.start(RunSpec(run_id="ahead-run", overrides=("actor_rollout_ref.rollout.name=vllm",
                                                                    "trainer.total_training_steps=100000"), n_gpus=2))
    record = proc_mod.read_record(handle.run_dir)
    assert record is not None and proc_mod.is_alive(record)
    running = ahead.ask()
    running.set_user_attr("owner", _dead_owner())
    running.set_user_attr("run_dir", str(handle.run_dir))
    ahead.enqueue_trial({}, user_attrs={"role": "incumbent", "seed": 11})

    # The stage before kept its incumbent: the real chain opens the stage from the baseline.
    reopened = open_stage(baseline)
    assert reopened is not None
    real, created = reopened[0].study, reopened[1]
    assert created and real.study_name == f"demo.{stage.name}" and real._study_id != ahead._study_id
    assert real.user_attrs["base_config"] == baseline and "ahead_of" not in real.user_attrs
    lost = optuna.load_study(study_name=f"demo.{stage.name}~lost{ahead._study_id}", storage=storage)
    assert [t.state for t in lost.trials] == [TrialState.FAIL, TrialState.FAIL]
    assert all(t.closed_as is CloseReason.WASTED for t in records(lost.trials))
    deadline = time.monotonic() + 10
    while proc_mod.is_alive(record) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not proc_mod.is_alive(record), "the dead worker's probe should have been killed"
    assert not psutil.pid_exists(record.pid) or psutil.Process(record.pid).status() == psutil.STATUS_ZOMBIE


def test_runs_ahead_from_a_losing_leader_are_stopped_and_closed_as_wasted(tmp_path: Path) -> None:
    spec = load_study(REPO / "studies" / "demo.yaml")
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    launcher = make_launcher("sim", tmp_path / "runs", max_concurrent=2, time_scale=1.0)
    runner = StudyRunner(spec, storage, launcher, console=Console(quiet=True), build_space=build_space)
    index, baseline = 1, spec.baseline_config()
    leader = merge(baseline, {"actor_rollout_ref.actor.optim.lr": 2e-6})
    ahead = runner.open_stage(index, leader, ahead_of=f"demo.{spec.stages[0].name}")
    assert ahead is not None
    assert ahead.runner.start()  # this worker's first run ahead: a real simulator probe
    (item,) = ahead.runner.active.values()
    record = proc_mod.read_record(item.probe.handle.run_dir)
    assert record is not None and proc_mod.is_alive(record)
    runner.ahead = ahead

    # The stage before kept its incumbent: the runs ahead from the leader do not count.
    assert runner.take_ahead(index, baseline) is None
    assert not proc_mod.is_alive(record)
    lost = optuna.load_study(study_name=f"{ahead.study.name}~lost{ahead.study.study_id}", storage=storage)
    assert {t.state for t in lost.trials} == {TrialState.FAIL}
    assert all(t.reason.startswith("ran ahead from a leader") and t.closed_as is CloseReason.WASTED
               for t in records(lost.trials))
    # The stage then opens afresh from the real winner, under its own name.
    real = runner.open_stage(index, baseline)
    assert real is not None and real.study.name == ahead.study.name
    assert real.study.attrs().base_config == baseline


def test_a_worker_whose_run_ahead_is_moved_aside_under_it_stops_cleanly(tmp_path: Path) -> None:
    """Another worker opens the real stage (another config won) while this one still follows a
    run ahead: this worker's next passes stop its probe, and dropping the run ahead is quiet."""
    spec = load_study(REPO / "studies" / "demo.yaml")
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    index, baseline = 1, spec.baseline_config()
    runners = [StudyRunner(spec, storage, make_launcher("sim", tmp_path / f"runs{i}", max_concurrent=2, time_scale=1.0),
                           console=Console(quiet=True), build_space=build_space, poll_interval_s=0.1)
               for i in range(2)]
    mine, other = runners
    ahead = mine.open_stage(index, merge(baseline, {"actor_rollout_ref.actor.optim.lr": 2e-6}),
                            ahead_of=f"demo.{spec.stages[0].name}")
    assert ahead is not None and ahead.runner.start()
    mine.ahead = ahead
    (item,) = ahead.runner.active.values()
    record = proc_mod.read_record(item.probe.handle.run_dir)

    real = other.open_stage(index, baseline)  # the incumbent won: moved aside
    assert real is not None and real.study.study_id != ahead.study.study_id
    time.sleep(TRIALS_REFRESH_S)  # the view a worker holds is read again at least this often
    for _ in range(3):
        ahead.tick(may_start_more=False)  # its trial was closed: the probe is stopped
    assert not ahead.active
    assert record is not None and not proc_mod.is_alive(record)
    assert mine.take_ahead(index, baseline) is None
    lost = optuna.load_study(study_name=f"{real.study.name}~lost{ahead.study.study_id}", storage=storage)
    assert {t.state for t in lost.trials} == {TrialState.FAIL}


def test_a_worker_stays_while_a_dead_process_s_confirmation_run_looks_alive(tmp_path: Path) -> None:
    """Right after a SIGKILL the dead process's run still has a fresh heartbeat; on this host
    its owner is known dead, so the worker does not leave: it will queue that run again."""
    spec = load_study(REPO / "studies" / "demo.yaml")
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    launcher = make_launcher("sim", tmp_path / "runs", max_concurrent=1)
    runner = StudyRunner(spec, storage, launcher, console=Console(quiet=True), build_space=build_space,
                         leave_at_end=True)  # fmt: skip
    last = runner.open_stage(len(spec.stages) - 1, spec.baseline_config())
    assert last is not None
    alive_owner = {"host": socket.gethostname(), "pid": psutil.Process().ppid(),
                   "started": round(psutil.Process().parent().create_time(), 2)}  # fmt: skip

    def rerun(owner: dict[str, object]) -> optuna.trial.FrozenTrial:
        return optuna.trial.create_trial(state=TrialState.RUNNING, user_attrs={"role": "rerun", "owner": owner})

    assert last.nothing_left_for_me(records([rerun(alive_owner)]))
    assert not last.nothing_left_for_me(records([rerun(alive_owner), rerun(_dead_owner())]))


def test_a_trial_closed_by_another_process_before_its_tell_is_dropped_not_a_crash(tmp_path: Path) -> None:
    """The owner of a run-ahead trial tells it just after another worker closed it as wasted:
    Optuna's tell says ValueError ("Cannot tell a FAIL trial"), which ended a worker with
    exit 1; it must be the UpdateFinishedTrialError that the runner drops the result on."""
    import pytest

    from verl_sweep.search.engine.trials import tell

    url = f"sqlite:///{tmp_path}/closed.db"
    mine = optuna.create_study(study_name="s", storage=open_storage(url))
    other = optuna.load_study(study_name="s", storage=open_storage(url, create=False))  # another process
    for state in (TrialState.PRUNED, TrialState.FAIL, None):
        trial = mine.ask()
        other._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        with pytest.raises(optuna.exceptions.UpdateFinishedTrialError, match="closed by another process"):
            tell(mine, trial, None if state else 1.0, state=state)
    trial = mine.ask()
    with pytest.raises(ValueError, match="Cannot tell with state"):  # a wrong call is still one
        tell(mine, trial, state=TrialState.RUNNING)
    tell(mine, trial, 2.0)
    assert mine.trials[-1].value == 2.0


def test_opening_a_stage_while_another_worker_moves_it_aside_starts_over(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Another worker moved the study opened ahead aside (its leader lost) between this
    worker's create_study (the name was taken) and its load of that name: the load raised
    KeyError 'Record does not exist.', and the worker exited 1 (16 workers on PostgreSQL, a
    world whose leaders lose often). Opening starts over instead, and creates the stage."""
    spec = load_study(REPO / "studies" / "demo.yaml")
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    stage, before = spec.stages[1], spec.stages[0].name
    plan = Stage.of(spec, 1)
    baseline = spec.baseline_config()
    leader = merge(baseline, {"actor_rollout_ref.actor.optim.lr": 2e-6})
    opened = StageStudy.open(storage, plan, leader, ahead_of=f"demo.{before}")
    assert opened is not None
    ahead = opened[0]
    ahead.mark_initialized()
    real_load = optuna.load_study

    def load_as_the_other_worker_moves_it_aside(**kwargs):  # type: ignore[no-untyped-def]
        if kwargs["study_name"] == ahead.name and not ahead.moved_aside():
            ahead.vacate(why="the stage before chose another config")  # the other worker, at this instant
        return real_load(**kwargs)

    monkeypatch.setattr(optuna, "load_study", load_as_the_other_worker_moves_it_aside)
    reopened = StageStudy.open(storage, plan, baseline)
    assert reopened is not None
    real, created = reopened
    assert created and real.name == f"demo.{stage.name}" and real.study_id != ahead.study_id
    assert real.attrs().base_config == baseline and ahead.moved_aside()


def test_a_stop_ends_the_wait_for_a_stage_whose_creator_died_before_initializing_it(tmp_path: Path) -> None:
    """A worker that finds a stage study another process created waits (up to a minute) for
    its first trials; if the creator was killed before queueing them, the wait runs to its end.
    A SIGTERM in that wait stopped the worker only after it (a worker's clean stop took > 30 s
    in the fault test): a stop request ends the wait at once."""
    import pytest

    from verl_sweep.search.database.records import stage_study_name
    from verl_sweep.search.spec.errors import Interrupted

    spec = load_study(REPO / "studies" / "demo.yaml")
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    plan = Stage.of(spec, 1)
    # the creator's create_study, and nothing after: SIGKILLed there
    optuna.create_study(study_name=stage_study_name(spec, spec.stages[1]), storage=storage, direction="maximize")
    asked = []

    def stop_requested() -> str | None:
        asked.append(time.monotonic())
        return "SIGTERM" if len(asked) >= 2 else None

    started = time.monotonic()
    with pytest.raises(Interrupted, match="stopped by SIGTERM"):
        StageStudy.open(storage, plan, spec.baseline_config(), stop_requested=stop_requested)
    assert time.monotonic() - started < 10, "the wait ran on after the stop request"


def test_a_worker_queues_the_first_trials_of_a_stage_whose_creator_died_before_it_did(tmp_path: Path) -> None:
    """The creator of a stage study was SIGKILLed after creating it, before queueing its first
    trials (the incumbent's runs). A worker that joins tells its process is gone, at once, and
    queues them itself; the stage then runs as if it had created it."""
    import subprocess
    import sys

    from verl_sweep.search.database.liveness import owner_record
    from verl_sweep.search.database.records import stage_study_name

    spec = load_study(REPO / "studies" / "demo.yaml")
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    plan = Stage.of(spec, 1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    study = optuna.create_study(study_name=stage_study_name(spec, spec.stages[1]), storage=storage, direction="maximize")
    study.set_user_attr("creator", {**owner_record(), "pid": int(dead.stdout)})  # a process that is gone
    started = time.monotonic()
    opened = StageStudy.open(storage, plan, spec.baseline_config())
    assert opened is not None and opened[1] is True, "the joiner did not take the creator's place"
    assert time.monotonic() - started < 10, "it waited out the minute for a dead creator"
    assert opened[0].attrs().base_config == spec.baseline_config()
