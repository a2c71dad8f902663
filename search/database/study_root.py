"""The study root: the study definition, stored on a study of its own so that resume and
workers need only the database.

The root study is named like the study (``<study>``); each stage has its own study,
``<study>.<stage>`` (``search/engine/stage_study.py``).
"""

from __future__ import annotations

import difflib
import re
import time
from typing import Any

import optuna

from verl_sweep.search.spec.errors import BadInputError, StudyNotFoundError
from verl_sweep.search.database.records import LAUNCHER_ATTR, SPEC_ATTR, StageResult, StageStudyAttrs, stage_study_name
from verl_sweep.search.spec.study_file import StageSettings, StudySpec, spec_from_dict, spec_to_dict


def save_spec(storage: optuna.storages.BaseStorage, spec: StudySpec) -> list[str]:
    """Create the root study holding the study definition; refuse a different definition
    under the same name (that would mix two experiments in one database). Changes to where
    and how probes run (``_is_operational``) and to the budgets of stages not finished are
    stored instead; returns their field paths."""

    data = spec_to_dict(spec)
    try:
        root = optuna.create_study(study_name=spec.name, storage=storage, direction="maximize")
        root.set_user_attr(SPEC_ATTR, data)
        return []
    except optuna.exceptions.DuplicatedStudyError:
        pass
    root = optuna.load_study(study_name=spec.name, storage=storage)
    stored = _stored_definition(root)
    if stored is None:
        raise BadInputError(
            f"the database already has an Optuna study named {spec.name!r} that verl-sweep did not "
            "create. Pick another study name or another --storage."
        )
    try:  # a definition stored by an older version: compared with this version's defaults filled in
        stored_now = spec_to_dict(spec_from_dict(stored))
    except BadInputError:
        stored_now = stored
    changed = [path for path in _differences(stored_now, data) if path != "source_dir"]  # where the file lies
    _refuse_other_definition(spec, changed)
    # A stage's budget may change until the stage has chosen its winner: the stages after it
    # start from that winner, so a finished stage stays as it ran.
    budgets = {int(m["index"]) for path in changed if (m := _BUDGET.match(path))}
    finished = [spec.stages[i].name for i in sorted(budgets) if stored_stage_result(storage, spec, spec.stages[i]) is not None]
    if finished:
        raise BadInputError(
            f"study {spec.name!r}: the budget of a finished stage cannot change (changed: {', '.join(finished)}; "
            "the stages after it started from its winner). Change only the budgets of stages not "
            "finished, or rename the study to run it again."
        )
    if changed:  # resume and workers read the stored definition: give them the new settings too
        root.set_user_attr(SPEC_ATTR, data)
    return changed


