"""Does re-timing a run phase by phase predict another layout's steps on real verl? Offline, on
what ``side_by_side.py`` recorded: written without a GPU, not run on one yet.

The final check's baseline runs are the baseline's learning at the tuned layout, each step's
phases (``timing_s/gen``, ``old_log_prob``, ``update_actor``, …) slowed by the ratios the two
layouts' speed probes measured on their first scored steps (``verl_sweep.objectives.retime``).
This reads each arm's runs, takes the ratios from steps 2..``--probe-steps`` of the runs both
arms made (run i of one against run i of the other: the same seed), re-times the fast arm's
later steps and compares them with the slow arm's own later steps, beside one ratio for the
whole step (what the speed stages' η alone would give).

What it must show (exit 1 otherwise): over the later steps, the re-timed seconds within
``--tolerance`` (5%) of the slow arm's measured seconds, or within 1.645 standard errors of the
ratio's own spread where that is wider. Its output says by how much one ratio missed.

usage, after side_by_side.py ran both arms for enough steps on the GPU, e.g.
  python scripts/real_verl/side_by_side.py studies/h200-05b-throughput.yaml OUT --runs 2 --steps 9
  python scripts/real_verl/check_retime.py OUT/side_by_side.json [--slow baseline --fast template]
(two runs of 10 steps an arm: ~75 GPU-minutes on one H200 at 0.36B, so over three leases:
side_by_side.py resumes what a lease left.)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from verl_sweep.objectives.metrics import StepMetrics
from verl_sweep.objectives.retime import PhaseRatios, retimed, seconds


def steps_of(entry: dict[str, Any]) -> list[StepMetrics]:
    return [StepMetrics(int(row["step"]), {k: v for k, v in row.items() if k != "step"})
            for row in entry.get("metrics", [])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("side_by_side", type=Path)
    parser.add_argument("--slow", default="baseline", help="the arm whose steps are predicted")
    parser.add_argument("--fast", default="template", help="the arm whose steps are re-timed")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--probe-steps", type=int, default=4, help="the last step the ratios are read from")
    parser.add_argument("--tolerance", type=float, default=0.05)
    args = parser.parse_args(argv)

    entries = [e for e in json.loads(args.side_by_side.read_text()) if e.get("state") == "complete"]
    runs = {(e["arm"], e["run"]): steps_of(e) for e in entries}
    pairs = sorted(run for arm, run in runs if arm == args.slow and (args.fast, run) in runs)
    if not pairs:
        print(f"no run of both {args.slow} and {args.fast}: nothing to check", file=sys.stderr)
        return 2
    early = lambda steps: {s.step: s for s in steps if args.warmup_steps < s.step <= args.probe_steps}  # noqa: E731
    slow = {(run, n): s for run in pairs for n, s in early(runs[(args.slow, run)]).items()}
    fast = {(run, n): s for run in pairs for n, s in early(runs[(args.fast, run)]).items()}
    ratios = PhaseRatios.of(slow, fast)
    if ratios is None:
        print(f"fewer than 2 paired steps {args.warmup_steps + 1}-{args.probe_steps} with step times", file=sys.stderr)
        return 2
    print(f"ratios {args.slow}/{args.fast} over steps {args.warmup_steps + 1}-{args.probe_steps} of runs {pairs}: "
          + ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in ratios.ratios.items())
          + f"; a step {ratios.step:.3f} (log se {ratios.log_se:.3f}, {ratios.pairs} pairs)")
    measured = predicted = one_ratio = 0.0
    for run in pairs:
        later_slow = [s for s in runs[(args.slow, run)] if s.step > args.probe_steps]
        later_fast = [s for s in runs[(args.fast, run)] if s.step > args.probe_steps]
        common = {s.step for s in later_slow} & {s.step for s in later_fast}
        later_slow = [s for s in later_slow if s.step in common]
        later_fast = [s for s in later_fast if s.step in common]
        m, p, o = seconds(later_slow), seconds(retimed(later_fast, ratios)), seconds(later_fast) * ratios.step
        print(f"run {run}, steps {min(common, default=0)}-{max(common, default=0)}: {args.slow} measured {m:.1f} s, "
              f"re-timed {p:.1f} s ({p / m - 1:+.1%}), one ratio {o:.1f} s ({o / m - 1:+.1%})" if m else
              f"run {run}: no later steps of both arms")
        measured, predicted, one_ratio = measured + m, predicted + p, one_ratio + o
    if not measured:
        print("no later steps to predict: run side_by_side.py with more --steps", file=sys.stderr)
        return 2
    error = predicted / measured - 1
    allowed = max(args.tolerance, math.expm1(1.645 * ratios.log_se))
    print(f"all runs: re-timed {error:+.1%} of the measured seconds (allowed ±{allowed:.1%}), one ratio "
          f"{one_ratio / measured - 1:+.1%}")
    return 0 if abs(error) <= allowed else 1


if __name__ == "__main__":
    raise SystemExit(main())
