"""verl 0.9.1's checkpoint folders, as the simulated verl saves and resumes them.

Layout (docs/verl-resume.md §1), under ``trainer.default_local_dir`` (verl's default
``checkpoints/${trainer.project_name}/${trainer.experiment_name}``, relative to the working
directory):

- ``global_step_N/actor/sim_state_world_size_W_rank_0.json``: the simulator's one state file
  where verl writes the model, optimizer and extra-state shards. Named by world size W
  (``n_gpus_per_node × nnodes``) as verl's shards are, so a branch on another GPU count finds
  no file, as in verl. It keeps verl's names: ``optimizer.param_groups`` (lr, initial_lr),
  ``lr_scheduler`` (base_lrs, last_epoch, _last_lr), ``data`` (the dataloader's position),
  and ``model.reward`` for the weights.
- ``latest_checkpointed_iteration.txt``: N, written after the folder (verl's tracker).

Resume (``trainer.resume_mode``): ``disable`` starts at step 1; ``auto`` (verl's default)
resumes the tracker's step if the tracker and its folder exist, else starts at step 1;
``resume_path`` resumes ``trainer.resume_from_path``, whose step N verl parses from the folder
name. What the branch then keeps and takes from its new config is :meth:`Landscape.simulate`'s
rule. A path verl cannot load fails with verl's error, one line (:class:`CheckpointError`).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from verl_sweep.launchers.simulator.config import get
from verl_sweep.launchers.simulator.outcomes import CheckpointState

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT = "verl-sweep simulated checkpoint 1"
#: every rank's state file of one checkpoint (``state_file`` names a world size's)
STATE_FILES = "sim_state_world_size_*_rank_*.json"


class CheckpointError(Exception):
    """A checkpoint verl would fail to resume from; the message is verl's error line."""


def checkpoint_root(config: Mapping[str, Any]) -> Path:
    """``trainer.default_local_dir`` with its ``${trainer.…}`` references resolved."""
    return Path(_resolve(config, str(get(config, "trainer.default_local_dir"))))


def state_file(step_dir: Path, config: Mapping[str, Any]) -> Path:
    world = int(get(config, "trainer.n_gpus_per_node")) * int(get(config, "trainer.nnodes"))
    return step_dir / "actor" / f"sim_state_world_size_{world}_rank_0.json"


def save(config: Mapping[str, Any], state: CheckpointState) -> Path:
    """Write ``state`` as ``global_step_N`` under the run's checkpoint root, then the tracker."""
    root = checkpoint_root(config)
    step_dir = root / f"global_step_{state.step}"
    path = state_file(step_dir, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_to_json(state), indent=1, default=str) + "\n")
    (root / TRACKER).write_text(str(state.step))
    return step_dir


def resume_from(config: Mapping[str, Any], *, say: Callable[[str], object] = lambda line: None) -> CheckpointState | None:
    """The checkpoint the run resumes from (None: it starts at step 1), chosen by
    ``trainer.resume_mode`` as verl chooses it; ``say`` gets the lines verl prints.
    Raises :class:`CheckpointError` where verl fails."""
    mode = get(config, "trainer.resume_mode")
    if mode == "disable":
        return None
    if mode == "auto":
        root = Path(os.path.abspath(checkpoint_root(config)))
        tracker = root / TRACKER
        if not tracker.exists():
            say(f"Checkpoint tracker file does not exist: {tracker}")
            return None
        text = tracker.read_text()
        try:
            step_dir = root / f"global_step_{int(text)}"
        except ValueError:
            raise CheckpointError(f"ValueError: invalid literal for int() with base 10: {text!r}") from None
        if not step_dir.exists():
            say(f"Checkpoint does not exist: {step_dir}")
            return None
        say(f"Found checkpoint: {step_dir}")
        folder = str(step_dir)
    elif mode == "resume_path":
        path = get(config, "trainer.resume_from_path")
        if not isinstance(path, str):
            raise CheckpointError("AssertionError: resume ckpt must be str type")
        if "global_step_" not in path:
            raise CheckpointError("AssertionError: resume ckpt must specify the global_steps")
        folder = os.path.join(os.getcwd(), _resolve(config, path))  # as given when absolute (verl's join)
    else:
        raise CheckpointError(f"UnboundLocalError: cannot access local variable 'global_step_folder' where it is not "
                              f"associated with a value (Unknown resume mode {mode})")  # fmt: skip
    tail = folder.split("global_step_")[-1]
    try:
        step = int(tail)  # verl takes N from the folder name, never from a file
    except ValueError:
        raise CheckpointError(f"ValueError: invalid literal for int() with base 10: {tail!r}") from None
    say(f"Resuming from {folder}, setting global step to {step}")
    return load(Path(folder), config, step=step)


