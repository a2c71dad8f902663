"""Branch runs (``RunSpec.branch``): a run that resumes its own copy of a verl checkpoint and saves
its own, through the sim launcher (the simulator process) and the replay launcher (the same model
in-process), as docs/verl-resume.md describes verl 0.9.1 doing it."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from support.launcher_contract import BASE, SIMULATOR
from verl_sweep.launchers.base import Branch, Launcher, LauncherError, RunHandle, RunSpec, RunState, RunStatus
from verl_sweep.launchers.ray_jobs import RayJobLauncher
from verl_sweep.launchers.replay import ReplayLauncher
from verl_sweep.launchers.run_dir import RunDir, probe_pins
from verl_sweep.launchers.sim import SimLauncher
from verl_sweep.launchers.simulator import load_landscape, parse_overrides

pytestmark = pytest.mark.fast

K = 2  # the incumbent's save_every
OLD_LR, NEW_LR = 1e-6, 3e-6  # verl's default actor lr; the branches'
LR_KEY = "actor_rollout_ref.actor.optim.lr"
STATE = "actor/sim_state_world_size_2_rank_0.json"  # 2 fake GPUs a probe, one node


def _sim(root: Path, gpus_per_probe: int = 2) -> SimLauncher:
    return SimLauncher(root, max_concurrent=1, time_scale=20000.0, gpus_per_probe=gpus_per_probe, command=SIMULATOR)


def _replay(root: Path, gpus_per_probe: int = 2) -> ReplayLauncher:
    # startup_s=None: the landscape's start-up, which the simulator process sleeps too
    return ReplayLauncher(root, max_concurrent=1, gpus_per_probe=gpus_per_probe, startup_s=None)


LAUNCHERS: dict[str, Callable[..., Launcher]] = {"sim": _sim, "replay": _replay}


def _spec(run_id: str, steps: int, branch: Branch | None, *extra: str) -> RunSpec:
    return RunSpec(run_id, (*BASE, f"trainer.total_training_steps={steps}", *extra), n_gpus=2, branch=branch)


def _finish(launcher: Launcher, handle: RunHandle) -> RunState:
    deadline = time.monotonic() + 60
    while not (state := launcher.poll(handle)).status.is_finished:
        assert time.monotonic() < deadline, f"{handle.run_id} never ended"
        launcher.wait(launcher.poll_interval_s)
    return state


def _run(launcher: Launcher, spec: RunSpec) -> RunHandle:
    handle = launcher.start(spec)
    state = _finish(launcher, handle)
    assert state.status is RunStatus.SUCCEEDED, (state, handle.stderr_path.read_text())
    return handle


def _rows(handle: RunHandle) -> dict[int, dict[str, Any]]:
    return {r["step"]: r["data"] for r in map(json.loads, handle.metrics_path.read_text().splitlines())}


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(scope="module", params=sorted(LAUNCHERS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def incumbent(kind: str, tmp_path_factory: pytest.TempPathFactory) -> RunHandle:
    """A run of 4 steps from scratch that saves every K = 2 steps: the chain's first run."""
    launcher = LAUNCHERS[kind](tmp_path_factory.mktemp(f"incumbent-{kind}"))
    return _run(launcher, _spec("inc", 2 * K, Branch(None, save_every=K)))


def test_a_branch_from_scratch_saves_every_k_steps_into_its_run_dir(incumbent: RunHandle) -> None:
    files = incumbent.files
    assert _listing(files.checkpoints) == ["global_step_2", "global_step_4", "latest_checkpointed_iteration.txt"]
    assert list(_rows(incumbent)) == [1, 2, 3, 4]
    state = json.loads((files.step_dir(K) / STATE).read_text())
    assert state["global_step"] == K and state["lr_scheduler"]["base_lrs"] == [OLD_LR]
    assert files.read_spec()["branch"] == {"resume_from": None, "save_every": K, "lr": None}
    assert not files.resume.exists()  # nothing to resume


def _modelled(handle: RunHandle) -> tuple[float, float]:
    """The run's modelled start-up and checkpoint load, from the config its launcher ran."""
    argv = handle.files.read_spec()["argv"]
    config = parse_overrides(argv[len(SIMULATOR):] if handle.launcher == "sim" else argv)
    land = load_landscape("default")
    return land.expected(config).startup_s, land.checkpoint_s(config)


def _held_s(launcher: Launcher, handle: RunHandle, last_step: int) -> float:
    """The seconds the run held its GPUs, as its launcher charges them: the replay's slot
    occupancy; the sim launcher's ``run_time`` (checked against its start-up too)."""
    if isinstance(launcher, ReplayLauncher):
        usage = next(u for u in launcher.usage() if u.run_id == handle.run_id)
        assert usage.gpu_s == pytest.approx((usage.ended_at - usage.started_at) * 2)
        return usage.ended_at - usage.started_at
    ran = launcher.run_time(handle, started_at=0.0, ended_at=1e9, first_step_at=0.0, last_step=last_step)
    startup_s, load_s = _modelled(handle)
    assert ran.startup_s == pytest.approx(startup_s + load_s, rel=1e-9)  # up to its first step
    return ran.held_s


