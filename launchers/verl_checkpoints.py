"""verl 0.9.1's checkpoint folders on disk: a branch's own copy of one (docs/verl-resume.md).

A run resumed from ``global_step_N`` (``trainer.resume_mode=resume_path``) takes its lr from the
checkpoint's optimizer param groups and lr-scheduler state, not from its config (docs/verl-resume.md
§2). A branch that changes the lr therefore resumes from its own copy with those rewritten; every
other file of the copy is a hard link to the incumbent's, which verl only reads.

The launchers that run on this machine's files (local, sim, replay) make a branch run's copy
with :func:`prepare_branch`, for verl's shards and for the simulator's state files alike.
Torch is imported only while a copy's files are rewritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

from verl_sweep.launchers.base import Branch, LauncherError
from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.launchers.simulator import checkpoints as sim_checkpoints

#: verl's tracker beside the step folders (``trainer_base.py`` writes it after a save)
TRACKER = "latest_checkpointed_iteration.txt"
OPTIMIZER_SHARDS = "optim_world_size_*_rank_*.pt"
EXTRA_STATE_SHARDS = "extra_state_world_size_*_rank_*.pt"
_STEP_DIR = re.compile(r"global_step_(\d+)")
_SHARD = re.compile(r"(model|optim|extra_state)_world_size_\d+_rank_\d+\.pt")


class VerlCheckpointError(LauncherError):
    """A verl checkpoint that cannot be branched; the one-line message names the file and what to do."""


@dataclasses.dataclass(frozen=True)
class BranchedCheckpoint:
    """A branch's copy: ``step_dir`` is its ``trainer.resume_from_path``; the byte counts let a
    caller charge the copy's time (linked bytes cost no I/O)."""

    step_dir: Path
    n_bytes_copied: int
    n_bytes_linked: int


def branch_checkpoint(src_step_dir: Path | str, dst_dir: Path | str, *, lr: float | None = None) -> BranchedCheckpoint:
    """Make ``dst_dir/global_step_N``, a branch's copy of verl's ``src_step_dir``, and
    ``dst_dir/latest_checkpointed_iteration.txt``.

    Every file is hard-linked (copied where links fail), except, with ``lr`` given, the actor's
    optimizer and extra-state shards: those are loaded, rewritten so that the resumed run trains
    at ``lr`` from its first step (each param group's ``lr`` scaled by ``lr / initial_lr`` and
    ``initial_lr = lr``; the scheduler's ``_last_lr`` scaled by ``lr / base_lr`` and
    ``base_lrs = lr``) and saved as new files. The Adam moments and step counts, the scheduler's
    ``last_epoch`` and the RNG stay as saved. Rewritten files are unpickled as verl loads them
    (``weights_only=False``): branch only checkpoints you trust.

    Raises :class:`VerlCheckpointError` for a folder not named ``global_step_N``, one with no
    actor shards (or, with ``lr``, no optimizer or extra-state shards), a shard torch cannot
    load, a state without the fields the rewrite needs, or a ``dst_dir/global_step_N`` that
    already exists; ``ValueError`` for ``lr <= 0``. Nothing is left behind on failure.
    """
    if lr is not None and not lr > 0:
        raise ValueError(f"lr must be > 0, but got {lr}. Pass the branch's actor_rollout_ref.actor.optim.lr.")
    src = Path(src_step_dir)
    step = _step(src)
    actor = src / "actor"
    if not actor.is_dir() or not any(_SHARD.fullmatch(p.name) for p in actor.iterdir()):
        raise VerlCheckpointError(f"A verl checkpoint must hold actor/model_world_size_W_rank_R.pt shards, but {actor} "
                                  f"has none. Branch from a step whose save finished.")
    rewritten = {} if lr is None else {
        path: rewrite for pattern, rewrite in _REWRITES.items() for path in _shards(actor, pattern)}
    dst_root = Path(dst_dir)
    dst = dst_root / src.name
    if dst.exists():
        raise VerlCheckpointError(f"A branch's checkpoint folder must not exist yet, but {dst} does. "
                                  f"Give each branch its own dst_dir.")
    n_copied = n_linked = 0
    with _partial(dst_root, src.name) as partial:
        for path in sorted(src.rglob("*")):
            target = partial / path.relative_to(src)
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if lr is not None and path in rewritten:
                _rewrite(path, target, *rewritten[path], lr=lr)
                n_copied += target.stat().st_size
                continue
            try:
                os.link(path, target)
                n_linked += target.stat().st_size
            except OSError:  # another filesystem, or one without hard links
                shutil.copy2(path, target)
                n_copied += target.stat().st_size
    (dst_root / TRACKER).write_text(str(step))
    return BranchedCheckpoint(dst, n_bytes_copied=n_copied, n_bytes_linked=n_linked)


