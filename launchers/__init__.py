"""Launchers start verl probes and report their state; pick one by name with ``make_launcher``.

Importing this package never imports Ray, torch or verl (the Ray launcher imports Ray only
when it talks to a cluster).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_sweep.launchers.base import (
    Launcher,
    LauncherError,
    NoCapacityError,
    RunHandle,
    RunSpec,
    RunState,
    RunStatus,
)
from verl_sweep.launchers.local import LocalLauncher
from verl_sweep.launchers.ray_jobs import RayJobLauncher
from verl_sweep.launchers.sim import SimLauncher
from verl_sweep.launchers.replay import ReplayLauncher

#: every launcher, by its kind (its ``name``: the one place a kind is spelled), as a study
#: file's ``launcher.kind`` and ``--launcher`` name it
LAUNCHERS: dict[str, type[Launcher]] = {cls.name: cls for cls in (SimLauncher, LocalLauncher, RayJobLauncher,
                                                                  ReplayLauncher)}
#: the kind of a study file that names none: the simulator, which runs anywhere
DEFAULT_KIND = SimLauncher.name


def launcher_class(kind: str) -> type[Launcher]:
    """The launcher registered as ``kind``; LauncherError naming the registered ones."""
    try:
        return LAUNCHERS[kind]
    except KeyError:
        valid = ", ".join(sorted(LAUNCHERS))
        raise LauncherError(f"launcher kind must be one of {valid}, but got {kind!r}. Pick one of those.") from None


def make_launcher(kind: str, root_dir: Path | str, **options: Any) -> Launcher:
    """Build the launcher registered as ``kind``; raises LauncherError for an unknown kind."""
    return launcher_class(kind)(root_dir, **options)


__all__ = [
    "DEFAULT_KIND",
    "LAUNCHERS",
    "Launcher",
    "LauncherError",
    "LocalLauncher",
    "NoCapacityError",
    "RayJobLauncher",
    "RunHandle",
    "RunSpec",
    "RunState",
    "RunStatus",
    "SimLauncher",
    "launcher_class",
    "make_launcher",
]