def test_a_branch_with_lr_resumes_at_k_plus_1_trains_at_its_lr_and_holds_only_its_own_seconds(
    kind: str, incumbent: RunHandle, tmp_path: Path
) -> None:
    launcher = LAUNCHERS[kind](tmp_path)
    source = incumbent.files.step_dir(K)
    handle = _run(launcher, _spec("b", 3 * K, Branch(str(source), save_every=K, lr=NEW_LR)))
    rows = _rows(handle)
    assert list(rows) == [3, 4, 5, 6]  # the checkpoint's step + 1 on
    assert {step: row["actor/lr"] for step, row in rows.items()} == dict.fromkeys(rows, NEW_LR)
    files = handle.files
    assert _listing(files.checkpoints) == ["global_step_4", "global_step_6", "latest_checkpointed_iteration.txt"]
    assert _listing(files.resume) == ["global_step_2", "latest_checkpointed_iteration.txt"]
    assert json.loads((files.resume_step_dir(str(source)) / STATE).read_text())["lr_scheduler"]["base_lrs"] == [NEW_LR]
    assert json.loads((source / STATE).read_text())["lr_scheduler"]["base_lrs"] == [OLD_LR]  # a copy was rewritten
    assert files.read_spec()["branch"] == {"resume_from": str(source), "save_every": K, "lr": NEW_LR}
    # Its GPU time: its own start-up, checkpoint load and steps, never the incumbent's seconds
    # (the checkpoint's elapsed_s, where the resumed model's clock carries on).
    startup_s, load_s = _modelled(handle)
    steps_s = sum(row["timing_s/step"] for row in rows.values())
    held_s = _held_s(launcher, handle, last_step=6)
    assert load_s > 0 and held_s == pytest.approx(startup_s + load_s + steps_s, rel=1e-9)
    saved = json.loads((files.step_dir(6) / STATE).read_text())["simulator"]["elapsed_s"]
    assert saved == pytest.approx(json.loads((source / STATE).read_text())["simulator"]["elapsed_s"] + held_s, rel=1e-9)


def test_a_branch_without_lr_trains_at_the_checkpoints_lr_whatever_its_config(
    kind: str, incumbent: RunHandle, tmp_path: Path
) -> None:
    launcher = LAUNCHERS[kind](tmp_path)
    branch = Branch(str(incumbent.files.step_dir(K)), save_every=K)
    rows = _rows(_run(launcher, _spec("c", 2 * K, branch, f"{LR_KEY}={NEW_LR}")))
    assert list(rows) == [3, 4]
    assert {row["actor/lr"] for row in rows.values()} == {OLD_LR}  # the checkpoint's: docs/verl-resume.md §2


def test_a_restarted_attempt_replaces_the_previous_copy_and_outputs(
    kind: str, incumbent: RunHandle, tmp_path: Path
) -> None:
    launcher = LAUNCHERS[kind](tmp_path)
    source = str(incumbent.files.step_dir(K))
    first = _run(launcher, _spec("again", 3 * K, Branch(source, save_every=K)))
    assert _listing(first.files.checkpoints) == ["global_step_4", "global_step_6", "latest_checkpointed_iteration.txt"]
    second = _run(launcher, _spec("again", 2 * K, Branch(source, save_every=K, lr=NEW_LR)))
    assert _listing(second.files.checkpoints) == ["global_step_4", "latest_checkpointed_iteration.txt"]
    assert {row["actor/lr"] for row in _rows(second).values()} == {NEW_LR}
    # An attempt may resume what the previous attempt of its run saved: copied before it is cleared.
    third = _run(launcher, _spec("again", 3 * K, Branch(str(second.files.step_dir(2 * K)), save_every=K)))
    assert list(_rows(third)) == [5, 6]
    assert _listing(third.files.checkpoints) == ["global_step_6", "latest_checkpointed_iteration.txt"]


def _missing(source: Path, tmp_path: Path) -> Path:
    return source.parent / "global_step_99"


