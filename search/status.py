"""What a study's database says: stages, trials, incumbents, winners, η, reasons.

Read-only; the same data feeds ``verl-sweep status``, its ``--json`` and the export.
"""

from __future__ import annotations

import collections
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from objectives.metrics import read_all
from search import liveness
from search.driver import StageResult, stage_study_name
from search.study_file import StudySpec
from spaces.overrides import Config

if TYPE_CHECKING:
    import optuna


#: a GPU below this utilisation (percent) counts as idle
IDLE_UTIL_PCT = 10.0
STEP_TIME_KEY = "timing_s/step"


def gpu_samples_summary(path: Path | str) -> dict[str, Any] | None:
    """Mean utilisation, idle fraction (share of GPU samples under ``IDLE_UTIL_PCT``) and peak
    memory of a ``gpu_samples.jsonl`` file; None when it is missing or holds no sample.
    Unreadable lines (a half-written last line) are skipped."""
    path = Path(path)
    if not path.is_file():
        return None
    utils: list[float] = []
    peak_mb = 0.0
    n_samples = 0
    indices: set[int] = set()
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        gpus = record.get("gpus") if isinstance(record, dict) else None
        if not isinstance(gpus, list):
            continue
        n_samples += 1
        for gpu in gpus:
            if not isinstance(gpu, dict):
                continue
            indices.add(int(gpu.get("index", len(indices))))
            util = gpu.get("util")
            if isinstance(util, (int, float)) and math.isfinite(util):
                utils.append(float(util))
            mem = gpu.get("mem_used_mb")
            if isinstance(mem, (int, float)) and math.isfinite(mem):
                peak_mb = max(peak_mb, float(mem))
    if not utils:
        return None
    return {
        "mean_util_pct": round(sum(utils) / len(utils), 2),
        "idle_fraction": round(sum(1 for u in utils if u < IDLE_UTIL_PCT) / len(utils), 4),
        "peak_mem_gb": round(peak_mb / 1024.0, 2),
        "n_gpus": len(indices),
        "n_samples": n_samples,
    }


def trial_gpu_summary(t: "optuna.trial.FrozenTrial") -> dict[str, Any] | None:
    """The trial's GPU summary: its ``gpu`` user attribute when it already holds one (same
    keys as ``gpu_samples_summary``), else computed from its run directory's samples."""
    attr = t.user_attrs.get("gpu")
    if isinstance(attr, dict) and {"mean_util_pct", "idle_fraction", "peak_mem_gb"} <= attr.keys():
        return {"n_gpus": None, "n_samples": None, **attr}
    run_dir = t.user_attrs.get("run_dir")
    return gpu_samples_summary(Path(run_dir) / "gpu_samples.jsonl") if run_dir else None


def mean_step_time_s(t: "optuna.trial.FrozenTrial", n_gpus: int) -> float | None:
    """Mean training-step time of a trial: verl's ``timing_s/step`` from its metrics file, else
    its GPU time spread over its steps (which counts start-up too, so it overestimates)."""
    run_dir = t.user_attrs.get("run_dir")
    if run_dir:
        times = [v for m in read_all(Path(run_dir) / "metrics.jsonl")
                 if (v := m.get(STEP_TIME_KEY)) is not None]
        if times:
            return sum(times) / len(times)
    probe = t.user_attrs.get("probe") or {}
    steps = probe.get("last_step") or 0
    gpu_s = probe.get("gpu_time_s") or 0.0
    if steps > 0 and gpu_s > 0:
        wall = gpu_s / max(1, n_gpus) - (probe.get("startup_s") or 0.0)
        return max(wall, 0.0) / steps or None
    return None


def _probe_steps(spec: StudySpec, stage: "Any", trials: list["optuna.trial.FrozenTrial"]) -> int:
    """A full probe's length in this stage: the longest complete probe (a speed-only stage runs
    shorter probes than the study's default), else the configured length."""
    if stage.probe_steps:
        return int(stage.probe_steps)
    done = [int((t.user_attrs.get("probe") or {}).get("last_step") or 0)
            for t in trials if t.state.name == "COMPLETE"]
    return max(done, default=0) or spec.probe.steps


def gpu_hours_saved(spec: StudySpec, stage: "Any", trials: list["optuna.trial.FrozenTrial"]) -> float:
    """GPU-hours that pruning (and early stops) saved: for each pruned trial, the steps it did not
    run × its mean step time × GPUs. An estimate: it assumes the step time would have held."""
    full = _probe_steps(spec, stage, trials)
    n_gpus = spec.hardware.n_gpus
    saved_s = 0.0
    for t in trials:
        if t.state.name != "PRUNED":
            continue
        last = int((t.user_attrs.get("probe") or {}).get("last_step") or 0)
        step_s = mean_step_time_s(t, n_gpus)
        if step_s is not None and last < full:
            saved_s += (full - last) * step_s * n_gpus
    return saved_s / 3600.0


def reason_category(row: dict[str, Any]) -> str:
    """What a pruned or failed trial's reason is counted under: the failure kind when one was
    classified, else the reason's head without its step ("pruned at step 200: …" → "pruned")."""
    text = row.get("failure_kind") or row.get("reason") or "unknown"
    return re.sub(r"\s+at step \d+", "", str(text).split(":")[0]).strip() or "unknown"


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
    gpu = trial_gpu_summary(t)
    if gpu is not None:
        row["gpu"] = gpu
    elif "gpu" in t.user_attrs:
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
        reasons = collections.Counter(reason_category(r) for r in rows if r["state"] in ("pruned", "fail"))
        base: Config = study.user_attrs.get("base_config", {})
        gpu_s = sum(r["gpu_time_s"] or 0.0 for r in rows)
        entry.update(
            state="finished" if result else "running",
            counts=dict(counts),
            reasons=dict(reasons),
            gpu_hours=round(gpu_s / 3600.0, 4),
            gpu_hours_saved=round(gpu_hours_saved(spec, stage, trials), 4),
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
