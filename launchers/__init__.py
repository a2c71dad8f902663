"""Launchers start verl probes and report their state; pick one by name with ``make_launcher``.

Importing this package never imports Ray, torch or verl (the Ray launcher imports Ray only
when it talks to a cluster).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launchers.base import (
    Launcher,
    LauncherError,
    NoCapacityError,
    RunHandle,
    RunSpec,
    RunState,
    RunStatus,
)
from launchers.local import LocalLauncher
from launchers.ray_jobs import RayJobLauncher
from launchers.sim import SimLauncher
from launchers.replay import ReplayLauncher

LAUNCHERS: dict[str, type[Launcher]] = {
    "sim": SimLauncher,
    "local": LocalLauncher,
    "ray": RayJobLauncher,
    "replay": ReplayLauncher,
}


def make_launcher(kind: str, root_dir: Path | str, **options: Any) -> Launcher:
    """Build the launcher registered as ``kind``; raises LauncherError for an unknown kind."""
    try:
        cls = LAUNCHERS[kind]
    except KeyError:
        valid = ", ".join(sorted(LAUNCHERS))
        raise LauncherError(f"launcher kind must be one of {valid}, but got {kind!r}. Pick one of those.") from None
    return cls(root_dir, **options)


__all__ = [
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
    "make_launcher",
]
