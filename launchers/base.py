"""The launcher interface: start a verl probe, follow its state, stop it.

Public ``start / poll / cancel`` keep the bookkeeping and check state changes; an
implementation writes the protected hooks ``_start / _poll / _cancel``. Records are frozen
dataclasses so they can be logged, compared and stored without surprises.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from verl_sweep.launchers.run_dir import RunDir

if TYPE_CHECKING:
    from verl_sweep.launchers.options import Option

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


class LauncherError(Exception):
    """Root of every error a launcher raises; the message says what to do."""


class NoCapacityError(LauncherError):
    """Raised by ``start`` when every slot is busy; try again after a run ends."""


class RunStatus(enum.Enum):
    PENDING = "pending"  # accepted, not yet running (queued for a slot or a Ray resource)
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # process exited 0
    FAILED = "failed"  # process exited non-zero or never started
    CANCELLED = "cancelled"  # stopped by ``cancel``

    @property
    def is_finished(self) -> bool:
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


@dataclasses.dataclass(frozen=True)
class Branch:
    """A run that forks a train-mode chain: it resumes ``resume_from`` (a verl ``global_step_N``
    folder; None: it starts at step 1) and saves every ``save_every`` steps into its own run
    directory's ``checkpoints/``. verl keeps the checkpoint's learning rate on resume
    (docs/verl-resume.md §2): with ``lr`` the launcher rewrites its own copy of the checkpoint
    so the run trains at ``lr``."""

    resume_from: str | None
    save_every: int
    lr: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.save_every, bool) or not isinstance(self.save_every, int) or self.save_every < 1:
            raise LauncherError(f"a branch's save_every must be an integer >= 1, but got {self.save_every!r}. "
                                "It is the steps between two of the branch's saves.")
        if self.resume_from is not None and ("\n" in self.resume_from or "\x00" in self.resume_from):
            raise LauncherError(f"a branch's resume_from must be one line, but got {self.resume_from!r}.")
        if self.lr is not None and not self.lr > 0:
            raise LauncherError(f"a branch's lr must be > 0, but got {self.lr!r}. "
                                "Pass None to keep the checkpoint's lr.")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What to run: one verl probe.

    ``overrides`` are verl/Hydra overrides (``key=value``), passed as separate argv items,
    never through a shell. ``run_id`` must be unique within the launcher's root directory
    and deterministic for (study, trial, attempt) so a restarted driver can find the run.
    ``branch``: the run resumes and saves checkpoints (:class:`Branch`); None: a clean probe.
    """

    run_id: str
    overrides: tuple[str, ...]
    n_gpus: int = 1
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    branch: Branch | None = None

    def __post_init__(self) -> None:
        if not _RUN_ID.match(self.run_id):
            raise LauncherError(
                f"run_id must be 1-128 letters, digits, '.', '_' or '-', but got {self.run_id!r}."
            )
        if self.n_gpus < 0:
            raise LauncherError(f"n_gpus must be >= 0, but got {self.n_gpus}.")
        for item in self.overrides:
            if "\n" in item or "\x00" in item:
                raise LauncherError(f"override must be one line, but got {item!r}.")


@dataclasses.dataclass(frozen=True)
class RunHandle:
    """Where a started run lives. ``external_id`` is the pid or the Ray submission id."""

    run_id: str
    launcher: str
    run_dir: Path
    metrics_path: Path
    stdout_path: Path
    stderr_path: Path
    external_id: str = ""
    started_at: float = 0.0

    @property
    def files(self) -> RunDir:
        """The run directory's files (``verl_sweep.launchers.run_dir``); its metrics may be elsewhere
        (``metrics_path``: a Ray job writes them on shared storage)."""
        return RunDir(self.run_dir)

    @property
    def worker_errors_path(self) -> Path:
        """Error lines a launcher kept from the run's own Ray workers' logs, when it failed:
        the root cause Ray does not forward to the run's stderr (vLLM's reason for "Engine core
        initialization failed" is only there)."""
        return self.files.worker_errors

    @classmethod
    def in_dir(cls, run_id: str, launcher: str, run_dir: Path, *, external_id: str = "",
               started_at: float = 0.0) -> "RunHandle":
        """A run whose files have the standard names inside ``run_dir`` (``RunDir``)."""
        files = RunDir(run_dir)
        return cls(run_id=run_id, launcher=launcher, run_dir=run_dir, metrics_path=files.metrics,
                   stdout_path=files.stdout, stderr_path=files.stderr,
                   external_id=external_id, started_at=started_at)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RunState:
    status: RunStatus
    exit_code: int | None = None
    message: str = ""


@dataclasses.dataclass(frozen=True)
class RunTime:
    """How long a run held its GPUs (``held_s``) and took to reach its first step
    (``startup_s``; None when it reached none), in seconds of its launcher's clock."""

    held_s: float
    startup_s: float | None


#: environment variables no probe may see: the study database's URL holds its password, and
#: verl and wandb log the environment they run in; the driver's own W&B service (wandb sets it
#: once the driver adds a trial's outcome to a run) would take a probe's run into the driver's
#: process, where a cancelled probe's run stays open: a probe runs its own, as a verl run does
PRIVATE_ENV = frozenset({"VERL_SWEEP_STORAGE", "WANDB_SERVICE"})


