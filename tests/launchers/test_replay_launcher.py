"""ReplayLauncher: the launcher contract on a virtual clock, and equality with the real
simulator process (same config, same seed → the same metrics lines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO
from support.launcher_contract import ContractKit, LauncherContract, finished, long_spec, metric_steps, ok_spec, running_with_metrics, wait_for
from verl_sweep.launchers import make_launcher
from verl_sweep.launchers.base import LauncherError, NoCapacityError, RunSpec, RunStatus
from verl_sweep.launchers.run_dir import RunDir, merge_overrides, probe_pins
from verl_sweep.launchers.replay import ReplayLauncher



def replay(root: Path, **options: object) -> ReplayLauncher:
    kwargs: dict[str, object] = {"max_concurrent": 2, "gpus_per_probe": 2, "poll_advance_s": 200.0}
    kwargs.update(options)
    return ReplayLauncher(root, **kwargs)  # type: ignore[arg-type]


class TestReplayLauncherContract(LauncherContract):
    """The shared contract. Two of its tests look for OS processes (there are none here);
    they are replaced below by what the same promise means without processes."""

    @pytest.fixture
    def kit(self) -> ContractKit:
        # poll_advance_s: the contract polls without calling wait(), so each poll lets
        # 200 virtual seconds pass (a probe step of the 2-GPU config takes ~400-1000 s).
        return ContractKit(make=replay, timeout_s=30.0)

    def test_cancel_kills_every_process(self, kit: ContractKit, tmp_path: Path) -> None:
        launcher = kit.make(tmp_path)
        handle = launcher.start(long_spec("long-run"))
        wait_for(launcher, handle, running_with_metrics(handle), kit.timeout_s)
        steps_at_cancel = metric_steps(handle)
        launcher.cancel(handle)
        assert launcher.poll(handle).status is RunStatus.CANCELLED
        assert isinstance(launcher, ReplayLauncher)
        launcher.wait(1e6)  # a cancelled run writes nothing more, however long we wait
        assert metric_steps(handle) == steps_at_cancel
        assert "Received SIGTERM" in handle.stderr_path.read_text()
        launcher.cancel(handle)  # idempotent
        assert launcher.free_slots() == launcher.max_concurrent

    def test_two_run_third_waits_and_freed_slot_is_reused(self, kit: ContractKit, tmp_path: Path) -> None:
        launcher = kit.make(tmp_path)
        assert launcher.max_concurrent == 2
        a, b = launcher.start(long_spec("cap-a")), launcher.start(long_spec("cap-b"))
        for h in (a, b):
            wait_for(launcher, h, running_with_metrics(h), kit.timeout_s)
        assert launcher.free_slots() == 0
        with pytest.raises(NoCapacityError, match="a free GPU slot is needed"):
            launcher.start(long_spec("cap-c"))
        launcher.cancel(a)
        assert launcher.free_slots() == 1
        c = launcher.start(long_spec("cap-c"))
        wait_for(launcher, c, running_with_metrics(c), kit.timeout_s)
        for h in (b, c):
            launcher.cancel(h)
        assert launcher.free_slots() == 2


# -- virtual clock ----------------------------------------------------------------------------


def test_wait_jumps_to_the_next_exit_and_no_further(tmp_path: Path) -> None:
    launcher = replay(tmp_path, poll_advance_s=0.0)
    handle = launcher.start(ok_spec("short", steps=3))
    assert launcher.clock() == 0.0
    launcher.wait(1.0)  # nothing would change for minutes: the clock moves only as asked
    assert launcher.clock() == 1.0 and launcher.poll(handle).status is RunStatus.RUNNING
    launcher.wait(1e9)  # ... but never past the run's exit
    state = launcher.poll(handle)
    assert state.status is RunStatus.SUCCEEDED, state
    steps = [json.loads(line) for line in handle.metrics_path.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    expected_end = 120.0 + sum(s["data"]["timing_s/step"] for s in steps)
    assert launcher.clock() == pytest.approx(expected_end)
    usage = launcher.usage()
    assert len(usage) == 1 and usage[0].gpu_s == pytest.approx(expected_end * 2)


def test_lines_appear_only_when_the_clock_passes_their_step(tmp_path: Path) -> None:
    launcher = replay(tmp_path, poll_advance_s=0.0)
    handle = launcher.start(ok_spec("paced", steps=50))
    launcher.advance_to(120.0)  # start-up: no step yet
    assert metric_steps(handle) == []
    first = launcher.landscape.simulate(_config_of(handle), max_steps=2)
    t1, t2 = (r.step_time_s for r in first)
    launcher.advance_to(120.0 + t1 + 1e-6)
    assert metric_steps(handle) == [1]
    launcher.advance_to(120.0 + t1 + t2 - 1.0)
    assert metric_steps(handle) == [1]


def test_config_error_fails_at_once_with_verls_text(tmp_path: Path) -> None:
    launcher = replay(tmp_path)
    spec = RunSpec("bad", ("actor_rollout_ref.rollout.name=hf", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"))
    handle = launcher.start(spec)
    state = launcher.poll(handle)
    assert state.status is RunStatus.FAILED and state.exit_code == 1
    assert "Error executing job with overrides" in handle.stderr_path.read_text()
    assert "Unknown rollout name 'hf'" in handle.stderr_path.read_text()


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(LauncherError, match="max_concurrent must be >= 1, but got 0"):
        ReplayLauncher(tmp_path, max_concurrent=0)
    with pytest.raises(LauncherError, match="poll_advance_s must be >= 0, but got -1"):
        ReplayLauncher(tmp_path, poll_advance_s=-1)
    launcher = replay(tmp_path)
    with pytest.raises(LauncherError, match=r"n_gpus must be <= gpus_per_probe \(2\), but got 4"):
        launcher.start(RunSpec("big", ok_spec("x").overrides, n_gpus=4))


def test_registered_by_name(tmp_path: Path) -> None:
    launcher = make_launcher("replay", tmp_path, max_concurrent=3, landscape="kl_edge")
    assert isinstance(launcher, ReplayLauncher) and launcher.max_concurrent == 3
    assert launcher.landscape.name == "kl_edge"


# -- the same texts and lines as the simulator process ----------------------------------------


def _config_of(handle) -> dict:  # type: ignore[no-untyped-def]
    from verl_sweep.launchers.simulator import parse_overrides

    return parse_overrides(json.loads((handle.run_dir / "spec.json").read_text())["argv"])


def _process_run(tmp_path: Path, overrides: list[str], run_id: str, landscape: str = "default") -> Path:
    """Run the real simulator process with the same pins the replay applies; its run dir."""
    run_dir = tmp_path / "process" / run_id
    run_dir.mkdir(parents=True)
    argv = merge_overrides(overrides, [*probe_pins(RunSpec(run_id, tuple(overrides)), RunDir(run_dir)), "trainer.n_gpus_per_node=8"])
    env = {**os.environ, "VERL_SIM_TIME_SCALE": "1e9", "VERL_SIM_LANDSCAPE": landscape,
           "VERL_SIM_GPU_SAMPLES_PATH": str(run_dir / "gpu_samples.jsonl"), "VERL_SIM_PDEATHSIG": "0"}
    proc = subprocess.run([sys.executable, "-m", "verl_sweep.launchers.simulator", *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    (run_dir / "stderr.log").write_text(proc.stderr)
    (run_dir / "rc").write_text(str(proc.returncode))
    return run_dir


BASELINE = [
    "algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=384",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.003", "actor_rollout_ref.actor.optim.lr=2e-6", "data.seed=7",
]  # fmt: skip


@pytest.mark.parametrize("landscape", ["default", "batch_lr"])
def test_replayed_metrics_equal_the_simulator_process(tmp_path: Path, landscape: str) -> None:
    overrides = [*BASELINE, "trainer.total_training_steps=40"]
    run_dir = _process_run(tmp_path, overrides, "same", landscape)
    launcher = ReplayLauncher(tmp_path / "replay", landscape=landscape)
    handle = launcher.start(RunSpec("same", tuple(overrides), n_gpus=8))
    launcher.wait(1e12)
    assert launcher.poll(handle).status is RunStatus.SUCCEEDED
    assert (run_dir / "rc").read_text() == "0"
    process_lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    replay_lines = [json.loads(x) for x in handle.metrics_path.read_text().splitlines()]
    assert len(replay_lines) == len(process_lines) == 40
    assert replay_lines == process_lines  # same JSON text → floats equal to the last digit
    process_samples = (run_dir / "gpu_samples.jsonl").read_text().splitlines()
    replay_samples = (handle.run_dir / "gpu_samples.jsonl").read_text().splitlines()
    assert [json.loads(x)["gpus"] for x in replay_samples] == [json.loads(x)["gpus"] for x in process_samples]


def test_oom_and_hang_fail_with_the_process_texts(tmp_path: Path) -> None:
    # A landscape whose NCCL trap hangs large mini-batches (the shipped ones have no trap).
    trap = tmp_path / "trap.yaml"
    trap.write_text(
        "extends: default\nname: trap\nfailures:\n  nccl_traps:\n"
        "    - {when: {actor_rollout_ref.actor.ppo_mini_batch_size: {min: 1000}}, reason: too large a mini-batch, at_step: 1}\n"
    )
    cases = {
        # a token budget far over the memory limit: CUDA OOM in step 1
        "oom": [*BASELINE, "actor_rollout_ref.rollout.max_num_batched_tokens=400000", "trainer.total_training_steps=5"],
        "hang": [*BASELINE, "actor_rollout_ref.actor.ppo_mini_batch_size=1024", "trainer.total_training_steps=5"],
    }
    for run_id, overrides in cases.items():
        run_dir = _process_run(tmp_path, overrides, run_id, str(trap))
        launcher = ReplayLauncher(tmp_path / "replay", landscape=str(trap))
        handle = launcher.start(RunSpec(run_id, tuple(overrides), n_gpus=8))
        launcher.wait(1e12)
        state = launcher.poll(handle)
        assert state.status is RunStatus.FAILED, (run_id, state)
        assert state.exit_code == int((run_dir / "rc").read_text()) == 1
        strip = lambda text: [line.split(") ", 1)[-1] for line in text.splitlines()]  # noqa: E731 - pids differ
        assert strip(handle.stderr_path.read_text()) == strip((run_dir / "stderr.log").read_text())
        assert run_id != "hang" or launcher.clock() == pytest.approx(120.0 + 600.0)  # start-up + NCCL timeout
    assert "CUDA out of memory" in (tmp_path / "replay" / "oom" / "stderr.log").read_text()
    assert "Watchdog caught collective operation timeout" in (tmp_path / "replay" / "hang" / "stderr.log").read_text()


def test_a_diverging_run_writes_the_same_nan_lines(tmp_path: Path) -> None:
    overrides = [*BASELINE, "actor_rollout_ref.actor.optim.lr=4e-5", "trainer.total_training_steps=60"]
    run_dir = _process_run(tmp_path, overrides, "diverge")
    launcher = ReplayLauncher(tmp_path / "replay")
    handle = launcher.start(RunSpec("diverge", tuple(overrides), n_gpus=8))
    launcher.wait(1e12)
    replayed = handle.metrics_path.read_text()
    assert replayed == (run_dir / "metrics.jsonl").read_text()
    assert '"critic/score/mean": null' in replayed  # the divergence reached NaN within the run
    assert finished(launcher.poll(handle))
