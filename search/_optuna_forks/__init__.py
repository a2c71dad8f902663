"""Forks of private Optuna code, fenced: verl-sweep's speed-ups of Optuna's TPE sampler
(``tpe.py``) and RDB storage (``rdb.py``).

Both rely on Optuna internals that may change in any release, so they are used only on the
Optuna version they were written against (``FORKED_FROM``); on any other version verl-sweep
uses stock Optuna, and says so in one log line. ``install`` puts the process-wide TPE changes
in place, once: the driver calls it when it is built (``search.driver.StudyRunner``), and
``tpe_sampler`` and ``storage_class`` call it too, so that a library user (a benchmark, a
test) gets the same samplers and storage.
"""

from __future__ import annotations

import logging
from typing import Any

import optuna

logger = logging.getLogger(__name__)

#: the Optuna release whose private code the forks copy and patch
FORKED_FROM = "5.0.0"

_installed: bool | None = None


def install() -> bool:
    """Put the forks in place if the installed Optuna is ``FORKED_FROM``; True if they are.
    Idempotent: the TPE changes are applied at most once a process."""
    global _installed
    if _installed is None:
        if optuna.__version__ == FORKED_FROM:
            from search._optuna_forks import tpe

            tpe.patch()
            _installed = True
        else:
            logger.warning("Optuna %s is installed, but verl-sweep's TPE and storage speed-ups were written "
                           "against Optuna %s: using stock Optuna's (slower asks on large studies)",
                           optuna.__version__, FORKED_FROM)
            _installed = False
    return _installed


def tpe_sampler(**kwargs: Any) -> optuna.samplers.TPESampler:
    """A TPE sampler with Optuna's ``TPESampler`` arguments: the fork where installed."""
    return tpe_sampler_class()(**kwargs)


def tpe_sampler_class() -> type[optuna.samplers.TPESampler]:
    """``ReadOnceTPESampler`` where installed, else Optuna's ``TPESampler``."""
    if install():
        from search._optuna_forks.tpe import ReadOnceTPESampler

        return ReadOnceTPESampler
    return optuna.samplers.TPESampler


def storage_class() -> type[optuna.storages.RDBStorage]:
    """The RDB storage class: ``SweepStorage`` where installed, else Optuna's own."""
    if install():
        from search._optuna_forks.rdb import SweepStorage

        return SweepStorage
    return optuna.storages.RDBStorage
