"""``python -m verl_sweep.launchers.simulator <verl overrides...>``: a process that behaves like verl.

Started exactly like ``python -m verl.trainer.main_ppo``; writes verl's metrics file and
console lines on a simulated clock (env ``VERL_SIM_TIME_SCALE`` simulated seconds per real
second, default 1000), fails the way verl fails, and exits when its parent dies.
Environment: ``VERL_SIM_LANDSCAPE`` (name or path), ``VERL_SIM_GPU_MEMORY_GB``,
``VERL_SIM_GPU_SAMPLES_PATH`` (NVML-format samples), ``VERL_SIM_CLOCK_PATH`` (the run's own
timeline: ``_Clock``), ``VERL_SIM_PDEATHSIG=0`` to rely on
polling alone (prctl's signal fires when the parent *thread* ends, see ``_watch_parent``).
Exit codes: 0 finished, 1 config error / OOM / hang / worker death, 143 SIGTERM.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any, Mapping

from verl_sweep.launchers.simulator import checkpoints
from verl_sweep.launchers.simulator.config import ConfigError, check_config, get, logger_path, parse_overrides
from verl_sweep.launchers.simulator.trace import console_line, full_record, gpu_sample, json_line, real_record
from verl_sweep.launchers.simulator.tracking import Tracking

_PARENT_POLL_S = 0.1


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.stderr.write("Received SIGTERM, shutting down\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def _watch_parent() -> int:
    """Ask Linux to SIGTERM us when the parent goes; return the parent pid for polling too.

    PR_SET_PDEATHSIG fires when the parent *thread* that forked us exits, which would kill a
    probe started from a short-lived thread; ``VERL_SIM_PDEATHSIG=0`` turns it off and leaves
    the getppid() polling in ``_sleep`` (≤ 0.1 s late) as the only watch.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux") and os.environ.get("VERL_SIM_PDEATHSIG", "1") != "0":
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass  # polling still covers it
    # A driver killed while this process started (before the line above) sends no signal, and
    # getppid() already names init: nobody would ever stop this run. The launcher says who
    # started it.
    expected = os.environ.get("VERL_SIM_PARENT_PID")
    if expected and expected.isdigit() and int(expected) != os.getppid():
        sys.stderr.write(f"the process that started this run ({expected}) is gone; exiting\n")
        os._exit(1)
    return parent


class _Clock:
    """Simulated seconds since start; sleeping scaled, watching the parent while asleep.

    Each sleep ends at a deadline from the clock's start, not a span from "now": the real time
    spent writing a step's metrics would otherwise add up, and be multiplied by the scale into
    simulated time that no step used (docs/method.md, Evidence).

    With a ``record`` path, each sleep's end appends ``{"step": <last step done>, "s": <now>}``
    to it: the run's own timeline (its first line ends the start-up), from which the launcher
    charges a probe's GPU time rather than from the real time its process took."""

    def __init__(self, scale: float, parent: int, *, record: str | None = None, monotonic: Any = time.monotonic,
                 sleep: Any = time.sleep) -> None:
        self.scale = scale
        self.parent = parent
        self.now = 0.0
        self.step = 0
        self._record = _open_append(record)
        self._monotonic = monotonic
        self._sleep = sleep
        self._origin = monotonic()

    def sleep(self, simulated_s: float, *, step: int | None = None) -> None:
        """Sleep ``simulated_s``; ``step``: the step this sleep completes (none: part of one)."""
        self._wait(simulated_s)
        self.step = self.step if step is None else step
        if self._record is not None:
            self._record.write(json.dumps({"step": self.step, "s": self.now}) + "\n")

    def _wait(self, simulated_s: float) -> None:
        self.now += simulated_s
        end = self._origin + self.now / self.scale
        while True:
            if os.getppid() != self.parent:
                os._exit(1)  # orphaned: the driver died without stopping us
            left = end - self._monotonic()
            if left <= 0:
                return
            self._sleep(min(left, _PARENT_POLL_S))


def _open_append(path: str | None) -> IO[str] | None:
    if not path:
        return None
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    return open(path, "w", buffering=1)  # verl opens "wb": truncated, line by line


def _fail(text: str, code: int = 1) -> None:
    sys.stdout.flush()
    sys.stderr.write(text.rstrip("\n") + "\n")
    sys.stderr.flush()
    raise SystemExit(code)


