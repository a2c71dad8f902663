"""What a study's database says: stages, trials, incumbents, winners, η, reasons.

Read-only; the same data feeds ``verl-sweep status``, its ``--json`` and the export.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from search import liveness
from search.driver import StageResult, stage_study_name
from search.study_file import StudySpec
from spaces.overrides import Config

if TYPE_CHECKING:
    import optuna


def _trial_row(t: "optuna.trial.FrozenTrial", requeued: set[int]) -> dict[str, Any]:
    interval = t.user_attrs.get("eta_interval")
    probe = t.user_attrs.get("probe", {})
    row: dict[str, Any] = {
        "number": t.number,
        "state": t.state.name.lower(),
        "role": t.user_attrs.get("role", "candidate"),
        "seed": t.user_attrs.get("seed"),
        "params": t.user_attrs.get("overrides", {}),
        "eta": t.user_attrs.get("eta"),
        "eta_interval": interval,
        "reason": t.user_attrs.get("reason") or t.user_attrs.get("requeued_because"),
        "failure_kind": t.user_attrs.get("failure_kind"),
        "requeued": t.number in requeued,
        "last_step": probe.get("last_step"),
        "gpu_time_s": probe.get("gpu_time_s"),
        "startup_s": probe.get("startup_s"),
    }
    if "gpu" in t.user_attrs:
        row["gpu"] = t.user_attrs["gpu"]
    return row


def study_status(storage: "optuna.storages.BaseStorage", spec: StudySpec) -> dict[str, Any]:
    import optuna

    stages: list[dict[str, Any]] = []
    for stage in spec.stages:
        name = stage_study_name(spec, stage)
        entry: dict[str, Any] = {"name": stage.name, "study": name, "space": stage.space,
                                 "budget": stage.budget.max_trials}
        try:
            study = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            entry.update(state="not started", trials=[], counts={}, incumbent=None, winner=None)
            stages.append(entry)
            continue
        trials = study.get_trials(deepcopy=False)
        requeued = liveness.requeued_numbers(trials)
        rows = [_trial_row(t, requeued) for t in trials]
        result = study.user_attrs.get("result")
        counts = collections.Counter(r["state"] for r in rows)
        reasons = collections.Counter(
            (r["failure_kind"] or r["reason"] or "").split(":")[0]
            for r in rows if r["state"] in ("pruned", "fail")
        )
        base: Config = study.user_attrs.get("base_config", {})
        gpu_s = sum(r["gpu_time_s"] or 0.0 for r in rows)
        entry.update(
            state="finished" if result else "running",
            counts=dict(counts),
            reasons=dict(reasons),
            gpu_hours=round(gpu_s / 3600.0, 4),
            incumbent={"config": base,
                       "trials": [r["number"] for r in rows if r["role"] == "incumbent"]},
            winner=result,
            trials=rows,
        )
        stages.append(entry)
    return {"study": spec.name, "algorithm": spec.algorithm.value, "stages": stages}


def finished_results(storage: "optuna.storages.BaseStorage", spec: StudySpec) -> list[StageResult]:
    out = []
    for stage in study_status(storage, spec)["stages"]:
        if stage.get("winner"):
            out.append(StageResult(**stage["winner"]))
    return out
