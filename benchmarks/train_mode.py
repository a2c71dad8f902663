"""Train mode, measured before it is built (every figure SIMULATED).

    python -m benchmarks.train_mode --split report,blind --reps 10 [--stage-steps 250,500] [--out DIR]

Train mode: the speed stages as today (the real driver on the replay launcher, the study cut to
systems + tokens); then each learning stage (mini-batch, KL, lr, λ for PPO) branches its
candidates and the incumbent's own continuation from the incumbent's checkpoint at the stage's
start, ``stage_steps`` steps each on two paired seeds; a candidate is adopted only if its paired
η over the incumbent's continuation is > 1.02 with its interval's low end > 1; the adopted (or
the incumbent's) branch is the next stage's incumbent, and after the last stage it trains on to
the run's end (2,000 steps). Its model's reward there is judged noise-free.

Rules of the measurement:

- Branches run in-process on ``Landscape.simulate(config, resume=...)``; a branch takes its own
  config's lr (the checkpoint rewritten as ``checkpoints.rewrite_lr`` does). Seeded branches
  (the decisions and their GPU-hours) resume from the chain's noise-free checkpoint; the chain
  itself (the model the user gets) is the same landscape with every noise sd at 0.
- Candidates: the stage space's own ``starting_points`` (3 of them) on the incumbent, as the
  driver queues them first, turned into a config by the space's ``suggest``.
- Score: ``score_reward_rate`` on the branch's steps, placed after the steps before it, its
  chord read to the run's end (``horizon_steps`` = 2,000): the gain the branch would bring
  by the end, per second.
- GPU-hours: the speed stages' (the launcher's accounting) + every branch (start-up, checkpoint
  load where it resumes, its steps with the save at its last step) + the winner's continuation
  to the end (start-up, load, noise-free steps), × the run's GPUs.
- A false adoption: an adopted branch whose config, continued noise-free from the stage's
  checkpoint to the run's end, ends below the incumbent's continued the same way.
- Search mode: today's study (its run in ``--search-results``, same world and repetition), then
  its final config's full run from scratch; cost = the study's GPU-hours + that run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

from verl_sweep.launchers.simulator import load_landscape
from verl_sweep.launchers.simulator.landscape import Landscape, StepRecord
from verl_sweep.launchers.simulator.outcomes import CheckpointState
from verl_sweep.objectives.metrics import StepMetrics
from verl_sweep.objectives.score import Score, ScoreError, paired_eta, score_reward_rate
from verl_sweep.verl_knowledge import LR, Config, merge, setting

from benchmarks import run as R

LEARNING_SPACES = ("mini_batch", "kl", "lr", "lam")
N_CANDIDATES = 3
MIN_GAIN = 0.02
#: the reward floor (vs the baseline) and the share of search mode's reward a run must reach
SEARCH_SHARE = 0.98
MAX_COST_R = 1.5
SEARCH_RESULTS = R.REPO / "benchmarks" / "results" / "2026-12-06_horizon_pruner" / "results.json"


def quiet(world: Landscape) -> Landscape:
    """``world`` without noise: every ``*_sd`` of its noise section at 0."""
    noise = {k: (0.0 if k.endswith("_sd") else v) for k, v in dict(world.data["noise"]).items()}
    return dataclasses.replace(world, data={**world.data, "noise": noise})


@dataclasses.dataclass(frozen=True)
class Branch:
    """One run from ``start`` (None: from scratch): its records, its checkpoint at its last
    step (None where it saved none), and its GPU-hours."""

    records: list[StepRecord]
    checkpoint: CheckpointState | None
    gpu_h: float

    @property
    def final_reward(self) -> float:
        reward = self.records[-1].metrics["critic/score/mean"] if self.records else math.nan
        return float(reward) if reward == reward else 0.0


def branch(world: Landscape, config: Config, start: CheckpointState | None, steps: int, *, run_steps: int,
           startup_s: float, seed: int | None = None, save: bool = True) -> Branch:
    """``steps`` steps of ``config`` from ``start`` at the config's own lr; saves at its last step
    when ``save`` (``start.step`` must then be a multiple of ``steps``)."""
    config = merge(config, {"trainer.total_training_steps": run_steps, "trainer.total_epochs": 10**6,
                            "trainer.save_freq": steps if save else -1})
    if seed is not None:
        config = merge(config, {"data.seed": seed})
    resume = start
    if start is not None:  # checkpoints.rewrite_lr's rule
        lr = float(setting(config, LR) or 1e-6)
        resume = dataclasses.replace(start, lr=start.lr * lr / start.base_lr, base_lr=lr)
    first = 0 if start is None else start.step
    records = []
    for record in world.simulate(config, max_steps=first + steps, resume=resume):
        records.append(record)
        if record.metrics["critic/score/mean"] != record.metrics["critic/score/mean"]:
            break  # a diverged run is dead at its first NaN reward (its KL would overflow later)
    exp = world.expected(config)
    seconds = startup_s + (0.0 if start is None else world.checkpoint_s(config))
    seconds += sum(float(r.metrics["timing_s/step"]) for r in records)
    checkpoint = records[-1].checkpoint if records and records[-1].step == first + steps else None
    return Branch(records, checkpoint, seconds * exp.n_gpus / 3600.0)


def score(b: Branch, start_step: int, horizon_steps: int | None) -> Score:
    """The branch's reward rate, placed after ``start_step`` steps, read to ``horizon_steps``
    (None: to its own last step)."""
    steps = [StepMetrics(r.step, {k: (float(v) if v == v else None) for k, v in r.metrics.items()}) for r in b.records]
    return score_reward_rate(steps, warmup_steps=start_step, horizon_steps=horizon_steps)


def candidates(spec: Any, stage: Any, index: int, base: Config) -> list[Config]:
    """The stage space's starting points on ``base``, as configs (``base`` itself left out)."""
    import optuna

    from verl_sweep.spaces.registry import build_space

    space = build_space(stage.space, model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm, base=base,
                        options=stage.params, where=f"stages[{index}]", baseline=spec.baseline_config())
    configs: list[Config] = []
    for point in space.starting_points(base, N_CANDIDATES):
        point = space.fitted(point, base)
        config = point and merge(base, space.suggest(optuna.trial.FixedTrial(point), base))
        if config and config != base and config not in configs:
            configs.append(config)
    return configs


