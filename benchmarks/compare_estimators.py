"""Which rate estimator: saturating-curve chord, OLS slope or window means?

For each (candidate, incumbent) pair of curves, run ``--reps`` repeated noisy evaluations
(candidate: one run; incumbent: two repeats on other seeds), compute η with each estimator
and report bias (mean η − true η), spread (sd of η), RMSE, and how often the 90% interval of
η holds the true η (coverage) with its mean width. True η is the ratio of the noise-free
chords (R(T) − R(0)) / T — the method's ΔR/T — over the first ``--steps`` steps.

    python benchmarks/compare_estimators.py [--reps 200] [--steps 500]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from curves import Curve, run  # noqa: E402

from verl_sweep.objectives.score import ESTIMATORS, eta, score_reward_rate  # noqa: E402

PAIRS = {
    "slow-vs-slow (early, near linear)": (Curve(t_mid_s=9000), Curve(t_mid_s=11000)),
    "mid-vs-mid (bending)": (Curve(t_mid_s=3000), Curve(t_mid_s=3600)),
    "fast-vs-mid (saturating)": (Curve(t_mid_s=1500, noise=0.04), Curve(t_mid_s=3000)),
    "faster steps, same curve": (Curve(step_s=9.0), Curve(step_s=12.0)),
    "same config (true η = 1)": (Curve(), Curve()),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--n-boot", type=int, default=300)
    args = parser.parse_args()
    print(f"{'pair':36s} {'estim.':8s} {'true':>6s} {'bias':>7s} {'sd':>6s} {'rmse':>6s} {'cover':>6s} {'width':>6s}")
    for name, (cand, inc) in PAIRS.items():
        true = cand.true_rate(args.steps) / inc.true_rate(args.steps)
        for est in ESTIMATORS:
            values, hits, widths = [], 0, []
            for rep in range(args.reps):
                kw = dict(estimator=est, n_boot=args.n_boot, seed=rep)
                c = score_reward_rate(run(cand, args.steps, seed=3 * rep), **kw)
                incs = [score_reward_rate(run(inc, args.steps, seed=3 * rep + j), **kw) for j in (1, 2)]
                e = eta(c, incs)
                values.append(e.value)
                hits += e.low <= true <= e.high
                widths.append(e.high - e.low)
            v = np.array(values)
            bias, sd = v.mean() - true, v.std(ddof=1)
            print(
                f"{name:36s} {est:8s} {true:6.3f} {bias:+7.3f} {sd:6.3f} {np.hypot(bias, sd):6.3f}"
                f" {hits / args.reps:6.2f} {np.median(widths):6.3f}"
            )


if __name__ == "__main__":
    main()
