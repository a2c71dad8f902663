"""One run of one peer: the peers of ``peers`` (Optuna's samplers, SMAC3, DEHB) and of
``prior_peers`` (PriorBand, ASHA, Syne Tune's BOHB, Optuna's GP), by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from benchmarks import peers, prior_peers

if TYPE_CHECKING:
    from benchmarks.methods import Trace
    from verl_sweep.launchers.replay import ReplayLauncher
    from verl_sweep.search.spec.study_file import StudySpec


def run_peer(spec: StudySpec, launcher: ReplayLauncher, method: str, *, budget_gpu_h: float, seed: int) -> Trace:
    """One peer, once, until ``budget_gpu_h`` GPU-hours are spent; its trace."""
    space = peers.FairJointSpace(spec)
    ev = peers.Evaluator(spec, launcher, space, budget_gpu_h=budget_gpu_h, name=method)
    runner = {**peers.RUNNERS, **prior_peers.RUNNERS}.get(method)
    if runner is not None:
        runner(ev, seed)
    else:
        peers.run_optuna(ev, method, seed)
    return ev.trace()
