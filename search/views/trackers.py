"""Each trial's outcome in the user's own tracker: a listener that adds it to the probe's run.

A probe logs to the trackers the baseline asks for (verl's ``trainer.logger``), named by
``verl_sweep.launchers.trackers``: W&B group = the study, job type = the stage, name = the run id
(``<study>.<stage>.t<trial>``), config = verl's whole config (which holds the trial's
parameters); TensorBoard ``<root>/<study>/<stage>/<run id>``. The probe cannot know how its
trial ends, so when the study tells a trial, ``TrackerListener`` adds to the same run:

- W&B: the run is opened again by its id (``resume="allow"``; offline, a second run directory
  with the same id, which ``wandb sync`` merges), config ``verl_sweep`` = {study, stage, trial,
  role, params: the trial's parameters}, summary ``verl_sweep/eta``, ``…/eta_low``,
  ``…/eta_high``, ``…/state``, ``…/reason``, ``…/role``.
- TensorBoard: an events file beside the probe's with the trial's parameters as hparams (and
  its state, role and trial number) and ``verl_sweep/eta…`` scalars.

A tracker that fails here never stops the study: one warning, then debug lines.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.launchers.trackers import ProbeTracking, parse_loggers
from verl_sweep.search.engine.events import StudyListener
from verl_sweep.search.database.records import TrialRecord

if TYPE_CHECKING:
    import optuna

    from verl_sweep.search.database.records import Role

logger = logging.getLogger(__name__)

#: the trackers whose runs get each trial's outcome
TRACKERS = ("wandb", "tensorboard")
#: seconds W&B may take to open a run again (its default, 90, would hold the driver up)
INIT_TIMEOUT_S = 30.0


def asks_for_trackers(baseline: Mapping[str, Any]) -> bool:
    """The baseline logs to W&B or TensorBoard (``trainer.logger``)."""
    return bool(set(TRACKERS) & set(parse_loggers(_list(baseline.get("trainer.logger")))))


def tracker_lines(study: str, baseline: Mapping[str, Any]) -> list[str]:
    """What ``validate`` says of the trackers the baseline asks for: where each probe shows up,
    and a warning when this machine lacks the package a tracker needs."""
    overrides = [f"trainer.logger={_list(baseline.get('trainer.logger'))}"]
    if baseline.get("trainer.project_name"):
        overrides.append(f"trainer.project_name={baseline['trainer.project_name']}")
    names = ProbeTracking.plan(f"{study}.<stage>.t<trial>", overrides, {"study": study, "stage": "<stage>"})
    lines = []
    if "wandb" in names.loggers:
        lines.append(f"note: each probe is a W&B run in project {names.project}: group {study}, job type = its stage, "
                     f"name {names.name}")
    if names.tensorboard_dir is not None:
        lines.append(f"note: each probe's TensorBoard events: {names.tensorboard_dir}")
    for package in (name for name in TRACKERS if name in names.loggers and importlib.util.find_spec(name) is None):
        lines.append(f"warning: the baseline logs to {package}, but {package} is not installed here: "
                     "pip install 'verl-sweep[trackers]'")
    return lines


def _list(value: Any) -> str:
    return f"[{','.join(map(str, value))}]" if isinstance(value, (list, tuple)) else str(value or "")


class TrackerListener(StudyListener):
    """Adds each finished trial's outcome to its probe's W&B run and TensorBoard directory. A
    tracker that fails once (no network: W&B's init waits up to ``INIT_TIMEOUT_S``) is left
    alone for the rest of the study, so that it never holds the driver up twice."""

    def __init__(self) -> None:
        self._failed: set[str] = set()

    def trial_finished(self, study: optuna.Study, number: int, role: Role, overrides: dict[str, Any], *,
                       eta: float | None = None, interval: tuple[float, float] | None = None,
                       state: str = "complete", reason: str = "", requeued: bool = False,
                       stderr_tail: str = "", log_path: str = "") -> None:
        try:
            trial = study.get_trials(deepcopy=False)[number]  # a study's trials are in number order
            record = TrialRecord.of(trial)
            if record.run_dir is None or record.carried_from is not None:
                return  # no probe of its own: refused before launch, or a run carried from a stage before
            names = ProbeTracking.of_argv(RunDir(Path(record.run_dir)).read_spec().get("argv", []))
            if names is None or not set(TRACKERS) & set(names.loggers):
                return  # no tracker asked for
            outcome: dict[str, Any] = {"state": state, "role": str(role), "trial": number}
            if eta is not None:
                outcome["eta"] = eta
            if interval is not None and all(math.isfinite(end) for end in interval):
                outcome["eta_low"], outcome["eta_high"] = interval
            if reason:
                outcome["reason"] = reason
        except (IndexError, KeyError, OSError, TypeError, ValueError) as e:  # a tracker is a view: go on
            logger.debug("no tracker outcome for trial %d: %s: %s", number, type(e).__name__, e)
            return
        for tracker, add in (("wandb", _wandb_outcome), ("tensorboard", _tensorboard_outcome)):
            if tracker not in names.loggers or tracker in self._failed:
                continue
            try:
                add(names, overrides, outcome)
            except Exception as e:  # a tracker is a view: the study goes on without it
                self._failed.add(tracker)
                logger.warning("%s did not take trial %d's outcome (%s: %s); no more outcomes go to it",
                               tracker, number, type(e).__name__, str(e)[:80])


def _wandb_outcome(names: ProbeTracking, params: Mapping[str, Any], outcome: Mapping[str, Any]) -> None:
    import wandb

    if names.wandb_id is None:
        return  # started before its probe's W&B run had an id of ours
    # x_disable_meta: no command line (a --storage URL may hold a password), host or git facts
    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True, save_code=False,
                              disable_git=True, disable_job_creation=True, init_timeout=INIT_TIMEOUT_S)
    run = wandb.init(project=names.project, entity=os.environ.get("WANDB_ENTITY"), id=names.wandb_id,
                     resume="allow", name=names.name, group=names.group, job_type=names.job_type,
                     settings=settings, reinit="create_new")
    try:
        run.config.update({"verl_sweep": {"study": names.group, "stage": names.job_type, "trial": outcome["trial"],
                                          "role": outcome["role"], "params": dict(params)}}, allow_val_change=True)
        run.summary.update({f"verl_sweep/{key}": value for key, value in outcome.items()})
    finally:
        run.finish(exit_code=1 if outcome["state"] == "failed" else 0)  # a pruned probe did not fail


def _tensorboard_outcome(names: ProbeTracking, params: Mapping[str, Any], outcome: Mapping[str, Any]) -> None:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.plugins.hparams import summary_v2 as hp
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    if names.tensorboard_dir is None:
        return
    names.tensorboard_dir.mkdir(parents=True, exist_ok=True)
    hparams = {key: value if isinstance(value, (bool, int, float, str)) else str(value) for key, value in params.items()}
    hparams.update({f"verl_sweep.{key}": outcome[key] for key in ("state", "role", "trial")})
    numbers = [summary_pb2.Summary.Value(tag=f"verl_sweep/{key}", simple_value=float(outcome[key]))
               for key in ("eta", "eta_low", "eta_high") if key in outcome]
    writer = EventFileWriter(str(names.tensorboard_dir), filename_suffix=".verl_sweep")
    try:
        now = time.time()
        writer.add_event(event_pb2.Event(wall_time=now, summary=hp.hparams_pb(hparams, trial_id=names.name)))
        if numbers:
            writer.add_event(event_pb2.Event(wall_time=now, step=0, summary=summary_pb2.Summary(value=numbers)))
    finally:
        writer.close()