def train_chain(world: Landscape, spec: Any, speed_config: Config, *, stage_steps: int, run_steps: int,
                startup_s: float, to_end: bool = True) -> dict[str, Any]:
    """The learning stages as branches from the chain's checkpoint, then the winner's run to the
    end. Returns the final noise-free reward, the branches' and the continuation's GPU-hours,
    and each stage's decision."""
    still = quiet(world)
    kw = dict(run_steps=run_steps, startup_s=startup_s)
    incumbent, checkpoint, branches_gpu_h, stages = speed_config, None, 0.0, []
    learning = [(i, s) for i, s in enumerate(spec.stages) if s.space in LEARNING_SPACES]
    for k, (index, stage) in enumerate(learning):
        start = k * stage_steps
        seeds = [seed + 1000 * (k + 1) for seed in spec.seeds[:2]]
        runs = {}
        for j, config in enumerate([incumbent, *candidates(spec, stage, index, incumbent)]):
            bs = [branch(world, config, checkpoint, stage_steps, seed=s, **kw) for s in seeds]
            branches_gpu_h += sum(b.gpu_h for b in bs)
            scored = []
            for s, b in zip(seeds, bs):
                try:
                    scored.append((s, score(b, start, run_steps if to_end else None)))
                except ScoreError:
                    pass
            runs[j] = (config, scored)
        ends = [branch(still, config, checkpoint, run_steps - start, save=False, **kw).final_reward
                for config, _ in runs.values()]  # each config continued noise-free to the end
        etas: list[list[float] | None] = [None]
        winner, best = 0, 1.0
        for j, (config, scored) in list(runs.items())[1:]:
            try:
                e = paired_eta(scored, runs[0][1]) if len(scored) == len(runs[0][1]) == 2 else None
            except (ScoreError, OverflowError):  # no ratio, or an interval too wide for exp(): undecided
                e = None
            etas.append(None if e is None else [e.value, e.low, e.high])
            if e is not None and e.value > 1 + MIN_GAIN and e.low > 1.0 and e.value > best:
                winner, best = j, e.value
        chosen = runs[winner][0]
        stages.append({"stage": stage.name, "start": start, "n_candidates": len(runs) - 1, "adopted": bool(winner),
                       "etas": etas, "ends": ends, "false_adoption": ends[winner] < ends[0],
                       "change": {key: v for key, v in chosen.items() if incumbent.get(key) != v}})
        checkpoint = branch(still, chosen, checkpoint, stage_steps, **kw).checkpoint
        incumbent = chosen
        if checkpoint is None:  # the chain's run stopped (OOM or divergence): the model is lost
            return {"final_reward": 0.0, "branches_gpu_h": branches_gpu_h, "final_gpu_h": 0.0, "stages": stages,
                    "final_config": incumbent}
    done = len(learning) * stage_steps
    if done >= run_steps:  # the stages' branches reached the run's end: the winner's is the model
        return {"final_reward": checkpoint.reward, "branches_gpu_h": branches_gpu_h, "final_gpu_h": 0.0,
                "stages": stages, "final_config": incumbent}
    final = branch(still, incumbent, checkpoint, run_steps - done, save=False, **kw)
    return {"final_reward": final.final_reward, "branches_gpu_h": branches_gpu_h, "final_gpu_h": final.gpu_h,
            "stages": stages, "final_config": incumbent}


