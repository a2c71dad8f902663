"""ReplayLauncher: simulated verl probes on a virtual clock, with no process at all.

Like Syne Tune's simulator backend: the same ``start / poll / cancel`` contract and the same
run directory files as :class:`verl_sweep.launchers.sim.SimLauncher` (``spec.json``, ``metrics.jsonl`` in
verl's format, ``stdout.log`` with verl's console lines, ``stderr.log`` with verl's failure
texts, ``gpu_samples.jsonl``), but each run's lines are written from
:mod:`verl_sweep.launchers.simulator.process` — the very run the simulator process plays — as the launcher's
virtual clock passes each step's end time. ``clock()`` returns virtual seconds; ``wait(s)``
moves the clock instantly (see :meth:`ReplayLauncher.wait`), so a study that would take days
of GPU time replays in seconds. Used by the benchmarks; ``poll_advance_s`` lets callers that
poll without calling ``wait`` (generic polling loops, the launcher contract) see time pass.

Overrides are parsed and checked exactly as the simulator process does
(``parse_overrides`` + ``check_config``) after the same probe pins as the local launchers. A
branch (``RunSpec.branch``) resumes its own copy of its checkpoint and saves its checkpoints
(``verl_sweep.launchers.simulator.checkpoints``) as the simulator process does. The
trackers a baseline names (W&B, TensorBoard: ``verl_sweep.launchers.simulator.tracking``) are not written:
a replay is a benchmark's thousands of runs in one process, not a study a person follows.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Iterator, Mapping

from verl_sweep.launchers.base import (
    Branch,
    Launcher,
    LauncherError,
    NoCapacityError,
    RunHandle,
    RunSpec,
    RunState,
    RunStatus,
)
from verl_sweep.launchers.options import Option
from verl_sweep.launchers.run_dir import RunDir, merge_overrides, probe_pins, stderr_tail
from verl_sweep.launchers.verl_checkpoints import prepare_branch

if TYPE_CHECKING:
    from verl_sweep.launchers.simulator import Landscape

logger = logging.getLogger(__name__)

#: what the simulator's SIGTERM handler writes; a cancelled replay writes the same
_SIGTERM_TEXT = "Received SIGTERM, shutting down"


@dataclasses.dataclass(frozen=True)
class RunUsage:
    """Slot occupancy of one run on the virtual clock (for GPU-hour and idle accounting)."""

    run_id: str
    started_at: float
    ended_at: float
    n_gpus: int
    status: RunStatus
    last_step: int

    @property
    def gpu_s(self) -> float:
        return max(0.0, self.ended_at - self.started_at) * self.n_gpus


@dataclasses.dataclass
class _Run:
    handle: RunHandle
    spec: RunSpec
    started_at: float
    events: Iterator[tuple[float, str, Any]]
    next_event: tuple[float, str, Any] | None
    files: Mapping[str, IO[str]]
    last_step: int = 0
    exit_code: int | None = None
    finished_at: float | None = None


class ReplayLauncher(Launcher):
    """Simulated-time probes (see module docstring). ``max_concurrent`` slots of
    ``gpus_per_probe`` GPUs; a start beyond them raises ``NoCapacityError``."""

    name = "replay"
    real_gpus = False
    builds_anywhere = True
    OPTIONS: tuple[Option, ...] = (
        Option("max_concurrent", "int", from_study="launcher.max_concurrent", help="probes at once"),
        Option("landscape", "str", help="the simulated world: a shipped landscape's name or a file"),
        # fake GPUs: as many a probe as a node of the study's hardware
        Option("gpus_per_probe", "int", from_study="hardware.gpus_per_node", help="fake GPUs a probe runs on"),
        Option("startup_s", "float", nullable=True, help="virtual seconds a probe takes to start (null: the landscape's)"),
        Option("poll_advance_s", "float", help="virtual seconds each poll moves the clock"),
        Option("write_console", "bool", help="write verl's console lines to stdout.log"),
        Option("write_gpu_samples", "bool", help="write gpu_samples.jsonl"),
        Option("verl_record", "bool", help="write verl's whole step record (false: the modelled keys only)"),
        Option("gpu_memory_gb", "float", nullable=True, help="the simulated GPUs' memory (null: the landscape's)"),
    )
    #: virtual seconds between two polls of the driver (a probe step takes minutes)
    poll_interval_s = 30.0

    def __init__(
        self,
        root_dir: Path | str,
        *,
        max_concurrent: int = 2,
        landscape: str = "default",
        gpus_per_probe: int = 8,
        startup_s: float | None = 120.0,
        poll_advance_s: float = 0.0,
        write_console: bool = True,
        write_gpu_samples: bool = True,
        verl_record: bool = True,
        gpu_memory_gb: float | None = None,
    ) -> None:
        if max_concurrent < 1:
            raise LauncherError(f"max_concurrent must be >= 1, but got {max_concurrent}.")
        if gpus_per_probe < 1:
            raise LauncherError(f"gpus_per_probe must be >= 1, but got {gpus_per_probe}.")
        if poll_advance_s < 0:
            raise LauncherError(f"poll_advance_s must be >= 0, but got {poll_advance_s}. It is virtual seconds per poll.")
        from verl_sweep.launchers.simulator import LandscapeError, load_landscape

        try:  # before the runs directory exists: a bad landscape is bad input
            world = load_landscape(landscape)
        except LandscapeError as e:
            raise LauncherError(f"launcher.options.landscape: {e}") from None
        self._now = 0.0
        super().__init__(root_dir, clock=self._virtual_now)
        self._max_concurrent = max_concurrent
        self.gpus_per_probe = gpus_per_probe
        self.landscape_name = landscape
        self.landscape = world
        # None: the landscape's own start-up time (what the simulator process sleeps).
        self.startup_s = startup_s
        self.poll_advance_s = float(poll_advance_s)
        self.write_console = write_console
        self.write_gpu_samples = write_gpu_samples
        # False: only the modelled keys (what scorers read), ~20x less to write and parse
        # than real verl's 90-key record; benchmarks that replay thousands of probes use it.
        self.verl_record = verl_record
        self.gpu_memory_gb = gpu_memory_gb
        self._runs: dict[str, _Run] = {}
        self._usage: list[RunUsage] = []
        self._key_checks: dict[frozenset[str], str | None] = {}

    # -- clock ------------------------------------------------------------------------------
    def _virtual_now(self) -> float:
        return self._now

    def wait(self, seconds: float) -> None:
        """Advance the virtual clock instantly to ``now + seconds``, or only as far as the
        first run exit before then (so the caller sees a freed slot at the moment it frees).
        Metrics lines due by then are written on the way."""
        self._advance_to(self._now + max(0.0, seconds), stop_at_exit=True)

    def advance_to(self, t: float) -> None:
        """Move the clock to ``t`` (never backwards), writing what the runs produce meanwhile."""
        self._advance_to(max(self._now, t))

    def _advance_to(self, t: float, *, stop_at_exit: bool = False) -> None:
        # Events of different runs interleave in time order so each file sees its lines at
        # the right virtual moment (one run's lines never depend on another's).
        heap = [(r.next_event[0], run_id) for run_id, r in self._runs.items() if r.next_event is not None]
        heapq.heapify(heap)
        while heap and heap[0][0] <= t:
            when, run_id = heapq.heappop(heap)
            run = self._runs[run_id]
            self._now = max(self._now, when)
            exiting = run.next_event is not None and run.next_event[1] == "exit"
            self._apply(run)
            if exiting and stop_at_exit:
                return
            if run.next_event is not None:
                heapq.heappush(heap, (run.next_event[0], run_id))
        self._now = t

    # -- capacity ---------------------------------------------------------------------------
    @property
    def max_concurrent(self) -> int:
        return self._max_concurrent

    def free_slots(self) -> int:
        busy = sum(1 for r in self._runs.values() if r.finished_at is None)
        return max(0, self._max_concurrent - busy)

    def usage(self) -> list[RunUsage]:
        """Every run's slot occupancy so far (finished runs, then running ones up to now)."""
        running = [
            RunUsage(r.spec.run_id, r.started_at, self._now, self.gpus_per_probe, RunStatus.RUNNING, r.last_step)
            for r in self._runs.values() if r.finished_at is None
        ]  # fmt: skip
        return [*self._usage, *running]

    # -- hooks -------------------------------------------------------------------------------
    def _start(self, spec: RunSpec) -> RunHandle:
        if spec.n_gpus > self.gpus_per_probe:
            raise LauncherError(
                f"a probe's n_gpus must be <= gpus_per_probe ({self.gpus_per_probe}), but got {spec.n_gpus}. "
                "Raise gpus_per_probe or lower the probe's GPU count."
            )
        if self.free_slots() == 0:
            raise NoCapacityError(
                f"a free GPU slot is needed to start {spec.run_id!r}, but all {self.max_concurrent} are busy. "
                "Wait until poll reports a run finished."
            )
        run_dir = self._files(spec.run_id)
        prepare_branch(spec.branch, run_dir)  # first: it may resume a checkpoint of this run's previous attempt
        run_dir.clear_outputs()
        pins = [*probe_pins(spec, run_dir), f"trainer.n_gpus_per_node={self.gpus_per_probe}"]
        argv = merge_overrides(spec.overrides, pins)
        run_dir.write_spec(spec, {"launcher": self.name, "argv": argv, "landscape": self.landscape_name,
                                  "started_at": self._now})  # fmt: skip
        handle = RunHandle.in_dir(spec.run_id, self.name, run_dir.path, external_id=f"replay:{spec.run_id}",
                                  started_at=self._now)
        self._begin(handle, spec, argv, started_at=self._now, skip_steps=0)
        return handle

    def _begin(self, handle: RunHandle, spec: RunSpec, argv: list[str], *, started_at: float, skip_steps: int) -> None:
        files = {"stdout": open(handle.stdout_path, "a", buffering=1), "stderr": open(handle.stderr_path, "a", buffering=1)}
        events = self._events(argv, handle, started_at=started_at, skip_steps=skip_steps, files=files)
        run = _Run(handle, spec, started_at, events, None, files)
        run.next_event = next(events, None)
        self._runs[spec.run_id] = run
        # Whatever is due at once (a config error exits right away) happens now.
        while run.next_event is not None and run.next_event[0] <= self._now:
            self._apply(run)

    def _poll(self, handle: RunHandle) -> RunState:
        if self.poll_advance_s > 0:
            self._advance_to(self._now + self.poll_advance_s)
        run = self._runs.get(handle.run_id)
        if run is None:
            raise LauncherError(f"run {handle.run_id!r} must have been started by this launcher, but it was not.")
        if run.finished_at is None:
            return RunState(RunStatus.RUNNING)
        if run.exit_code == 0:
            return RunState(RunStatus.SUCCEEDED, exit_code=0)
        tail = stderr_tail(handle.stderr_path)
        return RunState(RunStatus.FAILED, exit_code=run.exit_code, message=f"exit code {run.exit_code}: {tail}")

    def _cancel(self, handle: RunHandle) -> None:
        run = self._runs.get(handle.run_id)
        if run is None or run.finished_at is not None:
            return
        run.files["stderr"].write(_SIGTERM_TEXT + "\n")
        self._end(run, exit_code=143, status=RunStatus.CANCELLED)

    def _reattach(self, run_id: str) -> RunHandle | None:
        """Continue a run another launcher started in this root: its lines so far stay, the
        rest follow on this launcher's clock (an unfinished run has no exit in stderr)."""
        run_dir = self.root_dir / run_id
        data = RunDir(run_dir).read_spec()
        if data.get("launcher") != self.name:
            return None
        branch = data.get("branch")
        spec = RunSpec(run_id=run_id, overrides=tuple(data["overrides"]), n_gpus=int(data["n_gpus"]),
                       branch=None if branch is None else Branch(**branch))
        handle = RunHandle.in_dir(run_id, self.name, run_dir, external_id=f"replay:{run_id}", started_at=self._now)
        done = _last_step(handle.metrics_path)
        if "Training finished" in _read(handle.stdout_path) or _read(handle.stderr_path).strip():
            return None  # it ended under the old launcher; nothing left to follow
        self._begin(handle, spec, list(data["argv"]), started_at=self._now, skip_steps=done)
        return handle

    def close(self) -> None:
        for run in self._runs.values():
            for f in run.files.values():
                f.close()

    # -- the replay ----------------------------------------------------------------------------
    def _apply(self, run: _Run) -> None:
        assert run.next_event is not None
        when, kind, payload = run.next_event
        if kind == "exit":
            self._now = max(self._now, when)
            self._end(run, exit_code=int(payload), status=RunStatus.SUCCEEDED if payload == 0 else RunStatus.FAILED)
            return
        if kind == "step":
            run.last_step = int(payload)
        run.next_event = next(run.events, None)

    def _end(self, run: _Run, *, exit_code: int, status: RunStatus) -> None:
        run.exit_code = exit_code
        run.finished_at = self._now
        run.next_event = None
        run.events.close()  # type: ignore[attr-defined]
        for f in run.files.values():
            f.close()
        self._usage.append(RunUsage(run.spec.run_id, run.started_at, self._now, self.gpus_per_probe, status, run.last_step))

    def _check(self, config: Mapping[str, Any]) -> None:
        """``check_config`` as the process runs it; the key check against verl's config tree
        (a 20 ms YAML read) is remembered per set of keys."""
        import os

        from verl_sweep.launchers.simulator.config import ConfigError, check_config, check_keys

        keys = frozenset(config)
        if keys not in self._key_checks:
            try:
                check_keys(config)
                self._key_checks[keys] = None
            except ConfigError as e:
                self._key_checks[keys] = str(e)
        error = self._key_checks[keys]
        if error is not None:
            raise ConfigError(error)
        previous = os.environ.get("VERL_SIM_SKIP_KEY_CHECK")
        os.environ["VERL_SIM_SKIP_KEY_CHECK"] = "1"  # keys were checked just above
        try:
            check_config(config)
        finally:
            if previous is None:
                del os.environ["VERL_SIM_SKIP_KEY_CHECK"]
            else:
                os.environ["VERL_SIM_SKIP_KEY_CHECK"] = previous

    def _world(self) -> Landscape:
        if self.gpu_memory_gb is None:
            return self.landscape
        hardware = {**self.landscape.data["hardware"], "gpu_memory_gb": self.gpu_memory_gb}
        return dataclasses.replace(self.landscape, data={**self.landscape.data, "hardware": hardware})

    def _events(
        self, argv: list[str], handle: RunHandle, *, started_at: float, skip_steps: int, files: dict[str, Any]
    ) -> Iterator[tuple[float, str, Any]]:
        """What ``python -m verl_sweep.launchers.simulator argv`` does (``simulator.process``) as
        timed events; what follows an event is written as it is taken (when the clock passes it)."""
        from verl_sweep.launchers.simulator import process as sim
        from verl_sweep.launchers.simulator.trace import real_record

        t = started_at
        try:
            run = sim.setup(argv, landscape=self._world, check=self._check)
        except sim.StartError as e:
            files["stderr"].write(f"{e}\n")
            yield t, "exit", 1
            return
        events = sim.events(
            run, prefix=f"(TaskRunnerV1 pid=replay-{handle.run_id})", host="hostname: replay, PID: 0",
            gpu_samples=self.write_gpu_samples, template=real_record() if self.verl_record else {},
            console=self.write_console, track=False, startup_s=self.startup_s, skip_steps=skip_steps,
        )
        for event in events:
            if isinstance(event, sim.Sleep):
                t += event.seconds  # the clock stops at a step, a Wake and the exit only
                if event.step is not None:
                    yield t, "step", event.step
            elif isinstance(event, sim.Metrics):
                files["metrics"].write(event.line)
            elif isinstance(event, sim.Stdout):
                files["stdout"].write(event.text)
            elif isinstance(event, sim.Sample):
                files["samples"].write(json.dumps(event.sample) + "\n")
            elif isinstance(event, sim.Wake):
                yield t, "wake", None
            elif isinstance(event, sim.Ready):
                if event.metrics_path:
                    files["metrics"] = open(event.metrics_path, "a", buffering=1)
                if self.write_gpu_samples:
                    files["samples"] = open(handle.files.gpu_samples, "a", buffering=1)
            elif isinstance(event, sim.Exit):
                yield t, "wake", None  # the exit's lines at its own time (after a hang's timeout)
                files["stdout"].write(event.stdout)
                if event.stderr:
                    files["stderr"].write(event.stderr + "\n")
                yield t, "exit", event.code
                return


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _last_step(path: Path) -> int:
    last = 0
    for line in _read(path).splitlines():
        try:
            last = max(last, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return last
