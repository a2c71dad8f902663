"""Train mode against the baseline's run and search mode (every figure SIMULATED).

    python -m benchmarks.train_mode --split report,blind --reps 10 [--branch-steps 250] [--jobs 2] [--out DIR]

Train mode as shipped: the study file (studies/demo.yaml, or ``--study``) with ``train:
{branch_steps: N}``, run by the staged driver on the replay launcher (the simulator's model,
in-process, on a virtual clock), each world's repetitions on their own seeds as
``benchmarks.run`` gives them. Its runs' noise is the world's; its model is judged noise-free:
the schedule it chose (each learning stage's chosen config over its branch window, then the
continuation's to the run's end) replayed on the world without noise, branch by branch from
checkpoints, as ``Landscape.simulate`` resumes them.

- Cost: every run the study made (the replay launcher's GPU-hours: start-ups, checkpoint loads
  and saves, steps), its continuation included, in R (one full run of the baseline).
- Baseline: the baseline's full run, noise-free. Search mode: the same world and repetition's
  run of today's benchmark (``--search-results``, ``benchmarks.run``): its study's GPU-hours plus
  its final config's full run from scratch, noise-free.
- A false adoption (one on noise): a stage that took a new config whose noise-free branch from
  the stage's checkpoint rises less per second over its window than its incumbent's. Also counted: adoptions whose
  config, continued alone to the run's end, would end below the incumbent's (``late``: a gain
  of the window that a later config must keep; the chain changes config after it).
- Target (the train mode's issue): the model's reward ≥ the baseline's and ≥ 98% of search
  mode's in at least 90% of a world's runs, each at ≤ 1.5 R, no false adoption.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import multiprocessing
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

from benchmarks import run as R

SEARCH_SHARE = 0.98
MAX_COST_R = 1.5
SEARCH_RESULTS = R.REPO / "benchmarks" / "results" / "2026-12-06_both_ends_pruned" / "results.json"


def quiet(world: Any) -> Any:
    """``world`` without noise: every ``*_sd`` of its noise section at 0."""
    noise = {k: (0.0 if k.endswith("_sd") else v) for k, v in dict(world.data["noise"]).items()}
    return dataclasses.replace(world, data={**world.data, "noise": noise})


def segment(world: Any, config: dict[str, Any], start: Any, first: int, last: int) -> tuple[float, Any, float]:
    """Steps ``first + 1 .. last`` of ``config`` from the checkpoint ``start`` (None: from
    scratch) at the config's own lr, as a branch runs them: (the reward at ``last``, 0 for a
    run that failed or diverged; the checkpoint saved there; the steps' seconds)."""
    from verl_sweep.verl_knowledge import LR, merge, setting

    config = merge(config, {"trainer.total_training_steps": last, "trainer.total_epochs": 10**6,
                            "trainer.save_freq": last - first})
    resume = start
    if start is not None:  # the launcher rewrites a branch's copy to the config's lr
        lr = float(setting(config, LR))
        resume = dataclasses.replace(start, lr=start.lr * lr / start.base_lr, base_lr=lr)
    records = list(world.simulate(config, max_steps=last, resume=resume))
    seconds = sum(float(r.metrics["timing_s/step"]) for r in records)
    if not records or records[-1].step < last:
        return 0.0, None, seconds
    reward = float(records[-1].metrics["critic/score/mean"])
    return (reward if math.isfinite(reward) else 0.0), records[-1].checkpoint, seconds


def schedule_of(storage: Any, spec: Any) -> list[dict[str, Any]]:
    """The chain the study chose: (stage, from step, to step, config, incumbent, adopted), each
    learning stage's window, then the continuation's."""
    import optuna

    from verl_sweep.search.database.records import Decision, StageStudyAttrs, stage_study_name
    from verl_sweep.search.engine.continuation import stored_model
    from verl_sweep.search.method.stage import Stage

    rows = []
    for index, settings in enumerate(spec.stages):
        plan = Stage.of(spec, index)
        if not plan.branches:
            continue
        study = optuna.load_study(study_name=stage_study_name(spec, settings), storage=storage)
        attrs = StageStudyAttrs.of(study.user_attrs)
        if attrs.result is None or attrs.result.decision is Decision.SKIPPED or attrs.branch is None:
            continue
        rows.append({"stage": settings.name, "from": attrs.branch.step, "to": attrs.branch.step + plan.probe_steps,
                     "config": attrs.result.config, "incumbent": attrs.base_config,
                     "adopted": attrs.result.decision in (Decision.WON, Decision.WON_ON_BALANCE)})
    model, _ = stored_model(storage, spec)
    end = model.step if model is not None else spec.run_steps
    last = rows[-1]["to"] if rows else 0
    final = rows[-1]["config"] if rows else spec.baseline_config()
    rows.append({"stage": "train", "from": last, "to": end, "config": final, "incumbent": final, "adopted": False})
    return rows