def speed_stages(landscape: str, rep: int) -> tuple[Config, float]:
    """Today's speed stages (the demo study cut to systems + tokens) on the replay launcher:
    the chain's config after them and their GPU-hours."""
    from benchmarks import methods as M
    from benchmarks.speed_stages import speed_spec

    with tempfile.TemporaryDirectory(prefix="vs-train-") as tmp:
        launcher = M.replay_launcher(Path(tmp), landscape)
        trace = M.run_staged(speed_spec(landscape, rep, None), launcher)
        launcher.close()
    return trace.points[-1][1], trace.gpu_h


def run_world(landscape: str, reps: int, variants: Sequence[tuple[int, str]],
              search: dict[tuple[str, int], Any]) -> list[dict[str, Any]]:
    """Every repetition of ``landscape`` under each (stage steps, score horizon) variant."""
    world = load_landscape(landscape)
    still, steps = quiet(world), R.true_steps(world)
    spec0 = R.rep_spec(landscape, 0)
    full = R.full_run(landscape, spec0, steps)
    big_r, startup_s = full["run_gpu_h"], full["run_startup_s"]
    kw = dict(run_steps=steps, startup_s=startup_s)
    baseline = branch(still, spec0.baseline_config(), None, steps, save=False, **kw).final_reward
    rows = []
    for rep in range(reps):
        spec = R.rep_spec(landscape, rep)
        speed_config, speed_gpu_h = speed_stages(landscape, rep)
        found = search[(world.name, rep)]
        search_run = branch(still, found["final_config"], None, steps, save=False, **kw)
        for s, horizon in variants:
            chain = train_chain(world, spec, speed_config, stage_steps=s, to_end=horizon == "end", **kw)
            gpu_h = speed_gpu_h + chain["branches_gpu_h"] + chain["final_gpu_h"]
            rows.append({
                "landscape": world.name, "split": R.split_of(landscape), "rep": rep, "stage_steps": s, "horizon": horizon,
                "final_reward": chain["final_reward"], "gpu_h": gpu_h, "cost_r": gpu_h / big_r,
                "speed_gpu_h": speed_gpu_h, "branches_gpu_h": chain["branches_gpu_h"],
                "final_gpu_h": chain["final_gpu_h"], "stages": chain["stages"], "final_config": chain["final_config"],
                "baseline_reward": baseline, "search_reward": search_run.final_reward,
                "search_cost_r": (found["gpu_h"] + search_run.gpu_h) / big_r, "run_gpu_h": big_r,
            })  # fmt: skip
    return rows


