"""A probe's run directory: the files every launcher gives a run, named here once.

``<root>/<run_id>/`` holds:

- ``spec.json``: what was run (the RunSpec, the argv, the launcher's own fields)
- ``stdout.log`` / ``stderr.log``: the run's console (verl's ``step:N - key:value`` lines)
  and its errors
- ``metrics.jsonl``: verl's file logger (``$VERL_FILE_LOGGER_PATH``), one line per step
- ``tensorboard/``: verl's tensorboard logger (``$TENSORBOARD_DIR``), unless the baseline asks
  for TensorBoard: then the user's tree holds it (``verl_sweep.launchers.trackers``)
- ``gpu_samples.jsonl``: NVML samples of the run's GPUs
- ``sim_clock.jsonl``: a simulated run's own timeline (``verl_sweep.launchers.sim``)
- ``worker_errors.log``: error lines kept from the run's own Ray workers when it failed
- ``hydra/``: Hydra's run directory
- ``checkpoints/``: a branch's saves (``trainer.default_local_dir``: ``global_step_N/``), and
  ``resume/``: its own copy of the checkpoint it resumes (``verl_sweep.launchers.verl_checkpoints``)

The pins (``probe_pins``) make a probe clean (docs/method.md §3), or make a branch resume and save
(``verl_sweep.launchers.base.Branch``), point verl's file logger into
this directory and name the probe in the user's trackers; a caller's override of a pinned key is dropped (``merge_overrides``). Readers
(``verl_sweep.objectives.sources``, ``verl_sweep.search.views.status``, the report) find a run's files through
``RunDir`` too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from verl_sweep.launchers.trackers import ENV_OVERRIDE, ProbeTracking

logger = logging.getLogger(__name__)

#: the override that points verl's file logger (written inside a Ray actor) at a path
METRICS_OVERRIDE = ENV_OVERRIDE + "VERL_FILE_LOGGER_PATH"
#: pinned keys whose caller value the pins carry on (the baseline's loggers): no note when dropped
_CARRIED = frozenset({"trainer.logger"})


class _Branch(Protocol):
    """What the pins and ``spec.json`` read of a ``verl_sweep.launchers.base.Branch``."""

    @property
    def resume_from(self) -> str | None: ...

    @property
    def save_every(self) -> int: ...

    @property
    def lr(self) -> float | None: ...


class _Spec(Protocol):
    """What ``spec.json`` records of a ``verl_sweep.launchers.base.RunSpec``."""

    @property
    def run_id(self) -> str: ...

    @property
    def overrides(self) -> tuple[str, ...]: ...

    @property
    def n_gpus(self) -> int: ...

    @property
    def env(self) -> Mapping[str, str]: ...

    @property
    def metadata(self) -> Mapping[str, str]: ...

    @property
    def branch(self) -> _Branch | None: ...


@dataclasses.dataclass(frozen=True)
class RunDir:
    """The files of one run (see the module docstring)."""

    path: Path

    @property
    def spec(self) -> Path:
        return self.path / "spec.json"

    @property
    def stdout(self) -> Path:
        return self.path / "stdout.log"

    @property
    def stderr(self) -> Path:
        return self.path / "stderr.log"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def gpu_samples(self) -> Path:
        return self.path / "gpu_samples.jsonl"

    @property
    def sim_clock(self) -> Path:
        return self.path / "sim_clock.jsonl"

    @property
    def worker_errors(self) -> Path:
        return self.path / "worker_errors.log"

    @property
    def hydra(self) -> Path:
        return self.path / "hydra"

    @property
    def checkpoints(self) -> Path:
        """A branch's ``trainer.default_local_dir``."""
        return self.path / "checkpoints"

    @property
    def resume(self) -> Path:
        """Where a branch's own copy of the checkpoint it resumes lies."""
        return self.path / "resume"

    def step_dir(self, step: int) -> Path:
        """The folder of the checkpoint this run saved at ``step``."""
        return self.checkpoints / f"global_step_{step}"

    def resume_step_dir(self, resume_from: str) -> Path:
        """The run's copy of the checkpoint folder ``resume_from``: the folder keeps its name
        (verl reads the step from it)."""
        return self.resume / Path(resume_from).name

    @classmethod
    def make(cls, root: Path, run_id: str) -> RunDir:
        """``root/run_id``, created."""
        run_dir = cls(root / run_id)
        run_dir.path.mkdir(parents=True, exist_ok=True)
        return run_dir

    def clear_outputs(self) -> None:
        """Remove a previous attempt's outputs, its saved checkpoints included, so that a
        reader never mixes two runs."""
        for path in (self.metrics, self.stdout, self.stderr, self.gpu_samples, self.sim_clock):
            path.unlink(missing_ok=True)
        if self.checkpoints.exists():
            shutil.rmtree(self.checkpoints)

    def write_spec(self, spec: _Spec, extra: Mapping[str, Any] | None = None) -> None:
        """Record the spec (``spec.json``) for people and for re-attaching."""
        branch = None if spec.branch is None else {
            "resume_from": spec.branch.resume_from, "save_every": spec.branch.save_every, "lr": spec.branch.lr}
        payload = {"run_id": spec.run_id, "overrides": list(spec.overrides), "n_gpus": spec.n_gpus,
                   "env": dict(spec.env), "metadata": dict(spec.metadata), "branch": branch, **(extra or {})}
        self.spec.write_text(json.dumps(payload, indent=2))

    def read_spec(self) -> dict[str, Any]:
        """``spec.json`` as written; {} when it is missing or unreadable."""
        try:
            data = json.loads(self.spec.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def probe_pins(spec: _Spec, run_dir: RunDir, *, metrics_path: Path | None = None) -> list[str]:
    """The overrides that make a probe clean and findable (docs/method.md §3): no resume, no
    validation before training, no checkpoints (a branch: it resumes its own copy of its
    checkpoint, ``run_dir.resume``, and saves into ``run_dir.checkpoints``), its own experiment
    name and Hydra directory,
    the baseline's loggers with verl's console and file loggers, the file logger's path
    (``metrics_path``: where the run can write it, by default the run directory's), and the
    names the user's trackers give it (``verl_sweep.launchers.trackers``: W&B's group and job type, the
    TensorBoard directory, by default the run directory's)."""
    metrics = metrics_path or run_dir.metrics
    tracking = ProbeTracking.plan(spec.run_id, spec.overrides, spec.metadata)
    branch = spec.branch
    resume, saves = ["trainer.resume_mode=disable"], ["trainer.save_freq=-1"]
    if branch is not None:
        if branch.resume_from is not None:
            resume = ["trainer.resume_mode=resume_path",
                      f"trainer.resume_from_path={run_dir.resume_step_dir(branch.resume_from)}"]
        saves = [f"trainer.save_freq={branch.save_every}", f"trainer.default_local_dir={run_dir.checkpoints}"]
    return [
        *resume,
        "trainer.val_before_train=false",
        *saves,
        f"trainer.experiment_name={spec.run_id}",
        f"hydra.run.dir={run_dir.hydra}",
        tracking.logger_pin(),
        f"{METRICS_OVERRIDE}={metrics}",
        *tracking.env_pins(metrics.parent / "tensorboard"),
    ]


def override_key(item: str) -> str:
    """The config path an override sets: ``+a.b=1`` / ``++a.b=1`` / ``~a.b`` -> ``a.b``."""
    key = item.split("=", 1)[0].strip()
    return key.lstrip("~+")


#: the dropped overrides already warned about: every probe of a study drops the same ones
_warned_dropped: set[str] = set()


def merge_overrides(user: Sequence[str], pins: Sequence[str]) -> list[str]:
    """Caller overrides followed by the pins; a caller override of a pinned key is dropped
    (Hydra rejects a ``+key`` given twice, and the pin must win), with a warning once per
    process (one study) for each, not once per probe; the loggers' pin keeps the caller's
    loggers, so dropping them is no news."""
    pinned = {override_key(p) for p in pins}
    kept = []
    for item in user:
        if override_key(item) in pinned:
            if item not in pins and override_key(item) not in _CARRIED and item not in _warned_dropped:
                _warned_dropped.add(item)  # the same setting twice is not worth a warning
                logger.warning("dropping override %r from every probe: the launcher pins this key", item)
            continue
        kept.append(item)
    return [*kept, *pins]


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


def stderr_tail(path: Path, *, n_lines: int = 3, max_chars: int = 600) -> str:
    """The last non-empty lines of a log file, for a one-line failure message."""
    try:
        text = tail(path, n_lines=n_lines + 20, max_bytes=16384)
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-n_lines:])[-max_chars:]