def rise_rate(world: Any, config: dict[str, Any], start: Any, first: int, last: int) -> float:
    """How fast ``config`` raises the reward over steps ``first + 1 .. last`` from ``start``
    (a checkpoint, else from scratch): the rise per second from the checkpoint's reward, or
    from step 1's (a run's first reward is the model's own, whatever the config)."""
    reward, _, seconds = segment(world, config, start, first, last)
    level, before = (start.reward, 0.0) if start is not None else segment(world, config, None, 0, 1)[::2]
    return (reward - level) / (seconds - before) if seconds > before else 0.0


def judge(world: Any, schedule: list[dict[str, Any]], run_steps: int) -> tuple[float, list[bool]]:
    """The schedule's model replayed noise-free: its reward at the run's end, and for each
    adopted stage whether the adoption was false (on noise: the chosen config's noise-free
    window rises less per second than the incumbent's, what the stage measured)."""
    still, checkpoint, falses = quiet(world), None, []
    for row in schedule:
        if row["adopted"]:
            rates = [rise_rate(still, c, checkpoint, row["from"], row["to"]) for c in (row["config"], row["incumbent"])]
            ends = [segment(still, c, checkpoint, row["from"], run_steps)[0] for c in (row["config"], row["incumbent"])]
            falses.append(rates[0] <= rates[1])
            row.update(false=rates[0] <= rates[1], false_to_end=ends[0] < ends[1], window_rates=rates, ends=ends)
        reward, checkpoint, _ = segment(still, row["config"], checkpoint, row["from"], row["to"])
        if checkpoint is None and row["to"] < run_steps:
            return 0.0, falses  # the chain's run failed: no model
    return reward, falses


def train_spec(landscape: str, rep: int, branch_steps: int, run_steps: int) -> Any:
    spec = R.rep_spec(landscape, rep)
    data = spec.model_dump(mode="json")
    data.update(train={**(data.get("train") or {}), "branch_steps": branch_steps}, run_steps=run_steps,
                final_check=False)
    # The run is the chain: it must not end with the baseline's epochs before the run's steps.
    data["baseline"] = {**data["baseline"], "trainer.total_epochs": 10**6}
    return type(spec).model_validate(data)


def run_one(task: tuple[str, int, int, dict[str, Any] | None]) -> dict[str, Any]:
    import optuna

    from benchmarks import methods as M
    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.search.database.study_root import save_spec
    from verl_sweep.search.engine.driver import StudyRunner
    from verl_sweep.search.views.console import Console

    landscape, rep, branch_steps, found = task
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    world = load_landscape(landscape)
    steps = R.true_steps(world)
    spec = train_spec(landscape, rep, branch_steps, steps)
    full = R.full_run(landscape, R.rep_spec(landscape, 0), steps)
    big_r = full["run_gpu_h"]
    with tempfile.TemporaryDirectory(prefix="vs-train-") as tmp:
        storage = optuna.storages.RDBStorage(f"sqlite:///{tmp}/train.db")
        save_spec(storage, spec)
        launcher = M.replay_launcher(Path(tmp) / "runs", landscape)
        StudyRunner(spec, storage, launcher, console=Console(quiet=True), poll_interval_s=M.POLL_S).run()
        gpu_h = M.gpu_hours(launcher)
        launcher.close()
        schedule = schedule_of(storage, spec)
    final, falses = judge(world, schedule, steps)
    still = quiet(world)
    baseline = segment(still, spec.baseline_config(), None, 0, steps)[0]
    row = {"landscape": world.name, "split": R.split_of(landscape), "rep": rep, "branch_steps": branch_steps,
           "final_reward": final, "baseline_reward": baseline, "gpu_h": gpu_h, "cost_r": gpu_h / big_r,
           "run_gpu_h": big_r, "adopted": sum(r["adopted"] for r in schedule), "false": sum(falses),
           "late": sum(bool(r.get("false_to_end")) for r in schedule),
           "schedule": [{**{k: v for k, v in r.items() if k not in ("config", "incumbent")},
                         "changes": changes(spec.baseline_config(), r["config"])} for r in schedule]}
    if found is not None:
        search_reward = segment(still, found["final_config"], None, 0, steps)[0]
        search_run_h = R.full_run(landscape, R.rep_spec(landscape, 0), steps)["run_gpu_h"]
        row.update(search_reward=search_reward, search_cost_r=found["gpu_h"] / big_r + search_run_h / big_r)
    return row


