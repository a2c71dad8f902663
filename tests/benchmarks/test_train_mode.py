"""benchmarks/train_mode.py's judge on one SIMULATED world: a segment from a checkpoint repeats
the straight run, the quiet world is the noise-free curve, a schedule that never changes its
config is the straight run, and a false adoption is one that ends below its incumbent."""

from __future__ import annotations

import pytest

from benchmarks import run as R
from benchmarks import train_mode as T
from verl_sweep.launchers.simulator import load_landscape
from verl_sweep.verl_knowledge import merge

pytestmark = pytest.mark.fast

WORLD = "default"
LR = "actor_rollout_ref.actor.optim.lr"


@pytest.fixture(scope="module")
def world():  # type: ignore[no-untyped-def]
    return T.quiet(load_landscape(WORLD))


@pytest.fixture(scope="module")
def config():  # type: ignore[no-untyped-def]
    return R.rep_spec(WORLD, 0).baseline_config()


def test_segments_from_checkpoints_repeat_the_straight_run(world, config) -> None:  # type: ignore[no-untyped-def]
    whole, _, _ = T.segment(world, config, None, 0, 300)
    _, first, _ = T.segment(world, config, None, 0, 100)
    _, second, _ = T.segment(world, config, first, 100, 200)
    end, _, _ = T.segment(world, config, second, 200, 300)
    assert first is not None and first.step == 100 and second is not None and second.step == 200
    assert end == pytest.approx(whole, rel=1e-9)


def test_the_quiet_world_is_the_noise_free_curve(world, config) -> None:  # type: ignore[no-untyped-def]
    reward, _, _ = T.segment(world, config, None, 0, 2000)
    assert reward == pytest.approx(world.expected(merge(config, {"trainer.total_training_steps": 2000})).reward(2000),
                                   rel=1e-9)


def test_a_schedule_that_keeps_its_config_is_the_straight_run(world, config) -> None:  # type: ignore[no-untyped-def]
    rows = [{"stage": s, "from": a, "to": b, "config": config, "incumbent": config, "adopted": False}
            for s, a, b in (("kl", 0, 250), ("lr", 250, 500), ("train", 500, 2000))]
    reward, falses = T.judge(world, rows, 2000)
    assert falses == []
    assert reward == pytest.approx(T.segment(world, config, None, 0, 2000)[0], rel=1e-9)


def test_an_adoption_is_false_when_the_incumbents_window_rises_faster(world, config) -> None:  # type: ignore[no-untyped-def]
    slow = merge(config, {LR: 5e-7})  # half the baseline's lr: slower all the way
    rows = [{"stage": "lr", "from": 0, "to": 250, "config": slow, "incumbent": config, "adopted": True},
            {"stage": "train", "from": 250, "to": 2000, "config": slow, "incumbent": slow, "adopted": False}]
    _, falses = T.judge(world, rows, 2000)
    assert falses == [True] and rows[0]["false"] is True and rows[0]["false_to_end"] is True
    rows[0].update(config=config, incumbent=slow)
    rows[1].update(config=config, incumbent=config)
    _, falses = T.judge(world, rows, 2000)
    assert falses == [False]


def test_a_window_from_scratch_rises_from_the_models_first_reward(world, config) -> None:  # type: ignore[no-untyped-def]
    # Every run starts at the model's own reward: a from-scratch window's rate is its rise from
    # step 1, not its whole reward over its seconds (which makes any two configs look alike).
    first, _, first_s = T.segment(world, config, None, 0, 1)
    reward, _, seconds = T.segment(world, config, None, 0, 150)
    assert first > 0 and reward > first
    assert T.rise_rate(world, config, None, 0, 150) == pytest.approx((reward - first) / (seconds - first_s), rel=1e-9)
    _, checkpoint, _ = T.segment(world, config, None, 0, 150)
    later, _, later_s = T.segment(world, config, checkpoint, 150, 300)
    assert T.rise_rate(world, config, checkpoint, 150, 300) == pytest.approx((later - reward) / later_s, rel=1e-9)
