"""Side by side on the GPU: a study's baseline, seed 000's template and a winner, each run alone,
alternated (A B C A B C), each for step 1 (vLLM's and the optimizer's first calls) and
``--steps`` scored steps after it. Resumable: a lease that ends keeps the runs it finished, and
the next call runs the rest of the plan.

usage: python scripts/real_verl/side_by_side.py STUDY.yaml OUT_DIR [--arm NAME=FILE ...]
           [--runs 2] [--steps 5] [--deadline-s S]
  arms: ``baseline`` (the study's baseline config) and ``template`` (seed 000's layout as the
  study's systems stage proposes it) always; ``--arm winner=best.overrides`` adds one from a
  file of ``key=value`` lines (``verl-sweep export NAME --format overrides``).
  ``--deadline-s``: start no run that would not end this many seconds after the script began
  (a run of an arm is assumed to take as long as its last one, else 15 minutes).
writes OUT_DIR/side_by_side.json (one entry per run: arm, run, tokens_per_s, s_per_step,
       gpu_busy, peak_gb, steps, phase medians, startup_s and the raw metrics rows),
       OUT_DIR/side_by_side.md (medians per arm, and each against the baseline),
       OUT_DIR/runs/<arm>-<run>/ (the launcher's run directories)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import optuna

from verl_sweep.launchers.base import RunSpec
from verl_sweep.launchers.local import LocalLauncher
from verl_sweep.objectives.probe import Probe, ProbeSettings, ProbeState
from verl_sweep.objectives.score import Metric
from verl_sweep.objectives.utilisation import read_samples
from verl_sweep.search.spec.study_file import StudySpec, load_study
from verl_sweep.spaces import build_space
from verl_sweep.verl_knowledge import merge, parse_overrides, to_overrides
from verl_sweep.verl_knowledge import template_for

PHASES = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor")
DEFAULT_RUN_S = 900.0
SEED = 1  # every run on the same data: the arms differ in their config only


def arms_of(spec: StudySpec, extra: list[str]) -> dict[str, dict[str, Any]]:
    base = spec.baseline_config()
    facts = {"model": spec.model, "hardware": spec.hardware, "algorithm": spec.algorithm}
    systems = build_space("systems", base=base, options={}, **facts)
    params = systems.incumbent_params(merge(base, template_for(**facts).config))
    if params is None:
        raise SystemExit("seed 000's template is not a point of this study's systems space")
    arms = {"baseline": base,
            "template": merge(base, systems.suggest(optuna.trial.FixedTrial(params), base))}
    for item in extra:
        name, _, path = item.partition("=")
        lines = [line.strip() for line in Path(path).read_text().splitlines()]
        arms[name] = merge(base, parse_overrides([line for line in lines if line and not line.startswith("#")]))
    return arms


def summarise(arm: str, run: int, probe: Probe, outcome: Any, run_dir: Path) -> dict[str, Any]:
    steps = [s for s in probe.steps if s.step >= 2]
    rows = [{"step": s.step, **{k: v for k, v in s.data.items() if v is not None}} for s in probe.steps]
    # The scored steps' window on the clock the GPU samples use: from the end of step 1 to the
    # last step's end (the probe saw each step's line when it was written).
    begin = (probe.first_step_at or 0.0) + float(probe.steps[0].data.get("timing_s/step") or 0.0) if probe.steps else 0.0
    end = begin + sum(float(s.data.get("timing_s/step") or 0.0) for s in steps)
    samples = read_samples(run_dir / "gpu_samples.jsonl")
    during = [g["util"] for s in samples if begin <= s["t"] <= end for g in s["gpus"] if g.get("util") is not None]
    used = [g["mem_used_mb"] for s in samples for g in s["gpus"] if g.get("mem_used_mb") is not None]
    times = [float(s.data["timing_s/step"]) for s in steps if s.data.get("timing_s/step")]
    return {
        "arm": arm, "run": run, "state": outcome.state.value, "reason": outcome.reason,
        "tokens_per_s": None if outcome.score is None else round(outcome.score.rate, 1),
        "s_per_step": round(statistics.median(times), 2) if times else None,
        "gpu_busy": round(statistics.fmean(during) / 100, 3) if during else None,
        "peak_gb": round(max(used) / 1024, 2) if used else None,
        "steps": len(steps),
        "startup_s": outcome.startup_s,
        "phases_s": {key.split("/")[-1]: round(statistics.median(v), 2)
                     for key in PHASES if (v := [float(s.data[key]) for s in steps if s.data.get(key) is not None])},
        "metrics": rows,
    }


def table(entries: list[dict[str, Any]]) -> str:
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        if e["tokens_per_s"] is not None:
            by_arm.setdefault(e["arm"], []).append(e)

    def median(arm: str, key: str) -> float | None:
        values = [e[key] for e in by_arm.get(arm, []) if e[key] is not None]
        return statistics.median(values) if values else None

    base = median("baseline", "tokens_per_s")
    lines = ["| arm | runs | tokens/s (median) | × baseline | s/step | GPU busy during steps | peak GB |",
             "|---|---|---|---|---|---|---|"]
    for arm in by_arm:
        tps = median(arm, "tokens_per_s")
        ratio = f"{tps / base:.2f}" if tps and base else "—"
        busy = median(arm, "gpu_busy")
        lines.append(f"| {arm} | {len(by_arm[arm])} | {tps:,.0f} | {ratio} | {median(arm, 's_per_step')} | "
                     f"{'—' if busy is None else f'{busy:.0%}'} | {median(arm, 'peak_gb')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--arm", action="append", default=[])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--deadline-s", type=float, default=None)
    args = parser.parse_args()
    began = time.monotonic()
    spec = load_study(args.study)
    arms = arms_of(spec, args.arm)
    args.out.mkdir(parents=True, exist_ok=True)
    result_path = args.out / "side_by_side.json"
    entries: list[dict[str, Any]] = json.loads(result_path.read_text()) if result_path.exists() else []
    done = {(e["arm"], e["run"]) for e in entries}
    launcher = LocalLauncher(args.out / "runs", probes_per_gpu=1, min_free_gpu_memory_gb=20.0)
    settings = ProbeSettings(steps=1 + args.steps, metric=Metric.THROUGHPUT, health_screen=False, warmup_steps=1,
                             hang_timeout_s=900, n_boot=0)
    last_s: dict[str, float] = {}
    for run in range(args.runs):
        for arm, config in arms.items():
            if (arm, run) in done:
                continue
            expected = last_s.get(arm, DEFAULT_RUN_S)
            if args.deadline_s is not None and time.monotonic() - began + expected > args.deadline_s:
                print(f"stopping before {arm} run {run}: ~{expected:.0f} s would pass the deadline")
                return
            run_id = f"{arm}-{run}"
            spec_ = RunSpec(run_id=run_id, overrides=tuple(to_overrides(merge(config, {"data.seed": SEED}))), n_gpus=1)
            probe = Probe(launcher, spec_, settings)
            started = time.monotonic()
            probe.start()
            while (outcome := probe.poll()) is None:
                time.sleep(2.0)
            last_s[arm] = time.monotonic() - started
            entry = summarise(arm, run, probe, outcome, args.out / "runs" / run_id)
            entries.append(entry)
            result_path.write_text(json.dumps(entries, indent=1))
            (args.out / "side_by_side.md").write_text(table(entries))
            print(f"{arm} run {run}: {entry['state']} {entry['tokens_per_s']} tokens/s, {entry['s_per_step']} s/step, "
                  f"GPU busy {entry['gpu_busy']}, peak {entry['peak_gb']} GB ({last_s[arm]:.0f} s)", flush=True)
            if outcome.state is not ProbeState.COMPLETE:
                print(f"  {outcome.reason[:300]}")
    print(table(entries))


if __name__ == "__main__":
    main()