def probe_environment(*layers: Mapping[str, str]) -> dict[str, str]:
    """A probe's environment: ``layers`` merged (later wins) without :data:`PRIVATE_ENV`.
    Every launcher builds the environment it hands a probe with this function."""
    env: dict[str, str] = {}
    for layer in layers:
        env.update(layer)
    for name in PRIVATE_ENV:
        env.pop(name, None)
    return env


class Launcher(abc.ABC):
    """Starts probes and reports their state.

    Callers: the objective (one probe at a time per trial) and the driver (capacity).
    ``poll`` never raises for a failed run: a failure is a ``RunState``; it raises
    ``LauncherError`` only when the launcher itself cannot work (e.g. the cluster is gone).
    """

    name: str = "base"
    #: the options a study file may set under ``launcher.options`` (``verl_sweep.launchers.options``):
    #: the keyword arguments of the constructor, but the clock
    OPTIONS: tuple[Option, ...] = ()
    #: can be built on any machine (no GPU, no cluster): ``validate`` builds it to check the options
    builds_anywhere: bool = False
    #: how long the driver waits between two polls, on this launcher's clock
    poll_interval_s: float = 0.05
    #: probes run on real GPUs, so a config whose estimated memory cannot fit is refused
    #: before launch; a simulator's own world decides what runs out of memory
    real_gpus: bool = True

    def __init__(self, root_dir: Path | str, *, clock: Clock = time.time) -> None:
        self.root_dir = Path(root_dir).resolve()
        self.root_dir.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self._states: dict[str, RunState] = {}

    # -- capacity -------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def max_concurrent(self) -> int:
        """How many probes can run at once."""

    def free_slots(self) -> int:
        """Slots free right now (a launcher that queues may report max_concurrent)."""
        busy = sum(1 for s in self._states.values() if not s.status.is_finished)
        return max(0, self.max_concurrent - busy)

    # -- public API ------------------------------------------------------------------------
    def start(self, spec: RunSpec) -> RunHandle:
        if spec.run_id in self._states and not self._states[spec.run_id].status.is_finished:
            raise LauncherError(f"run {spec.run_id!r} is already active in this launcher.")
        handle = self._start(spec)
        self._states[spec.run_id] = RunState(RunStatus.PENDING)
        logger.debug("started %s (%s)", spec.run_id, handle.external_id)
        return handle

    def poll(self, handle: RunHandle) -> RunState:
        previous = self._states.get(handle.run_id)
        if previous is not None and previous.status.is_finished:
            return previous  # finished states are final
        state = self._poll(handle)
        self._states[handle.run_id] = state
        return state

    def cancel(self, handle: RunHandle) -> None:
        """Stop the run and everything it started. Idempotent."""
        previous = self._states.get(handle.run_id)
        if previous is not None and previous.status.is_finished:
            return
        self._cancel(handle)
        self._states[handle.run_id] = RunState(RunStatus.CANCELLED, message="cancelled")

    def reattach(self, run_id: str) -> RunHandle | None:
        """Find a run a previous driver started (same ``run_id``); None when there is none."""
        handle = self._reattach(run_id)
        if handle is not None:
            self._states[run_id] = RunState(RunStatus.PENDING)
        return handle

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass on the launcher's clock between two polls. Real launchers
        sleep; a simulated-time launcher advances its clock instead (benchmarks)."""
        time.sleep(seconds)

    def run_time(self, handle: RunHandle, *, started_at: float, ended_at: float, first_step_at: float | None,
                 last_step: int) -> RunTime:
        """How long a finished run held its GPUs and took to start, from the caller's readings of
        this launcher's clock at its start, its end and its first step's start (None: it reached
        none); ``last_step``: the last step the caller read. Called by the probe when its run is
        over. Here, the differences of those readings."""
        startup = None if first_step_at is None else max(0.0, first_step_at - started_at)
        return RunTime(held_s=max(0.0, ended_at - started_at), startup_s=startup)

    def cleanup_leftover(self, run_dir: Path) -> None:
        """Kill whatever a dead driver's run left running. Called before the run's trial is
        queued again; launchers that start processes override it (nothing to do here)."""

    def close(self) -> None:
        """Release what the launcher holds (does not stop runs; call ``cancel`` for that)."""

    # -- hooks -----------------------------------------------------------------------------
    @abc.abstractmethod
    def _start(self, spec: RunSpec) -> RunHandle: ...

    @abc.abstractmethod
    def _poll(self, handle: RunHandle) -> RunState: ...

    @abc.abstractmethod
    def _cancel(self, handle: RunHandle) -> None: ...

    def _reattach(self, run_id: str) -> RunHandle | None:
        return None

    # -- helpers for implementations --------------------------------------------------------
    def _run_dir(self, run_id: str) -> Path:
        """The run's directory under ``root_dir``, created."""
        return self._files(run_id).path

    def _files(self, run_id: str) -> RunDir:
        """The run's directory under ``root_dir`` (created) with the files every launcher's runs
        have (``verl_sweep.launchers.run_dir``)."""
        return RunDir.make(self.root_dir, run_id)
