"""What a study's database says: stages, trials, incumbents, winners, η, reasons.

Read-only; the same data feeds ``verl-sweep status``, its ``--json`` and the export.
"""

from __future__ import annotations

import collections
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_sweep.search.views.text import r_number, r_text
from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.objectives.metrics import STEP_TIME_KEY
from verl_sweep.objectives.sources import read_run
from verl_sweep.search.database import liveness
from verl_sweep.search.engine.final_check import (BASELINE_STEP_S, BASELINE_TIME_RATIO, baseline_learning_step_s,
                                                 final_probe, final_study_name, skip_reason, stored_overall)
from verl_sweep.search.method.policy import incumbent_run_etas
from verl_sweep.search.database.records import CloseReason, Role, StageResult, StageStudyAttrs, TrialRecord, records, requeued_numbers, stage_study_name
from verl_sweep.search.method.run_cost import probe_step_s
from verl_sweep.search.method.stage import Stage
from verl_sweep.search.spec.study_file import StudySpec
from verl_sweep.verl_knowledge import Config

if TYPE_CHECKING:
    import optuna

    from verl_sweep.search.views.progress import StudyProgress


def gpu_samples_summary(run_dir: Path | str) -> dict[str, Any] | None:
    """``verl_sweep.objectives.utilisation.summarise`` of a run directory's ``gpu_samples.jsonl`` (with
    the GPU count); None when the run recorded no sample."""
    from verl_sweep.objectives.utilisation import read_samples, summarise

    run_dir = Path(run_dir)
    samples = read_samples(RunDir(run_dir).gpu_samples)
    summary = summarise(samples, read_run(run_dir)) if samples else None
    if summary is None or summary.get("mean_util_pct") is None:
        return None
    summary["n_gpus"] = len({g.get("index") for s in samples for g in s["gpus"]})
    return summary


def trial_gpu_summary(t: TrialRecord) -> dict[str, Any] | None:
    """The trial's GPU summary: its record's (the driver stores the probe's summary there),
    else one computed from its run directory's samples."""
    if isinstance(t.gpu, dict) and t.gpu.get("mean_util_pct") is not None:
        return t.gpu
    return gpu_samples_summary(t.run_dir) if t.run_dir else None


def mean_step_time_s(t: TrialRecord, n_gpus: int) -> float | None:
    """Mean training-step time of a trial: verl's ``timing_s/step`` from its metrics, else its
    GPU time spread over its steps (which counts start-up too, so it overestimates)."""
    if t.run_dir:
        times = [v for m in read_run(t.run_dir) if (v := m.get(STEP_TIME_KEY)) is not None]
        if times:
            return sum(times) / len(times)
    return probe_step_s(t.probe, n_gpus) or None


def gpu_hours_saved(stage: Stage, trials: list[TrialRecord]) -> float:
    """GPU-hours that pruning (and early stops) saved: for each pruned trial, the steps it did not
    run × its mean step time × GPUs. A full probe runs as long as the longest complete one
    (probes are stopped from outside, a step or two past their length), else the stage's probe
    length. An estimate: it assumes the step time would have held."""
    done = [int(t.probe.get("last_step") or 0) for t in trials if t.state.name == "COMPLETE"]
    full = max(done, default=0) or stage.probe_steps
    n_gpus = stage.spec.hardware.n_gpus
    saved_s = 0.0
    for t in trials:
        if t.state.name != "PRUNED":
            continue
        last = int(t.probe.get("last_step") or 0)
        step_s = mean_step_time_s(t, n_gpus)
        if step_s is not None and last < full:
            saved_s += (full - last) * step_s * n_gpus
    return saved_s / 3600.0