def meets(row: dict[str, Any]) -> bool:
    """At least the baseline's final reward and SEARCH_SHARE of search mode's. Equal within
    float rounding counts as equal: a chain through checkpoints and a straight run of the same
    learning reach one reward by different sums."""
    final = row["final_reward"]
    at_least = final >= row["baseline_reward"] or math.isclose(final, row["baseline_reward"], rel_tol=1e-9)
    return at_least and final >= SEARCH_SHARE * row["search_reward"]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["landscape"], row["stage_steps"], row["horizon"]), []).append(row)
    out = []
    for (name, s, horizon), rs in groups.items():
        false = sum(st["false_adoption"] for r in rs for st in r["stages"])
        cost = statistics.median(r["cost_r"] for r in rs)
        ok = sum(meets(r) for r in rs)
        out.append({"landscape": name, "split": rs[0]["split"], "stage_steps": s, "horizon": horizon, "n": len(rs), "ok": ok,
                    "reward_vs_search": statistics.median(r["final_reward"] / r["search_reward"] for r in rs),
                    "reward_vs_baseline": statistics.median(r["final_reward"] / r["baseline_reward"] for r in rs),
                    "cost_r": cost, "max_cost_r": max(r["cost_r"] for r in rs),
                    "search_cost_r": statistics.median(r["search_cost_r"] for r in rs),
                    "adoptions": sum(st["adopted"] for r in rs for st in r["stages"]), "false": false,
                    "pass": ok >= 0.9 * len(rs) and cost <= MAX_COST_R and false == 0})  # fmt: skip
    return out


def table(summary: list[dict[str, Any]]) -> str:
    lines = ["| world (SIMULATED) | split | stage steps | score to | runs ≥ baseline & ≥ 98% search | train ÷ search reward "
             "| train ÷ baseline reward | train GPU-h (R) | search GPU-h (R) | adopted | false | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(summary, key=lambda r: (r["stage_steps"], r["horizon"], r["split"] != "report", r["landscape"])):
        lines.append(f"| {r['landscape']} | {r['split']} | {r['stage_steps']} | {r['horizon']} | {r['ok']}/{r['n']} | "
                     f"{r['reward_vs_search']:.3f} | {r['reward_vs_baseline']:.3f} | {r['cost_r']:.2f} "
                     f"(max {r['max_cost_r']:.2f}) | {r['search_cost_r']:.2f} | {r['adoptions']} | {r['false']} | "
                     f"{'met' if r['pass'] else 'not met'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", default="report,blind")
    parser.add_argument("--landscape", action="append", help="a world (name or file) instead of --split; repeatable")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--stage-steps", default="250,500", help="comma-separated steps a learning stage's branches run")
    parser.add_argument("--horizon", default="end", help="comma-separated: end (a branch's rate read to the run's "
                        "end) and/or branch (to its own last step)")
    parser.add_argument("--search-results", type=Path, default=SEARCH_RESULTS,
                        help="results.json of today's search mode (benchmarks.run) on the same worlds and repetitions")
    parser.add_argument("--rows", type=Path, help="summarize the runs of an earlier results.json instead of running")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    variants = [(int(s), h) for s in args.stage_steps.split(",") for h in args.horizon.split(",")]
    search = {(r["landscape"], r["rep"]): r for r in json.loads(args.search_results.read_text())["runs"]
              if r["method"] == "verl-sweep"}
    out = args.out or R.REPO / "benchmarks" / "results" / f"{datetime.date.today()}_train_mode"
    rows: list[dict[str, Any]] = json.loads(args.rows.read_text())["runs"] if args.rows else []
    for landscape in [] if args.rows else args.landscape or R.split_landscapes(args.split):
        rows += run_world(landscape, args.reps, variants, search)
        print(f"SIMULATED {Path(landscape).stem}: done", flush=True)
    summary = summarize(rows)
    text = table(summary)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": "python -m benchmarks.train_mode", "argv": argv or sys.argv[1:],
                                                  "summary": summary, "runs": rows}, indent=1, default=str))
    (out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
