"""The launcher interface: start a verl probe, follow its state, stop it.

Public ``start / poll / cancel`` keep the bookkeeping and check state changes; an
implementation writes the protected hooks ``_start / _poll / _cancel``. Records are frozen
dataclasses so they can be logged, compared and stored without surprises.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping

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
class RunSpec:
    """What to run: one verl probe.

    ``overrides`` are verl/Hydra overrides (``key=value``), passed as separate argv items,
    never through a shell. ``run_id`` must be unique within the launcher's root directory
    and deterministic for (study, trial, attempt) so a restarted driver can find the run.
    """

    run_id: str
    overrides: tuple[str, ...]
    n_gpus: int = 1
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)

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


WORKER_ERRORS_FILE = "worker_errors.log"


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
    def worker_errors_path(self) -> Path:
        """Error lines a launcher kept from the run's own Ray workers' logs, when it failed:
        the root cause Ray did not forward to the run's stderr (on the H200, vLLM's reason for
        "Engine core initialization failed" was only there)."""
        return self.run_dir / WORKER_ERRORS_FILE

    @classmethod
    def in_dir(cls, run_id: str, launcher: str, run_dir: Path, *, external_id: str = "",
               started_at: float = 0.0) -> "RunHandle":
        """A run whose files have the standard names inside ``run_dir``."""
        return cls(run_id=run_id, launcher=launcher, run_dir=run_dir, metrics_path=run_dir / "metrics.jsonl",
                   stdout_path=run_dir / "stdout.log", stderr_path=run_dir / "stderr.log",
                   external_id=external_id, started_at=started_at)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RunState:
    status: RunStatus
    exit_code: int | None = None
    message: str = ""


#: environment variables no probe may see: the study database's URL holds its password, and
#: verl and wandb log the environment they run in
PRIVATE_ENV = frozenset({"VERL_SWEEP_STORAGE"})


def probe_environment(*layers: Mapping[str, str]) -> dict[str, str]:
    """A probe's environment: ``layers`` merged (later wins) without :data:`PRIVATE_ENV`.
    Every launcher builds the environment it hands a probe with this function."""
    env: dict[str, str] = {}
    for layer in layers:
        env.update(layer)
    for name in PRIVATE_ENV:
        env.pop(name, None)
    return env


def write_spec(run_dir: Path, spec: RunSpec, extra: Mapping[str, Any] | None = None) -> None:
    """Record the spec in the run directory (``spec.json``) for people and for re-attaching."""
    payload = {
        "run_id": spec.run_id,
        "overrides": list(spec.overrides),
        "n_gpus": spec.n_gpus,
        "env": dict(spec.env),
        "metadata": dict(spec.metadata),
        **(extra or {}),
    }
    (run_dir / "spec.json").write_text(json.dumps(payload, indent=2))


class Launcher(abc.ABC):
    """Starts probes and reports their state.

    Callers: the objective (one probe at a time per trial) and the driver (capacity).
    ``poll`` never raises for a failed run: a failure is a ``RunState``; it raises
    ``LauncherError`` only when the launcher itself cannot work (e.g. the cluster is gone).
    """

    name: str = "base"
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
        run_dir = self.root_dir / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir


# -- reading a run's logs ------------------------------------------------------------------
#: a log line worth keeping as evidence when a run failed
_ERROR_LINE = re.compile(r"Error\b|Exception\b|Traceback|out of memory|less than desired", re.IGNORECASE)


def error_lines(lines: list[str]) -> list[str]:
    """The lines that may carry a failure's cause (stripped), in order."""
    return [line.strip() for line in lines if _ERROR_LINE.search(line)]


def tail(path: Path | str, n_lines: int = 20, *, max_bytes: int = 1 << 20) -> str:
    """The last ``n_lines`` lines of a log file ("" when it does not exist).

    Reads backwards in blocks so a multi-gigabyte stdout costs only its end; undecodable
    bytes are replaced, never raised.
    """
    if n_lines < 1:
        raise ValueError(f"n_lines must be >= 1, but got {n_lines}. Pass e.g. 20.")
    path = Path(path)
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return ""
    with handle:
        handle.seek(0, os.SEEK_END)
        end = handle.tell()
        data = b""
        pos = end
        while pos > 0 and data.count(b"\n") <= n_lines and end - pos < max_bytes:
            step = min(8192, pos)
            pos -= step
            handle.seek(pos)
            data = handle.read(step) + data
    lines = data.decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n_lines:])
