"""The landscape files: the ones shipped in ``landscapes/``, and a landscape read from its
YAML file, following ``extends`` (a world that changes a few sections of another)."""

from __future__ import annotations

from pathlib import Path

from verl_sweep.launchers.simulator.landscape import Landscape
from verl_sweep.launchers.simulator.outcomes import LandscapeError

LANDSCAPE_DIR = Path(__file__).with_name("landscapes")


def shipped_landscapes() -> list[str]:
    """Names of the landscapes shipped in ``launchers/simulator/landscapes``."""
    return sorted(p.stem for p in LANDSCAPE_DIR.glob("*.yaml"))


def load_landscape(name_or_path: str | Path = "default", *, _seen: tuple[Path, ...] = ()) -> Landscape:
    """A shipped landscape by name, or a YAML file by path (read through the one user-file
    reader: a FIFO, a device, a binary or huge file is a LandscapeError, never a hang)."""
    from verl_sweep.launchers.user_files import UserFileError, load_yaml

    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = LANDSCAPE_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise LandscapeError(
                f"landscape must be a file or one of {shipped_landscapes()}, but got {str(name_or_path)!r}. "
                "Pass a path to a YAML file or a shipped name."
            )
    if path.resolve() in _seen:
        raise LandscapeError(f"landscape {path} extends itself (through {' → '.join(p.name for p in _seen)}). "
                             "Remove the loop of 'extends'.")
    try:
        data = load_yaml(path, what="landscape file")
    except UserFileError as e:
        raise LandscapeError(str(e)) from None
    if not isinstance(data, dict):
        raise LandscapeError(f"landscape file must hold a mapping, but got {type(data).__name__} in {path}.")
    parent = data.pop("extends", None)
    if parent is not None and not isinstance(parent, str):
        raise LandscapeError(f"landscape {path}: extends must name a landscape, but got {parent!r}.")
    if parent:  # a landscape may extend another and change a few sections
        base = dict(load_landscape(parent, _seen=(*_seen, path.resolve())).data)
        for key, value in data.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
        data = base
    return Landscape(name=str(data.get("name", path.stem)), data=data)
