"""LocalLauncher: verl probes as local processes, each on its own slot of GPUs.

Contract:
- G GPUs and g GPUs per probe give G // g GPU groups, each shared by ``probes_per_gpu``
  probes (a small model leaves most of a GPU idle, so several of its probes fit on one), so
  (G // g) × probes_per_gpu slots; ``start`` raises ``NoCapacityError`` when every slot is
  busy. A slot frees as soon as ``poll`` sees the exit or ``cancel`` kills it.
- Each run gets its run directory (``verl_sweep.launchers.run_dir``: spec, stdout, stderr, metrics, GPU
  samples on real GPUs) and ``process.json``; its own CUDA_VISIBLE_DEVICES; the clean-probe pins
  (``run_dir.probe_pins``, appended after the caller's overrides, which lose any pinned key); a
  private Ray. A branch (``RunSpec.branch``) resumes its own copy of its checkpoint
  (``verl_checkpoints.prepare_branch``, made at start) and saves into its run directory.
- With NVML GPUs present, ``start`` refuses a slot whose GPUs have less than
  ``min_free_gpu_memory_gb`` free. With no GPU and no explicit ``gpu_ids``, construction
  raises ``LauncherError`` (one line; the CLI maps it to exit 2).
- ``cancel`` kills the whole tree, including Ray processes that left the group; a probe that
  exits by itself has its leftovers (Ray workers in process groups of their own) killed too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from verl_sweep.launchers import gpu as gpu_mod
from verl_sweep.launchers import process as proc_mod
from verl_sweep.launchers.base import (
    Clock,
    Launcher,
    LauncherError,
    NoCapacityError,
    RunHandle,
    RunSpec,
    RunState,
    RunStatus,
    probe_environment,
)
from verl_sweep.launchers.options import Option
from verl_sweep.launchers.run_dir import RunDir, error_lines, merge_overrides, override_key, probe_pins, stderr_tail, tail
from verl_sweep.launchers.verl_checkpoints import prepare_branch

logger = logging.getLogger(__name__)

VERL_COMMAND: tuple[str, ...] = (sys.executable, "-m", "verl.trainer.main_ppo")


#: Probes sharing a GPU start together, and vLLM's start-up profiling counts a neighbour's
#: allocations as its own, so a probe started beside others may die "No available memory for the
#: cache blocks" or "Error in memory profiling" (docs/method.md, Evidence).
#: A fixed KV cache size skips that profiling (vllm/v1/worker/gpu_worker.py,
#: determine_available_memory). It is this share of the probe's memory fraction; the rest holds
#: weights, activations and CUDA's context, which a model small enough to share a GPU keeps small.
KV_CACHE_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes"
KV_CACHE_SHARE = 0.5
MEMORY_FRACTION_KEY = "actor_rollout_ref.rollout.gpu_memory_utilization"
VERL_DEFAULT_MEMORY_FRACTION = 0.5  # verl 0.9.1's rollout.yaml


def shared_gpu_kv_pin(overrides: Sequence[str], gpu_memory_bytes: int) -> str | None:
    """The fixed-KV-cache override for a probe that shares its GPU, or None when the caller
    set the size already."""
    fraction = VERL_DEFAULT_MEMORY_FRACTION
    for item in overrides:
        key = override_key(item)
        if key == KV_CACHE_KEY:
            return None
        if key == MEMORY_FRACTION_KEY and "=" in item:
            fraction = float(item.split("=", 1)[1])
    return f"+{KV_CACHE_KEY}={int(gpu_memory_bytes * fraction * KV_CACHE_SHARE)}"


def private_ray_dir(run_dir: Path) -> str:
    """A short per-run Ray temp dir: Ray's unix sockets live under it and paths must stay
    below ~107 bytes, so it cannot sit inside a deep run directory."""
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]
    base = "/tmp" if os.path.isdir("/tmp") else os.path.realpath(os.sep)
    return os.path.join(base, f"vs-{digest}")




def keep_worker_errors(run_dir: Path, *, max_lines: int = 60) -> Path | None:
    """Copy the error lines of the run's private Ray session's worker logs
    (``<ray dir>/session_*/logs/*.err`` and ``*.out``) into ``worker_errors.log`` in
    ``run_dir``; returns it, or None when there were none. Ray forwards a worker's output to
    the driver only while the driver lives, so a child process's last words (vLLM's engine
    workers log their exception to stdout) can be missing from the run's own logs."""
    seen: set[Path] = set()
    kept: list[str] = []
    logs = Path(private_ray_dir(run_dir))
    for path in sorted([*logs.glob("session_*/logs/*.err"), *logs.glob("session_*/logs/*.out")]):
        real = path.resolve()
        if real in seen:  # session_latest links to the session itself
            continue
        seen.add(real)
        try:  # the end is where a failure is
            lines = tail(path, n_lines=100_000, max_bytes=262_144).splitlines()
        except OSError:
            continue
        kept += [f"({path.name}) {line}" for line in error_lines(lines)]
    if not kept:
        return None
    target = RunDir(run_dir).worker_errors
    target.write_text("\n".join(kept[-max_lines:]) + "\n")
    return target


class LocalLauncher(Launcher):
    """Runs probes as processes on this machine, one GPU slot each (see module docstring)."""

    name = "local"
    OPTIONS: tuple[Option, ...] = (
        Option("gpu_ids", "list[int]", nullable=True, help="NVML indices of the GPUs to use (default: every visible one)"),
        Option("gpus_per_probe", "int", help="GPUs a probe runs on"),
        Option("probes_per_gpu", "int", help="probes sharing a GPU (small models only)"),
        Option("command", "list[str]", nullable=True, help="what runs a probe (default: python -m verl.trainer.main_ppo)"),
        Option("min_free_gpu_memory_gb", "float", help="a slot's GPUs need this much free memory to start a probe"),
        Option("extra_env", "dict[str, str]", nullable=True, help="environment variables of every probe"),
        Option("sample_gpus", "bool", help="record NVML samples of a probe's GPUs"),
        Option("kill_grace_s", "float", help="seconds between SIGTERM and SIGKILL when a probe is stopped"),
    )

    def __init__(
        self,
        root_dir: Path | str,
        *,
        gpu_ids: list[int] | None = None,
        gpus_per_probe: int = 1,
        probes_per_gpu: int = 1,
        command: Sequence[str] | None = None,
        min_free_gpu_memory_gb: float = 5.0,
        clock: Clock = time.time,
        extra_env: Mapping[str, str] | None = None,
        sample_gpus: bool = True,
        kill_grace_s: float = 5.0,
    ) -> None:
        if gpus_per_probe < 1:
            raise LauncherError(f"gpus_per_probe must be >= 1, but got {gpus_per_probe}.")
        if isinstance(probes_per_gpu, bool) or not isinstance(probes_per_gpu, int) or not 1 <= probes_per_gpu <= 64:
            raise LauncherError(f"probes_per_gpu must be an integer in [1, 64], but got {probes_per_gpu!r}. "
                                "Use more than 1 only for models small enough to share a GPU.")
        n_real = self._count_real_gpus()
        if gpu_ids is None:
            gpu_ids = gpu_mod.visible_gpu_ids() if n_real else []
            if not gpu_ids:
                raise LauncherError(
                    "the local launcher needs GPUs, but NVML found none on this machine. "
                    "Run on a GPU machine, or use the 'sim' launcher (or 'ray' with a cluster address)."
                )
        if len(set(gpu_ids)) != len(gpu_ids):
            raise LauncherError(f"gpu_ids must not repeat, but got {gpu_ids}.")
        if len(gpu_ids) < gpus_per_probe:
            raise LauncherError(
                f"gpus_per_probe must be <= the number of GPUs ({len(gpu_ids)}), but got {gpus_per_probe}. "
                "Lower gpus_per_probe or give more gpu_ids."
            )
        if n_real:
            bad = [i for i in gpu_ids if not 0 <= i < n_real]
            if bad:
                raise LauncherError(
                    f"gpu_ids must be NVML indices in [0, {n_real}), but got {bad}. Use the indices nvidia-smi lists."
                )
        super().__init__(root_dir, clock=clock)
        self.gpu_ids = list(gpu_ids)
        self.gpus_per_probe = gpus_per_probe
        self.command = list(command) if command is not None else list(VERL_COMMAND)
        self.min_free_gpu_memory_gb = min_free_gpu_memory_gb
        self.extra_env = dict(extra_env or {})
        self.kill_grace_s = kill_grace_s
        # NVML checks (preflight, sampling) only where the ids are real devices.
        self._nvml = bool(n_real)
        self._sample_gpus = sample_gpus and self._nvml
        self.probes_per_gpu = probes_per_gpu
        groups = [tuple(self.gpu_ids[i * gpus_per_probe : (i + 1) * gpus_per_probe])
                  for i in range(len(self.gpu_ids) // gpus_per_probe)]
        # Sharing probes round-robin over the groups: with fewer probes than slots, each GPU
        # gets as few as it can.
        self._slots: list[tuple[int, ...]] = [g for _ in range(probes_per_gpu) for g in groups]
        n_slots = len(self._slots)
        self._slot_owner: list[str | None] = [None] * n_slots
        self._records: dict[str, proc_mod.ProcessRecord] = {}
        self._samplers: dict[str, gpu_mod.GpuSampler] = {}

    # -- overridable pieces (SimLauncher) --------------------------------------------------
    def _count_real_gpus(self) -> int:
        return gpu_mod.gpu_count()

    def _gpu_memory_bytes(self, gpus: Sequence[int]) -> int | None:
        """The smallest total memory of the slot's GPUs (None without NVML)."""
        if not self._nvml:
            return None
        return int(min(r.mem_total_mb for r in gpu_mod.read_gpus(gpus)) * 2**20)

    def _probe_env(self, spec: RunSpec, run_dir: Path) -> dict[str, str]:
        """Extra environment for one probe (on top of os.environ, extra_env and spec.env)."""
        return {}

    # -- capacity ----------------------------------------------------------------------------
    @property
    def max_concurrent(self) -> int:
        return len(self._slots)

    def free_slots(self) -> int:
        return sum(1 for owner in self._slot_owner if owner is None)

    def slot_gpus(self, run_id: str) -> tuple[int, ...] | None:
        """The GPU ids a run holds, or None when it holds no slot."""
        for index, owner in enumerate(self._slot_owner):
            if owner == run_id:
                return self._slots[index]
        return None

    def _take_slot(self, run_id: str, preferred: int | None = None) -> int | None:
        order = list(range(len(self._slots)))
        if preferred is not None and 0 <= preferred < len(order):
            order.remove(preferred)
            order.insert(0, preferred)
        for index in order:
            if self._slot_owner[index] is None:
                self._slot_owner[index] = run_id
                return index
        return None

    def _release(self, run_id: str) -> None:
        for index, owner in enumerate(self._slot_owner):
            if owner == run_id:
                self._slot_owner[index] = None
        sampler = self._samplers.pop(run_id, None)
        if sampler is not None:
            sampler.stop()

    # -- hooks -------------------------------------------------------------------------------
    def _start(self, spec: RunSpec) -> RunHandle:
        if spec.n_gpus > self.gpus_per_probe:
            raise LauncherError(
                f"a probe's n_gpus must be <= gpus_per_probe ({self.gpus_per_probe}), but got {spec.n_gpus}. "
                "Raise gpus_per_probe or lower the probe's GPU count."
            )
        run_dir = self._files(spec.run_id)
        old = proc_mod.read_record(run_dir.path)
        if old is not None and proc_mod.is_alive(old):
            raise LauncherError(
                f"run {spec.run_id!r} must not be running already, but pid {old.pid} still is. "
                "Re-attach to it, or cancel it first."
            )
        slot = self._take_slot(spec.run_id)
        if slot is None:
            raise NoCapacityError(
                f"a free GPU slot is needed to start {spec.run_id!r}, but all {self.max_concurrent} are busy. "
                "Wait until poll reports a run finished."
            )
        try:
            return self._launch(spec, run_dir, slot)
        except BaseException:
            self._release(spec.run_id)
            raise

    def _launch(self, spec: RunSpec, run_dir: RunDir, slot: int) -> RunHandle:
        gpus = self._slots[slot]
        if self._nvml:
            self._preflight(gpus)
        ray_dir = private_ray_dir(run_dir.path)
        pins = [
            *probe_pins(spec, run_dir),
            # A private Ray per probe: ray.init() would otherwise join any running cluster.
            "+ray_kwargs.ray_init.address=local",
            f"+ray_kwargs.ray_init._temp_dir={ray_dir}",
            f"trainer.n_gpus_per_node={self.gpus_per_probe}",
        ]
        memory = self._gpu_memory_bytes(gpus) if self.probes_per_gpu > 1 else None
        kv_pin = None if memory is None else shared_gpu_kv_pin(spec.overrides, memory)
        if kv_pin is not None:
            pins.append(kv_pin)
        overrides = merge_overrides(spec.overrides, pins)
        argv = [*self.command, *overrides]
        env = probe_environment(os.environ, self.extra_env, spec.env, self._probe_env(spec, run_dir.path))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so CUDA's numbering is NVML's
        # Ray's workers retitle themselves (``ray::IDLE``) with setproctitle, which by default
        # overwrites /proc/PID/environ too, and with it the run marker that finds them once
        # they have left the probe's process group; SPT_NOENV keeps the environment readable.
        env["SPT_NOENV"] = "1"
        started_at = self.clock()
        prepare_branch(spec.branch, run_dir)  # first: it may resume a checkpoint of this run's previous attempt
        run_dir.clear_outputs()
        run_dir.write_spec(
            spec,
            {
                "launcher": self.name,
                "argv": argv,
                "cuda_visible_devices": env["CUDA_VISIBLE_DEVICES"],
                "slot": slot,
                "ray_temp_dir": ray_dir,
                "started_at": started_at,
            },
        )
        _popen, record = proc_mod.spawn(
            argv,
            run_dir=run_dir.path,
            env=env,
            stdout_path=run_dir.stdout,
            stderr_path=run_dir.stderr,
            markers=(ray_dir,),
            # cwd stays the driver's: relative data/model paths in overrides mean what the user meant.
        )
        self._records[spec.run_id] = record
        if self._sample_gpus:
            sampler = gpu_mod.GpuSampler(run_dir.gpu_samples, gpus, clock=self.clock)
            sampler.start()
            self._samplers[spec.run_id] = sampler
        return RunHandle.in_dir(spec.run_id, self.name, run_dir.path, external_id=str(record.pid), started_at=started_at)

    def _preflight(self, gpus: Sequence[int]) -> None:
        """Refuse GPUs with too little free memory (docs/method.md §1: never start below 5 GB free)."""
        for reading in gpu_mod.read_gpus(gpus):
            free_gb = reading.mem_free_mb / 1024.0
            if free_gb < self.min_free_gpu_memory_gb:
                raise LauncherError(
                    f"GPU {reading.index} must have at least {self.min_free_gpu_memory_gb:g} GB free to start a probe, "
                    f"but has {free_gb:.1f} GB free. Free it (nvidia-smi shows who holds it) or lower min_free_gpu_memory_gb."
                )

    def _record(self, handle: RunHandle) -> proc_mod.ProcessRecord:
        record = self._records.get(handle.run_id) or proc_mod.read_record(handle.run_dir)
        if record is None:
            raise LauncherError(
                f"run {handle.run_id!r} must have a process.json in {handle.run_dir}, but it has none. "
                "The run directory was moved or deleted."
            )
        self._records[handle.run_id] = record
        return record

    def _poll(self, handle: RunHandle) -> RunState:
        record = self._record(handle)
        finished, code = proc_mod.exit_code(record)
        if not finished:
            return RunState(RunStatus.RUNNING)
        self._release(handle.run_id)
        # The leader is gone, but Ray's workers and raylet may not be (they can outlive
        # main_ppo): kill whatever still carries the run's marker.
        proc_mod.kill_tree(record, grace_s=self.kill_grace_s)
        proc_mod.forget_child(record.pid)
        self._remove_empty_ray_dir(handle.run_dir)
        if code == 0:
            return RunState(RunStatus.SUCCEEDED, exit_code=0)
        if code is None:
            return RunState(
                RunStatus.FAILED,
                message="exit code unknown: the probe was started by another driver; judge it by its metrics",
            )
        keep_worker_errors(handle.run_dir)
        tail = stderr_tail(handle.stderr_path)
        return RunState(RunStatus.FAILED, exit_code=code, message=f"exit code {code}: {tail}" if tail else f"exit code {code}")

    def _cancel(self, handle: RunHandle) -> None:
        record = self._record(handle)
        n = proc_mod.kill_tree(record, grace_s=self.kill_grace_s)
        logger.debug("cancelled %s (%d process(es))", handle.run_id, n)
        self._release(handle.run_id)
        proc_mod.forget_child(record.pid)

    def _reattach(self, run_id: str) -> RunHandle | None:
        run_dir = self.root_dir / run_id
        record = proc_mod.read_record(run_dir)
        if record is None:
            return None
        spec = RunDir(run_dir).read_spec()
        self._records[run_id] = record
        if proc_mod.is_alive(record):
            slot = self._take_slot(run_id, preferred=spec.get("slot"))
            if slot is None:
                logger.warning("re-attached %s holds no slot: all are busy", run_id)
        return RunHandle.in_dir(run_id, self.name, run_dir, external_id=str(record.pid),
                                started_at=float(spec.get("started_at", 0.0)))

    # -- maintenance -------------------------------------------------------------------------
    def cleanup_leftover(self, run_dir: Path) -> None:
        """Kill the process tree a dead driver's run left (recorded in its run directory)."""
        record = proc_mod.read_record(run_dir) if run_dir.is_dir() else None
        if record is not None and (proc_mod.is_alive(record) or proc_mod.find_marked(record.markers)):
            logger.info("killing leftover run in %s", run_dir)
            proc_mod.kill_tree(record, grace_s=self.kill_grace_s)

    def kill_leftovers(self) -> list[str]:
        """Kill probe trees under ``root_dir`` that this launcher does not track (left by a
        driver that died); returns their run ids. A restarted driver calls it before starting."""
        active = {owner for owner in self._slot_owner if owner is not None}
        killed = []
        for path in sorted(self.root_dir.glob(f"*/{proc_mod.PROCESS_FILE}")):
            run_id = path.parent.name
            if run_id in active:
                continue
            record = proc_mod.read_record(path.parent)
            if record is None:
                continue
            if proc_mod.is_alive(record) or proc_mod.find_marked(record.markers):
                proc_mod.kill_tree(record, grace_s=self.kill_grace_s)
                killed.append(run_id)
        return killed

    def close(self) -> None:
        for run_id in list(self._samplers):
            self._samplers.pop(run_id).stop()

    @staticmethod
    def _remove_empty_ray_dir(run_dir: Path) -> None:
        try:
            os.rmdir(private_ray_dir(run_dir))  # only if Ray never used it; logs are kept
        except OSError:
            pass