def load(step_dir: Path, config: Mapping[str, Any], *, step: int) -> CheckpointState:
    """The state in ``step_dir`` as a run of ``config`` (its world size) loads it at ``step``."""
    path = state_file(step_dir, config)
    return _state(path, _read(path), step=step)


def check(step_dir: Path) -> None:
    """Raise :class:`CheckpointError` (verl's line) unless ``step_dir/actor`` holds state files
    and each loads, whatever the world size it was saved at."""
    for path in _state_files(step_dir):
        _state(path, _read(path), step=0)


def _state(path: Path, data: dict[str, Any], *, step: int) -> CheckpointState:
    try:
        if not data["optimizer"]["param_groups"]:
            raise ValueError("no optimizer param groups")
        scheduler, sim, reward = data["lr_scheduler"], data["simulator"], data["model"]["reward"]
        return CheckpointState(
            step=step,
            reward=math.nan if reward is None else float(reward),
            lr=float(scheduler["_last_lr"][0]),
            base_lr=float(scheduler["base_lrs"][0]),
            optimizer_steps=int(data["optimizer"]["step"]),
            samples_seen=int(data["data"]["samples_yielded"]),
            elapsed_s=float(sim["elapsed_s"]),
            diverging_since=None if sim["diverging_since"] is None else int(sim["diverging_since"]),
            config=dict(sim["config"]),
        )
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise _corrupt(path, f"missing or bad field {e}") from None


def rewrite_lr(step_dir: Path, lr: float) -> None:
    """Make a resumed run train at ``lr``: rewrite the checkpoint's optimizer param groups
    (lr scaled by new/initial, initial_lr = new) and scheduler (base_lrs = new, _last_lr scaled),
    as scripts/real_verl/check_branch_resume.sh does to a real checkpoint. Rewrite the branch's
    own copy (``shutil.copytree``): every state file in ``step_dir/actor`` changes."""
    if not lr > 0:
        raise ValueError(f"lr must be > 0, but got {lr}.")
    for path in _state_files(step_dir):
        data = _read(path)
        try:
            for group in data["optimizer"]["param_groups"]:
                group["lr"] *= lr / group["initial_lr"]
                group["initial_lr"] = lr
            s = data["lr_scheduler"]
            s["_last_lr"] = [last * lr / base for last, base in zip(s["_last_lr"], s["base_lrs"])]
            s["base_lrs"] = [lr] * len(s["base_lrs"])
        except (KeyError, TypeError, ZeroDivisionError) as e:
            raise _corrupt(path, f"missing or bad field {e}") from None
        path.write_text(json.dumps(data, indent=1) + "\n")


def is_simulated(step_dir: Path) -> bool:
    """Whether ``step_dir`` holds the simulator's state files rather than verl's shards."""
    return any((step_dir / "actor").glob(STATE_FILES))


def _state_files(step_dir: Path) -> list[Path]:
    paths = sorted((step_dir / "actor").glob(STATE_FILES))
    if not paths:
        raise CheckpointError(f"FileNotFoundError: [Errno 2] No such file or directory: '{step_dir / 'actor'}'")
    return paths


def _to_json(state: CheckpointState) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "global_step": state.step,  # for readers: verl reads N from the folder name
        "model": {"reward": state.reward if math.isfinite(state.reward) else None},
        "optimizer": {"param_groups": [{"lr": state.lr, "initial_lr": state.base_lr}], "step": state.optimizer_steps},
        "lr_scheduler": {"base_lrs": [state.base_lr], "last_epoch": state.step, "_last_lr": [state.lr]},
        "data": {"samples_yielded": state.samples_seen},
        "simulator": {"elapsed_s": state.elapsed_s, "diverging_since": state.diverging_since, "config": dict(state.config)},
    }


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"FileNotFoundError: [Errno 2] No such file or directory: '{path}'") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, str(e)) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _corrupt(path, f"its format is not {FORMAT!r}")
    return data


def _corrupt(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"RuntimeError: {path} is not a readable simulated verl checkpoint: {why}")


def _resolve(config: Mapping[str, Any], value: str) -> str:
    """OmegaConf's ``${key}`` references, resolved against the run's config."""
    return re.sub(r"\$\{([\w.]+)\}", lambda m: str(get(config, m.group(1))), value)
