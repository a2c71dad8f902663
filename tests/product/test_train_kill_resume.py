"""A train-mode study killed with SIGKILL in the middle of a learning stage resumes its chain:
`verl-sweep run` on the simulator, killed once a branch of the lr stage has started, then
`verl-sweep resume`, which finishes the stages and trains the model to the run's end from the
checkpoints on disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.search.database.records import StageStudyAttrs, records, stage_study_name
from verl_sweep.search.engine.continuation import stored_model
from verl_sweep.search.spec.study_file import load_study

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BRANCH = 100


def _study(tmp_path: Path) -> Path:
    data = yaml.safe_load((REPO / "studies" / "demo-train.yaml").read_text())
    data["train"] = {"branch_steps": BRANCH, "max_cost_r": None}  # a short run: the cap would skip both stages
    data["run_steps"] = 400  # the continuation: steps 201-400
    data["launcher"]["options"]["time_scale"] = 4000  # slow enough to be killed mid-stage
    data["stages"] = [{"name": "kl", "space": "kl", "budget": {"max_trials": 3}, "confirm_top": 0},
                      {"name": "lr", "space": "lr", "budget": {"max_trials": 4}, "confirm_top": 0}]
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "verl_sweep", *args]


def test_a_train_mode_study_killed_mid_stage_resumes_its_chain(tmp_path: Path) -> None:
    path = _study(tmp_path)
    db = f"sqlite:///{tmp_path}/train.db"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    log = (tmp_path / "run.log").open("w")
    driver = subprocess.Popen(_cli("run", str(path), "--storage", db), cwd=tmp_path, stdout=log,
                              stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while "[lr] trial" not in (tmp_path / "run.log").read_text():
        assert driver.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-2000:]
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and its simulated runs, at once
    driver.wait()
    spec = load_study(path)
    storage = optuna.storages.RDBStorage(db)
    lr = optuna.load_study(study_name=stage_study_name(spec, spec.stages[1]), storage=storage)
    before = StageStudyAttrs.of(lr.user_attrs)
    assert before.result is None and before.branch is not None and before.branch.step == BRANCH
    resumed = subprocess.run(_cli("resume", spec.name, "--storage", db), cwd=tmp_path, capture_output=True,
                             text=True, timeout=600, env=env)
    assert resumed.returncode == 0, (resumed.stdout[-2000:], resumed.stderr[-2000:])
    after = StageStudyAttrs.of(optuna.load_study(study_name=lr.study_name, storage=storage).user_attrs)
    assert after.branch == before.branch and after.result is not None
    for t in records(optuna.load_study(study_name=lr.study_name, storage=storage).get_trials(deepcopy=False)):
        metrics = RunDir(Path(t.run_dir)).metrics if t.run_dir else None
        if metrics is not None and metrics.is_file() and metrics.read_text().strip():
            assert json.loads(metrics.read_text().splitlines()[0])["step"] == BRANCH + 1, t.number
    model, _ = stored_model(storage, spec)
    assert model is not None and model.step == spec.run_steps and Path(model.step_dir).is_dir()