def prepare_branch(branch: Branch | None, run_dir: RunDir) -> Path | None:
    """Make a branch run's own copy of the checkpoint it resumes, ``run_dir.resume_step_dir``
    (the folder its pins resume, ``run_dir.probe_pins``), and return it; None for a run that
    resumes nothing. Called by the launchers that run on this machine's files as they start a
    run; a previous attempt's copy is removed first.

    verl's shards: :func:`branch_checkpoint` (hard links, the lr rewritten in new files). The
    simulator's state files (``verl_sweep.launchers.simulator.checkpoints``): checked, copied (its
    ``rewrite_lr`` writes in place) and, with ``branch.lr``, rewritten. Raises
    :class:`VerlCheckpointError`, one line naming the path, for a folder that is missing, not
    named ``global_step_N``, or not a checkpoint that loads.
    """
    if branch is None or branch.resume_from is None:
        return None
    src = Path(branch.resume_from)
    step = _step(src)
    shutil.rmtree(run_dir.resume, ignore_errors=True)
    if not sim_checkpoints.is_simulated(src):
        return branch_checkpoint(src, run_dir.resume, lr=branch.lr).step_dir
    dst = run_dir.resume_step_dir(branch.resume_from)
    try:
        sim_checkpoints.check(src)
        with _partial(run_dir.resume, src.name) as partial:
            shutil.copytree(src, partial)
            if branch.lr is not None:
                sim_checkpoints.rewrite_lr(partial, branch.lr)
    except sim_checkpoints.CheckpointError as e:
        raise VerlCheckpointError(f"A branch's checkpoint must load, but {src} does not ({' '.join(str(e).split())}). "
                                  f"Branch from another step, or re-save this one.") from e
    (run_dir.resume / TRACKER).write_text(str(step))
    return dst


def _step(src: Path) -> int:
    """N of a checkpoint folder ``global_step_N`` that exists; VerlCheckpointError otherwise."""
    match = _STEP_DIR.fullmatch(src.name)
    if match is None:
        raise VerlCheckpointError(f"A verl checkpoint folder must be named global_step_N (verl reads N from the name), "
                                  f"but got {src}. Pass the global_step_N folder under trainer.default_local_dir.")
    if not src.is_dir():
        raise VerlCheckpointError(f"A verl checkpoint folder must exist, but {src} is not a directory. "
                                  f"Pass a global_step_N folder that verl saved.")
    return int(match.group(1))


@contextlib.contextmanager
def _partial(dst_root: Path, name: str) -> Iterator[Path]:
    """A folder that becomes ``dst_root/name`` when the block ends, and leaves nothing when it fails."""
    partial = dst_root / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield partial
        partial.rename(dst_root / name)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _shards(actor: Path, pattern: str) -> list[Path]:
    paths = sorted(actor.glob(pattern))
    if not paths:
        raise VerlCheckpointError(f"Setting a branch's lr needs actor/{pattern} in the checkpoint, but {actor} has "
                                  f"none. Branch without lr, or from a save whose checkpoint.save_contents has "
                                  f"optimizer and extra.")
    return paths


def _rewrite(path: Path, target: Path, change: Callable[[Any, float], None], needs: str, *, lr: float) -> None:
    """Load ``path``, apply ``change(state, lr)``, save it as the new file ``target``."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        why = " ".join(str(e).split())[:200]
        raise VerlCheckpointError(f"{path} must be a file torch can load, but loading failed ({type(e).__name__}: "
                                  f"{why}). Branch from another step, or re-save this one.") from e
    try:
        change(state, lr)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
        raise VerlCheckpointError(f"{path} must hold {needs}, but it does not ({type(e).__name__}: {e}). "
                                  f"Branch without lr, or from a checkpoint verl saved with its lr scheduler.") from e
    torch.save(state, target)


def _rewrite_optimizer(state: Any, lr: float) -> None:
    groups = state["param_groups"]
    if not groups:
        raise ValueError("no param groups")
    for group in groups:
        group["lr"] *= lr / group["initial_lr"]
        group["initial_lr"] = lr


def _rewrite_scheduler(state: Any, lr: float) -> None:
    scheduler = state["lr_scheduler"]
    base_lrs, last_lrs = scheduler["base_lrs"], scheduler["_last_lr"]
    if not base_lrs or len(base_lrs) != len(last_lrs):
        raise ValueError(f"base_lrs {base_lrs} and _last_lr {last_lrs} do not pair up")
    scheduler["_last_lr"] = [last * lr / base for last, base in zip(last_lrs, base_lrs)]
    scheduler["base_lrs"] = [lr] * len(base_lrs)


#: the shards a new lr rewrites: how, and what the rewrite needs each to hold
_REWRITES: dict[str, tuple[Callable[[Any, float], None], str]] = {
    OPTIMIZER_SHARDS: (_rewrite_optimizer, "an optimizer state whose param_groups carry lr and initial_lr"),
    EXTRA_STATE_SHARDS: (_rewrite_scheduler, "an lr_scheduler state with base_lrs and _last_lr"),
}
