"""SimLauncher: the LocalLauncher mechanics around the verl simulator process.

Contract: each probe runs ``python -m verl_sweep.launchers.simulator <overrides>`` with fake GPU ids,
``VERL_SIM_TIME_SCALE``, ``VERL_SIM_LANDSCAPE``, ``VERL_SIM_GPU_SAMPLES_PATH`` and
``VERL_SIM_CLOCK_PATH`` set; no NVML preflight or sampling. ``clock`` reads SIMULATED seconds
(real elapsed seconds since the launcher was made × ``time_scale``), so the scorer, the budgets
and the simulator share one clock. ``max_concurrent`` slots of ``gpus_per_probe`` fake GPUs each. A probe's GPU time is read
from its run's own simulated timeline (``run_time``), not from that clock.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Mapping

from verl_sweep.launchers.base import Clock, LauncherError, RunHandle, RunSpec, RunTime
from verl_sweep.launchers.local import LocalLauncher
from verl_sweep.launchers.options import Option
from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.launchers.simulator.landscape_files import LandscapeError, load_landscape

SIMULATOR_COMMAND: tuple[str, ...] = (sys.executable, "-m", "verl_sweep.launchers.simulator")


class SimClock:
    """Simulated seconds: real (monotonic) seconds since creation × ``time_scale``."""

    def __init__(self, time_scale: float, *, real_clock: Clock = time.monotonic) -> None:
        self.time_scale = time_scale
        self._real_clock = real_clock
        self._origin = real_clock()

    def __call__(self) -> float:
        return (self._real_clock() - self._origin) * self.time_scale


class SimLauncher(LocalLauncher):
    """Simulated verl probes on fake GPUs (see module docstring)."""

    name = "sim"
    real_gpus = False
    builds_anywhere = True
    OPTIONS: tuple[Option, ...] = (
        Option("max_concurrent", "int", from_study="launcher.max_concurrent", help="probes at once"),
        Option("time_scale", "float", help="simulated seconds per real second"),
        Option("landscape", "str", help="the simulated world: a shipped landscape's name or a file"),
        # fake GPUs: as many a probe as a node of the study's hardware
        Option("gpus_per_probe", "int", from_study="hardware.gpus_per_node", help="fake GPUs a probe runs on"),
        Option("extra_env", "dict[str, str]", nullable=True, help="environment variables of every probe"),
        Option("command", "list[str]", help="what runs a probe (default: the simulator process)"),
        Option("kill_grace_s", "float", help="seconds between SIGTERM and SIGKILL when a probe is stopped"),
    )

    def __init__(
        self,
        root_dir: Path | str,
        *,
        max_concurrent: int = 2,
        time_scale: float = 1000.0,
        landscape: str = "default",
        # The default landscape models 8 GPUs per run (7B on 8×A100), and verl's default
        # rollout TP of 2 cannot fit on fewer than 2.
        gpus_per_probe: int = 8,
        clock: Clock | None = None,
        extra_env: Mapping[str, str] | None = None,
        command: tuple[str, ...] | list[str] = SIMULATOR_COMMAND,
        kill_grace_s: float = 2.0,
    ) -> None:
        if max_concurrent < 1:
            raise LauncherError(f"max_concurrent must be >= 1, but got {max_concurrent}.")
        if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) or not time_scale > 0:
            raise LauncherError(f"time_scale must be a number > 0, but got {time_scale!r}. "
                                "It is simulated seconds per real second.")
        try:  # here, not in each probe: a misspelled landscape fails the launch, not every run
            world = load_landscape(landscape)
            world.expected(world.baseline)  # a file of the wrong shape fails here, not in every probe
        except LandscapeError as e:
            raise LauncherError(f"launcher.options.landscape: {e}") from None
        except (ArithmeticError, AttributeError, KeyError, TypeError, ValueError) as e:
            raise LauncherError(f"launcher.options.landscape: {landscape} must be a landscape like the shipped ones, "
                                f"but computing its baseline failed ({type(e).__name__}: {e}).") from None
        self.time_scale = float(time_scale)
        self.landscape = landscape
        super().__init__(
            root_dir,
            gpu_ids=list(range(max_concurrent * gpus_per_probe)),
            gpus_per_probe=gpus_per_probe,
            command=list(command),
            clock=clock if clock is not None else SimClock(self.time_scale),
            extra_env=extra_env,
            sample_gpus=False,
            kill_grace_s=kill_grace_s,
        )

    @property
    def poll_interval_s(self) -> float:  # type: ignore[override]
        """On the launcher's clock, which is simulated: the local launcher's real cadence."""
        return LocalLauncher.poll_interval_s * self.time_scale

    def wait(self, seconds: float) -> None:
        # ``seconds`` on the simulated clock: a speed stage's 30 s between polls is 30 simulated
        # seconds (a fraction of a step), not 30 real ones (a whole study at 20,000×).
        time.sleep(seconds / self.time_scale)

    def run_time(self, handle: RunHandle, *, started_at: float, ended_at: float, first_step_at: float | None,
                 last_step: int) -> RunTime:
        """From the run's own timeline (``sim_clock.jsonl``), not the clock's differences: those
        add the simulator process's start (Python and its imports, real seconds × ``time_scale``)
        and the driver's delay in reading it, which no verl run holds GPUs for. A run holds them
        for its modelled start-up (a branch's includes loading its checkpoint), the steps up to
        ``last_step`` and the modelled part of a step it failed in: one stopped from outside stops
        as its last read step ends, as a real run does within a poll. The timeline starts at the
        run's own start, never at the seconds of the run a branch resumes. Without a timeline (its
        process ended before its start-up did), the clock's differences."""
        events = _read_timeline(handle.files.sim_clock)
        if not events:
            return super().run_time(handle, started_at=started_at, ended_at=ended_at,
                                    first_step_at=first_step_at, last_step=last_step)
        held = next((seconds for step, seconds in reversed(events) if step <= last_step), events[0][1])
        startup = next(seconds for step, seconds in reversed(events) if step == events[0][0])  # up to its first step
        return RunTime(held_s=held, startup_s=None if first_step_at is None else startup)

    def _count_real_gpus(self) -> int:
        return 0  # fake ids: no NVML preflight, no sampler, even on a GPU machine

    def _probe_env(self, spec: RunSpec, run_dir: Path) -> dict[str, str]:
        return {
            "VERL_SIM_TIME_SCALE": repr(self.time_scale),
            "VERL_SIM_LANDSCAPE": self.landscape,
            "VERL_SIM_GPU_SAMPLES_PATH": str(RunDir(run_dir).gpu_samples),
            "VERL_SIM_CLOCK_PATH": str(RunDir(run_dir).sim_clock),
            "VERL_SIM_PARENT_PID": str(os.getpid()),  # the probe's parent: see the simulator's _watch_parent
        }


def _read_timeline(path: Path) -> list[tuple[int, float]]:
    """A run's timeline as the simulator writes it: (last step done, simulated seconds) at the
    end of each of its sleeps, the first ending its start-up; [] when there is none. A line torn
    by the process's end is skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            item = json.loads(line)
            events.append((int(item["step"]), float(item["s"])))
        except (ValueError, KeyError, TypeError):
            continue
    return events
