"""Keeping trials honest when processes die: heartbeats, owners, and re-queueing.

Optuna records heartbeats only inside ``study.optimize``; the driver uses ask/tell, so it
records them itself. A trial left RUNNING by a dead driver is closed as FAIL and its
assignment (parameters, role, seed) queued again, so it is neither lost nor counted twice.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

import psutil

from verl_sweep.search.database.records import Assignment, TrialRecord, requeue_system_attrs

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

logger = logging.getLogger(__name__)

MAX_REQUEUES = 3
#: a RUNNING trial with no owner older than this was asked for by a process that died at once
ORPHAN_GRACE_S = 120.0


def owner_record() -> dict[str, Any]:
    """Who runs a trial: enough to tell, on the same host, whether that process still lives."""
    me = psutil.Process()
    return {"host": socket.gethostname(), "pid": me.pid, "started": round(me.create_time(), 2)}


def owner_is_dead(owner: Any) -> bool:
    """True only when we can be sure: the owner ran on this host and its process is gone."""
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        process = psutil.Process(pid)
        return abs(process.create_time() - float(owner.get("started", 0))) > 1.0
    except psutil.NoSuchProcess:
        return True


def requeue(study: "optuna.Study", trial: "FrozenTrial", *, reason: str,
            assignment: Assignment | None = None) -> int | None:
    """Queue the trial's assignment (or ``assignment``) again (WAITING); returns the new trial
    number, or None when it has been re-queued MAX_REQUEUES times already."""
    import optuna

    record = TrialRecord.of(trial)
    history = [*record.retry_history, trial.number]
    if len(history) > MAX_REQUEUES:
        logger.warning("trial %d not re-queued: already retried %d times", trial.number, MAX_REQUEUES)
        return None
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING,
            params=trial.params,
            distributions=trial.distributions,
            user_attrs=(assignment or record.assignment).requeued(because=reason),
            system_attrs=requeue_system_attrs(history),
        )
    )
    return max(t.number for t in study.get_trials(deepcopy=False))


def requeue_stale_trial(study: "optuna.Study", trial: "FrozenTrial") -> None:
    """Optuna's heartbeat callback: the trial's process stopped sending heartbeats."""
    requeue(study, trial, reason="its worker stopped sending heartbeats")


def orphaned_trials(study: "optuna.Study") -> list["FrozenTrial"]:
    """RUNNING trials whose owner process on this host is gone (known at once, without
    waiting for the heartbeat grace period), and ownerless ones older than the grace period
    (asked for by a process that died before it could record itself)."""
    from optuna.trial import TrialState

    now = datetime.datetime.now()
    found = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = TrialRecord.of(trial).owner
        ownerless = owner is None and trial.datetime_start is not None and (
            (now - trial.datetime_start).total_seconds() > ORPHAN_GRACE_S
        )
        if ownerless or owner_is_dead(owner):
            found.append(trial)
    return found


def close_and_requeue(study: "optuna.Study", trial: "FrozenTrial", *, reason: str) -> bool:
    """Close a RUNNING trial as FAIL and queue its assignment again; False when another
    process closed it first."""
    import optuna
    from optuna.trial import TrialState

    try:
        if study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
            requeue(study, trial, reason=reason)
            return True
    except optuna.exceptions.UpdateFinishedTrialError:
        pass
    return False
