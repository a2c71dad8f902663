"""A simulated probe's GPU time and start-up are its run's own simulated timeline (the start-up
the landscape models and its steps' ``timing_s/step``), not the simulator process's real
seconds × ``time_scale``; every other launcher keeps its clock's differences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_sweep.launchers.base import RunHandle, RunSpec, RunTime
from verl_sweep.launchers.local import LocalLauncher
from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.launchers.sim import SimLauncher
from verl_sweep.launchers.simulator import load_landscape, parse_overrides
from verl_sweep.objectives.metrics import STEP_TIME_KEY
from verl_sweep.objectives.probe import Probe, ProbeOutcome, ProbeSettings, ProbeState
from support.launcher_contract import SIMULATOR, failing_spec, ok_spec

pytestmark = pytest.mark.fast

#: simulated seconds per real second: the demo's; the simulator process's own start (~0.1 s
#: real) would be ~2,000 simulated seconds, many times a probe's modelled start-up and steps
SCALE = 20000.0


def _sim(root: Path) -> SimLauncher:
    return SimLauncher(root, max_concurrent=1, time_scale=SCALE, gpus_per_probe=2, command=SIMULATOR)


def _follow(probe: Probe, *, stop_at_step: int | None = None) -> ProbeOutcome:
    probe.start()
    for _ in range(100_000):
        outcome = probe.poll()
        if outcome is not None:
            return outcome
        if stop_at_step is not None and probe.follower is not None and probe.follower.last_step >= stop_at_step:
            return probe.stop(ProbeState.PRUNED, "pruned")
        probe.launcher.wait(probe.launcher.poll_interval_s)
    raise AssertionError("the probe never ended")


def _modelled(handle: RunHandle, last_step: int) -> tuple[float, float]:
    """The run's modelled start-up and the ``timing_s/step`` of its steps up to ``last_step``."""
    argv = json.loads(RunDir(handle.run_dir).spec.read_text())["argv"]
    config = parse_overrides(argv[len(SIMULATOR):])
    startup = load_landscape("default").expected(config).startup_s
    rows = [json.loads(line) for line in handle.metrics_path.read_text().splitlines()]
    return startup, sum(r["data"][STEP_TIME_KEY] for r in rows if 1 <= r["step"] <= last_step)


@pytest.mark.parametrize("stop_at_step", [None, 3])
def test_a_simulated_probe_holds_its_modelled_startup_and_steps(tmp_path: Path, stop_at_step: int | None) -> None:
    launcher = _sim(tmp_path)
    probe = Probe(launcher, ok_spec("timed", steps=1000), ProbeSettings(steps=6, n_gpus=2, health_screen=False))
    outcome = _follow(probe, stop_at_step=stop_at_step)
    assert probe.handle is not None and outcome.last_step >= (stop_at_step or 6)
    startup, steps_s = _modelled(probe.handle, outcome.last_step)
    assert 0 < startup < 1000 and steps_s > 0
    assert outcome.startup_s == pytest.approx(startup, rel=1e-6)
    assert outcome.gpu_time_s == pytest.approx((startup + steps_s) * 2, rel=0.02)


def test_a_probe_that_failed_part_way_holds_the_failing_steps_modelled_part(tmp_path: Path) -> None:
    launcher = _sim(tmp_path)
    spec = RunSpec(run_id="oom", n_gpus=2, overrides=(*ok_spec("oom").overrides,
                                                      "actor_rollout_ref.rollout.max_num_batched_tokens=200000"))
    outcome = _follow(Probe(launcher, spec, ProbeSettings(steps=6, n_gpus=2)))
    assert outcome.state is ProbeState.FAILED and outcome.last_step == 0
    assert outcome.startup_s is None  # it reached no step
    events = [json.loads(line) for line in RunDir(tmp_path / "oom").sim_clock.read_text().splitlines()]
    assert [e["step"] for e in events] == [0, 0]  # the start-up, then 0.3 of step 1
    assert outcome.gpu_time_s == pytest.approx(events[-1]["s"] * 2)
    assert events[0]["s"] < events[-1]["s"] < events[0]["s"] + 1000


def test_a_run_without_a_timeline_holds_its_clock_difference(tmp_path: Path) -> None:
    launcher = _sim(tmp_path)
    outcome = _follow(Probe(launcher, failing_spec("config-error"), ProbeSettings(steps=6, n_gpus=2)))
    assert outcome.state is ProbeState.FAILED
    assert not RunDir(tmp_path / "config-error").sim_clock.exists()
    assert outcome.gpu_time_s > 0  # the process's real seconds × the scale, × GPUs


def _handle_with_timeline(root: Path, lines: list[str]) -> RunHandle:
    run_dir = RunDir.make(root, "crafted")
    run_dir.sim_clock.write_text("".join(line + "\n" for line in lines))
    return RunHandle.in_dir("crafted", "sim", run_dir.path)


def test_sim_run_time_reads_the_timeline_to_the_last_read_step(tmp_path: Path) -> None:
    handle = _handle_with_timeline(tmp_path, [
        '{"step": 0, "s": 120.0}', '{"step": 1, "s": 270.0}', '{"step": 2, "s": 420.0}',
        '{"step": 2, "s": 465.0}',  # a failing step's modelled part
        '{"step": 3, "s": 5',  # torn by the process's end
    ])  # fmt: skip
    launcher = _sim(tmp_path / "runs")
    times = {step: launcher.run_time(handle, started_at=1000.0, ended_at=9000.0, first_step_at=4000.0, last_step=step)
             for step in (1, 2, 5)}  # fmt: skip
    assert times == {1: RunTime(held_s=270.0, startup_s=120.0), 2: RunTime(held_s=465.0, startup_s=120.0),
                     5: RunTime(held_s=465.0, startup_s=120.0)}
    no_step = launcher.run_time(handle, started_at=1000.0, ended_at=9000.0, first_step_at=None, last_step=0)
    assert no_step == RunTime(held_s=120.0, startup_s=None)


def test_other_launchers_hold_their_clock_difference_even_beside_a_timeline(tmp_path: Path) -> None:
    handle = _handle_with_timeline(tmp_path, ['{"step": 0, "s": 120.0}', '{"step": 1, "s": 270.0}'])
    local = LocalLauncher(tmp_path / "runs", gpu_ids=[0, 1], gpus_per_probe=2)
    assert local.run_time(handle, started_at=1000.0, ended_at=9000.0, first_step_at=4000.0, last_step=1) == \
        RunTime(held_s=8000.0, startup_s=3000.0)
    bare = _handle_with_timeline(tmp_path / "bare", [])
    assert _sim(tmp_path / "sim").run_time(bare, started_at=1000.0, ended_at=9000.0, first_step_at=None, last_step=0) == \
        RunTime(held_s=8000.0, startup_s=None)