def changes(base: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What ``config`` sets otherwise than ``base`` (None: a key it leaves unset)."""
    return {k: config.get(k) for k in sorted({*base, *config}) if base.get(k) != config.get(k)}


def meets(row: dict[str, Any]) -> bool:
    """At least the baseline's reward and SEARCH_SHARE of search mode's (equal within float
    rounding counts: a chain through checkpoints and a straight run reach one reward by
    different sums)."""
    final = row["final_reward"]
    at_least = final >= row["baseline_reward"] or math.isclose(final, row["baseline_reward"], rel_tol=1e-9)
    return at_least and final >= SEARCH_SHARE * row.get("search_reward", 0.0)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["landscape"], row["branch_steps"]), []).append(row)
    out = []
    for (name, steps), rs in groups.items():
        ok, cost, false = sum(meets(r) for r in rs), statistics.median(r["cost_r"] for r in rs), sum(r["false"] for r in rs)
        out.append({"landscape": name, "split": rs[0]["split"], "branch_steps": steps, "n": len(rs), "ok": ok,
                    "reward_vs_search": statistics.median(r["final_reward"] / r["search_reward"] for r in rs
                                                          if r.get("search_reward")) if any(r.get("search_reward") for r in rs) else math.nan,
                    "reward_vs_baseline": statistics.median(r["final_reward"] / r["baseline_reward"] for r in rs),
                    "cost_r": cost, "max_cost_r": max(r["cost_r"] for r in rs),
                    "search_cost_r": statistics.median(r.get("search_cost_r", math.nan) for r in rs),
                    "adopted": sum(r["adopted"] for r in rs), "false": false, "late": sum(r["late"] for r in rs),
                    "pass": ok >= 0.9 * len(rs) and max(r["cost_r"] for r in rs) <= MAX_COST_R and false == 0})  # fmt: skip
    return out


def table(summary: list[dict[str, Any]]) -> str:
    lines = ["| world (SIMULATED) | split | branch steps | runs ≥ baseline & ≥ 98% search | train ÷ search reward "
             "| train ÷ baseline reward | train GPU-h (R) | search GPU-h (R) | adopted | false | late | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(summary, key=lambda r: (r["branch_steps"], r["split"] != "report", r["landscape"])):
        lines.append(f"| {r['landscape']} | {r['split']} | {r['branch_steps']} | {r['ok']}/{r['n']} | "
                     f"{r['reward_vs_search']:.3f} | {r['reward_vs_baseline']:.3f} | {r['cost_r']:.2f} "
                     f"(max {r['max_cost_r']:.2f}) | {r['search_cost_r']:.2f} | {r['adopted']} | {r['false']} | {r['late']} | "
                     f"{'met' if r['pass'] else 'not met'} |")
    return "\n".join(lines)


def tasks(landscapes: Sequence[str], reps: int, branch_steps: Sequence[int],
          search: dict[tuple[str, int], Any]) -> list[tuple[str, int, int, dict[str, Any] | None]]:
    from verl_sweep.launchers.simulator import load_landscape

    out = []
    for landscape in landscapes:
        name = load_landscape(landscape).name
        out += [(landscape, rep, steps, search.get((name, rep))) for rep in range(reps) for steps in branch_steps]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", default="report,blind")
    parser.add_argument("--landscape", action="append", help="a world (name or file) instead of --split; repeatable")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--branch-steps", default="250", help="comma-separated: the learning stages' branch lengths")
    parser.add_argument("--study", type=Path, help="the study file (default studies/demo.yaml)")
    parser.add_argument("--search-results", type=Path, default=SEARCH_RESULTS,
                        help="results.json of search mode (benchmarks.run) on the same worlds and repetitions")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.study:
        import os

        os.environ[R.STUDY_ENV] = str(args.study.resolve())
    search = {(r["landscape"], r["rep"]): r for r in json.loads(args.search_results.read_text())["runs"]
              if r["method"] == "verl-sweep"}
    todo = tasks(args.landscape or R.split_landscapes(args.split), args.reps,
                 [int(s) for s in args.branch_steps.split(",")], search)
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            rows = pool.map(run_one, todo, chunksize=1)
    else:
        rows = [run_one(t) for t in todo]
    summary = summarize(rows)
    text = table(summary)
    print(text)
    out = args.out or R.REPO / "benchmarks" / "results" / f"{datetime.date.today()}_train_mode"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": "python -m benchmarks.train_mode",
                                                  "argv": argv if argv is not None else sys.argv[1:],
                                                  "summary": summary, "runs": rows}, indent=1, default=str))
    (out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