def ended_early(stage: Stage, trials: list[TrialRecord]) -> str | None:
    """Why a stage found nothing, when every probe that finished ended before its length: the
    run itself is shorter than the probes (a probe as long as the run is the whole run). A
    speed probe that ends once its tokens/s settles ends early by design, and says nothing."""
    if not stage.learns and stage.spec.probe.speed_settle_tolerance > 0:
        return None
    steps = stage.probe_steps
    end = stage.start_step + steps  # a train-mode branch runs on from the chain's step
    done = [int(t.probe.get("last_step") or 0) for t in trials if t.state.name == "COMPLETE"]
    if not done or max(done) >= end:
        return None
    until = f"its {steps} steps" if not stage.start_step else f"step {end} (its {steps} steps from step {stage.start_step})"
    return (f"every probe of this stage ended before {until} (the furthest at step {max(done)}): the run "
            "itself stops there (trainer.total_training_steps or trainer.total_epochs). Make the probes at most ¼ "
            "of the run (`verl-sweep init` sets them so), or lengthen the run")


def reason_category(row: dict[str, Any]) -> str:
    """What a pruned or failed trial's reason is counted under: the failure kind when one was
    classified, else the reason's head without its step ("pruned at step 200: …" → "pruned")."""
    text = row.get("failure_kind") or row.get("reason") or "unknown"
    return re.sub(r"\s+at step \d+", "", str(text).split(":")[0]).strip() or "unknown"


def _requeue_reasons(trials: list[TrialRecord]) -> dict[int, str]:
    """Each re-queued trial and why it was queued again: the reason is stored on its copy (the
    copy's ``retry_history`` ends with the number of the trial it replaces)."""
    reasons = {number: "requeued" for number in requeued_numbers(trials)}
    for t in trials:
        if t.retry_history and t.requeued_because is not None:
            reasons[int(t.retry_history[-1])] = f"requeued: {t.requeued_because}"
    return reasons


def _owner(t: TrialRecord) -> str | None:
    """Which process runs a trial ("host pid"), and whether that process is known to be gone
    (same host only; elsewhere the heartbeat's grace period decides)."""
    owner = t.owner
    if not isinstance(owner, dict):
        return None
    text = f"{owner.get('host')} pid {owner.get('pid')}"
    return f"{text} (gone: `resume` or a worker queues it again)" if liveness.owner_is_dead(owner) else text


def _state_name(t: TrialRecord) -> str:
    """A trial's state as status shows it: Optuna's, but "skipped" for a trial given back
    unstarted and "stopped" for a run closed because its driver was stopped (not a failure)."""
    if t.role is Role.SKIPPED:
        return "skipped"
    if t.closed_as is CloseReason.STOPPED:
        return "stopped"
    return t.state.name.lower()


def _trial_row(t: TrialRecord, requeued: dict[int, str]) -> dict[str, Any]:
    probe = t.probe
    row: dict[str, Any] = {
        "number": t.number,
        # A trial a worker gave back unstarted (the budget was full, or another worker queued
        # the same re-run) never ran: not a failure.
        "state": _state_name(t),
        "role": t.role.value,
        "seed": t.seed,
        "params": t.overrides,
        "eta": t.eta,
        "eta_interval": None if t.eta_interval is None else list(t.eta_interval),
        # A copy queued again ran afresh: the reason it was queued belongs to the trial it replaces.
        "reason": (f"wasted: {t.reason}" if t.closed_as is CloseReason.WASTED else t.reason) or requeued.get(t.number),
        "failure_kind": t.failure_kind,
        "requeued": t.number in requeued,
        "carried_from": t.carried_from,
        "owner": _owner(t) if t.state.name == "RUNNING" else None,
        "last_step": probe.get("last_step"),
        "gpu_time_s": probe.get("gpu_time_s"),
        "startup_s": probe.get("startup_s"),
    }
    gpu = trial_gpu_summary(t)
    if gpu is not None:
        row["gpu"] = gpu
    elif t.gpu is not None:
        row["gpu"] = t.gpu
    return row


