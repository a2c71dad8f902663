"""``verl_sweep.search.method.stage.Stage``: what a stage measures, how long its probes run, when it prunes and
what it costs, worked out once from the study file (and a stage study's stored probe length)."""

from __future__ import annotations

from typing import Any

import pytest
from optuna.trial import TrialState, create_trial

from verl_sweep.objectives.score import Metric
from verl_sweep.search.database.records import TrialRecord
from verl_sweep.search.method.stage import Stage, stages_of
from verl_sweep.search.views.status import gpu_hours_saved
from verl_sweep.search.spec.study_file import parse_study
from verl_sweep.spaces import Moves, SpaceError

from support import demo_data

pytestmark = pytest.mark.fast


def _spec(**changes: Any) -> Any:
    data = demo_data()
    data.update(changes)
    return parse_study(data)


SPEC = _spec()  # systems, tokens (speed); minibatch, kl, lr, polish (learning); 500/30-step probes


def test_what_the_knobs_move_decides_the_probe() -> None:
    systems, tokens, minibatch = (Stage.of(SPEC, i) for i in range(3))
    assert systems.moves is Moves.SPEED and tokens.moves is Moves.SPEED and minibatch.moves is Moves.LEARNING
    for speed in (systems, tokens):
        assert (speed.probe_steps, speed.warmup_steps, speed.metric) == (30, 1, Metric.THROUGHPUT)
        assert not speed.probe.health_screen and speed.probe.metric is Metric.THROUGHPUT
        assert (speed.report_every, speed.prune_from, speed.late_prune_from) == (3, 15, 0)
        assert not speed.may_be_stretched
    assert (minibatch.probe_steps, minibatch.warmup_steps, minibatch.metric) == (500, 0, Metric.REWARD_RATE)
    assert minibatch.probe.health_screen
    assert (minibatch.report_every, minibatch.prune_from, minibatch.late_prune_from) == (25, 250, 375)
    assert [s.learns for s in stages_of(SPEC)] == [False, False, True, True, True, True]


def test_a_slow_start_stretches_learning_stages_only() -> None:
    lr = Stage.of(SPEC, 4, slow_start=True)
    assert lr.stretch == 2 and lr.probe_steps == 1000 and not lr.may_stretch
    assert (lr.report_every, lr.prune_from, lr.late_prune_from) == (50, 750, 750)
    assert Stage.of(SPEC, 1, slow_start=True).stretch == 1  # a speed stage is not stretched
    assert Stage.of(SPEC, 4).may_stretch and Stage.stored(SPEC, 4, 1000) == lr
    assert Stage.stored(SPEC, 4, 2000).stretch == 4  # a study stored with the factor it ran
    own = _spec(stages=[{"name": "lr", "space": "lr", "budget": {"max_trials": 4}, "probe_steps": 120}])
    assert Stage.of(own, 0, slow_start=True).probe_steps == 120  # its own length is never stretched


def test_an_unknown_space_names_the_registered_ones() -> None:
    spec = _spec(stages=[{"name": "x", "space": "learning_rate", "budget": {"max_trials": 4}}])
    with pytest.raises(SpaceError, match=r"stages\[0\]\.space must be one of \[.*'lr'.*\], but got 'learning_rate'"):
        Stage.of(spec, 0)


def test_probe_length_and_pruner_reach_are_checked_on_the_stage() -> None:
    short = _spec(probe={"steps": 8, "warmup_steps": 1})
    problem = Stage.of(short, 2).probe_length_problem()
    assert problem == ("probe.steps: a probe of stage minibatch must score at least 10 steps after its warm-up (1), "
                       "but 8 steps leave 7. Raise it to at least 11.")
    assert Stage.of(SPEC, 2).probe_length_problem() is None and Stage.of(SPEC, 0).probe_length_problem() is None
    assert Stage.of(SPEC, 2).first_prune_step() == 275  # half the probe, then 2 reports in a row below the bar
    assert "will never prune" in (Stage.of(short, 2).pruner_reach_warning() or "")


def test_the_cost_of_a_stage_is_its_probes_at_its_length() -> None:
    tokens, lr = Stage.of(SPEC, 1), Stage.of(SPEC, 4)
    assert tokens.max_probes == 10 + 3 and lr.max_probes == 5 + 1  # its budget and the top confirmed
    assert tokens.cost_estimate_gpu_h(step_s=36.0, startup_s=120.0) == pytest.approx(13 * (120 + 30 * 36) * 8 / 3600)
    assert lr.cost_estimate_gpu_h(step_s=36.0) == pytest.approx(6 * 500 * 36 * 8 / 3600)


def _pruned(last_step: int, step_s: float) -> TrialRecord:
    probe = {"last_step": last_step, "startup_s": 0.0, "gpu_time_s": last_step * step_s * 8}
    return TrialRecord.of(create_trial(state=TrialState.PRUNED, user_attrs={"probe": probe, "role": "candidate"}))


def test_status_costs_a_speed_stage_at_its_speed_probe_length() -> None:
    """A speed stage whose only finished trial was pruned: the steps it saved are counted to
    its 30-step probe, not to the study's 500."""
    saved = gpu_hours_saved(Stage.of(SPEC, 1), [_pruned(last_step=12, step_s=36.0)])
    assert saved == pytest.approx((30 - 12) * 36.0 * 8 / 3600)


def test_learning_probes_are_judged_over_the_run_the_study_tunes_for() -> None:
    # The study's run_steps, else the baseline's own length, else 2,000 steps; read no further
    # than 4× the probe (the method's probes are ¼ of its runs); speed probes read tokens/s,
    # which no horizon moves.
    from verl_sweep.search.engine.final_check import final_probe

    def with_run(**changes: Any) -> Any:
        return _spec(baseline={**demo_data()["baseline"], "trainer.total_training_steps": 1200}, **changes)

    assert Stage.of(SPEC, 2).probe.horizon_steps == 2000  # the demo's gsm8k files are not local
    assert Stage.of(SPEC, 0).probe.horizon_steps is None
    assert Stage.of(with_run(), 2).probe.horizon_steps == 1200
    assert Stage.of(with_run(run_steps=1600), 2).probe.horizon_steps == 1600
    assert final_probe(with_run(run_steps=1600)).horizon_steps == 1600
    assert Stage.of(with_run(run_steps=10_000), 2).probe.horizon_steps == 2000
