"""What a simulated verl run does, step for step, as events: the one description that the
simulator process (``__main__``, on the real clock) and the replay launcher (on its virtual
clock) both play, so that the two write the same bytes.

:func:`setup` reads the config and the landscape (a :class:`StartError` is the run's whole
stderr); :func:`events` is the run from then on. The generator does the run's own checkpoint
I/O (``checkpoints.resume_from`` / ``save``) as it goes; its player does everything else.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, Callable, Iterator, Mapping, Union

from verl_sweep.launchers.simulator import checkpoints
from verl_sweep.launchers.simulator.config import ConfigError, check_config, get, logger_path, parse_overrides
from verl_sweep.launchers.simulator.landscape import Landscape
from verl_sweep.launchers.simulator.outcomes import Expectation, LandscapeError
from verl_sweep.launchers.simulator.trace import console_line, gpu_sample, json_line


@dataclasses.dataclass(slots=True)  # not frozen: a few are made each step, and frozen's init is slower
class Sleep:
    """``seconds`` of simulated time pass; ``step``: the step they complete (None: part of none)."""

    seconds: float
    step: int | None = None


@dataclasses.dataclass(slots=True)
class Wake:
    """The replay's clock stops here. It adds each ``Sleep`` up but stops only at a ``Wake``, a
    step or the exit, so what comes between happens at its last stop (its files open at the
    checkpoint lookup, before the load's sleep, as they always have). The process ignores it."""


@dataclasses.dataclass(slots=True)
class Stdout:
    text: str


@dataclasses.dataclass(slots=True)
class Ready:
    """verl makes its trackers and opens its file logger's file (``metrics_path``; None: no file
    logger) and the GPU sampler's."""

    metrics_path: str | None


@dataclasses.dataclass(slots=True)
class Metrics:
    """One line of verl's file logger."""

    line: str


@dataclasses.dataclass(slots=True)
class Track:
    """What the trackers (W&B, TensorBoard) log: ``data`` as is, or with ``record``, a step's
    modelled values as verl's whole step record."""

    step: int
    data: Mapping[str, Any]
    record: bool


@dataclasses.dataclass(slots=True)
class Sample:
    """One ``gpu_samples.jsonl`` line."""

    sample: dict[str, Any]


@dataclasses.dataclass(slots=True)
class Exit:
    """The run ends with ``code``, its trackers finished, then ``stdout`` / ``stderr`` written
    (``stderr`` without its final newline)."""

    code: int
    stdout: str = ""
    stderr: str = ""


Event = Union[Sleep, Wake, Stdout, Ready, Metrics, Track, Sample, Exit]


class StartError(Exception):
    """The run cannot start (a config or landscape verl's ``main_ppo`` cannot use); the message
    is what it writes to stderr before it exits with 1."""


@dataclasses.dataclass(frozen=True)
class Setup:
    config: dict[str, Any]
    landscape: Landscape
    expectation: Expectation


def setup(argv: list[str], *, landscape: Callable[[], Landscape],
          check: Callable[[Mapping[str, Any]], None] = check_config) -> Setup:
    """Parse and check the overrides, then read the landscape and its expectation for them."""
    try:
        config = parse_overrides(argv)
        check(config)
    except ConfigError as e:
        raise StartError(f"Error executing job with overrides: {argv!r}\n{e}\n\n"
                         "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.") from None
    try:
        world = landscape()
        expectation = world.expected(config)
    except (LandscapeError, ConfigError, ValueError, TypeError) as e:  # a value the model cannot read
        raise StartError(f"Error executing job with overrides: {argv!r}\n{type(e).__name__}: {e}") from None
    return Setup(config, world, expectation)


def events(
    run: Setup, *, prefix: str, host: str, gpu_samples: bool, template: Mapping[str, Any],
    console: bool = True, track: bool = True, startup_s: float | None = None, skip_steps: int = 0,
) -> Iterator[Event]:
    """The run after :func:`setup`. ``prefix``: verl's ``(TaskRunnerV1 pid=…)``; ``host``: its
    first line's ``hostname: …, PID: …``; ``gpu_samples``: the run samples its GPUs (their jitter
    stream draws the worker-died chance too); ``template``: the step record's keys
    (``trace.real_record()``, or ``{}``: the modelled keys only); ``console``: write stdout;
    ``track``: log to the trackers; ``startup_s``: in place of the landscape's start-up;
    ``skip_steps``: a run continued after its first ``skip_steps`` steps, whose time, lines and
    checkpoints are there already."""
    config, landscape, expectation = run.config, run.landscape, run.expectation
    fresh = skip_steps == 0
    if console and fresh:
        yield Stdout(f"{prefix} TaskRunner {host}\n"
                     f"{prefix} landscape={landscape.name} total_training_steps={expectation.total_steps}\n")
    startup = expectation.startup_s if startup_s is None else startup_s
    if fresh:
        yield Sleep(startup)  # model load, engine start: never in timing_s/step

    failure = expectation.failure
    if failure is not None and failure.kind == "hang":
        timeout = float(get(config, "actor_rollout_ref.nccl_timeout") or 600)
        yield Sleep(timeout)
        yield Exit(1, stderr=(
            f"[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] {failure.message}, "
            f"WorkNCCL(SeqNum=1, OpType=ALLREDUCE, Timeout(ms)={int(timeout * 1000)}) ran for longer "
            f"than the timeout ({failure.reason}).\nA worker died or was killed while executing a task."))
        return
    if failure is not None and failure.at_step == 0:
        yield Exit(1, stderr=f"{prefix} Traceback (most recent call last):\n{failure.message}")
        return
    if get(config, "trainer.resume_mode") != "disable":
        yield Wake()  # the workers are up: verl looks for its checkpoint now
    said: list[str] = []
    try:
        resume, error = checkpoints.resume_from(config, say=said.append), None
    except checkpoints.CheckpointError as e:
        resume, error = None, e
    if console and fresh and said:  # verl's lines about the checkpoint
        yield Stdout("".join(f"{prefix} {line}\n" for line in said))
    if error is not None:
        yield Exit(1, stderr=f"{prefix} Traceback (most recent call last):\n{prefix} {error}")
        return
    load_s = 0.0 if resume is None else landscape.checkpoint_s(config)
    if resume is not None and fresh:
        yield Sleep(load_s)

    path = logger_path(config)
    yield Ready(path)
    yield Wake()
    if path and fresh and bool(get(config, "trainer.val_before_train")):
        val_step = 0 if resume is None else resume.step
        val = {"val-core/default/reward/mean@1": expectation.r0 if resume is None else resume.reward}
        yield Metrics(json.dumps({"step": val_step, "data": val}) + "\n")
        if console:
            yield Stdout(f"{prefix} step:{val_step} - " + " - ".join(f"{k}:{v}" for k, v in val.items()) + "\n")
        if track:
            yield Track(val_step, val, record=False)
    n_gpus = int(get(config, "trainer.n_gpus_per_node"))
    gpu_mb = landscape.gpu_memory_gb * 1024.0
    seed = get(config, "data.seed")
    jitter = random.Random(f"gpu:{landscape.seed}:{0 if seed is None else seed}")
    last = 0 if resume is None else resume.step
    now = startup + load_s  # the process's clock, the GPU samples' "t" (a continued run's too)
    for record in landscape.simulate(config, resume=resume):
        now += record.step_time_s
        last = record.step
        if record.step <= skip_steps:
            if gpu_samples:  # keep the jitter stream where the process has it
                gpu_sample(now, record.gpu_util, record.mem_used_gb, n_gpus, gpu_mb, config, jitter)
            continue
        yield Sleep(record.step_time_s, step=record.step)
        if record.checkpoint is not None:
            checkpoints.save(config, record.checkpoint)
        if path:
            yield Metrics(json_line(template, record.step, record.metrics))
        if console:
            yield Stdout(console_line(prefix, template, record.step, record.metrics))
        if track:
            yield Track(record.step, record.metrics, record=True)
        if gpu_samples:
            yield Sample(gpu_sample(now, record.gpu_util, record.mem_used_gb, n_gpus, gpu_mb, config, jitter))

    if failure is not None:  # the failing step ran out of memory part-way
        yield Sleep(expectation.step_time_s * 0.3)
        yield Exit(1, stderr=f"{prefix} Traceback (most recent call last):\n{prefix} {failure.message}")
        return
    p_died = float((landscape.data.get("failures") or {}).get("worker_died_probability", 0.0))
    if p_died > 0 and jitter.random() < p_died:
        yield Exit(1, stderr=(
            "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n"
            f"A worker died or was killed while executing a task by an unexpected system error. (after step {last})"))
        return
    yield Exit(0, stdout=f"{prefix} Training finished at step {last}\n" if console else "")
