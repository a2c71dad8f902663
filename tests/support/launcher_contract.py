"""One behavioural contract for every launcher (like Hydra's LauncherTestSuite).

A test module subclasses ``LauncherContract`` (``LocalGpuLauncherContract`` for a launcher
that hands each probe its own local GPUs) and provides a ``kit`` fixture returning a
``ContractKit``: how to make the launcher (with two slots) over a root dir, and what kind of
capacity it has. The probes are real processes (the verl simulator, or a stand-in), so every
test can fail for real reasons.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from support import REPO

from verl_sweep.launchers.base import Launcher, NoCapacityError, RunHandle, RunSpec, RunState, RunStatus
from verl_sweep.launchers.process import find_marked

FAKE_PROBE = [sys.executable, str(REPO / "tests" / "support" / "fake_probe.py")]
SIMULATOR = [sys.executable, "-m", "verl_sweep.launchers.simulator"]


def simulator_available() -> bool:
    return (REPO / "launchers" / "simulator" / "__main__.py").exists()


def probe_command() -> list[str]:
    """The verl simulator when it is there, else the stand-in probe."""
    return list(SIMULATOR) if simulator_available() else list(FAKE_PROBE)


# Overrides valid for verl's config (and so for the simulator), with a small run length.
BASE = ("actor_rollout_ref.rollout.name=vllm", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4")


def ok_spec(run_id: str, steps: int = 3) -> RunSpec:
    return RunSpec(run_id=run_id, overrides=(*BASE, f"trainer.total_training_steps={steps}"), n_gpus=2)


def long_spec(run_id: str) -> RunSpec:
    return ok_spec(run_id, steps=1_000_000)


def failing_spec(run_id: str) -> RunSpec:
    # rollout.name=hf is gone since verl 0.8: a config error, exit 1 before any step.
    overrides = tuple(o for o in BASE if "rollout.name" not in o) + ("actor_rollout_ref.rollout.name=hf",)
    return RunSpec(run_id=run_id, overrides=(*overrides, "trainer.total_training_steps=3"), n_gpus=2)


@dataclasses.dataclass
class ContractKit:
    make: Callable[[Path], Launcher]  # a launcher with exactly 2 slots over the given root
    queues: bool = False  # True: a third start is accepted and stays PENDING (Ray)
    timeout_s: float = 60.0


def wait_for(
    launcher: Launcher, handle: RunHandle, predicate: Callable[[RunState], bool], timeout_s: float
) -> tuple[RunState, set[RunStatus]]:
    """Poll until ``predicate(state)``; returns the state and every status seen on the way."""
    seen: set[RunStatus] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        state = launcher.poll(handle)
        seen.add(state.status)
        if predicate(state):
            return state, seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{handle.run_id}: still {state} after {timeout_s} s (seen {seen})")
        time.sleep(0.05)


def finished(state: RunState) -> bool:
    return state.status.is_finished


def running_with_metrics(handle: RunHandle) -> Callable[[RunState], bool]:
    def check(state: RunState) -> bool:
        assert not state.status.is_finished, f"{handle.run_id} ended early: {state}"
        return state.status is RunStatus.RUNNING and handle.metrics_path.exists() and handle.metrics_path.stat().st_size > 0

    return check


def leftovers(handle: RunHandle) -> list[psutil.Process]:
    """Live processes whose command line or environment names this run's directory."""
    marker = str(handle.run_dir) + "/"  # trailing slash: run-1 must not match run-10
    return find_marked([marker, str(handle.run_dir)])


def metric_steps(handle: RunHandle) -> list[int]:
    lines = handle.metrics_path.read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


def leader_env(handle: RunHandle) -> dict[str, str]:
    return psutil.Process(int(handle.external_id)).environ()


