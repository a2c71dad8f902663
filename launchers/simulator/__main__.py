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
import signal
import sys
import time
from typing import IO, Any, NoReturn

from verl_sweep.launchers.simulator import process as sim
from verl_sweep.launchers.simulator.trace import full_record, real_record
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


def _fail(text: str, code: int = 1) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.write(text.rstrip("\n") + "\n")
    sys.stderr.flush()
    raise SystemExit(code)


def run(argv: list[str]) -> int:
    """The simulated ``main_ppo`` (``simulator.process``, played on the real clock); returns the exit code."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parent = _watch_parent()
    pid = os.getpid()
    from verl_sweep.launchers.simulator.landscape_files import load_landscape

    try:
        setup = sim.setup(argv, landscape=lambda: load_landscape(os.environ.get("VERL_SIM_LANDSCAPE") or "default"))
    except sim.StartError as e:
        _fail(str(e))
    scale = float(os.environ.get("VERL_SIM_TIME_SCALE", "1000"))
    clock = _Clock(scale if scale > 0 else 1000.0, parent, record=os.environ.get("VERL_SIM_CLOCK_PATH"))
    out = sys.stdout
    samples_path = os.environ.get("VERL_SIM_GPU_SAMPLES_PATH")
    template = real_record()
    tracking: Tracking | None = None
    metrics_file = samples_file = None
    for event in sim.events(setup, prefix=f"(TaskRunnerV1 pid={pid})", host=f"hostname: sim, PID: {pid}",
                            gpu_samples=bool(samples_path), template=template):
        if isinstance(event, sim.Sleep):
            out.flush()  # the lines so far are out before time passes
            clock.sleep(event.seconds, step=event.step)
        elif isinstance(event, sim.Stdout):
            out.write(event.text)
        elif isinstance(event, sim.Metrics):
            assert metrics_file is not None
            metrics_file.write(event.line)
        elif isinstance(event, sim.Track):
            assert tracking is not None
            if not event.record:
                tracking.log(event.data, event.step)
            elif tracking.active:
                tracking.log(full_record(template, event.step, event.data), event.step)
        elif isinstance(event, sim.Sample):
            assert samples_file is not None
            samples_file.write(json.dumps(event.sample) + "\n")
        elif isinstance(event, sim.Ready):
            tracking = Tracking(setup.config)  # where verl makes its trackers: once the workers are up
            metrics_file = _open_append(event.metrics_path)
            samples_file = _open_append(samples_path)
        elif isinstance(event, sim.Exit):
            if tracking is not None:
                tracking.finish(exit_code=event.code)
            out.write(event.stdout)
            if event.stderr:
                _fail(event.stderr, event.code)
            out.flush()
            return event.code
    raise AssertionError("a simulated run ends with an Exit event")


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