def study_status(storage: "optuna.storages.BaseStorage", spec: StudySpec, *,
                 run_steps: int | None = None) -> dict[str, Any]:
    """``run_steps``: a full run's length, for the cost in R and the payback (default: the
    baseline's, when known, else 2,000 steps assumed)."""
    from verl_sweep.search.database.study_root import stored_study

    stages: list[dict[str, Any]] = []
    stored: dict[str, StageStudyAttrs] = {}  # each opened stage's attributes (train mode reads its branch)
    for index, stage in enumerate(spec.stages):
        name = stage_study_name(spec, stage)
        entry: dict[str, Any] = {"name": stage.name, "study": name, "space": stage.space,
                                 "budget": stage.budget.max_trials}
        study = stored_study(storage, name)
        if study is None:
            entry.update(state="not started", trials=[], counts={}, incumbent=None, winner=None)
            stages.append(entry)
            continue
        trials = records(study.get_trials(deepcopy=False))
        incumbent_etas = incumbent_run_etas(trials)
        requeued = _requeue_reasons(trials)
        rows = [_trial_row(t, requeued) for t in trials]
        for row in rows:  # every run of the incumbent against all of them, whichever finished first
            incumbent_eta = incumbent_etas.get(row["number"])
            if incumbent_eta is not None:
                row.update(eta=incumbent_eta.value, eta_interval=[incumbent_eta.low, incumbent_eta.high])
        attrs = stored[stage.name] = StageStudyAttrs.of(study.user_attrs)
        result = None if attrs.result is None else attrs.result.to_attr()
        counts = collections.Counter(r["state"] for r in rows)
        reasons = collections.Counter(reason_category(r) for r in rows if r["state"] in ("pruned", "fail"))
        base: Config = attrs.base_config or {}
        gpu_s = sum(r["gpu_time_s"] or 0.0 for r in rows)
        planned = Stage.stored(spec, index, attrs.probe_steps, attrs.branch.step if attrs.branch is not None else 0)
        entry.update(
            state="finished" if result else "running",
            counts=dict(counts),
            reasons=dict(reasons),
            gpu_hours=round(gpu_s / 3600.0, 4),
            gpu_hours_saved=round(gpu_hours_saved(planned, trials), 4),
            incumbent={"config": base,
                       "trials": [r["number"] for r in rows if r["role"] == Role.INCUMBENT]},
            winner=result,
            trials=rows,
        )
        note = ended_early(planned, trials)
        if note:
            entry["ended_early"] = note
        stages.append(entry)
    data: dict[str, Any] = {"study": spec.name, "algorithm": spec.algorithm.value, "stages": stages}
    final_entry, overall = final_check_status(storage, spec, [s["winner"] for s in stages if s.get("winner")])
    if final_entry is not None:
        data["final_check"] = final_entry
    data["overall"] = overall
    continuation = None
    if spec.train is not None:  # train mode: the chain, the continuation, the model (search mode: no key)
        from verl_sweep.search.views.train import train_status

        data["train"] = train_status(storage, spec, stages, stored, trial_row=_trial_row)
        continuation = data["train"]["continuation"]
    data["cost"] = _cost(storage, spec, stages, final_entry, overall, run_steps, continuation)
    return data


