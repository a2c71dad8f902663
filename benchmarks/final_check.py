"""The final check: what it costs and how close its overall η comes to the world's noise-free one.

    python -m benchmarks.final_check [--landscape NAME|FILE ...] [--reps 2] [--out results.json]

Runs the demo study of each repetition (``benchmarks.run.rep_spec``: its seeds and sampler seed)
with its final check on the ReplayLauncher, and compares the overall η the check measured with
the world's noise-free η of the final config against the baseline at the run's horizon
(``benchmarks.run.true_steps``). Prints one line a run and a summary: the error's median and
largest, how many 90% intervals hold the noise-free η, and the check's share of the study's
GPU-hours. Every figure is SIMULATED.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Any

DEFAULT_WORLDS = ("default", "kl_low_edge", "noisy_hetero", "oom_sharp", "ppo_lam", "slow_start",
                  "benchmarks/blind/blind_ends_low.yaml", "benchmarks/blind/blind_flat_speed_small.yaml")


def run_one(landscape: str, rep: int) -> dict[str, Any] | None:
    """One study with its final check; None where the check did not measure (skipped: the
    final config is the baseline)."""
    import optuna

    from benchmarks.methods import POLL_S
    from benchmarks.run import rep_spec, true_rate, true_steps
    from verl_sweep.launchers.replay import ReplayLauncher
    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.search.database.optuna_forks import storage_class
    from verl_sweep.search.engine.driver import StudyRunner
    from verl_sweep.search.engine.final_check import final_study_name
    from verl_sweep.search.spec.study_file import FINAL_STAGE
    from verl_sweep.search.views.console import Console

    spec = rep_spec(landscape, rep)
    spec = type(spec).model_validate({**spec.model_dump(mode="json"), "final_check": {"runs": 2}})
    world = load_landscape(landscape)
    with tempfile.TemporaryDirectory(prefix="vs-final-") as tmp:
        storage = storage_class()(f"sqlite:///{tmp}/study.db", heartbeat_interval=60, grace_period=120)
        launcher = ReplayLauncher(Path(tmp), max_concurrent=spec.launcher.max_concurrent, landscape=landscape,
                                  gpus_per_probe=spec.hardware.gpus_per_node, write_console=False,
                                  write_gpu_samples=False, verl_record=False)
        StudyRunner(spec, storage, launcher, console=Console(quiet=True), poll_interval_s=POLL_S).run()
        usage = launcher.usage()
        launcher.close()
        try:
            final = optuna.load_study(study_name=final_study_name(spec), storage=storage)
        except KeyError:
            return None
        result = final.user_attrs.get("result")
        if not result:
            return None
        steps = true_steps(world)
        truth = true_rate(world, final.user_attrs["final_config"], steps) / true_rate(world, spec.baseline_config(), steps)
        check_h = sum(u.gpu_s for u in usage if f".{FINAL_STAGE}." in u.run_id) / 3600
        return {"landscape": world.name, "rep": rep, "eta": result["eta"], "low": result["low"], "high": result["high"],
                "truth": truth, "check_gpu_h": check_h, "study_gpu_h": sum(u.gpu_s for u in usage) / 3600,
                "retimed": "retime" in final.user_attrs, "runs": len(final.trials)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--landscape", action="append", help="a shipped world's name or a landscape YAML (repeatable)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write every run's figures here (JSON)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    rows = []
    for landscape in args.landscape or DEFAULT_WORLDS:
        for rep in range(args.reps):
            row = run_one(landscape, rep)
            if row is None:
                print(f"SIMULATED {landscape} rep {rep}: no final check (the final config is the baseline)", flush=True)
                continue
            rows.append(row)
            print(f"SIMULATED {row['landscape']} rep {rep}: overall η {row['eta']:.3f} [{row['low']:.3f}, "
                  f"{row['high']:.3f}], noise-free {row['truth']:.3f} ({row['eta'] / row['truth'] - 1:+.1%}); the check "
                  f"{row['check_gpu_h']:,.0f} of {row['study_gpu_h']:,.0f} GPU-h, {row['runs']} runs"
                  f"{', its baseline re-timed' if row['retimed'] else ''}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    if rows:
        errors = [abs(r["eta"] / r["truth"] - 1) for r in rows]
        print(f"SIMULATED {len(rows)} runs: error median {statistics.median(errors):.1%}, largest {max(errors):.1%}; "
              f"{sum(r['low'] <= r['truth'] <= r['high'] for r in rows)} of {len(rows)} intervals hold the noise-free η; "
              f"the check {statistics.median(r['check_gpu_h'] / r['study_gpu_h'] for r in rows):.0%} of a study's "
              f"GPU-hours (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
