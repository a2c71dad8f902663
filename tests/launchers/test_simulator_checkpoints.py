"""The simulated verl's checkpoints: saved as verl 0.9.1 lays them out, resumed as it resumes
them (docs/verl-resume.md), by the process and by :meth:`Landscape.simulate`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from verl_sweep.launchers.simulator import checkpoints, load_landscape, parse_overrides
from verl_sweep.launchers.simulator.outcomes import CheckpointState

from test_simulator import BASE as SIMULATOR_BASE

pytestmark = pytest.mark.fast

BASE = [*SIMULATOR_BASE, "data.seed=5"]
LAND = load_landscape("default")
# Only the step-to-step reward noise left: the noise-free curve is the expectation's.
QUIET = dataclasses.replace(LAND, data={**LAND.data, "noise": {"reward_sd": 0.0, "t_mid_sd": 0.0, "ceiling_sd": 0.0,
                                                                 "step_time_sd": 0.0, "run_time_sd": 0.0}})  # fmt: skip
NOISY_REWARD = dataclasses.replace(QUIET, data={**QUIET.data, "noise": {**QUIET.data["noise"], "reward_sd": 0.015}})


def _run(cwd: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[int, dict[str, Any]]]:
    """One simulated verl process in ``cwd``; its metrics by step."""
    metrics = cwd / f"{name}.jsonl"
    argv = [*BASE, f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics}", *extra]
    proc = subprocess.run([sys.executable, "-m", "verl_sweep.launchers.simulator", *argv], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "VERL_SIM_TIME_SCALE": "1000000"}, timeout=60)  # fmt: skip
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return proc, {r["step"]: r["data"] for r in rows}


def _config(*extra: str) -> dict[str, Any]:
    return parse_overrides([*BASE, *extra])


def _saved(land: Any, config: dict[str, Any], step: int) -> CheckpointState:
    """The checkpoint a run of ``config`` saves at ``step``."""
    records = land.simulate({**config, "trainer.save_freq": step}, max_steps=step)
    state = list(records)[-1].checkpoint
    assert state is not None and state.step == step
    return state


def _scores(records: Any) -> dict[int, float]:
    return {r.step: r.metrics["critic/score/mean"] for r in records}


def test_save_every_k_steps_writes_verls_layout(tmp_path: Path) -> None:
    proc, rows = _run(tmp_path, "a", "trainer.total_training_steps=7", "trainer.save_freq=3", "trainer.default_local_dir=ck")
    assert proc.returncode == 0, proc.stderr
    root = tmp_path / "ck"  # relative to the working directory, as verl's is
    assert sorted(p.name for p in root.iterdir()) == [
        "global_step_3", "global_step_6", "global_step_7", "latest_checkpointed_iteration.txt"]  # and the last step
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "7"
    state = json.loads((root / "global_step_6/actor/sim_state_world_size_8_rank_0.json").read_text())
    assert state["lr_scheduler"] == {"base_lrs": [1e-6], "last_epoch": 6, "_last_lr": [1e-6]}
    assert state["optimizer"] == {"param_groups": [{"lr": 1e-6, "initial_lr": 1e-6}], "step": 12}  # 2 updates a step
    assert state["data"] == {"samples_yielded": 6 * 1024}
    assert state["simulator"]["config"]["actor_rollout_ref.actor.ppo_mini_batch_size"] == 512
    assert 0.25 < state["model"]["reward"] < 0.4
    save_s = LAND.checkpoint_s(_config())
    assert save_s == pytest.approx(3.0 * 7)  # 7B: 3 s per billion parameters
    assert [s for s, data in rows.items() if "timing_s/save_checkpoint" in data] == [3, 6, 7]
    assert rows[3]["timing_s/save_checkpoint"] == save_s
    assert LAND.checkpoint_s(_config("algorithm.adv_estimator=gae")) == pytest.approx(2 * save_s)  # and the critic's
    assert state["simulator"]["elapsed_s"] == pytest.approx(
        LAND.expected(_config()).startup_s + sum(rows[s]["timing_s/step"] for s in range(1, 7)))
    # No saves by default: verl's save_freq is -1.
    proc, _ = _run(tmp_path, "b", "trainer.total_training_steps=3", "trainer.default_local_dir=none")
    assert proc.returncode == 0 and not (tmp_path / "none").exists()


def test_a_save_counts_in_its_steps_time() -> None:
    config = _config("trainer.total_training_steps=6")
    plain = list(LAND.simulate(config))
    saving = list(LAND.simulate({**config, "trainer.save_freq": 4}))
    save_s = LAND.checkpoint_s(config)
    for a, b in zip(plain, saving):
        extra = save_s if b.step in (4, 6) else 0.0
        assert b.step_time_s == pytest.approx(a.step_time_s + extra)
        assert b.metrics["timing_s/step"] == pytest.approx(a.metrics["timing_s/step"] + extra)  # verl times it inside the step
        assert b.metrics["perf/throughput"] < a.metrics["perf/throughput"] or not extra


def test_same_config_resume_repeats_the_run(tmp_path: Path) -> None:
    proc, whole = _run(tmp_path, "whole", "trainer.total_training_steps=10", "trainer.save_freq=4",
                       "trainer.default_local_dir=base")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    proc, branch = _run(tmp_path, "branch", "trainer.total_training_steps=10", "trainer.resume_mode=resume_path",
                        f"trainer.resume_from_path={tmp_path}/base/global_step_4", "trainer.val_before_train=true",
                        "trainer.default_local_dir=branch")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"Resuming from {tmp_path}/base/global_step_4, setting global step to 4" in proc.stdout
    assert list(branch) == [4, 5, 6, 7, 8, 9, 10]  # validation at step 4, then steps from the folder's N + 1
    saved = json.loads((tmp_path / "base/global_step_4/actor/sim_state_world_size_8_rank_0.json").read_text())
    assert branch[4]["val-core/default/reward/mean@1"] == saved["model"]["reward"]
    for step in range(5, 11):
        for key in ("critic/score/mean", "actor/kl_loss", "actor/grad_norm", "response_length/mean", "actor/lr"):
            assert branch[step][key] == pytest.approx(whole[step][key], rel=1e-9), (step, key)
        if step not in (8, 10):  # the whole run saved there
            assert branch[step]["timing_s/step"] == pytest.approx(whole[step]["timing_s/step"], rel=1e-9)


@pytest.mark.parametrize("n", [4, 15, 60])
def test_noise_free_resume_follows_the_uninterrupted_curve(n: int) -> None:
    config = _config("trainer.total_training_steps=80", "actor_rollout_ref.actor.optim.lr_warmup_steps=20")
    whole = _scores(QUIET.simulate(config))
    resumed = _scores(QUIET.simulate(config, resume=_saved(QUIET, config, n)))
    assert list(resumed) == list(range(n + 1, 81))
    for step, reward in resumed.items():
        assert reward == pytest.approx(whole[step], rel=1e-12, abs=1e-12)
    exp = QUIET.expected(config)
    assert whole[80] == pytest.approx(exp.reward(80 - 10))  # the warm-up's lag, as before resuming existed


def test_branch_with_another_mini_batch_enters_its_curve_at_equal_reward() -> None:
    base = _config("trainer.total_training_steps=60")
    state = _saved(QUIET, base, 40)
    other = {**base, "actor_rollout_ref.actor.ppo_mini_batch_size": 256}
    exp = QUIET.expected(other)
    entry = exp.steps_at(state.reward)
    assert exp.reward(entry) == pytest.approx(state.reward, rel=1e-12)
    assert abs(entry - 40) > 8  # the new curve reaches that reward at another step
    records = list(QUIET.simulate(other, resume=state))
    rewards = _scores(records)
    assert [r.step for r in records] == list(range(41, 61))
    for step, reward in rewards.items():
        assert reward == pytest.approx(exp.reward(entry + step - 40), rel=1e-12)
    assert rewards[41] != pytest.approx(_scores(QUIET.simulate(other))[41])  # not the new config's own step 41
    assert rewards[41] != pytest.approx(_scores(QUIET.simulate(base))[41])  # nor the old config's
    last = list(QUIET.simulate({**other, "trainer.save_freq": 60}, resume=state))[-1].checkpoint
    assert last is not None and last.optimizer_steps == state.optimizer_steps + 20 * 4  # the new mini-batch's updates
    assert records[0].metrics["actor/kl_coef"] == 0.001


def test_branch_above_its_curve_continues_at_the_ceiling() -> None:
    base = _config("trainer.total_training_steps=700")
    state = _saved(QUIET, base, 600)
    weak = {**base, "actor_rollout_ref.actor.ppo_mini_batch_size": 128}  # 8 updates a step: stale, a lower ceiling
    exp = QUIET.expected(weak)
    assert state.reward > exp.ceiling
    assert _scores(QUIET.simulate(weak, resume=state, max_steps=602)) == {601: pytest.approx(exp.ceiling), 602: pytest.approx(exp.ceiling)}


def test_branches_from_one_checkpoint_share_their_noise() -> None:
    base = _config("trainer.total_training_steps=30")
    state = _saved(QUIET, base, 10)

    def residuals(config: dict[str, Any]) -> list[float]:
        noisy, quiet = _scores(NOISY_REWARD.simulate(config, resume=state)), _scores(QUIET.simulate(config, resume=state))
        return [noisy[s] - quiet[s] for s in noisy]

    a = residuals(base)
    b = residuals({**base, "actor_rollout_ref.actor.kl_loss_coef": 0.003})
    c = residuals({**base, "data.seed": 6})
    assert a == pytest.approx(b, abs=1e-12)  # one data.seed: the same draws, step for step
    assert a != pytest.approx(c, abs=1e-3)
    assert 0.005 < sum(abs(x) for x in a) / len(a) < 0.03


def test_an_lr_change_needs_a_rewritten_checkpoint(tmp_path: Path) -> None:
    proc, whole = _run(tmp_path, "whole", "trainer.total_training_steps=8", "trainer.save_freq=4",
                       "trainer.default_local_dir=base")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    step_dir = tmp_path / "base" / "global_step_4"
    resume = ("trainer.total_training_steps=8", "trainer.resume_mode=resume_path", "actor_rollout_ref.actor.optim.lr=3e-6")
    proc, plain = _run(tmp_path, "plain", *resume, f"trainer.resume_from_path={step_dir}")
    assert proc.returncode == 0, proc.stderr
    assert [plain[s]["actor/lr"] for s in plain] == [1e-6] * 4  # the checkpoint's lr wins
    assert [plain[s]["critic/score/mean"] for s in plain] == pytest.approx([whole[s]["critic/score/mean"] for s in plain])

    patched = tmp_path / "patched" / "global_step_4"
    shutil.copytree(step_dir, patched)
    checkpoints.rewrite_lr(patched, 3e-6)
    state = json.loads((patched / "actor/sim_state_world_size_8_rank_0.json").read_text())
    assert state["optimizer"]["param_groups"] == [{"lr": pytest.approx(3e-6), "initial_lr": 3e-6}]
    assert state["lr_scheduler"]["base_lrs"] == [3e-6] and state["lr_scheduler"]["_last_lr"] == [pytest.approx(3e-6)]
    proc, rewritten = _run(tmp_path, "rewritten", *resume, f"trainer.resume_from_path={patched}")
    assert proc.returncode == 0, proc.stderr
    assert [rewritten[s]["actor/lr"] for s in rewritten] == [pytest.approx(3e-6)] * 4
    assert rewritten[8]["critic/score/mean"] != pytest.approx(whole[8]["critic/score/mean"], abs=1e-4)


def test_rewrite_lr_scales_a_warm_up_in_progress(tmp_path: Path) -> None:
    state = CheckpointState(step=3, reward=0.3, lr=0.5e-6, base_lr=1e-6, optimizer_steps=6, samples_seen=0,
                            elapsed_s=1.0, diverging_since=None, config={})  # fmt: skip
    config = {"trainer.default_local_dir": str(tmp_path)}
    step_dir = checkpoints.save(config, state)
    checkpoints.rewrite_lr(step_dir, 2e-6)
    loaded = checkpoints.load(step_dir, config, step=3)
    assert (loaded.base_lr, loaded.lr) == (2e-6, pytest.approx(1e-6))
    with pytest.raises(ValueError, match=r"lr must be > 0, but got 0"):
        checkpoints.rewrite_lr(step_dir, 0)
    with pytest.raises(checkpoints.CheckpointError, match=r"^FileNotFoundError: \[Errno 2\] No such file or directory"):
        checkpoints.rewrite_lr(tmp_path / "global_step_9", 2e-6)


@pytest.fixture(scope="module")
def saved_step_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = _config("trainer.total_training_steps=4")
    root = tmp_path_factory.mktemp("ckpt")
    return checkpoints.save({**config, "trainer.default_local_dir": str(root)}, _saved(LAND, config, 4))


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("no step in the name", r"AssertionError: resume ckpt must specify the global_steps"),
        ("missing", r"FileNotFoundError: \[Errno 2\] No such file or directory: '.*/global_step_7/actor/sim_state_world_size_8_rank_0\.json'"),
        ("corrupt", r"RuntimeError: .*/global_step_4/actor/sim_state_world_size_8_rank_0\.json is not a readable simulated verl checkpoint: "),
        ("other GPU count", r"FileNotFoundError: .*/global_step_4/actor/sim_state_world_size_4_rank_0\.json'"),
        ("trailing slash", r"ValueError: invalid literal for int\(\) with base 10: '4/'"),
        ("unknown mode", r"UnboundLocalError: .*'global_step_folder'.* \(Unknown resume mode latest\)"),
    ],
)  # fmt: skip
def test_an_unloadable_checkpoint_fails_with_verls_error(tmp_path: Path, saved_step_4: Path, case: str, reason: str) -> None:
    path, extra = str(saved_step_4), ["trainer.resume_mode=resume_path"]
    if case == "no step in the name":
        path = str(saved_step_4.parent)
    elif case == "missing":
        path = str(saved_step_4.parent / "global_step_7")
    elif case == "corrupt":
        copy = tmp_path / "global_step_4"
        shutil.copytree(saved_step_4, copy)
        (copy / "actor/sim_state_world_size_8_rank_0.json").write_text('{"format": "verl-sweep simulated checkpoint 1"')
        path = str(copy)
    elif case == "other GPU count":
        extra += ["trainer.n_gpus_per_node=4"]
    elif case == "trailing slash":
        path += "/"
    elif case == "unknown mode":
        extra = ["trainer.resume_mode=latest"]
    proc, rows = _run(tmp_path, "r", "trainer.total_training_steps=8", f"trainer.resume_from_path={path}", *extra)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert __import__("re").search(reason, last), last
    assert rows == {} and " step:" not in proc.stdout


def test_auto_resume_takes_the_latest_checkpoint(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "a", "trainer.total_training_steps=6", "trainer.save_freq=3", "trainer.project_name=p",
                   "trainer.experiment_name=e")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    root = tmp_path / "checkpoints" / "p" / "e"  # verl's default_local_dir, under the working directory
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "6"
    proc, rows = _run(tmp_path, "b", "trainer.total_training_steps=9", "trainer.project_name=p", "trainer.experiment_name=e")
    assert proc.returncode == 0, proc.stderr  # resume_mode is auto unless set
    assert list(rows) == [7, 8, 9] and f"Found checkpoint: {root}/global_step_6" in proc.stdout
    proc, rows = _run(tmp_path, "c", "trainer.total_training_steps=6", "trainer.project_name=p", "trainer.experiment_name=e")
    assert proc.returncode == 0 and rows == {}  # nothing left to train: verl exits without a step
    (root / "latest_checkpointed_iteration.txt").write_text("12")
    proc, rows = _run(tmp_path, "d", "trainer.total_training_steps=2", "trainer.project_name=p", "trainer.experiment_name=e")
    assert proc.returncode == 0 and list(rows) == [1, 2]  # the tracker names no folder: from scratch
    assert f"Checkpoint does not exist: {root}/global_step_12" in proc.stdout
    proc, rows = _run(tmp_path, "e", "trainer.total_training_steps=2", "trainer.project_name=p", "trainer.experiment_name=e",
                      "trainer.resume_mode=disable")  # fmt: skip
    assert list(rows) == [1, 2]


def test_a_diverging_branch_blows_up_counted_from_its_first_step() -> None:
    base = _config("trainer.total_training_steps=200")
    reckless = {**base, "actor_rollout_ref.actor.optim.lr": 3e-5}
    exp = QUIET.expected(reckless)
    assert exp.diverge_step is not None
    state = _saved(QUIET, base, 100)
    patched = dataclasses.replace(state, base_lr=3e-5, lr=3e-5)  # what rewrite_lr does on disk
    first_nan = next(r.step for r in QUIET.simulate(reckless, resume=patched) if math.isnan(r.metrics["critic/score/mean"]))
    assert first_nan == 100 + exp.diverge_step + 12
    assert all(r.metrics["critic/score/mean"] == r.metrics["critic/score/mean"] for r in QUIET.simulate(reckless, resume=state))



def test_adaptive_in_reward_kl_moves_as_verls_and_restarts_on_resume() -> None:
    """verl's adaptive controller: the coefficient logged at a step is the one applied, then it
    moves by 1 + clip(KL / target - 1, ±0.2) × responses / horizon; no checkpoint keeps it, so a
    resumed run logs kl_ctrl.kl_coef again at its first step."""
    base = _config("trainer.total_training_steps=30", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                   "algorithm.kl_ctrl.kl_coef=0.002", "algorithm.kl_ctrl.target_kl=0.01", "algorithm.kl_ctrl.horizon=20000")
    responses = base["data.train_batch_size"] * base["actor_rollout_ref.rollout.n"]
    rows = {r.step: r.metrics for r in QUIET.simulate(base)}
    assert rows[1]["actor/reward_kl_penalty_coeff"] == 0.002
    for step in range(1, 30):
        error = min(max(rows[step]["actor/reward_kl_penalty"] / 0.01 - 1, -0.2), 0.2)
        assert rows[step + 1]["actor/reward_kl_penalty_coeff"] == pytest.approx(
            rows[step]["actor/reward_kl_penalty_coeff"] * (1 + error * responses / 20000), rel=1e-12)
    assert rows[30]["actor/reward_kl_penalty_coeff"] != pytest.approx(0.002, rel=1e-3)  # it moved
    resumed = list(QUIET.simulate(base, resume=_saved(QUIET, base, 20)))
    assert resumed[0].step == 21 and resumed[0].metrics["actor/reward_kl_penalty_coeff"] == 0.002
    fixed = {**base, "algorithm.kl_ctrl.type": "fixed"}
    assert {r.metrics["actor/reward_kl_penalty_coeff"] for r in QUIET.simulate(fixed)} == {0.002}
