"""The simulated verl process, run as a real subprocess exactly like ``verl.trainer.main_ppo``."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO

from verl_sweep.launchers.simulator import ConfigError, check_config, load_landscape, parse_overrides, shipped_landscapes
from verl_sweep.launchers.simulator.config import verl_config_path

BASE = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=1024",
    "actor_rollout_ref.actor.ppo_mini_batch_size=512",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "trainer.logger=[console,file]",
    "trainer.val_before_train=false",
]
FAST = "1000000"  # simulated seconds per real second: a 300 s step takes 0.3 ms


def _run(
    tmp_path: Path, extra: list[str], *, scale: str = FAST, env: dict[str, str] | None = None, timeout: float = 30
) -> tuple[subprocess.CompletedProcess[str], Path]:
    metrics = tmp_path / "metrics.jsonl"
    argv = [
        *BASE,
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics}",
        *extra,
    ]
    full_env = {**os.environ, "VERL_SIM_TIME_SCALE": scale, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "verl_sweep.launchers.simulator", *argv],
        capture_output=True, text=True, env=full_env, timeout=timeout,
    )  # fmt: skip
    return proc, metrics


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


REQUIRED = {
    "critic/score/mean", "actor/ppo_kl", "actor/kl_loss", "actor/grad_norm", "actor/entropy",
    "actor/lr", "response_length/mean", "timing_s/step", "timing_s/gen", "timing_s/update_actor",
    "timing_s/old_log_prob", "perf/throughput", "perf/total_num_tokens", "perf/time_per_step",
    "training/global_step",
}  # fmt: skip


def test_metrics_file_and_console_lines(tmp_path: Path) -> None:
    proc, metrics = _run(tmp_path, ["trainer.total_training_steps=20"])
    assert proc.returncode == 0, proc.stderr
    rows = _lines(metrics)
    assert [r["step"] for r in rows] == list(range(1, 21))
    for row in rows:
        assert REQUIRED <= set(row["data"]), REQUIRED - set(row["data"])
        assert row["data"]["training/global_step"] == row["step"]
        assert 100 < row["data"]["timing_s/step"] < 1000  # simulated seconds, not real ones
    console = [ln for ln in proc.stdout.splitlines() if " step:" in ln]
    assert len(console) == 20
    first = console[0]
    assert re.match(r"^\(TaskRunnerV1 pid=\d+\) step:1 - global_seqlen/min:[\d.]+ - ", first), first  # real verl's order
    value = float(re.search(r"critic/score/mean:([^ ]+) ", first).group(1))
    assert value == pytest.approx(rows[0]["data"]["critic/score/mean"])


def test_validation_step_zero_and_truncation(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 99, "data": {}}\n' * 50)  # an old run's file
    proc, _ = _run(tmp_path, ["trainer.total_training_steps=3", "trainer.val_before_train=true"])
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in _lines(metrics)] == [0, 1, 2, 3]


def test_no_file_without_file_logger(tmp_path: Path) -> None:
    proc, metrics = _run(tmp_path, ["trainer.total_training_steps=3", "trainer.logger=[console]"])
    assert proc.returncode == 0, proc.stderr
    assert not metrics.exists()
    assert "step:3 -" in proc.stdout


def test_run_length_from_epochs(tmp_path: Path) -> None:
    # default landscape: 120000 prompts // 4096 per step = 29 steps per epoch
    proc, metrics = _run(tmp_path, ["data.train_batch_size=4096", "actor_rollout_ref.actor.ppo_mini_batch_size=1024",
                                    "trainer.total_epochs=2"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = _lines(metrics)
    assert len(rows) == 2 * (120000 // 4096)
    assert rows[-1]["data"]["training/epoch"] == 1


def test_same_seed_same_output_other_seed_other_noise(tmp_path: Path) -> None:
    outs = []
    for i, seed in enumerate((7, 7, 8)):
        sub = tmp_path / str(i)
        sub.mkdir()
        proc, metrics = _run(sub, ["trainer.total_training_steps=30", f"data.seed={seed}"])
        assert proc.returncode == 0, proc.stderr
        outs.append(metrics.read_text())
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]
    a = [r["data"]["critic/score/mean"] for r in map(json.loads, outs[0].splitlines())]
    b = [r["data"]["critic/score/mean"] for r in map(json.loads, outs[2].splitlines())]
    assert 0.002 < sum(abs(x - y) for x, y in zip(a, b)) / len(a) < 0.1  # noise, not a new world


def test_gpu_samples(tmp_path: Path) -> None:
    samples = tmp_path / "gpu.jsonl"
    proc, _ = _run(tmp_path, ["trainer.total_training_steps=5", "trainer.n_gpus_per_node=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
                   env={"VERL_SIM_GPU_SAMPLES_PATH": str(samples)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = _lines(samples)
    assert len(rows) == 5
    assert rows[0]["t"] > 120  # start-up counts in the sample clock
    assert all(b["t"] > a["t"] for a, b in zip(rows, rows[1:]))
    for gpu in rows[0]["gpus"]:
        assert set(gpu) == {"index", "util", "mem_used_mb", "mem_total_mb", "pcie_mbps"}
        assert 0 <= gpu["util"] <= 100 and 0 < gpu["mem_used_mb"] <= gpu["mem_total_mb"] == 80 * 1024
    assert [g["index"] for g in rows[0]["gpus"]] == [0, 1, 2, 3]


def test_real_time_follows_the_scale(tmp_path: Path) -> None:
    # 120 s start-up + 3 steps of ~300 s at 10000x ≈ 0.1 s of real time
    start = time.monotonic()
    proc, metrics = _run(tmp_path, ["trainer.total_training_steps=3"], scale="10000")
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    simulated = sum(r["data"]["timing_s/step"] for r in _lines(metrics)) + 120
    assert elapsed >= simulated / 10000


def test_clock_work_between_steps_does_not_stretch_simulated_time() -> None:
    # A fake real clock: each step's writing costs 0.5 ms of real time. With sleeps measured
    # from "now" that would add 50% to every 1 ms step; with deadlines the work is absorbed.
    from verl_sweep.launchers.simulator.__main__ import _Clock

    real = [0.0]
    clock = _Clock(1000.0, os.getppid(), monotonic=lambda: real[0], sleep=lambda s: real.__setitem__(0, real[0] + s))
    for _ in range(100):
        clock.sleep(1.0)  # one simulated second = 1 ms real
        real[0] += 0.0005  # writing the step's metrics
    assert clock.now == 100.0
    assert real[0] == pytest.approx(0.1 + 0.0005)


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["actor_rollout_ref.actor.no_such_knob=1"], r"Could not override 'actor_rollout_ref\.actor\.no_such_knob'"),
        (["+data.train_batch_size=8"], r"Could not append to config\. An item is already at 'data\.train_batch_size'"),
        (["actor_rollout_ref.rollout.name=hf"], r"Unknown rollout name 'hf'"),
        (["actor_rollout_ref.rollout.n=1"], r"GRPO needs actor_rollout_ref\.rollout\.n >= 2"),
        (["actor_rollout_ref.rollout.gpu_memory_utilization=1.2"], r"gpu_memory_utilization must be in \(0, 1\]"),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], r"rollout world size 3\*1\*1 .* must divide the 8 GPUs"),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], r"per GPU \(512\) must be divisible by ppo_micro_batch_size_per_gpu \(3\)"),
    ],
)  # fmt: skip
def test_config_errors_exit_1_before_any_step(tmp_path: Path, extra: list[str], reason: str) -> None:
    if "Could not" in reason and verl_config_path() is None:
        pytest.skip("key checks need verl's config files")
    proc, metrics = _run(tmp_path, ["trainer.total_training_steps=5", *extra])
    assert proc.returncode == 1
    assert "Error executing job with overrides: [" in proc.stderr
    assert re.search(reason, proc.stderr), proc.stderr
    assert " step:" not in proc.stdout and not metrics.exists()


def test_missing_rollout_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"Missing mandatory value: actor_rollout_ref\.rollout\.name"):
        check_config(parse_overrides(["algorithm.adv_estimator=gae"]))


def test_oom_after_startup(tmp_path: Path) -> None:
    proc, metrics = _run(tmp_path, ["trainer.total_training_steps=5",
                                    "actor_rollout_ref.rollout.max_num_batched_tokens=200000"])  # fmt: skip
    assert proc.returncode == 1
    assert re.search(r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate [\d.]+ GiB", proc.stderr)
    assert metrics.exists() and _lines(metrics) == []  # started training, died in step 1


def test_training_oom_from_micro_batch_activations(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, ["trainer.total_training_steps=5", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32"])  # fmt: skip
    assert proc.returncode == 1
    assert "torch.OutOfMemoryError: CUDA out of memory" in proc.stderr


def test_nccl_hang_until_timeout(tmp_path: Path) -> None:
    # ulysses 3 does not divide 32 heads (and 8 GPUs would refuse it first: use 6 GPUs)
    extra = ["trainer.total_training_steps=5", "trainer.n_gpus_per_node=6",
             "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=3",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.nccl_timeout=600"]  # fmt: skip
    start = time.monotonic()
    proc, _ = _run(tmp_path, extra, scale="4000")
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert "Watchdog caught collective operation timeout" in proc.stderr
    assert elapsed >= (120 + 600) / 4000  # it hung for the timeout, scaled


def test_divergence_turns_reward_nan(tmp_path: Path) -> None:
    proc, metrics = _run(tmp_path, ["trainer.total_training_steps=120", "actor_rollout_ref.actor.optim.lr=1e-4"])
    assert proc.returncode == 0, proc.stderr
    rows = _lines(metrics)
    rewards = [r["data"]["critic/score/mean"] for r in rows]
    assert rewards[0] is not None and rewards[-1] is None
    kls = [r["data"]["actor/kl_loss"] for r in rows if r["data"]["actor/kl_loss"] is not None]
    assert kls[-1] > 100 * kls[2]
    assert "critic/score/mean:nan" in proc.stdout  # verl's console prints a NaN as nan


def _wait_for(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= 1:
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} got no line in {timeout} s")


def test_sigterm_exits_promptly(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl_sweep.launchers.simulator", *BASE,
         f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics}"],
        env={**os.environ, "VERL_SIM_TIME_SCALE": "3000"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    _wait_for(metrics)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=5)
    assert time.monotonic() - start < 1.0
    assert code != 0
    assert "SIGTERM" in proc.stderr.read().decode()


@pytest.mark.parametrize("pdeathsig", ["1", "0"])
def test_exits_when_parent_is_killed(tmp_path: Path, pdeathsig: str) -> None:
    metrics = tmp_path / "m.jsonl"
    pid_file = tmp_path / "child.pid"
    driver = (
        "import subprocess, sys, os\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'verl_sweep.launchers.simulator', *{BASE!r}, "
        f"'+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics}'], stdout=subprocess.DEVNULL)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "p.wait()\n"
    )
    env = {**os.environ, "VERL_SIM_TIME_SCALE": "3000", "VERL_SIM_PDEATHSIG": pdeathsig}
    parent = subprocess.Popen([sys.executable, "-c", driver], env=env)
    _wait_for(metrics)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return  # gone (reaped by init)
        # a zombie already counts as gone: it no longer runs
        try:
            if Path(f"/proc/{child}/stat").read_text().split(") ")[1].startswith("Z"):
                return
        except (FileNotFoundError, IndexError):
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("simulator outlived its killed parent")


def test_exits_when_its_parent_died_before_it_could_watch(tmp_path: Path) -> None:
    """Seen in CI: a worker SIGKILLed while its probe's process was starting left that probe
    running for good (init was its parent before it could ask for PDEATHSIG)."""
    proc, metrics = _run(tmp_path, ["trainer.total_training_steps=5"], env={"VERL_SIM_PARENT_PID": "1"})
    assert proc.returncode == 1 and "is gone; exiting" in proc.stderr
    assert not metrics.exists()
    alive, metrics = _run(tmp_path, ["trainer.total_training_steps=5"], env={"VERL_SIM_PARENT_PID": str(os.getpid())})
    assert alive.returncode == 0, alive.stderr


def test_worker_died_after_a_good_run(tmp_path: Path) -> None:
    landscape = tmp_path / "dies.yaml"
    landscape.write_text("extends: default\nname: dies\nfailures: {worker_died_probability: 1.0}\n")
    proc, metrics = _run(tmp_path, ["trainer.total_training_steps=4"], env={"VERL_SIM_LANDSCAPE": str(landscape)})
    assert proc.returncode == 1
    assert "A worker died or was killed" in proc.stderr
    assert len(_lines(metrics)) == 4  # the run itself finished: judge by the last step


def test_unknown_landscape_lists_shipped_ones() -> None:
    with pytest.raises(ValueError, match=r"landscape must be a file or one of \[.*'default'.*\], but got 'nope'"):
        load_landscape("nope")
    assert {"default", "batch_lr", "kl_edge"} <= set(shipped_landscapes())


def test_in_process_api_matches_the_process(tmp_path: Path) -> None:
    proc, metrics = _run(tmp_path, ["trainer.total_training_steps=10", "data.seed=3"])
    assert proc.returncode == 0, proc.stderr
    config = parse_overrides([*BASE, "trainer.total_training_steps=10", "data.seed=3"])
    records = list(load_landscape("default").simulate(config))
    from_file = [r["data"]["critic/score/mean"] for r in _lines(metrics)]
    assert from_file == [r.metrics["critic/score/mean"] for r in records]


def test_expected_and_true_rate() -> None:
    land = load_landscape("default")
    config = parse_overrides(BASE)
    exp = land.expected(config)
    assert not exp.oom and not exp.diverges and exp.failure is None
    assert 200 < exp.step_time_s < 400
    rate = land.true_rate(config, steps=500)
    assert rate > 0
    assert math.isnan(land.true_rate({**config, "actor_rollout_ref.rollout.max_num_batched_tokens": 300000}))
    assert land.expected({**config, "actor_rollout_ref.actor.optim.lr": 1e-4}).diverges


def test_simulator_record_has_real_verls_shape(tmp_path: Path) -> None:
    """Field for field with a real verl 0.9.1 run (tests/data/real-verl-0.9.1/): the same
    metric keys in the file, the same console shape with plain floats, no step 0 without
    validation, and a start-up phase before step 1 that is not in any step's time."""
    from verl_sweep.objectives.metrics import parse_console_line, read_all

    real_dir = REPO / "tests" / "data" / "real-verl-0.9.1"
    real = read_all(real_dir / "probe_baseline.metrics.jsonl")
    proc, metrics = _run(tmp_path, ["trainer.total_training_steps=5"])
    assert proc.returncode == 0, proc.stderr
    sim = _lines(metrics)
    assert [r["step"] for r in sim] == [1, 2, 3, 4, 5]  # no step 0: val_before_train=false
    for record in sim:
        assert set(real[0].data) <= set(record["data"]), sorted(set(real[0].data) - set(record["data"]))
        assert record["data"]["training/global_step"] == record["step"]
    console = [line for line in proc.stdout.splitlines() if " step:" in line]
    assert len(console) == 5 and "np.float64" not in proc.stdout
    with __import__("gzip").open(real_dir / "probe_baseline.stdout.log.gz", "rt", errors="replace") as f:
        real_line = next(line for line in f if " step:1 - " in line)
    assert re.match(r"^\S*\(TaskRunnerV1 pid=\d+\)\S* step:1 - [\w/@.\-]+:-?[\d.e+\-]+ - ", real_line)
    assert re.match(r"^\(TaskRunnerV1 pid=\d+\) step:1 - [\w/@.\-]+:-?[\d.e+\-]+ - ", console[0])
    for line, record in zip(console, sim):
        parsed = parse_console_line(line)
        assert parsed is not None and parsed.step == record["step"]
        assert parsed.get("critic/score/mean") == pytest.approx(record["data"]["critic/score/mean"])
    assert "landscape=" in proc.stdout.splitlines()[1]  # the start-up phase is announced before any step


def test_a_run_diverging_long_before_its_end_goes_on_as_nan() -> None:
    # A run that diverges at step ~3 and runs on for hundreds of steps (a long probe, a branch
    # trained to the run's end) keeps logging NaN; its blow-up factors never overflow.
    from verl_sweep.launchers.simulator import load_landscape

    land = load_landscape("default")
    config = {**land.baseline, "actor_rollout_ref.actor.optim.lr": 1e-3}
    exp = land.expected(config)
    assert exp.diverge_step is not None and exp.diverge_step < 20
    records = list(land.simulate(config, max_steps=exp.diverge_step + 800))
    assert len(records) == exp.diverge_step + 800
    assert math.isnan(records[-1].metrics["critic/score/mean"])
