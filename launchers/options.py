"""Launcher options as each launcher declares them (``Launcher.OPTIONS``), checked in one place.

Like Hydra's launcher configs: every launcher lists the options a study file may set under
``launcher.options`` (name, type, whether it is required, and which study field fills it when
the file leaves it out). ``resolve`` turns a study's options into the launcher's constructor
arguments, refusing an unknown option or a value of the wrong type in one line that names
what the launcher takes. The study file, the CLI and ``validate`` all go through it
(``verl_sweep.search.commands.launch``); nobody reads a constructor's signature.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

#: the type names an option may have
_TYPES = ("int", "float", "str", "bool", "list[int]", "list[str]", "dict[str, str]")


class OptionError(ValueError):
    """A study's launcher options that the launcher does not take (bad input); one line."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a launcher: ``type`` is one of ``_TYPES``; ``required``: the study must set
    it (unless ``from_study`` fills it); ``nullable``: null is allowed; ``from_study``: the study
    field whose value it takes when the file leaves it out (``launcher.max_concurrent``,
    ``hardware.gpus_per_node``)."""

    name: str
    type: str
    required: bool = False
    nullable: bool = False
    from_study: str | None = None
    help: str = ""

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise ValueError(f"an option's type must be one of {', '.join(_TYPES)}, but got {self.type!r}.")

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not of this option's type (one line), or None."""
        if value is None and self.nullable:
            return None
        what = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                "list[int]": "a list of integers", "list[str]": "a list of strings",
                "dict[str, str]": "a mapping of strings to strings"}[self.type]
        ok = {
            "int": _is_int(value),
            "float": _is_int(value) or isinstance(value, float),
            "str": isinstance(value, str),
            "bool": isinstance(value, bool),
            "list[int]": isinstance(value, list) and all(_is_int(v) for v in value),
            "list[str]": isinstance(value, list) and all(isinstance(v, str) for v in value),
            "dict[str, str]": isinstance(value, dict) and all(isinstance(v, str) for v in value.values()),
        }[self.type]
        return None if ok else f"launcher.options.{self.name}: must be {what}, but got {value!r}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve(kind: str, declared: Sequence[Option], given: Mapping[str, Any], *, study: Mapping[str, Any],
            drop_unknown: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The constructor arguments of launcher ``kind`` from a study's ``launcher.options``
    (``given``) and its fields (``study``: ``from_study`` name -> value). ``drop_unknown``:
    options the launcher does not take are left out (the study was written for another kind),
    else refused. Returns (arguments, the names left out); raises OptionError."""
    by_name = {option.name: option for option in declared}
    takes = ", ".join(sorted(by_name))
    unknown = sorted(name for name in given if name not in by_name)
    if unknown and not drop_unknown:
        raise OptionError(f"launcher.options: the {kind} launcher takes {takes}, but got "
                          f"{', '.join(repr(k) for k in unknown)}. Check the spelling (README: study-file reference).")
    options = {name: value for name, value in given.items() if name in by_name}
    missing = sorted(o.name for o in declared if o.required and o.name not in options and o.from_study is None)
    if missing:
        raise OptionError(f"launcher.options: the {kind} launcher needs {', '.join(missing)}, but the study "
                          f"does not set {'it' if len(missing) == 1 else 'them'}. Add launcher.options."
                          f"{missing[0]} to the study file (README: study-file reference).")
    for name, value in options.items():
        problem = by_name[name].problem(value)
        if problem:
            raise OptionError(f"{problem}. See the README's study-file reference.")
    for option in declared:
        if option.name not in options and option.from_study is not None and option.from_study in study:
            options[option.name] = study[option.from_study]
    return options, unknown


def describe(declared: Sequence[Option]) -> list[str]:
    """One line per option, for help texts: ``name (type[, required][, default: the study's X]): help``."""
    lines = []
    for o in declared:
        notes = [o.type + (" or null" if o.nullable else "")]
        if o.required and o.from_study is None:
            notes.append("required")
        if o.from_study:
            notes.append(f"default: the study's {o.from_study}")
        lines.append(f"{o.name} ({', '.join(notes)})" + (f": {o.help}" if o.help else ""))
    return lines