def final_check_status(storage: "optuna.storages.BaseStorage", spec: StudySpec,
                       winners: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The final check's entry (its trials, GPU-hours; None before it opened) and the overall
    gain: its measured η against the baseline beside the product of the stages' ηs
    (``winners``: the finished stages' results, ``StageResult.to_attr``)."""
    product = math.prod(float(w["eta"]) for w in winners) if winners else None
    overall: dict[str, Any] = {"eta": None, "low": None, "high": None, "n_pairs": 0,
                               "stage_product": None if product is None else round(product, 4),
                               "metric": final_probe(spec).metric.value, "simulated": simulated(spec)}
    result, trials = stored_overall(storage, spec)
    entry: dict[str, Any] | None = None
    if trials:
        rows = [_trial_row(t, _requeue_reasons(trials)) for t in trials]
        for t, row in zip(trials, rows):  # a baseline run re-timed from the speed stages' layout
            for key in (BASELINE_TIME_RATIO, BASELINE_STEP_S):
                if key in t.frozen.user_attrs:
                    row[key] = t.frozen.user_attrs[key]
        entry = {"study": final_study_name(spec), "runs": spec.final_check.runs,
                 "gpu_hours": round(sum(r["gpu_time_s"] or 0.0 for r in rows) / 3600.0, 4), "trials": rows}
    if result is not None:
        overall.update(state="measured", eta=round(result.eta, 4), low=round(result.low, 4),
                       high=round(result.high, 4), n_pairs=result.n_pairs)
    elif spec.train is not None and entry is None:  # the driver runs the continuation instead
        overall.update(state="skipped", note="train mode runs none, the study is the run")
    elif len(winners) < len(spec.stages):
        overall["state"] = "stages running"
    else:
        why = skip_reason(spec, StageResult.of(winners[-1]).config)
        if why is not None:
            overall.update(state="skipped", note=why)
        elif entry is not None and all(r["state"] not in ("waiting", "running") for r in entry["trials"]):
            overall.update(state="failed", note="no seed has a finished run of both configs")
        else:
            overall["state"] = "running" if entry is not None else "not started"
    return entry, overall


def simulated(spec: StudySpec) -> bool:
    """The study runs on a simulator: its GPU-hours and speeds are simulated, not measured."""
    from verl_sweep.launchers import LAUNCHERS

    kind = LAUNCHERS.get(spec.launcher.kind)
    return kind is not None and not kind.real_gpus


def _baseline_step_s(storage: "optuna.storages.BaseStorage", spec: StudySpec, stages: list[dict[str, Any]],
                     final_entry: dict[str, Any] | None) -> float | None:
    """The baseline's measured seconds a training step: its runs in the final check (a run of
    its learning at the speed stages' layout slowed as its steps were re-timed), else the first
    learning stage's incumbent runs (``baseline_learning_step_s``), else the first stage's
    incumbent runs (the baseline itself; speed probes read the first few steps alone)."""
    rows: list[dict[str, Any]] = []
    if final_entry is not None:  # (a final config's run re-timed as the baseline's carries its ratio too)
        rows = [r for r in final_entry["trials"]
                if r["state"] == "complete" and (r["role"] == Role.INCUMBENT or BASELINE_TIME_RATIO in r)]
    if not rows:
        learning = baseline_learning_step_s(storage, spec)
        if learning is not None:
            return learning
    if not rows and stages and stages[0].get("trials"):
        rows = [r for r in stages[0]["trials"] if r["role"] == Role.INCUMBENT and r["state"] == "complete"]
    def step_s(row: dict[str, Any]) -> float | None:
        if BASELINE_STEP_S in row:  # a run carried from a learning stage: no GPU time of its own here
            return float(row[BASELINE_STEP_S])
        s = probe_step_s(row, spec.hardware.n_gpus)
        return None if s is None else s * row.get(BASELINE_TIME_RATIO, 1.0)

    times = [s for r in rows if (s := step_s(r)) is not None]
    return sum(times) / len(times) if times else None


def _cost(storage: "optuna.storages.BaseStorage", spec: StudySpec, stages: list[dict[str, Any]],
          final_entry: dict[str, Any] | None, overall: dict[str, Any], run_steps: int | None,
          continuation: dict[str, Any] | None = None) -> dict[str, Any]:
    """GPU-hours spent, and for a full run of the baseline (R: ``run_steps`` steps, else the
    baseline's own length, else 2,000 assumed) at its measured speed: what it costs, the study's
    cost in R (each stage's too: its ``cost_r``), what the winner saves on it (the same reward
    reached η times sooner) and how many full runs repay the study (break-even).

    Train mode (``continuation``: ``train_status``'s entry of it): the continuation's GPU-hours
    count too, and instead of a payback, ``train`` holds the study's total in R (tuning and the
    trained run) against the one full run of the baseline it replaces."""
    from verl_sweep.search.method.run_length import study_run_length

    tuning = sum(s.get("gpu_hours") or 0.0 for s in stages) + (final_entry or {}).get("gpu_hours", 0.0)
    trained = (continuation or {}).get("gpu_hours") or 0.0
    spent = tuning + trained
    run = study_run_length(spec, run_steps)
    cost: dict[str, Any] = {"gpu_hours_spent": round(spent, 2), "simulated": simulated(spec),
                            "run_steps": run.steps, "run_steps_from": run.how, "run_steps_assumed": run.assumed,
                            "r_gpu_hours": None, "cost_r": None}
    step_s = _baseline_step_s(storage, spec, stages, final_entry)
    cost["baseline_step_s"] = None if step_s is None else round(step_s, 3)
    full = None if step_s is None or run.steps is None else run.steps * step_s * spec.hardware.n_gpus / 3600.0
    for entry in [*stages, *(e for e in (final_entry, continuation) if e is not None)]:
        hours = entry.get("gpu_hours")
        entry["cost_r"] = None if not full or hours is None else round(hours / full, 4)
    if not full:
        return cost
    cost.update(full_run_gpu_hours=round(full, 2), r_gpu_hours=round(full, 2), cost_r=round(spent / full, 4))
    if continuation is not None:  # the study is the run: no full run follows for a payback
        cost["train"] = {"tuning_gpu_hours": round(tuning, 2), "tuning_r": round(tuning / full, 4),
                         "continuation_gpu_hours": round(trained, 2), "continuation_r": round(trained / full, 4),
                         "continuation_state": continuation["state"], "total_r": round(spent / full, 4)}
        return cost
    eta, low, high = overall.get("eta"), overall.get("low"), overall.get("high")
    if eta is None or low is None or high is None:
        return cost

    def saved(e: float) -> float:
        return full * (1 - 1 / e) if e > 0 else -math.inf

    cost["saved_gpu_hours_per_run"] = round(saved(eta), 2)
    cost["saved_interval"] = [round(saved(low), 2), round(saved(high), 2)]
    cost["break_even_runs"] = round(spent / saved(eta), 2) if saved(eta) > 0 else None
    return cost


def overall_line(data: dict[str, Any]) -> str:
    """One line (≤ ~130 characters): the overall gain against the baseline (``status``, the
    report's header, the export's header)."""
    o = data.get("overall") or {}
    tag = "SIMULATED " if o.get("simulated") else ""
    product = o.get("stage_product")
    product_text = "" if product is None else f"product of the stages' η {product:.3f}"
    if o.get("state") == "measured":
        on = " on throughput" if o.get("metric") == "throughput" else ""  # a speed-only study's
        return (f"{tag}overall gain against your baseline: η {o['eta']:.3f} [{o['low']:.3f}, {o['high']:.3f}] "
                f"(final check{on}, {o['n_pairs']} paired seeds; {product_text or 'no stage won'})")
    note = f": {o['note']}" if o.get("note") else ""
    return f"{tag}overall gain: final check {o.get('state', 'not started')}{note}" + (
        f" ({product_text})" if product_text else "")


#: why no saving is shown yet, by the overall gain's state
_NO_SAVING = {"stages running": "the stages are still running", "not started": "the final check has not started",
              "running": "the final check is running", "skipped": "the final check is skipped",
              "failed": "the final check failed"}


def cost_lines(data: dict[str, Any], *, give: str = "give --run-steps N") -> list[str]:
    """Two lines (each ≤ ~150 characters): the study's cost in GPU-hours and in R (one full run
    of the baseline), and the winner's payback on a full run, or in train mode the study's total
    against one full run (``train_total_line``) (``status``, the report's header, the end of ``run``). ``give``: how to set a full run's length, where 2,000 steps are assumed."""
    c = data.get("cost") or {}
    tag = "SIMULATED " if c.get("simulated") else ""
    spent = f"{tag}cost: {c.get('gpu_hours_spent', 0.0):,.1f} GPU-h"
    steps = c.get("run_steps") or 0
    run = f"a {steps:,}-step run of the baseline"
    assumed = f"; {steps:,} steps assumed; {give}" if c.get("run_steps_assumed") else ""
    if c.get("cost_r") is None:
        return [spent + f" (R, {run}: its step time is not measured yet{assumed})"]
    lines = [spent + f" = {r_text(c['cost_r'])} (R: {run}, {c['r_gpu_hours']:,.1f} GPU-h{assumed})"]
    if c.get("train") is not None:
        return lines + [train_total_line(c, tag)]
    saved = c.get("saved_gpu_hours_per_run")
    if saved is None:
        state = (data.get("overall") or {}).get("state", "not started")
        return lines + [f"{tag}payback: no saving to show: {_NO_SAVING.get(state, f'the final check is {state}')}"]
    if c.get("break_even_runs") is None:
        return lines + [f"{tag}payback: none: the winner saves nothing on a full run ({saved:,.1f} GPU-h)"]
    low, high = c["saved_interval"]
    return lines + [f"{tag}payback: the winner saves {saved:,.1f} [{low:,.1f}, {high:,.1f}] GPU-h a full run = "
                    f"{r_text(saved / c['r_gpu_hours'])}; break-even after {c['break_even_runs']:.1f} runs"]


#: the continuation's part of the train mode's total, by its state
_CONTINUATION_PART = {"trained": "the trained run", "running": "the trained run so far (running)",
                      "stopped": "the trained run so far (stopped: resume it)"}


def train_total_line(cost: dict[str, Any], tag: str = "") -> str:
    """Train mode's line in place of the payback: the study is the run, so its total (tuning and
    the continuation) stands against the one full run of the baseline (1 R) it replaces."""
    t = cost["train"]
    part = _CONTINUATION_PART.get(t["continuation_state"])
    trained = f"{r_text(t['continuation_r'])} {part}" if part else "the trained run not started"
    return (f"{tag}train mode: the study is the run: {r_text(t['tuning_r'])} tuning + {trained} = "
            f"{r_text(t['total_r'])}, against 1 R for one full run of the baseline (no separate full run follows)")


def finished_results(storage: "optuna.storages.BaseStorage", spec: StudySpec) -> list[StageResult]:
    return results_of(study_status(storage, spec))


def results_of(status: dict[str, Any]) -> list[StageResult]:
    """The decided stages' results, in order, from a ``study_status`` answer."""
    return [StageResult.of(stage["winner"]) for stage in status["stages"] if stage.get("winner")]


def study_progress(storage: "optuna.storages.BaseStorage", spec: StudySpec, *, simulated: bool = False) -> "StudyProgress":
    """What the study has done so far, for the console's progress line: per stage the trials
    that count against its budget, its re-runs, its probes' GPU-seconds and whether it is
    decided (a resumed study counts on from here)."""
    from verl_sweep.search.database.study_root import stored_study
    from verl_sweep.search.views.progress import StageCount, StudyProgress

    stages: dict[str, StageCount] = {}
    for stage in spec.stages:
        count = stages[stage.name] = StageCount(stage.budget.max_trials)
        study = stored_study(storage, stage_study_name(spec, stage))
        if study is None:
            continue
        trials = records(study.get_trials(deepcopy=False))
        requeued = requeued_numbers(trials)
        for t in trials:
            count.gpu_s += float(t.probe.get("gpu_time_s") or 0.0)
            if not t.state.is_finished() or t.role is Role.SKIPPED or t.number in requeued:
                continue
            if t.role is Role.RERUN:
                count.reruns += 1
            else:
                count.done += 1
        count.finished = StageStudyAttrs.of(study.user_attrs).result is not None
    if spec.train is not None:  # train mode: the continuation, one run to the run's end
        from verl_sweep.search.engine.continuation import TRAIN_STAGE, stored_model

        model, attempts = stored_model(storage, spec)
        count = stages[TRAIN_STAGE] = StageCount(1, finished=model is not None)
        count.gpu_s = sum(float(t.probe.get("gpu_time_s") or 0.0) for t in attempts)
        count.done = int(model is not None)
    return StudyProgress(spec.name, stages, simulated=simulated)
