"""benchmarks/train_mode.py's machinery on one SIMULATED world: a branch's cost, a branch that
repeats the incumbent's run, a chain that never adopts, and the GPU-hours a run adds up."""

from __future__ import annotations

import math

import pytest

from benchmarks import run as R
from benchmarks import train_mode as T
from verl_sweep.launchers.simulator import load_landscape

WORLD = "default"
KW = {"run_steps": 2000, "startup_s": 120.0}


@pytest.fixture(scope="module")
def world():  # type: ignore[no-untyped-def]
    return load_landscape(WORLD)


@pytest.fixture(scope="module")
def spec():  # type: ignore[no-untyped-def]
    return R.rep_spec(WORLD, 0)


def test_a_branch_costs_its_startup_load_steps_and_the_save_at_its_end(world, spec) -> None:  # type: ignore[no-untyped-def]
    config = spec.baseline_config()
    first = T.branch(world, config, None, 40, seed=3, **KW)
    second = T.branch(world, config, first.checkpoint, 40, seed=3, **KW)
    save_s = world.checkpoint_s(config)
    assert first.checkpoint is not None and first.checkpoint.step == 40
    assert [r.step for r in second.records] == list(range(41, 81))
    assert second.records[-1].metrics["timing_s/save_checkpoint"] == save_s
    steps_s = sum(r.metrics["timing_s/step"] for r in second.records)
    assert second.gpu_h == pytest.approx((120.0 + save_s + steps_s) * 8 / 3600.0)
    assert first.gpu_h == pytest.approx((120.0 + sum(r.metrics["timing_s/step"] for r in first.records)) * 8 / 3600.0)


@pytest.mark.parametrize("seed", [None, 7])
def test_a_branch_with_the_incumbents_config_repeats_the_incumbents_run(world, spec, seed) -> None:  # type: ignore[no-untyped-def]
    land = T.quiet(world) if seed is None else world
    config = spec.baseline_config()
    whole = T.branch(land, config, None, 100, seed=seed, save=False, **KW)
    first = T.branch(land, config, None, 50, seed=seed, **KW)
    rest = T.branch(land, config, first.checkpoint, 50, seed=seed, **KW)
    rewards = [r.metrics["critic/score/mean"] for r in rest.records]
    assert rewards == pytest.approx([r.metrics["critic/score/mean"] for r in whole.records[50:]], rel=1e-12)


def test_the_quiet_world_is_the_noise_free_curve(world, spec) -> None:  # type: ignore[no-untyped-def]
    config = spec.baseline_config()
    run = T.branch(T.quiet(world), config, None, 2000, save=False, **KW)
    assert run.final_reward == pytest.approx(world.expected(config).reward(2000), rel=1e-12)


def test_a_chain_that_never_adopts_ends_at_the_speed_configs_own_run(world, spec, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(T, "MIN_GAIN", math.inf)
    config, steps = spec.baseline_config(), 50
    chain = T.train_chain(world, spec, config, stage_steps=steps, **KW)
    still = T.quiet(world)
    assert not any(stage["adopted"] or stage["false_adoption"] for stage in chain["stages"])
    assert chain["final_config"] == config
    assert chain["final_reward"] == pytest.approx(T.branch(still, config, None, 2000, save=False, **KW).final_reward,
                                                  rel=1e-12)
    # the accounting: every stage's branches (incumbent + candidates, 2 seeds) and the continuation
    learning = [(i, s) for i, s in enumerate(spec.stages) if s.space in T.LEARNING_SPACES]
    checkpoint, branches_gpu_h = None, 0.0
    for k, (index, stage) in enumerate(learning):
        seeds = [s + 1000 * (k + 1) for s in spec.seeds[:2]]
        for c in [config, *T.candidates(spec, stage, index, config)]:
            branches_gpu_h += sum(T.branch(world, c, checkpoint, steps, seed=s, **KW).gpu_h for s in seeds)
        checkpoint = T.branch(still, config, checkpoint, steps, **KW).checkpoint
    assert chain["branches_gpu_h"] == pytest.approx(branches_gpu_h, rel=1e-12)
    final = T.branch(still, config, checkpoint, 2000 - steps * len(learning), save=False, **KW)
    assert chain["final_gpu_h"] == pytest.approx(final.gpu_h, rel=1e-12)


def test_a_runs_gpu_hours_add_up_and_are_judged_against_both_modes(world, spec) -> None:  # type: ignore[no-untyped-def]
    search = {(world.name, 0): {"final_config": spec.baseline_config(), "gpu_h": 100.0}}
    (row,) = T.run_world(WORLD, 1, [(50, "end")], search)
    assert row["gpu_h"] == pytest.approx(row["speed_gpu_h"] + row["branches_gpu_h"] + row["final_gpu_h"])
    big_r = R.full_run(WORLD, spec)["run_gpu_h"]
    assert row["cost_r"] == pytest.approx(row["gpu_h"] / big_r)
    # search mode here chose the baseline: its full run is R, its reward the baseline's
    assert row["search_cost_r"] == pytest.approx((100.0 + big_r) / big_r, rel=1e-9)
    assert row["search_reward"] == row["baseline_reward"]
    assert T.meets(row) == (row["final_reward"] >= row["baseline_reward"])