class LauncherContract:
    """The contract every launcher meets. Subclasses provide the ``kit`` fixture."""

    def test_start_runs_to_success_with_metrics(self, kit: ContractKit, tmp_path: Path) -> None:
        launcher = kit.make(tmp_path)
        handle = launcher.start(ok_spec("ok-run", steps=3))
        assert handle.run_id == "ok-run"
        assert (handle.run_dir / "spec.json").exists()
        state, seen = wait_for(launcher, handle, finished, kit.timeout_s)
        assert state.status is RunStatus.SUCCEEDED, state
        assert state.exit_code == 0
        assert RunStatus.RUNNING in seen
        assert metric_steps(handle)[-1] == 3
        assert launcher.poll(handle) == state  # final states stay final

    def test_failing_command_reports_exit_code_and_stderr(self, kit: ContractKit, tmp_path: Path) -> None:
        launcher = kit.make(tmp_path)
        handle = launcher.start(failing_spec("bad-run"))
        state, _ = wait_for(launcher, handle, finished, kit.timeout_s)
        assert state.status is RunStatus.FAILED, state
        assert state.exit_code == 1
        assert "Error executing job with overrides" in handle.stderr_path.read_text()
        assert state.message

    def test_cancel_kills_every_process(self, kit: ContractKit, tmp_path: Path) -> None:
        launcher = kit.make(tmp_path)
        handle = launcher.start(long_spec("long-run"))
        wait_for(launcher, handle, running_with_metrics(handle), kit.timeout_s)
        assert leftovers(handle), "the probe's processes must be findable while it runs"
        launcher.cancel(handle)
        assert launcher.poll(handle).status is RunStatus.CANCELLED
        deadline = time.monotonic() + 10.0
        while leftovers(handle) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers(handle) == []
        launcher.cancel(handle)  # idempotent
        assert launcher.free_slots() == launcher.max_concurrent

    def test_two_run_third_waits_and_freed_slot_is_reused(self, kit: ContractKit, tmp_path: Path) -> None:
        launcher = kit.make(tmp_path)
        assert launcher.max_concurrent == 2
        a = launcher.start(long_spec("cap-a"))
        b = launcher.start(long_spec("cap-b"))
        for h in (a, b):
            wait_for(launcher, h, running_with_metrics(h), kit.timeout_s)
        assert launcher.free_slots() == 0
        if kit.queues:
            c = launcher.start(long_spec("cap-c"))
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                assert launcher.poll(c).status is RunStatus.PENDING
                time.sleep(0.2)
            launcher.cancel(a)
            wait_for(launcher, c, lambda s: s.status is RunStatus.RUNNING, kit.timeout_s)
        else:
            with pytest.raises(NoCapacityError, match="a free GPU slot is needed"):
                launcher.start(long_spec("cap-c"))
            gpus_a = leader_env(a)["CUDA_VISIBLE_DEVICES"]
            launcher.cancel(a)
            assert launcher.free_slots() == 1
            c = launcher.start(long_spec("cap-c"))
            wait_for(launcher, c, running_with_metrics(c), kit.timeout_s)
            assert leader_env(c)["CUDA_VISIBLE_DEVICES"] == gpus_a  # the freed slot, reused
        for h in (b, c):
            launcher.cancel(h)
        assert all(leftovers(h) == [] for h in (a, b, c))

    def test_slot_frees_when_poll_sees_exit(self, kit: ContractKit, tmp_path: Path) -> None:
        launcher = kit.make(tmp_path)
        handles = [launcher.start(ok_spec(f"quick-{i}")) for i in range(2)]
        for h in handles:
            assert wait_for(launcher, h, finished, kit.timeout_s)[0].status is RunStatus.SUCCEEDED
        assert launcher.free_slots() == 2
        more = [launcher.start(ok_spec(f"quick-{i}")) for i in range(2, 4)]
        for h in more:
            assert wait_for(launcher, h, finished, kit.timeout_s)[0].status is RunStatus.SUCCEEDED

    def test_reattach_after_launcher_is_thrown_away(self, kit: ContractKit, tmp_path: Path) -> None:
        first = kit.make(tmp_path)
        spec = ok_spec("again-run", steps=12)
        handle = first.start(spec)
        wait_for(first, handle, running_with_metrics(handle), kit.timeout_s)
        del first
        second = kit.make(tmp_path)
        assert second.reattach("never-started") is None
        again = second.reattach("again-run")
        assert again is not None
        assert again.metrics_path == handle.metrics_path
        assert again.external_id == handle.external_id  # the same process / job, not a new one
        state, _ = wait_for(second, again, finished, kit.timeout_s)
        assert state.status is RunStatus.SUCCEEDED, state
        assert metric_steps(again) == list(range(1, 13))  # one run, not a rerun
        assert second.free_slots() == 2


class LocalGpuLauncherContract(LauncherContract):
    """The contract, plus what a launcher whose probes are local processes promises: each gets
    GPUs of its own through CUDA_VISIBLE_DEVICES. (Ray's launcher leaves GPUs to the cluster and
    the replay launcher's are simulated: they subclass LauncherContract, with no such test
    rather than one that skips.)"""

    def test_each_probe_gets_its_own_gpus(self, kit: ContractKit, tmp_path: Path) -> None:
        launcher = kit.make(tmp_path)
        handles = [launcher.start(long_spec(f"gpu-{i}")) for i in range(2)]
        seen = []
        for h in handles:
            wait_for(launcher, h, running_with_metrics(h), kit.timeout_s)
            seen.append(leader_env(h)["CUDA_VISIBLE_DEVICES"].split(","))
            assert json.loads((h.run_dir / "spec.json").read_text())["cuda_visible_devices"] == ",".join(seen[-1])
        assert all(len(ids) == len(seen[0]) > 0 for ids in seen)
        assert not set(seen[0]) & set(seen[1])
        for h in handles:
            launcher.cancel(h)
