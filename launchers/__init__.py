"""Launchers start verl probes and report their state; pick one by name with ``make_launcher``.

Importing this package imports none of its modules: each name is imported when first used
(``LAUNCHERS``, ``make_launcher``, ``from verl_sweep.launchers import SimLauncher``), so a
simulated probe's process (``verl_sweep.launchers.simulator``) starts without psutil, the
launchers or their interface. Ray, torch and verl are imported only when a launcher needs them
(the Ray launcher, when it talks to a cluster).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl_sweep.launchers.base import (
        Branch,
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
    from verl_sweep.launchers.replay import ReplayLauncher
    from verl_sweep.launchers.sim import SimLauncher

    #: every launcher, by its kind (its ``name``: the one place a kind is spelled), as a study
    #: file's ``launcher.kind`` and ``--launcher`` name it
    LAUNCHERS: dict[str, type[Launcher]]
    #: the kind of a study file that names none: the simulator, which runs anywhere
    DEFAULT_KIND: str

#: every launcher class, in registry order (the simulator first: the default), by its module
_CLASSES = {
    "SimLauncher": "verl_sweep.launchers.sim",
    "LocalLauncher": "verl_sweep.launchers.local",
    "RayJobLauncher": "verl_sweep.launchers.ray_jobs",
    "ReplayLauncher": "verl_sweep.launchers.replay",
}
#: every public name but the registry's, by its module
_NAMES = {
    **dict.fromkeys(("Branch", "Launcher", "LauncherError", "NoCapacityError", "RunHandle", "RunSpec", "RunState",
                     "RunStatus"), "verl_sweep.launchers.base"),
    **_CLASSES,
}


def __getattr__(name: str) -> Any:
    """A public name, ``LAUNCHERS`` or ``DEFAULT_KIND``, imported on first use (PEP 562)."""
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif name == "LAUNCHERS":
        value = {cls.name: cls for cls in (__getattr__(c) for c in _CLASSES)}
    elif name == "DEFAULT_KIND":
        value = __getattr__("SimLauncher").name
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def launcher_class(kind: str) -> type[Launcher]:
    """The launcher registered as ``kind``; LauncherError naming the registered ones."""
    from verl_sweep.launchers.base import LauncherError

    launchers: dict[str, type[Launcher]] = __getattr__("LAUNCHERS")
    try:
        return launchers[kind]
    except KeyError:
        valid = ", ".join(sorted(launchers))
        raise LauncherError(f"launcher kind must be one of {valid}, but got {kind!r}. Pick one of those.") from None


def make_launcher(kind: str, root_dir: Path | str, **options: Any) -> Launcher:
    """Build the launcher registered as ``kind``; raises LauncherError for an unknown kind."""
    return launcher_class(kind)(root_dir, **options)


__all__ = [
    "Branch",
    "DEFAULT_KIND",
    "LAUNCHERS",
    "Launcher",
    "LauncherError",
    "LocalLauncher",
    "NoCapacityError",
    "RayJobLauncher",
    "ReplayLauncher",
    "RunHandle",
    "RunSpec",
    "RunState",
    "RunStatus",
    "SimLauncher",
    "launcher_class",
    "make_launcher",
]
