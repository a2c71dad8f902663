"""Health screen on synthetic streams: healthy runs pass, sick runs stop in time."""

from __future__ import annotations

import math

import numpy as np
import pytest

from support.curves import Curve, run

from verl_sweep.objectives.health import screen
from verl_sweep.objectives.metrics import StepMetrics

pytestmark = pytest.mark.fast


def _first_verdict(steps: list[StepMetrics], **kwargs: object):
    """Replay the run step by step as the probe does; the first verdict (or None)."""
    for i in range(1, len(steps) + 1):
        verdict = screen(steps[:i], **kwargs)  # type: ignore[arg-type]
        if verdict is not None:
            return verdict
    return None


def _with(steps: list[StepMetrics], start: int, key: str, values) -> list[StepMetrics]:
    out = []
    for s in steps:
        data = dict(s.data)
        if s.step >= start:
            data[key] = values(s.step - start)
        out.append(StepMetrics(s.step, data))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_healthy_rising_runs_pass(seed: int) -> None:
    steps = run(Curve(t_mid_s=4000, noise=0.04), 500, seed=seed)
    assert _first_verdict(steps) is None


@pytest.mark.parametrize("onset", [60, 250])
def test_kl_divergence_stops_within_50_steps(onset: int) -> None:
    steps = run(Curve(), 400, seed=1)
    rng = np.random.default_rng(0)
    # KL blows up exponentially from the healthy 0.1 (doubling every 8 steps).
    steps = _with(steps, onset, "actor/kl_loss", lambda k: 0.1 * 2 ** (k / 8) + rng.normal(0, 0.01))
    verdict = _first_verdict(steps)
    assert verdict is not None and verdict.kind == "kl_divergence"
    assert verdict.step - onset <= 50
    assert "> 0.3 and rising over steps" in verdict.reason


def test_high_but_falling_kl_is_not_divergence() -> None:
    steps = run(Curve(), 300, seed=2)
    steps = _with(steps, 100, "actor/kl_loss", lambda k: max(0.05, 0.6 - 0.002 * k))
    verdict = _first_verdict(steps[:130])
    # The first window after the jump rises (0.1 → 0.6), later ones fall: only an early flag.
    later = [screen(steps[:i]) for i in range(125, 300)]
    assert all(v is None or v.kind != "kl_divergence" for v in later)
    del verdict


def test_grad_explosion_stops_within_50_steps() -> None:
    steps = run(Curve(), 400, seed=3)
    onset = 150
    steps = _with(steps, onset, "actor/grad_norm", lambda k: 0.3 * 1.3**k)
    verdict = _first_verdict(steps)
    assert verdict is not None and verdict.kind == "grad_explosion"
    assert verdict.step - onset <= 50


def test_occasional_grad_spikes_are_tolerated() -> None:
    steps = run(Curve(), 300, seed=4)
    steps = _with(steps, 1, "actor/grad_norm", lambda k: 25.0 if k % 10 == 0 else 0.4)
    assert _first_verdict(steps) is None


def test_grad_vanishing() -> None:
    steps = run(Curve(), 400, seed=5)
    onset = 120
    steps = _with(steps, onset, "actor/grad_norm", lambda k: 1e-4)
    verdict = _first_verdict(steps)
    assert verdict is not None and verdict.kind == "grad_vanishing"
    assert onset + 89 <= verdict.step <= onset + 110  # "long": 90% of a 100-step window


def test_non_finite_reward_stops_at_once() -> None:
    steps = run(Curve(), 200, seed=6)
    steps = _with(steps, 90, "critic/score/mean", lambda k: None)
    verdict = _first_verdict(steps)
    assert verdict is not None and verdict.kind == "non_finite" and verdict.step == 90
    assert "critic/score/mean is NaN/inf at step 90" in verdict.reason


def test_single_nan_grad_norm_is_survivable_three_are_not() -> None:
    steps = run(Curve(), 200, seed=7)
    one = _with(steps, 50, "actor/grad_norm", lambda k: None if k == 0 else 0.3)
    assert _first_verdict(one) is None
    three = _with(steps, 50, "actor/grad_norm", lambda k: None if k < 3 else 0.3)
    verdict = _first_verdict(three)
    assert verdict is not None and verdict.kind == "non_finite" and verdict.step == 52


