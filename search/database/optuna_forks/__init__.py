"""Forks of private Optuna code, fenced: verl-sweep's speed-ups of Optuna's TPE sampler
(``tpe.py``) and RDB storage (``rdb.py``).

Both rely on Optuna internals that any release may change. They were written against Optuna
``FORKED_FROM`` and apply on every release whose internals they rely on have the shape they
were written against (``RELIED_ON``: the private functions' parameters and the names they
read, the tables' columns), whatever its version number: a release that changed none of it
(5.1.0 changed comments and type annotations there) gets them quietly. On one that changed
any of it verl-sweep uses stock Optuna and says in one log line what changed; CI runs the
newest Optuna in range, where ``tests/search/database/test_optuna_forks.py`` fails on such a release.

``install`` puts the process-wide TPE changes in place, once: the driver calls it when it is
built (``verl_sweep.search.engine.driver.StudyRunner``), and ``tpe_sampler`` and ``storage_class`` call it too,
so that a library user (a benchmark, a test) gets the same samplers and storage.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

import optuna

logger = logging.getLogger(__name__)

#: the Optuna release whose private code the forks copy and patch
FORKED_FROM = "5.0.0"

#: what the forks need of Optuna's private code, by "module:qualified name": a function's
#: parameters (as the forks call or override it) and the names its code must read (what the
#: forks replace or hand it). A table's entry lists its columns.
RELIED_ON: dict[str, dict[str, tuple[str, ...]]] = {
    # tpe.py and search/method/sampler.py: TPE's ask reads the trials through the study's
    # _get_trials, splits them with the module's _split_trials and converts them with
    # _get_internal_repr, each looked up at call time
    "optuna.samplers._tpe.sampler:TPESampler._sample": {
        "params": ("self", "study", "trial", "search_space"),
        "reads": ("_get_trials", "_split_trials", "_build_parzen_estimator")},
    "optuna.samplers._tpe.sampler:_split_trials": {"params": ("study", "trials", "n_below")},
    "optuna.samplers._tpe.sampler:TPESampler._get_internal_repr": {
        "params": ("self", "trials", "search_space", "study"), "reads": ("_get_params", "to_internal_repr")},
    "optuna.samplers._tpe.sampler:TPESampler._get_params": {"params": ("self", "trial", "study")},
    "optuna.study.study:Study._get_trials": {"params": ("self", "deepcopy", "states", "use_cache")},
    # rdb.py: the storage methods it overrides (falling back to Optuna's), and what Optuna's
    # FrozenTrial builder reads of the rows it is handed
    "optuna.storages._rdb.storage:RDBStorage._create_new_trial": {"params": ("self", "study_id", "template_trial")},
    "optuna.storages._rdb.storage:RDBStorage._set_trial_param": {
        "params": ("self", "trial_id", "param_name", "param_value_internal", "distribution",
                   "previous_distribution")},
    "optuna.storages._rdb.storage:RDBStorage._get_trials": {
        "params": ("self", "study_id", "states", "included_trial_ids", "trial_id_greater_than")},
    "optuna.storages._rdb.storage:RDBStorage.get_trial": {"params": ("self", "trial_id")},
    "optuna.storages._rdb.storage:RDBStorage.set_trial_state_values": {
        "params": ("self", "trial_id", "state", "values")},
    "optuna.storages._rdb.storage:RDBStorage.set_trial_user_attr": {"params": ("self", "trial_id", "key", "value")},
    "optuna.storages._rdb.storage:RDBStorage.set_trial_system_attr": {
        "params": ("self", "trial_id", "key", "value")},
    "optuna.storages._rdb.storage:RDBStorage.set_trial_intermediate_value": {
        "params": ("self", "trial_id", "step", "intermediate_value")},
    "optuna.storages._rdb.storage:RDBStorage.record_heartbeat": {"params": ("self", "trial_id")},
    "optuna.storages._rdb.storage:RDBStorage._build_frozen_trial_from_trial_model": {
        "params": ("self", "trial"),
        "reads": ("datetime_complete", "datetime_start", "intermediate_values", "number", "objective", "params",
                  "state", "system_attributes", "trial_id", "user_attributes", "value", "value_type", "values")},
    "optuna.storages._rdb.models:TrialModel": {
        "columns": ("trial_id", "number", "study_id", "state", "datetime_start", "datetime_complete")},
    "optuna.storages._rdb.models:TrialParamModel": {
        "columns": ("param_id", "trial_id", "param_name", "param_value", "distribution_json")},
    "optuna.storages._rdb.models:TrialValueModel": {
        "columns": ("trial_value_id", "trial_id", "objective", "value", "value_type")},
    "optuna.storages._rdb.models:TrialUserAttributeModel": {
        "columns": ("trial_user_attribute_id", "trial_id", "key", "value_json")},
    "optuna.storages._rdb.models:TrialSystemAttributeModel": {
        "columns": ("trial_system_attribute_id", "trial_id", "key", "value_json")},
    "optuna.storages._rdb.models:TrialIntermediateValueModel": {
        "columns": ("trial_intermediate_value_id", "trial_id", "step", "intermediate_value",
                    "intermediate_value_type")},
    "optuna.storages._rdb.models:TrialHeartbeatModel": {"columns": ("trial_heartbeat_id", "trial_id", "heartbeat")},
    "optuna.storages._rdb.models:StudyModel": {"columns": ("study_id", "study_name")},
}

_installed: bool | None = None


def _resolve(where: str) -> Any:
    module, _, qualname = where.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def shape_differences(relied_on: dict[str, dict[str, tuple[str, ...]]] = RELIED_ON) -> list[str]:
    """Where the installed Optuna's private code differs from what the forks rely on (empty
    when the forks apply), one phrase each."""
    differences = []
    for where, need in relied_on.items():
        name = where.partition(":")[2]
        try:
            found = _resolve(where)
        except (ImportError, AttributeError):
            differences.append(f"{name} is gone")
            continue
        if "columns" in need:
            columns = tuple(column.name for column in found.__table__.columns)
            if columns != need["columns"]:
                differences.append(f"{name}'s columns are {', '.join(columns)}")
            continue
        params = tuple(inspect.signature(found).parameters)
        if params != need["params"]:
            differences.append(f"{name} takes ({', '.join(params)})")
        missing = sorted(set(need.get("reads", ())) - set(found.__code__.co_names))
        if missing:
            differences.append(f"{name} no longer reads {', '.join(missing)}")
    return differences


def install() -> bool:
    """Put the forks in place if the installed Optuna has the shape they rely on; True if they
    are. Idempotent: the TPE changes are applied at most once a process."""
    global _installed
    if _installed is None:
        differences = shape_differences()
        if not differences:
            from verl_sweep.search.database.optuna_forks import tpe

            tpe.patch()
            _installed = True
        else:
            logger.warning("Optuna %s changed private code that verl-sweep's TPE and storage speed-ups rely on (%s): "
                           "using stock Optuna's (slower asks on large studies, TPE not learning from runs that ran "
                           "out of memory). Install optuna==%s for them.",
                           optuna.__version__, "; ".join(differences[:3]), FORKED_FROM)
            _installed = False
    return _installed


def tpe_sampler(**kwargs: Any) -> optuna.samplers.TPESampler:
    """A TPE sampler with Optuna's ``TPESampler`` arguments: the fork where installed."""
    return tpe_sampler_class()(**kwargs)


def tpe_sampler_class() -> type[optuna.samplers.TPESampler]:
    """``ReadOnceTPESampler`` where installed, else Optuna's ``TPESampler``."""
    if install():
        from verl_sweep.search.database.optuna_forks.tpe import ReadOnceTPESampler

        return ReadOnceTPESampler
    return optuna.samplers.TPESampler


def storage_class() -> type[optuna.storages.RDBStorage]:
    """The RDB storage class: ``SweepStorage`` where installed, else Optuna's own."""
    if install():
        from verl_sweep.search.database.optuna_forks.rdb import SweepStorage

        return SweepStorage
    return optuna.storages.RDBStorage
