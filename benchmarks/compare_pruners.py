"""Which Optuna pruner for noisy η probes: Wilcoxon, Patient(Percentile) or Median?

Each simulated study runs ``--trials`` configs in random order; a config is a synthetic
noisy saturating curve (``tests/support/curves.py``) whose speed (t_mid), ceiling and step time
vary, so configs differ in true rate (noise-free chord over 500 steps). Every ``--every``
steps the trial reports its running rate — reward gain per training second so far, the
scorer's estimate on the steps so far — and asks the pruner. Reported per pruner, over
``--studies`` studies: share of GPU time saved (skipped steps' time ÷ all steps' time
without pruning), how often the truly best config was pruned, and the mean regret of the
best *completed* config's true rate vs the true best (in %).

    python benchmarks/compare_pruners.py [--studies 10] [--trials 24]

Of Optuna's pruners, the median rule suits the running rate: the rate is already a trend
fitted over all steps so far, not a jittery per-step reward, so the median rule's weakness on
noisy curves does not bite. Wilcoxon's paired test assumes independent per-step pairs, but
successive running rates share their steps, so it is over-confident and prunes the true best;
Patient(Percentile) is safe but saves less. The figures: docs/method.md, Evidence.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import optuna

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from curves import Curve, run  # noqa: E402

from verl_sweep.objectives.score import ScoreError, score_reward_rate  # noqa: E402

STEPS = 500


def pruners() -> dict[str, Callable[[], optuna.pruners.BasePruner]]:
    return {
        "none": optuna.pruners.NopPruner,
        "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=100),
        "patient(p25)": lambda: optuna.pruners.PatientPruner(
            optuna.pruners.PercentilePruner(25.0, n_startup_trials=5, n_warmup_steps=100), patience=2
        ),
        "wilcoxon(p=0.1)": lambda: optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=3),
        "wilcoxon(p=0.05)": lambda: optuna.pruners.WilcoxonPruner(p_threshold=0.05, n_startup_steps=3),
    }


def configs(rng: np.random.Generator, n: int) -> list[Curve]:
    return [
        Curve(
            t_mid_s=float(rng.uniform(1500, 9000)),
            ceiling=float(rng.uniform(0.6, 0.9)),
            step_s=float(rng.uniform(9, 15)),
            noise=0.03,
        )
        for _ in range(n)
    ]


def study_once(make: Callable[[], optuna.pruners.BasePruner], curves: list[Curve], seed: int, every: int) -> tuple[float, bool, float]:
    true = np.array([c.true_rate(STEPS) for c in curves])
    best = int(true.argmax())
    study = optuna.create_study(direction="maximize", pruner=make(), sampler=optuna.samplers.RandomSampler(seed))
    total_time = used_time = 0.0
    best_pruned = False
    completed: list[int] = []
    for i, curve in enumerate(curves):
        steps = run(curve, STEPS, seed=seed * 1000 + i)
        times = np.cumsum([s.data["timing_s/step"] for s in steps])
        total_time += float(times[-1])
        trial = study.ask()
        pruned_at = None
        value = float("nan")
        for k in range(every, STEPS + 1, every):
            try:
                value = score_reward_rate(steps[:k], n_boot=2).rate
            except ScoreError:
                continue
            trial.report(value, k)
            if k < STEPS and trial.should_prune():
                pruned_at = k
                break
        if pruned_at is None:
            study.tell(trial, value)
            used_time += float(times[-1])
            completed.append(i)
        else:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            used_time += float(times[pruned_at - 1])
            best_pruned |= i == best
    regret = 1.0 - true[completed].max() / true[best] if completed else 1.0
    return 1.0 - used_time / total_time, best_pruned, regret


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--studies", type=int, default=10)
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--every", type=int, default=50)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    logging.getLogger("objectives").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print(f"{'pruner':18s} {'GPU saved':>9s} {'best pruned':>11s} {'regret %':>8s}")
    for name, make in pruners().items():
        saved, pruned, regret = [], 0, []
        for s in range(args.studies):
            curves = configs(np.random.default_rng(s), args.trials)
            a, b, c = study_once(make, curves, s, args.every)
            saved.append(a)
            pruned += b
            regret.append(c)
        print(f"{name:18s} {np.mean(saved):9.1%} {pruned:>5d}/{args.studies:<5d} {100 * np.mean(regret):8.2f}")


if __name__ == "__main__":
    main()