@pytest.mark.parametrize(("seed", "noise"), [(0, 0.02), (1, 0.03), (2, 0.05)])
def test_plateau_stopped_within_250_steps(seed: int, noise: float) -> None:
    # Rises for 150 steps, then flat for good (the KL-stuck run of the method's field case).
    rng = np.random.default_rng(seed)
    onset = 150
    steps = []
    for i in range(1, 601):
        level = 0.3 + 0.5 * min(i, onset) / onset
        steps.append(StepMetrics(i, {"critic/score/mean": level + rng.normal(0, noise), "timing_s/step": 10.0}))
    verdict = _first_verdict(steps)
    assert verdict is not None and verdict.kind == "plateau"
    assert onset + 150 <= verdict.step <= onset + 250
    assert "reward flat over steps" in verdict.reason


def test_slowly_rising_run_is_not_a_plateau() -> None:
    rng = np.random.default_rng(9)
    steps = [
        StepMetrics(i, {"critic/score/mean": 0.3 + 0.0002 * i + rng.normal(0, 0.01)}) for i in range(1, 601)
    ]  # +0.04 per 200 steps: slow, but rising
    assert _first_verdict(steps) is None


def test_thresholds_are_keywords() -> None:
    steps = run(Curve(), 60, seed=8)
    steps = _with(steps, 1, "actor/kl_loss", lambda k: 0.2 + 0.001 * k)
    assert screen(steps) is None
    verdict = screen(steps, kl_max=0.15)
    assert verdict is not None and verdict.kind == "kl_divergence"
    assert math.isclose(float(verdict.reason.split(" ")[2]), np.median([0.2 + 0.001 * k for k in range(50, 60)]), rel_tol=1e-2)


def _simulated(config_changes: dict, *, seed: int, steps: int):
    simulator = pytest.importorskip("verl_sweep.launchers.simulator")
    landscape = simulator.load_landscape("default")
    config = {**landscape.baseline, **config_changes, "data.seed": seed}
    records = [
        StepMetrics(r.step, {k: None if not math.isfinite(v) else float(v) for k, v in r.metrics.items()})
        for r in landscape.simulate(config, max_steps=steps)
    ]
    return landscape.expected(config), records


@pytest.mark.parametrize(("lr", "seed"), [(5e-5, 0), (5e-5, 1), (1e-4, 2)])
def test_simulator_divergence_stopped_within_50_steps(lr: float, seed: int) -> None:
    expectation, steps = _simulated({"actor_rollout_ref.actor.optim.lr": lr}, seed=seed, steps=300)
    assert expectation.diverge_step is not None
    verdict = _first_verdict(steps)
    assert verdict is not None and verdict.kind in {"kl_divergence", "grad_explosion", "non_finite"}
    assert 0 <= verdict.step - expectation.diverge_step <= 50


@pytest.mark.parametrize("seed", [0, 1])
def test_simulator_healthy_baseline_passes_500_steps(seed: int) -> None:
    _, steps = _simulated({}, seed=seed, steps=500)
    assert _first_verdict(steps) is None


def test_simulator_saturated_run_is_called_a_plateau() -> None:
    # t_mid is ~260 steps at the baseline: by ~1500 steps the curve is flat (rise < 0.01/200).
    expectation, steps = _simulated({}, seed=3, steps=2500)
    flat_from = next(t for t in range(1, 2500) if expectation.reward(t + 200) - expectation.reward(t) < 0.01)
    verdict = _first_verdict(steps)
    assert verdict is not None and verdict.kind == "plateau"
    assert verdict.step <= flat_from + 250


def test_converged_run_is_no_plateau_for_a_probe_but_a_stuck_one_is() -> None:
    # The screen calls both flat; with plateau_max_rise (what a probe passes) only the run
    # that never rose is stopped: a long probe after a slow start reaches its ceiling.
    rng = np.random.default_rng(4)
    rose = [StepMetrics(i, {"critic/score/mean": 0.3 + 0.5 * min(i, 150) / 150 + rng.normal(0, 0.02)})
            for i in range(1, 601)]
    stuck = [StepMetrics(i, {"critic/score/mean": 0.3 + rng.normal(0, 0.02)}) for i in range(1, 601)]
    assert screen(rose).kind == "plateau"
    assert screen(rose, plateau_max_rise=0.05) is None
    verdict = screen(stuck, plateau_max_rise=0.05)
    assert verdict is not None and verdict.kind == "plateau"
