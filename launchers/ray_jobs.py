"""RayJobLauncher: each probe is a Ray job on an existing cluster (Ray Jobs API).

Contract:
- ``submission_id`` = ``run_id`` (callers derive it from study/trial/attempt), so a restarted
  driver re-attaches by id; ``start`` of an id the cluster already knows re-attaches instead of
  rerunning (Ray rejects a reused id).
- Each job asks ``entrypoint_resources={slot_resource: 1}``: with the cluster's slots all held,
  further jobs wait as PENDING instead of failing. ``entrypoint_num_gpus`` is never set (verl
  reserves its own GPUs through placement groups; GPUs reserved for the driver are invisible
  to it).
- Status, driver exit code and message come from ``get_job_info``; ``cancel`` calls
  ``stop_job`` and waits until the job is terminal.
- verl writes metrics to ``<shared_dir or root_dir>/<run_id>/metrics.jsonl``, which must be
  storage this driver reads. The job's log (stdout and stderr together) is mirrored into
  ``<root_dir>/<run_id>/stdout.log`` when the run ends, and while it runs as long as no
  metrics file appears, so the console-line parser has something to read.
- A branch (``RunSpec.branch``) is refused at start, for now: its copy of its checkpoint is
  made from this machine's files (``verl_checkpoints.prepare_branch``).
- Ray is imported only inside methods: ``import launchers`` works without Ray.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from verl_sweep.launchers.base import (
    Clock,
    Launcher,
    LauncherError,
    RunHandle,
    RunSpec,
    RunState,
    RunStatus,
    probe_environment,
)
from verl_sweep.launchers.options import Option
from verl_sweep.launchers.run_dir import RunDir, merge_overrides, probe_pins, stderr_tail

logger = logging.getLogger(__name__)

_STATUS = {
    "PENDING": RunStatus.PENDING,
    "RUNNING": RunStatus.RUNNING,
    "SUCCEEDED": RunStatus.SUCCEEDED,
    "FAILED": RunStatus.FAILED,
    "STOPPED": RunStatus.CANCELLED,
}


class RayJobLauncher(Launcher):
    """Probes as Ray jobs, queued on a custom slot resource (see module docstring)."""

    name = "ray"
    OPTIONS: tuple[Option, ...] = (
        Option("address", "str", required=True, help="the Ray dashboard's job address, e.g. http://head:8265"),
        Option("max_concurrent", "int", required=True, from_study="launcher.max_concurrent",
               help="the cluster's slot count: jobs beyond it wait as pending"),
        Option("slot_resource", "str", help="the custom resource each job holds one of"),
        Option("command", "list[str]", nullable=True, help="what runs a probe (default: python -m verl.trainer.main_ppo)"),
        Option("shared_dir", "str", nullable=True, help="storage the jobs write their metrics to, read here"),
        Option("gpus_per_probe", "int", nullable=True, help="trainer.n_gpus_per_node of every probe"),
        Option("extra_env", "dict[str, str]", nullable=True, help="environment variables of every job"),
        Option("stop_timeout_s", "float", help="seconds a stopped job has to end"),
        Option("log_mirror_interval_s", "float", help="seconds between copies of a running job's log"),
    )

    def __init__(
        self,
        root_dir: Path | str,
        *,
        address: str,
        max_concurrent: int,
        slot_resource: str = "verl_sweep_slot",
        command: Sequence[str] | None = None,
        shared_dir: Path | str | None = None,
        gpus_per_probe: int | None = None,
        extra_env: Mapping[str, str] | None = None,
        clock: Clock = time.time,
        stop_timeout_s: float = 60.0,
        log_mirror_interval_s: float = 5.0,
    ) -> None:
        if max_concurrent < 1:
            raise LauncherError(
                f"max_concurrent must be >= 1, but got {max_concurrent}. Set it to the cluster's {slot_resource} count."
            )
        if not address:
            raise LauncherError(
                "address must name the Ray dashboard (e.g. http://head:8265), but got ''. Pass the cluster's job address."
            )
        super().__init__(root_dir, clock=clock)
        self.address = address
        self._max_concurrent = max_concurrent
        self.slot_resource = slot_resource
        self.command = list(command) if command is not None else ["python", "-m", "verl.trainer.main_ppo"]
        self.shared_dir = Path(shared_dir).resolve() if shared_dir is not None else self.root_dir
        self.gpus_per_probe = gpus_per_probe
        self.extra_env = dict(extra_env or {})
        self.stop_timeout_s = stop_timeout_s
        self.log_mirror_interval_s = log_mirror_interval_s
        self._client: Any = None
        self._last_mirror: dict[str, float] = {}

    @property
    def max_concurrent(self) -> int:
        return self._max_concurrent

    # -- Ray boundary ------------------------------------------------------------------------
    def client(self) -> Any:
        """The JobSubmissionClient (made on first use); LauncherError if the cluster is unreachable."""
        if self._client is None:
            try:
                from ray.job_submission import JobSubmissionClient
            except ImportError as e:
                raise LauncherError(
                    "the ray launcher needs Ray, but it is not installed. Install it: pip install 'verl-sweep[ray]'."
                ) from e
            try:
                self._client = JobSubmissionClient(self.address)
            except (RuntimeError, ConnectionError, ValueError) as e:
                raise LauncherError(
                    f"the Ray job server must be reachable at {self.address}, but connecting failed: {_one_line(e)}. "
                    "Check the address and that the head runs the dashboard."
                ) from e
        return self._client

    def _job_info(self, run_id: str) -> Any | None:
        """The job's JobInfo, or None when the cluster does not know ``run_id``."""
        try:
            return self.client().get_job_info(run_id)
        except RuntimeError as e:
            if "does not exist" in str(e) or "404" in str(e):
                return None
            raise LauncherError(
                f"the Ray job server must answer for job {run_id!r}, but it failed: {_one_line(e)}. Check the cluster."
            ) from e
        except ConnectionError as e:
            raise LauncherError(
                f"the Ray job server must be reachable at {self.address}, but it is not: {_one_line(e)}. Check the cluster."
            ) from e

    # -- paths -------------------------------------------------------------------------------
    def _paths(self, run_id: str) -> tuple[RunDir, RunDir]:
        """(local run dir, run dir on shared storage: where the job writes its metrics)."""
        run_dir = self._files(run_id)
        remote_dir = RunDir(self.shared_dir / run_id)
        try:
            remote_dir.path.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # not mounted here; verl's logger will fail loudly on the node instead
        return run_dir, remote_dir

    def _handle(self, run_id: str, started_at: float) -> RunHandle:
        run_dir, remote_dir = self._paths(run_id)
        log_path = run_dir.stdout
        return RunHandle(
            run_id=run_id,
            launcher=self.name,
            run_dir=run_dir.path,
            metrics_path=remote_dir.metrics,
            stdout_path=log_path,
            stderr_path=log_path,  # Ray keeps one log per job: stdout and stderr interleaved
            external_id=run_id,
            started_at=started_at,
        )

    # -- hooks -------------------------------------------------------------------------------
    def _start(self, spec: RunSpec) -> RunHandle:
        if spec.branch is not None:
            raise LauncherError(
                f"a branch run ({spec.run_id!r}) needs a launcher on the machine that holds its checkpoints, "
                "but the ray launcher runs it on a cluster. Use the local or sim launcher for branches, for now."
            )
        run_dir, remote_dir = self._paths(spec.run_id)
        pins = probe_pins(spec, remote_dir)
        if self.gpus_per_probe is not None:
            pins.append(f"trainer.n_gpus_per_node={self.gpus_per_probe}")
        argv = [*self.command, *merge_overrides(spec.overrides, pins)]
        env_vars = probe_environment(self.extra_env, spec.env)
        started_at = self.clock()
        try:
            self.client().submit_job(
                entrypoint=shlex.join(argv),
                submission_id=spec.run_id,
                runtime_env={"env_vars": env_vars} if env_vars else None,
                metadata={"verl_sweep_run_id": spec.run_id, **dict(spec.metadata)},
                entrypoint_resources={self.slot_resource: 1},
            )
        except RuntimeError as e:
            if "already exists" not in str(e):
                raise LauncherError(
                    f"Ray must accept job {spec.run_id!r}, but submit failed: {_one_line(e)}. Check the cluster."
                ) from e
            # The id is taken: a previous driver submitted this run. Follow it, never rerun it.
            logger.info("job %s already exists on the cluster; re-attaching", spec.run_id)
            handle = self._reattach(spec.run_id)
            if handle is None:
                raise LauncherError(
                    f"job {spec.run_id!r} must be readable after Ray said it exists, but it is not. Retry."
                ) from e
            return handle
        run_dir.write_spec(spec, {"launcher": self.name, "address": self.address, "argv": argv,
                                  "started_at": started_at})
        return self._handle(spec.run_id, started_at)

    def _poll(self, handle: RunHandle) -> RunState:
        info = self._job_info(handle.run_id)
        if info is None:
            return RunState(RunStatus.FAILED, message=f"job {handle.run_id} is unknown to the cluster (was it restarted?)")
        status = _STATUS.get(str(getattr(info.status, "value", info.status)), RunStatus.FAILED)
        if status.is_finished:
            self._mirror_logs(handle, force=True)
            code = info.driver_exit_code
            if status is RunStatus.SUCCEEDED:
                return RunState(status, exit_code=0 if code is None else code)
            message = _one_line(info.message or "")[:300]
            tail = stderr_tail(handle.stdout_path)
            if tail:
                message = f"{message} | {tail}" if message else tail
            return RunState(status, exit_code=code, message=message)
        if status is RunStatus.RUNNING and not handle.metrics_path.exists():
            self._mirror_logs(handle, force=False)
        return RunState(status)

    def _cancel(self, handle: RunHandle) -> None:
        from ray.job_submission import JobStatus

        try:
            self.client().stop_job(handle.run_id)
        except RuntimeError as e:
            if "does not exist" in str(e):
                return
            raise LauncherError(f"Ray must stop job {handle.run_id!r}, but stop_job failed: {_one_line(e)}.") from e
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline:
            status = self.client().get_job_status(handle.run_id)
            if status in (JobStatus.STOPPED, JobStatus.SUCCEEDED, JobStatus.FAILED):
                self._mirror_logs(handle, force=True)
                return
            time.sleep(0.2)
        raise LauncherError(
            f"job {handle.run_id!r} must stop within {self.stop_timeout_s:g} s, but it is still running. "
            "Stop it by hand: ray job stop " + handle.run_id
        )

    def _reattach(self, run_id: str) -> RunHandle | None:
        info = self._job_info(run_id)
        if info is None:
            return None
        started_at = self.clock()
        try:
            started_at = float(RunDir(self.root_dir / run_id).read_spec()["started_at"])
        except (KeyError, TypeError, ValueError):
            pass  # spec written by another driver's root; the start time is approximate
        return self._handle(run_id, started_at)

    # -- logs --------------------------------------------------------------------------------
    def _mirror_logs(self, handle: RunHandle, *, force: bool) -> None:
        """Copy the job's log into stdout.log (atomically) for the console-line parser."""
        now = time.monotonic()
        if not force and now - self._last_mirror.get(handle.run_id, -1e9) < self.log_mirror_interval_s:
            return
        self._last_mirror[handle.run_id] = now
        try:
            logs = self.client().get_job_logs(handle.run_id)
        except RuntimeError as e:
            logger.debug("no logs for %s: %s", handle.run_id, e)
            return
        tmp = handle.stdout_path.with_suffix(".tmp")
        tmp.write_text(logs)
        os.replace(tmp, handle.stdout_path)

    def close(self) -> None:
        self._client = None


def _one_line(error: BaseException | str) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

