"""Provoke real verl failures on the GPU through the project's own probe path, and record how
they were classified: each case is a probe of the tiny study's baseline with one override
changed, started by the LocalLauncher and followed by verl_sweep.objectives.probe.Probe.

usage: python scripts/real_verl/provoke.py STUDY.yaml RUNS_DIR OUT.json [CASE...]   (default: all)
PROVOKE_DELAY_S=S waits S seconds first: a probe that dies while a neighbour on the GPU is in
vLLM's start-up memory profiling makes that neighbour fail too.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from verl_sweep.launchers.base import RunSpec
from verl_sweep.launchers.local import LocalLauncher
from verl_sweep.objectives.failures import tail
from verl_sweep.objectives.probe import Probe, ProbeSettings
from verl_sweep.search.spec.study_file import load_study
from verl_sweep.verl_knowledge import merge, to_overrides

#: name -> (override that breaks the baseline, what it provokes)
CASES = {
    # vLLM checks at start-up that the card has this fraction free: it never has all of it.
    "oom_memory_fraction": ({"actor_rollout_ref.rollout.gpu_memory_utilization": 1.0},
                            "a memory fraction beyond the card"),
    # verl's own config checks pass; the 1-GPU run cannot place a TP-2 rollout at start-up.
    "refused_tp2_on_1_gpu": ({"actor_rollout_ref.rollout.tensor_model_parallel_size": 2},
                             "a layout verl refuses at start-up"),
}


def main() -> None:
    study_path, runs_dir, out_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    cases = {name: CASES[name] for name in sys.argv[4:]} or CASES
    spec = load_study(study_path)
    time.sleep(float(os.environ.get("PROVOKE_DELAY_S", "0")))
    launcher = LocalLauncher(runs_dir, probes_per_gpu=len(cases), min_free_gpu_memory_gb=1.0)
    probes = {}
    for name, (change, _) in cases.items():
        config = merge(spec.baseline_config(), change, {"data.seed": 1})
        run_spec = RunSpec(run_id=name, overrides=tuple(to_overrides(config)), n_gpus=1)
        probe = Probe(launcher, run_spec, ProbeSettings(steps=spec.probe.steps, hang_timeout_s=600))
        probe.start()
        probes[name] = (probe, time.monotonic())
    results = {}
    while len(results) < len(probes):
        for name, (probe, started) in probes.items():
            if name in results:
                continue
            outcome = probe.poll()
            if outcome is not None:
                assert probe.handle is not None
                results[name] = {
                    "provokes": CASES[name][1],
                    "override": CASES[name][0],
                    "state": outcome.state.value,
                    "failure_kind": outcome.failure.value if outcome.failure else None,
                    "reason": outcome.reason,
                    "seconds_to_fail": round(time.monotonic() - started, 1),
                    "stderr_tail_40": tail(probe.handle.stderr_path, n_lines=40),
                    "worker_errors": tail(probe.handle.worker_errors_path, n_lines=60),
                }
                print(f"{name}: {outcome.state.value} {results[name]['failure_kind']} after "
                      f"{results[name]['seconds_to_fail']} s: {outcome.reason[:200]}", flush=True)
        time.sleep(2.0)
    out_path.write_text(json.dumps(results, indent=2))
    launcher.close()


if __name__ == "__main__":
    main()
