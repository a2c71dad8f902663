"""The speed stages alone (systems, token budget): what they cost and how close they get.

    python -m benchmarks.speed_stages [--landscape NAME|FILE ...] [--study FILE] [--reps 10]

Runs only the study's speed stages (the demo study's, or ``--study``'s on its own launcher
shape: one probe at a time for a one-GPU study) on the ReplayLauncher and judges the chosen
config by its noise-free tokens/s against the best reachable (TPE over the same stage spaces
on the world's noise-free model, two chains). Prints, per world, the runs at ≥ 95% of the best
tokens/s, the median and worst fraction, and the median GPU-hours (also in R: a 2,000-step
run of the baseline) and probes. Every figure is SIMULATED.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Any

import yaml

from verl_sweep.verl_knowledge import Config, merge

SPEED_SPACES = ("systems", "token_budget")
RUN_STEPS = 2000


def speed_spec(landscape: str, rep: int, study: Path | None) -> Any:
    """The study's speed stages for repetition ``rep`` (seeds shifted by 100 × rep, its own
    sampler seed), without a final check or the flat-world stop."""
    from benchmarks.run import rep_spec
    from verl_sweep.search.spec.study_file import parse_study

    if study is None:
        data = rep_spec(landscape, rep).model_dump(mode="json")
    else:
        data = yaml.safe_load(study.read_text())
        data["launcher"] = {"kind": "sim", "max_concurrent": 1, "options": {"landscape": landscape}}
        data["seeds"] = [s + 100 * rep for s in data.get("seeds", [11, 12, 13, 14, 15, 16])]
    data["final_check"] = False
    data.pop("stop_when_flat", None)
    data["stages"] = [s for s in data["stages"] if s["space"] in SPEED_SPACES]
    for stage in data["stages"]:
        stage["sampler"] = {**(stage.get("sampler") or {}), "seed": 1000 + rep}
    return parse_study(data)


def tokens_per_s(world: Any, config: Config) -> float:
    expected = world.expected(config)
    return 0.0 if expected.failure is not None else expected.throughput


def best_tokens_per_s(world: Any, spec: Any, *, trials: int = 500) -> float:
    """The best noise-free tokens/s the speed stages' spaces reach: each stage by TPE on the
    previous one's best, two chains (sampler seeds 0 and 1)."""
    import optuna

    from verl_sweep.spaces.registry import build_space

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    base = spec.baseline_config()
    best = tokens_per_s(world, base)
    for seed in range(2):
        chain = base
        for index, stage in enumerate(spec.stages):
            space = build_space(stage.space, model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm,
                                base=chain, options=stage.params, where=f"stages[{index}]", baseline=base)
            study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(
                seed=seed, multivariate=True, n_startup_trials=60))
            leader, leader_value = chain, tokens_per_s(world, chain)
            for _ in range(trials):
                trial = study.ask()
                config = merge(chain, space.suggest(trial, chain))
                value = tokens_per_s(world, config)
                study.tell(trial, value)
                if value > leader_value:
                    leader, leader_value = config, value
            chain = leader
        best = max(best, tokens_per_s(world, chain))
    return best


def run_world(landscape: str, study: Path | None, reps: int) -> dict[str, Any]:
    from benchmarks import methods as M
    from verl_sweep.launchers.replay import ReplayLauncher
    from verl_sweep.launchers.simulator import load_landscape

    world = load_landscape(landscape)
    spec = speed_spec(landscape, 0, study)
    gpus = spec.hardware.n_gpus
    best = best_tokens_per_s(world, spec)
    base = spec.baseline_config()
    r_gpu_h = (world.expected(base).startup_s + sum(world.step_time(base, t) for t in range(1, RUN_STEPS + 1))) \
        * gpus / 3600.0
    runs = []
    for rep in range(reps):
        spec = speed_spec(landscape, rep, study)
        with tempfile.TemporaryDirectory(prefix="vs-speed-") as tmp:
            launcher = ReplayLauncher(Path(tmp), max_concurrent=spec.launcher.max_concurrent, landscape=landscape,
                                      gpus_per_probe=gpus, write_console=False, write_gpu_samples=False,
                                      verl_record=False)
            trace = M.run_staged(spec, launcher)
            launcher.close()
        runs.append({"fraction": tokens_per_s(world, trace.points[-1][1]) / best, "gpu_h": trace.gpu_h,
                     "probes": trace.n_probes})
    return {"landscape": world.name, "best": best, "baseline_fraction": tokens_per_s(world, base) / best,
            "r_gpu_h": r_gpu_h, "runs": runs}


def line(result: dict[str, Any]) -> str:
    fractions = [r["fraction"] for r in result["runs"]]
    gpu_h = statistics.median(r["gpu_h"] for r in result["runs"])
    dearest = max(r["gpu_h"] for r in result["runs"])
    probes = [r["probes"] for r in result["runs"]]
    minutes = ", ".join(f"{r['gpu_h'] * 60:.1f}" for r in result["runs"])
    # per run too: the goal is every run's, not the median's
    return (f"SIMULATED {result['landscape']}: ≥95% of the best tokens/s in {sum(f >= 0.95 for f in fractions)}/"
            f"{len(fractions)}, median {statistics.median(fractions):.3f}, worst {min(fractions):.3f} (baseline "
            f"{result['baseline_fraction']:.3f}); GPU-h median {gpu_h:,.2f} = {gpu_h / result['r_gpu_h']:.3f} R "
            f"({gpu_h * 60:,.0f} GPU-min), dearest run {dearest:,.2f} = {dearest / result['r_gpu_h']:.3f} R "
            f"({dearest * 60:,.1f} GPU-min); probes median {statistics.median(probes):.0f}, most {max(probes)}; "
            f"GPU-min per run {minutes}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--landscape", action="append", help="a shipped world's name or a landscape YAML (repeatable)")
    parser.add_argument("--study", type=Path, help="a study file whose speed stages to run (default: the demo's)")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    for landscape in args.landscape or ["default"]:
        print(line(run_world(landscape, args.study, args.reps)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
