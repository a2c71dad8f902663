"""A study's launcher, built from the study file: its options checked against what the launcher
declares (``Launcher.OPTIONS``, ``verl_sweep.launchers.options``), its runs directory checked. ``run``,
``resume``, ``worker`` and ``validate`` build it here; the CLI only says which kind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from verl_sweep.search.spec.errors import BadInputError

if TYPE_CHECKING:
    from verl_sweep.launchers.base import Launcher
    from verl_sweep.search.spec.study_file import StudySpec


def launcher_kinds() -> list[str]:
    """The registered launcher kinds (``launchers.LAUNCHERS``), in registry order."""
    from verl_sweep.launchers import LAUNCHERS

    return list(LAUNCHERS)


def launcher_options(spec: StudySpec, kind: str, *, on_dropped: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The constructor arguments of launcher ``kind`` for the study: its ``launcher.options``
    checked against the options the launcher declares, and the study's fields for those it
    fills in (slots, fake GPUs a probe). A ``--launcher`` of another kind than the file's
    leaves out the options that kind does not take (``on_dropped`` is told which); an option
    the kind does not take, or of the wrong type, is refused in one line naming what it takes."""
    from verl_sweep.launchers import LauncherError, launcher_class
    from verl_sweep.launchers.options import OptionError, resolve

    try:
        cls = launcher_class(kind)
    except LauncherError as e:
        raise BadInputError(str(e)) from None
    other_kind = kind != spec.launcher.kind
    takes = sorted(o.name for o in cls.OPTIONS)
    dropped = sorted(name for name in spec.launcher.options if name not in takes) if other_kind else []
    if dropped and on_dropped is not None:
        on_dropped(f"--launcher {kind}: leaving out the study's {spec.launcher.kind} options {', '.join(dropped)} "
                   f"({kind} takes {', '.join(takes)}).")
    study = {"launcher.max_concurrent": spec.launcher.max_concurrent, "hardware.gpus_per_node": spec.hardware.gpus_per_node}
    try:
        options, _ = resolve(kind, cls.OPTIONS, spec.launcher.options, study=study, drop_unknown=other_kind)
    except OptionError as e:
        raise BadInputError(str(e)) from None
    return options


def default_runs_dir(spec: StudySpec) -> Path:
    """Where each probe gets its directory: ``runs/<study>`` beside the study file."""
    return (spec.source_dir or Path.cwd()) / "runs" / spec.name


def build_launcher(spec: StudySpec, kind: str | None = None, runs_dir: Path | None = None, *,
                   on_dropped: Callable[[str], None] | None = None) -> Launcher:
    """The study's launcher (or ``kind``'s); a launcher that cannot be built (unknown kind,
    bad option, no GPU here, a runs directory that cannot be made) is bad input."""
    from verl_sweep.launchers import LauncherError, make_launcher

    kind = kind or spec.launcher.kind
    runs_dir = runs_dir or default_runs_dir(spec)
    options = launcher_options(spec, kind, on_dropped=on_dropped)
    check_runs_dir(runs_dir)
    try:
        return make_launcher(kind, runs_dir, **options)
    except LauncherError as e:
        raise BadInputError(str(e)) from None
    except OSError as e:
        raise BadInputError(f"the runs directory {runs_dir} cannot be created ({e.strerror or e}). Run from a "
                            "directory where runs/ can be written.") from None


def check_runs_dir(runs_dir: Path) -> None:
    """A ``runs`` that is a file, or not writable, is refused before anything is stored."""
    existing = runs_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise BadInputError(f"the runs directory {runs_dir} cannot be created: {existing} is not a directory. "
                            "Move it away, or run the study from another directory.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInputError(f"the runs directory {runs_dir} cannot be created: {existing} is not writable. "
                            "Run the study from a directory you can write.")


def launcher_problems(spec: StudySpec) -> list[str]:
    """What the study's launcher would refuse at ``run``: its options, and, for a launcher
    that builds on any machine (a simulator), the launcher itself; one that needs its
    hardware (GPUs, a cluster) is built only where it runs."""
    from verl_sweep.launchers import LAUNCHERS

    try:
        launcher_options(spec, spec.launcher.kind)
        if LAUNCHERS[spec.launcher.kind].builds_anywhere:
            with tempfile.TemporaryDirectory(prefix="vs-validate-") as tmp:
                build_launcher(spec, runs_dir=Path(tmp)).close()
    except BadInputError as e:
        return [str(e)]
    return []