def run(argv: list[str]) -> int:
    """The simulated ``main_ppo``; returns the exit code."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parent = _watch_parent()
    pid = os.getpid()
    prefix = f"(TaskRunnerV1 pid={pid})"
    try:
        config = parse_overrides(argv)
        check_config(config)
    except ConfigError as e:
        _fail(
            f"Error executing job with overrides: {argv!r}\n{e}\n\n"
            "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."
        )
        return 1  # unreachable; keeps type checkers calm

    from verl_sweep.launchers.simulator.landscape_files import LandscapeError, load_landscape

    try:
        landscape = load_landscape(os.environ.get("VERL_SIM_LANDSCAPE") or "default")
        expectation = landscape.expected(config)
    except (LandscapeError, ConfigError, ValueError, TypeError) as e:  # a value the model cannot read
        _fail(f"Error executing job with overrides: {argv!r}\n{type(e).__name__}: {e}")
        return 1
    scale = float(os.environ.get("VERL_SIM_TIME_SCALE", "1000"))
    clock = _Clock(scale if scale > 0 else 1000.0, parent, record=os.environ.get("VERL_SIM_CLOCK_PATH"))
    out = sys.stdout
    out.write(f"{prefix} TaskRunner hostname: sim, PID: {pid}\n")
    out.write(f"{prefix} landscape={landscape.name} total_training_steps={expectation.total_steps}\n")
    out.flush()
    clock.sleep(expectation.startup_s)  # model load, engine start: never in timing_s/step

    failure = expectation.failure
    if failure is not None and failure.kind == "hang":
        clock.sleep(float(get(config, "actor_rollout_ref.nccl_timeout") or 600))
        _fail(
            f"[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] {failure.message}, "
            f"WorkNCCL(SeqNum=1, OpType=ALLREDUCE, Timeout(ms)="
            f"{int(float(get(config, 'actor_rollout_ref.nccl_timeout') or 600) * 1000)}) ran for longer "
            f"than the timeout ({failure.reason}).\nA worker died or was killed while executing a task."
        )
    if failure is not None and failure.at_step == 0:
        _fail(f"{prefix} Traceback (most recent call last):\n{failure.message}")
    try:  # once the workers are up, as verl loads it
        resume = checkpoints.resume_from(config, say=lambda line: out.write(f"{prefix} {line}\n"))
    except checkpoints.CheckpointError as e:
        _fail(f"{prefix} Traceback (most recent call last):\n{prefix} {e}")
    if resume is not None:
        clock.sleep(landscape.checkpoint_s(config))

    tracking = Tracking(config)  # where verl makes its trackers: once the workers are up
    metrics_file = _open_append(logger_path(config))
    samples_file = _open_append(os.environ.get("VERL_SIM_GPU_SAMPLES_PATH"))
    if metrics_file is not None and bool(get(config, "trainer.val_before_train")):
        val_step = 0 if resume is None else resume.step
        val = {"val-core/default/reward/mean@1": expectation.r0 if resume is None else resume.reward}
        metrics_file.write(json.dumps({"step": val_step, "data": val}) + "\n")
        out.write(f"{prefix} step:{val_step} - " + " - ".join(f"{k}:{v}" for k, v in val.items()) + "\n")
        tracking.log(val, val_step)
    n_gpus = int(get(config, "trainer.n_gpus_per_node"))
    gpu_mb = landscape.gpu_memory_gb * 1024.0
    seed = get(config, "data.seed")
    jitter = random.Random(f"gpu:{landscape.seed}:{0 if seed is None else seed}")
    last = 0 if resume is None else resume.step
    template = real_record()
    for record in landscape.simulate(config, resume=resume):
        clock.sleep(record.step_time_s, step=record.step)
        last = record.step
        if record.checkpoint is not None:
            checkpoints.save(config, record.checkpoint)
        if metrics_file is not None:
            metrics_file.write(json_line(template, record.step, record.metrics))
        out.write(console_line(prefix, template, record.step, record.metrics))
        out.flush()
        if tracking.active:
            tracking.log(full_record(template, record.step, record.metrics), record.step)
        if samples_file is not None:
            samples_file.write(json.dumps(gpu_sample(clock.now, record.gpu_util, record.mem_used_gb, n_gpus, gpu_mb, config, jitter)) + "\n")

    if failure is not None:  # the failing step ran out of memory part-way
        clock.sleep(expectation.step_time_s * 0.3)
        tracking.finish(exit_code=1)
        _fail(f"{prefix} Traceback (most recent call last):\n{prefix} {failure.message}")
    p_died = float((landscape.data.get("failures") or {}).get("worker_died_probability", 0.0))
    if p_died > 0 and jitter.random() < p_died:
        tracking.finish(exit_code=1)
        _fail(
            f"ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n"
            f"A worker died or was killed while executing a task by an unexpected system error. (after step {last})"
        )
    tracking.finish(exit_code=0)
    out.write(f"{prefix} Training finished at step {last}\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
