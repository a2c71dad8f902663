"""Where does verl-sweep lose η on a landscape? Per-stage traces, scored on the noise-free model.

    python -m benchmarks.diagnose LANDSCAPE [--reps 3] [--first-rep 0] [--trials polish,lr]

For each repetition and stage: the true η (vs the study baseline, at the landscape's judged
horizon) of the stage's base, of its choice, and of the best config it measured; the
measured η of its choice; the GPU-hours it spent. Then where the gap to the best reachable η
lies: (a) never visited (best measured < 95% of the best), (b) visited but not chosen (a
stage measured a config above its choice by > 2%), (c) GPU-hours of stages that kept their
incumbent, (d) the final choice below the best config measured anywhere. ``--trials`` lists
the named stages' trials: the learning knobs, the role, measured and true η. SIMULATED.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any

from benchmarks import methods as M
from benchmarks.run import true_eta_of, reference, rep_spec, true_steps


class _StageTrace(M.StageTrace):
    """Each stage's decision with the trials told in it."""

    def __init__(self, launcher: Any) -> None:
        super().__init__(launcher)
        self.stages: list[dict[str, Any]] = []
        self._start_h = 0.0
        self._start_trials = 0

    def stage_finished(self, name: str, result: Any) -> None:
        super().stage_finished(name, result)
        h = M.gpu_hours(self.launcher)
        self.stages.append({"name": name, "base": dict(self.base), "config": dict(result.config), "eta": result.eta,
                            "decision": result.summary, "gpu_h": h - self._start_h,
                            "trials": self.trials[self._start_trials:]})  # fmt: skip
        self._start_h, self._start_trials = h, len(self.trials)


def _knobs(config: dict[str, Any]) -> str:
    """The learning knobs and the token budget of a config, short."""
    kl = config.get("actor_rollout_ref.actor.kl_loss_coef") if config.get("actor_rollout_ref.actor.use_kl_loss") else None
    tokens = config.get("actor_rollout_ref.rollout.max_num_batched_tokens")
    return (f"mini {config.get('actor_rollout_ref.actor.ppo_mini_batch_size')} "
            f"lr {config.get('actor_rollout_ref.actor.optim.lr', 0):.3g} kl {'off' if kl is None else f'{kl:.3g}'}"
            + (f" tokens {tokens}" if tokens is not None else ""))


def diagnose(landscape_name: str, rep: int) -> dict[str, Any]:
    from verl_sweep.launchers.simulator import load_landscape

    spec = rep_spec(landscape_name, rep)
    landscape = load_landscape(landscape_name)
    steps = true_steps(landscape, spec)
    base_rate = landscape.true_rate(spec.baseline_config(), steps)
    with tempfile.TemporaryDirectory(prefix="vs-diag-") as tmp:
        launcher = M.replay_launcher(Path(tmp), landscape_name)
        trace = _StageTrace(launcher)
        M.run_staged(spec, launcher, trace=trace)
        launcher.close()
    true = lambda c: true_eta_of(landscape, c, base_rate, steps)  # noqa: E731
    out = []
    for s in trace.stages:
        measured = [(true(c), role, e) for _, role, c, e in s["trials"]]
        out.append({"name": s["name"], "base": true(s["base"]), "chosen": true(s["config"]), "measured_eta": s["eta"],
                    "best_seen": max([m[0] for m in measured] or [true(s["base"])]), "gpu_h": s["gpu_h"],
                    "n": len(measured), "kept": s["config"] == s["base"], "decision": s["decision"],
                    "config": s["config"], "trials": [(role, _knobs(c), e, t) for (t, role, e), (_, _, c, _) in
                                                      zip(measured, s["trials"])]})  # fmt: skip
    return {"rep": rep, "stages": out}


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    parser = argparse.ArgumentParser()
    parser.add_argument("landscape")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--first-rep", type=int, default=0)
    parser.add_argument("--trials", default="", help="comma-separated stages whose trials to list")
    args = parser.parse_args()
    best = reference(args.landscape, False)["best_eta"]
    print(f"{args.landscape}: best reachable η {best:.3f} (SIMULATED)")
    for rep in range(args.first_rep, args.first_rep + args.reps):
        d = diagnose(args.landscape, rep)
        print(f"-- rep {rep}")
        print(f"   {'stage':<10} {'base':>6} {'chosen':>6} {'best seen':>9} {'meas η':>7} {'GPU-h':>6} {'n':>3}  decision")
        for s in d["stages"]:
            print(f"   {s['name']:<10} {s['base'] / best:>6.3f} {s['chosen'] / best:>6.3f} {s['best_seen'] / best:>9.3f} "
                  f"{s['measured_eta']:>7.3f} {s['gpu_h']:>6.0f} {s['n']:>3}  {s['decision'][:90]}")  # fmt: skip
            if s["name"] in args.trials.split(","):
                for role, knobs, eta, true_eta in s["trials"]:
                    measured = "—" if eta is None else f"{eta:.3f}"
                    print(f"      {role:<10} {knobs:<32} measured {measured:>6}  true {true_eta / best:.3f}")
        final = d["stages"][-1]
        seen = max(s["best_seen"] for s in d["stages"])
        print(f"   final {final['chosen'] / best:.3f} of best; best measured anywhere {seen / best:.3f}; "
              f"kept-incumbent stages spent {sum(s['gpu_h'] for s in d['stages'] if s['kept']):.0f} of "
              f"{sum(s['gpu_h'] for s in d['stages']):.0f} GPU-h")
        print(f"   final config: { {k: v for k, v in final['config'].items() if 'path' not in k and 'files' not in k} }")


if __name__ == "__main__":
    main()