def _refuse_other_definition(spec: StudySpec, changed: list[str]) -> None:
    refused = [path for path in changed if not _is_operational(path) and not _BUDGET.match(path)]
    if refused:
        shown = ", ".join(refused[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
        raise BadInputError(
            f"study {spec.name!r} already exists in this database with a different definition ({shown} "
            f"changed). Run `verl-sweep resume {spec.name}` to continue it as stored, or rename the study."
        )


def check_name_clash(url: str, spec: StudySpec, *, holds: bool | None = None) -> None:
    """What ``save_spec`` would refuse (another definition under this name), found read-only
    and before verl's checks (seconds): a database that holds no study yet (none there, an
    empty file, a server database without Optuna's tables) has no clash. ``holds``: what
    ``holds_studies`` said of it already (``run``'s preflight), so the server is asked once."""
    from verl_sweep.search.database.storage import holds_studies, open_storage

    if not (holds_studies(url) if holds is None else holds):
        return
    root = stored_study(open_storage(url, create=False, readonly=True), spec.name)
    if root is None:
        return
    stored = root.user_attrs.get(SPEC_ATTR)
    if stored is None:
        return  # save_spec says what it is
    try:
        stored = spec_to_dict(spec_from_dict(stored))
    except BadInputError:
        pass
    _refuse_other_definition(spec, [p for p in _differences(stored, spec_to_dict(spec)) if p != "source_dir"])


def _stored_definition(root: optuna.Study) -> Any:
    """The definition stored on the root study; None if there is none after 5 s. A `run` stores
    it just after creating the root, so a worker or another `run` may find the root without it."""
    for _ in range(25):
        stored = root.user_attrs.get(SPEC_ATTR)
        if stored is not None:
            return stored
        time.sleep(0.2)
    return root.user_attrs.get(SPEC_ATTR)


#: a definition field that may change while its stage has not finished (``save_spec``)
_BUDGET = re.compile(r"stages\[(?P<index>\d+)\]\.budget\.")


def stored_study(storage: optuna.storages.BaseStorage, name: str) -> optuna.Study | None:
    """The study ``name`` as stored; None where there is none (not opened yet)."""
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return None


def stored_stage_result(storage: optuna.storages.BaseStorage, spec: StudySpec,
                        stage: StageSettings) -> StageResult | None:
    """The stage's recorded result; None while it has not chosen its winner (or not started)."""
    study = stored_study(storage, stage_study_name(spec, stage))
    return None if study is None else StageStudyAttrs.of(study.user_attrs).result


def _is_operational(path: str) -> bool:
    """A definition field that says where and how probes run, not what they measure: more
    slots, other GPUs, another Ray address, a moved database. The simulator's landscape is
    what its probes measure, and the launcher kind stays (``--launcher`` overrides it per
    command)."""
    return path in ("storage", "launcher.max_concurrent") or (
        path.startswith("launcher.options.") and path != "launcher.options.landscape")


def _differences(old: Any, new: Any, path: str = "") -> list[str]:
    """Field paths where two study definitions differ, e.g. ``stages[1].budget.max_trials``."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for key in sorted(old.keys() | new.keys(), key=str)
                for d in _differences(old.get(key), new.get(key), f"{path}.{key}" if path else str(key))]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, f"{path}[{i}]")]
    return [] if old == new else [path or "(the whole definition)"]


def _known_studies_hint(name: str, known: list[str], shown: int = 10) -> str:
    """The studies a mistyped name may have meant: all of them when few, else the closest."""
    if not known:
        return " This database has no studies."
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    guess = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    if len(known) <= shown:
        return f"{guess} Studies here: {', '.join(known)}."
    return f"{guess} {len(known)} studies here, e.g. {', '.join(known[:shown])}, …"


def remember_launcher(storage: optuna.storages.BaseStorage, name: str, kind: str) -> None:
    """Store the launcher kind study ``name`` runs with (the file's, or ``--launcher``'s)."""
    root = optuna.load_study(study_name=name, storage=storage)
    if root.user_attrs.get(LAUNCHER_ATTR) != kind:
        root.set_user_attr(LAUNCHER_ATTR, kind)


def stored_launcher(storage: optuna.storages.BaseStorage, name: str) -> str | None:
    """The launcher kind study ``name`` last ran with (None: a study stored before it was kept)."""
    return optuna.load_study(study_name=name, storage=storage).user_attrs.get(LAUNCHER_ATTR)


def load_spec(storage: optuna.storages.BaseStorage, name: str) -> StudySpec:
    try:
        root = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        # Names only: summaries would read every trial of every study (docs/method.md, Evidence).
        known = sorted(n for n in optuna.get_all_study_names(storage) if "." not in n)
        hint = _known_studies_hint(name, known)
        raise StudyNotFoundError(f"no study named {name!r} in this database.{hint}") from None
    stored = root.user_attrs.get(SPEC_ATTR)
    if stored is None and "." not in name:
        stored = _stored_definition(root)
    if stored is None:
        study, _, stage = name.rpartition(".")
        if study and study in optuna.get_all_study_names(storage):
            raise BadInputError(f"{name!r} is the study of stage {stage!r}; pass the study's name, {study!r}.")
        raise BadInputError(f"study {name!r} was not created by verl-sweep; verl-sweep cannot use it.")
    return spec_from_dict(stored)