def _corrupt(source: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "bad" / source.name
    shutil.copytree(source, copy)
    (copy / STATE).write_text('{"format": "verl-sweep simulated checkpoint 1", "optimizer": ')
    return copy


def _misnamed(source: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "step_2"
    shutil.copytree(source, copy)
    return copy


@pytest.mark.parametrize(("make", "what", "named"), [
    (_missing, r"A verl checkpoint folder must exist, but {} is not a directory", "folder"),
    (_corrupt, r"A branch's checkpoint must load, but {} does not \(RuntimeError: .* is not a readable simulated "
               r"verl checkpoint: Expecting value", "file"),
    (_misnamed, r"A verl checkpoint folder must be named global_step_N .*, but got {}\.", "folder"),
], ids=["missing", "corrupt", "misnamed"])  # fmt: skip
@pytest.mark.parametrize("lr", [None, NEW_LR])
def test_an_unusable_checkpoint_fails_the_start_in_one_line_naming_it(
    kind: str, incumbent: RunHandle, tmp_path: Path, make: Callable[[Path, Path], Path], what: str, named: str,
    lr: float | None,
) -> None:
    launcher = LAUNCHERS[kind](tmp_path / "runs")
    source = make(incumbent.files.step_dir(K), tmp_path)
    with pytest.raises(LauncherError, match="^" + what.format(re.escape(str(source)))) as info:
        launcher.start(_spec("bad", 2 * K, Branch(str(source), save_every=K, lr=lr)))
    message = str(info.value)
    assert "\n" not in message
    assert str(source / STATE if named == "file" else source) in message
    assert launcher.free_slots() == 1  # the failed start holds no slot
    assert not RunDir(tmp_path / "runs" / "bad").resume.exists()  # no copy left behind


def test_a_checkpoint_of_another_gpu_count_fails_with_verls_error_in_both_launchers(
    incumbent: RunHandle, tmp_path: Path
) -> None:
    """The copy is made (the state loads), but a run on 4 GPUs looks for the world-size-4 file,
    as verl does: the simulator process and the replay write the same error line."""
    lines = {}
    for kind, make in LAUNCHERS.items():
        launcher = make(tmp_path / kind, gpus_per_probe=4)
        handle = launcher.start(_spec("wide", 2 * K, Branch(str(incumbent.files.step_dir(K)), save_every=K)))
        state = _finish(launcher, handle)
        assert state.status is RunStatus.FAILED and state.exit_code == 1
        last = handle.stderr_path.read_text().splitlines()[-1]
        lines[kind] = last.split(") ", 1)[1].replace(str(tmp_path / kind), "<root>")
        assert not handle.metrics_path.exists() or not handle.metrics_path.read_text()
    missing = "<root>/wide/resume/global_step_2/actor/sim_state_world_size_4_rank_0.json"
    assert lines == dict.fromkeys(LAUNCHERS, f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'")


def test_the_pins_of_a_branch(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "b")
    common = [
        "trainer.experiment_name=b",
        f"hydra.run.dir={run_dir.path}/hydra",
        "trainer.logger=[console,file]",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={run_dir.path}/metrics.jsonl",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR={run_dir.path}/tensorboard",
    ]

    def pins(branch: Branch | None) -> list[str]:
        return probe_pins(RunSpec("b", BASE, branch=branch), run_dir)

    assert pins(Branch("/ck/inc/checkpoints/global_step_4", save_every=3, lr=NEW_LR)) == [
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={run_dir.path}/resume/global_step_4",  # its own copy
        "trainer.val_before_train=false",
        "trainer.save_freq=3",
        f"trainer.default_local_dir={run_dir.path}/checkpoints",
        *common,
    ]
    assert pins(Branch(None, save_every=5)) == [
        "trainer.resume_mode=disable",
        "trainer.val_before_train=false",
        "trainer.save_freq=5",
        f"trainer.default_local_dir={run_dir.path}/checkpoints",
        *common,
    ]
    assert pins(None) == [
        "trainer.resume_mode=disable", "trainer.val_before_train=false", "trainer.save_freq=-1", *common]
    assert run_dir.step_dir(6) == run_dir.path / "checkpoints" / "global_step_6"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"resume_from": None, "save_every": 0}, r"^a branch's save_every must be an integer >= 1, but got 0\."),
    ({"resume_from": None, "save_every": True}, r"^a branch's save_every must be an integer >= 1, but got True\."),
    ({"resume_from": None, "save_every": 2, "lr": 0.0}, r"^a branch's lr must be > 0, but got 0\.0\."),
    ({"resume_from": "a\nb/global_step_1", "save_every": 2}, r"^a branch's resume_from must be one line"),
])  # fmt: skip
def test_a_branch_checks_its_fields(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(LauncherError, match=match):
        Branch(**kwargs)


def test_the_ray_launcher_refuses_a_branch_in_one_line(tmp_path: Path) -> None:
    launcher = RayJobLauncher(tmp_path, address="http://127.0.0.1:1", max_concurrent=1)  # never reached
    with pytest.raises(LauncherError, match=r"^a branch run \('b'\) needs a launcher on the machine that holds its "
                                            r"checkpoints, .* Use the local or sim launcher for branches, for now\.$"):
        launcher.start(_spec("b", 2, Branch(None, save_every=1)))
