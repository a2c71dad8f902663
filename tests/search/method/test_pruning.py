"""The incumbent pruner: stops only candidates, only after the warm-up, only after
``patience`` reports in a row below the incumbent on the same seed."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from verl_sweep.search.method.pruning import IncumbentPruner
from verl_sweep.search.method.stage import PACE

pytestmark = pytest.mark.fast

optuna.logging.set_verbosity(optuna.logging.WARNING)
STEPS = (25, 50, 75, 100, 125, 150)


def _study_with_incumbent(rate: float = 1.0) -> optuna.Study:
    study = optuna.create_study(direction="maximize")
    study.add_trial(create_trial(
        state=TrialState.COMPLETE, value=1.0, params={"x": 0.5}, distributions={"x": FloatDistribution(0, 1)},
        user_attrs={"role": "incumbent", "seed": 11}, intermediate_values={s: rate for s in STEPS},
    ))  # fmt: skip
    return study


def _running(study: optuna.Study, role: str, values: dict[int, float], seed: int = 11) -> optuna.trial.FrozenTrial:
    trial = study.ask()
    trial.set_user_attr("role", role)
    trial.set_user_attr("seed", seed)
    for step, value in values.items():
        trial.report(value, step)
    return study._storage.get_trial(trial._trial_id)


def test_a_candidate_below_the_incumbent_after_the_warm_up_is_pruned() -> None:
    pruner = IncumbentPruner(n_warmup_steps=100, patience=2)
    study = _study_with_incumbent()
    low = {s: 0.8 for s in STEPS}
    assert not pruner.prune(study, _running(study, "candidate", {s: v for s, v in low.items() if s <= 100}))
    assert pruner.prune(study, _running(study, "candidate", {s: v for s, v in low.items() if s <= 125}))


def test_one_report_below_is_not_enough() -> None:
    pruner = IncumbentPruner(n_warmup_steps=100, patience=2)
    study = _study_with_incumbent()
    assert not pruner.prune(study, _running(study, "candidate", {100: 1.1, 125: 0.8}))
    assert not pruner.prune(study, _running(study, "candidate", {100: 0.8, 125: 1.0}))


def test_slow_starters_survive_the_warm_up() -> None:
    # KL on starts slower and ends higher: far below at 25-75, level from 100.
    pruner = IncumbentPruner(n_warmup_steps=100, patience=2)
    study = _study_with_incumbent()
    assert not pruner.prune(study, _running(study, "candidate", {25: 0.5, 50: 0.6, 75: 0.7, 100: 1.0, 125: 1.01}))


def _with_params(study: optuna.Study, params: dict[str, object], values: dict[int, float]) -> optuna.trial.FrozenTrial:
    trial = study.ask()
    for name, value in params.items():
        trial.suggest_categorical(name, [value])
    trial.set_user_attr("role", "candidate")
    trial.set_user_attr("seed", 11)
    for step, value in values.items():
        trial.report(value, step)
    return study._storage.get_trial(trial._trial_id)


@pytest.mark.parametrize("params", [{"kl_coef": 0.004}, {"use_kl": True, "x": 0.5}, {"kl_ctrl_type": "adaptive"}])
def test_a_candidate_that_changes_the_kl_pull_is_pruned_only_late(params: dict[str, object]) -> None:
    """A stronger KL pull starts slower and may end higher: before ``late_from`` its running
    rate is not held against it; from there on the usual rule applies."""
    pruner = IncumbentPruner(n_warmup_steps=100, patience=2, late_from=375, pace=PACE)
    study = optuna.create_study(direction="maximize")  # the incumbent has KL off: no KL params
    study.add_trial(create_trial(
        state=TrialState.COMPLETE, value=1.0, params={"x": 0.5}, distributions={"x": FloatDistribution(0, 1)},
        user_attrs={"role": "incumbent", "seed": 11}, intermediate_values={s: 1.0 for s in range(25, 501, 25)},
    ))  # fmt: skip
    early_low = {s: 0.8 for s in (100, 125, 150, 175, 200)}
    assert not pruner.prune(study, _with_params(study, params, early_low))
    assert pruner.prune(study, _with_params(study, params, {**early_low, 375: 0.8, 400: 0.8}))
    # the same running rates without a KL change are pruned from the ordinary warm-up
    assert pruner.prune(study, _with_params(study, {"x": 0.5}, early_low))
    assert IncumbentPruner(n_warmup_steps=100, patience=2).prune(study, _with_params(study, params, early_low))


def test_a_coupled_move_is_pruned_only_late_but_a_one_knob_move_from_the_warm_up() -> None:
    """Fewer updates per step at a larger lr start slower and may end higher: a candidate that
    moves the mini-batch and lr both is held to its running rate only from ``late_from``; one
    that moves either alone (the mini-batch or lr stage's candidates) from the warm-up."""
    pruner = IncumbentPruner(n_warmup_steps=100, patience=2, late_from=375, pace=PACE)

    def candidate(params: dict[str, object], values: dict[int, float]) -> tuple[optuna.Study, optuna.trial.FrozenTrial]:
        study = optuna.create_study(direction="maximize")
        study.add_trial(create_trial(
            state=TrialState.COMPLETE, value=1.0, params={"mini_batch": 384, "lr": 2.4e-6},
            distributions={"mini_batch": FloatDistribution(256, 640), "lr": FloatDistribution(5e-7, 5e-6)},
            user_attrs={"role": "incumbent", "seed": 11}, intermediate_values={s: 1.0 for s in range(25, 501, 25)},
        ))  # fmt: skip
        trial = study.ask()
        for name, value in params.items():
            trial.suggest_float(name, value, value)
        trial.set_user_attr("role", "candidate")
        trial.set_user_attr("seed", 11)
        for step, value in values.items():
            trial.report(value, step)
        return study, study._storage.get_trial(trial._trial_id)

    early_low = {s: 0.87 for s in (100, 125, 150, 175, 200)}
    coupled = {"mini_batch": 480, "lr": 2.8e-6}
    assert not pruner.prune(*candidate(coupled, early_low))
    assert pruner.prune(*candidate(coupled, {**early_low, 375: 0.87, 400: 0.87}))
    for one_knob in ({"mini_batch": 480, "lr": 2.4e-6}, {"mini_batch": 384, "lr": 2.8e-6}, {"mini_batch": 480}, {"lr": 2.8e-6}):
        assert pruner.prune(*candidate(one_knob, early_low)), one_knob


def test_incumbents_and_confirmation_reruns_are_never_pruned() -> None:
    pruner = IncumbentPruner(n_warmup_steps=100, patience=2)
    study = _study_with_incumbent()
    low = {s: 0.5 for s in STEPS}
    assert pruner.prune(study, _running(study, "candidate", low))
    assert not pruner.prune(study, _running(study, "rerun", low, seed=13))
    assert not pruner.prune(study, _running(study, "incumbent", low, seed=12))


def test_a_candidate_just_below_the_incumbent_runs_on_but_not_one_below_the_leader() -> None:
    # kl_edge: KL-on candidates ran 0-3% below the incumbent at 100-125 steps and ended 3-23%
    # above it; the default 3% margin keeps them.
    pruner = IncumbentPruner(n_warmup_steps=100, patience=2)
    study = _study_with_incumbent()
    slow_starter = {100: 0.98, 125: 0.975}
    assert not pruner.prune(study, _running(study, "candidate", slow_starter))
    assert IncumbentPruner(margin=0.0, n_warmup_steps=100, patience=2).prune(
        study, _running(study, "candidate", slow_starter))
    # A finished candidate that beat the incumbent by more than the margin is the bar once
    # there is one: no margin, from the probe's middle, for a run that is not closing in on it.
    study.add_trial(create_trial(
        state=TrialState.COMPLETE, value=1.2, params={"x": 0.2}, distributions={"x": FloatDistribution(0, 1)},
        user_attrs={"role": "candidate", "seed": 11}, intermediate_values={s: 1.2 for s in STEPS},
    ))  # fmt: skip
    assert pruner.prune(study, _running(study, "candidate", {100: 1.15, 125: 1.15, 150: 1.15}))
    assert not pruner.prune(study, _running(study, "candidate", {100: 1.15, 125: 1.15}))  # two reports: noise


def test_below_the_leader_runs_on_before_the_middle_and_while_closing_in() -> None:
    # blind_couple_up_far: a larger mini-batch at the leader's lr starts slower and ends 7%
    # above it; at step 150 its noisy ratio to the leader read 0.965 and it was stopped.
    steps = range(100, 525, 25)
    pruner = IncumbentPruner(n_warmup_steps=100, patience=2)
    study = optuna.create_study(direction="maximize")
    for role, eta in (("incumbent", 1.0), ("candidate", 1.1)):
        study.add_trial(create_trial(
            state=TrialState.COMPLETE, value=eta, params={"x": 0.5}, distributions={"x": FloatDistribution(0, 1)},
            user_attrs={"role": role, "seed": 11}, intermediate_values={s: eta for s in steps},
        ))  # fmt: skip
    below = {s: 1.05 for s in range(100, 325, 25)}
    assert not pruner.prune(study, _running(study, "candidate", {s: v for s, v in below.items() if s < 250}))
    assert pruner.prune(study, _running(study, "candidate", below))  # past the middle, flat: stopped
    closing_in = {s: 1.0 + 0.0004 * (s - 100) for s in range(100, 325, 25)}  # 1.0 → 1.08, on to 1.16
    assert not pruner.prune(study, _running(study, "candidate", closing_in))
    # below the incumbent's margin the projection does not count
    assert pruner.prune(study, _running(study, "candidate", {s: 0.9 + 0.001 * (s - 100) for s in (100, 125)}))


@pytest.mark.parametrize("leader_eta", [1.0, 1.02, 1.03])
def test_a_leader_within_the_margin_of_the_incumbent_is_no_bar(leader_eta: float) -> None:
    # noisy_hetero rep 8: lr 5e-6 (+6% true) was stopped at step 450 of 500 because its noisy
    # running rate fell below the curve of a leader at η 1.012, i.e. the incumbent's within noise.
    pruner = IncumbentPruner(n_warmup_steps=100, patience=2)
    study = _study_with_incumbent()
    study.add_trial(create_trial(
        state=TrialState.COMPLETE, value=leader_eta, params={"x": 0.2}, distributions={"x": FloatDistribution(0, 1)},
        user_attrs={"role": "candidate", "seed": 11}, intermediate_values={s: leader_eta + 0.01 for s in STEPS},
    ))  # fmt: skip
    assert not pruner.prune(study, _running(study, "candidate", {100: 0.99, 125: 0.99}))


def test_a_candidate_ahead_of_a_running_incumbent_is_compared_where_both_have_reported() -> None:
    # Seen on the H200: probes sharing a GPU start together, and the candidate can be a step
    # ahead of the incumbent, so at its latest step there is nothing to compare with yet.
    pruner = IncumbentPruner(n_warmup_steps=3, patience=2)
    study = optuna.create_study(direction="maximize")
    _running(study, "incumbent", {3: 1.0, 4: 1.0, 5: 1.0})
    assert not pruner.prune(study, _running(study, "candidate", {3: 0.1, 4: 1.0, 5: 0.1, 6: 0.1}))
    assert pruner.prune(study, _running(study, "candidate", {3: 0.1, 4: 0.1, 5: 0.1, 6: 0.1}))
    assert not pruner.prune(study, _running(study, "candidate", {3: 0.1, 6: 0.1, 7: 0.1}))  # one step in common


@pytest.mark.parametrize(
    ("probe", "pruner", "first", "warned"),
    [
        # the demo: 500-step probes, pruning from the probe's middle, a report every 25, patience 2
        ({"steps": 500}, {}, 275, False),
        # the H200's 11-step probes with the default pruner: it would never act
        ({"steps": 11, "warmup_steps": 1}, {}, 50, True),
        # its own pruner settings: a running rate from step 4, two reports in a row by step 5
        ({"steps": 11, "warmup_steps": 1}, {"interval_steps": 1, "warmup_steps": 3}, 5, False),
        # the probe's warm-up, not the pruner's, sets the first report
        ({"steps": 40, "warmup_steps": 20}, {"interval_steps": 5, "warmup_steps": 0}, 30, False),
        ({"steps": 40, "warmup_steps": 20}, {"interval_steps": 5, "warmup_steps": 0, "patience": 4}, 40, True),
    ],
)
def test_validate_says_when_a_stage_pruner_can_never_act(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, probe: dict, pruner: dict, first: int, warned: bool
) -> None:
    from support import demo_data, write_study
    from verl_sweep.search.spec.study_file import load_study
    from verl_sweep.search.method.stage import Stage
    from verl_sweep.search.commands.validate import validate_study

    data = demo_data()
    data["probe"] = {**data["probe"], **probe}
    data["stages"] = [{"name": "lr", "space": "lr", "budget": {"max_trials": 3}, "pruner": pruner}]
    spec = load_study(write_study(tmp_path, data))
    assert Stage.of(spec, 0).first_prune_step() == first
    with caplog.at_level("WARNING", logger="verl_sweep.search.commands.validate"):
        problems, _ = validate_study(spec, with_verl=False)
    assert problems == []
    said = [r.getMessage() for r in caplog.records if "never prune" in r.getMessage()]
    assert bool(said) is warned
    if warned:
        assert said == [f"stages[0].pruner: stage lr's pruner can first stop a candidate at step {first} "
                        f"(warm-up {Stage.of(spec, 0).prune_from}, a report every "
                        f"{spec.stages[0].pruner.interval_steps}, patience {spec.stages[0].pruner.patience}), "
                        f"but its probes end at step {probe['steps']}: it will never prune. "
                        "Lower pruner.warmup_steps or lengthen the probes."]


def test_a_stopped_run_reads_no_higher_than_a_finished_one_that_ran_above_it() -> None:
    # blind_couple_up_far: a far move (lr × 4) ran 20% above the incumbent at step 175, below
    # the finished leader (η 1.049) there, and was stopped; read over the incumbent alone it
    # was the "best" point, and the polish's next round went on from it.
    from verl_sweep.search.method.policy import structured_points
    from verl_sweep.search.database.records import START_ORIGIN, TrialRecord

    steps = range(100, 525, 25)

    def record(state: TrialState, role: str, values: dict[int, float], x: float, eta: float | None = None) -> TrialRecord:
        return TrialRecord.of(create_trial(
            state=state, value=eta if state == TrialState.COMPLETE else None, params={"x": x},
            distributions={"x": FloatDistribution(0, 1)}, intermediate_values=values,
            user_attrs={"role": role, "seed": 11, "origin": START_ORIGIN, **({"eta": eta} if eta else {})},
        ))  # fmt: skip

    incumbent = record(TrialState.COMPLETE, "incumbent", {s: 1.0 for s in steps}, 0.5, 1.0)
    leader = record(TrialState.COMPLETE, "candidate", {s: 1.3 - 0.0005 * (s - 100) for s in steps}, 0.6, 1.049)
    stopped = record(TrialState.PRUNED, "candidate", {100: 1.2, 125: 1.2}, 0.7)
    ended, _ = structured_points([incumbent, leader, stopped])
    readings = {params["x"]: value for params, value in ended}
    assert readings[0.6] == 1.049 and readings[0.7] < 1.049
    assert readings[0.7] == pytest.approx(1.2 / 1.2875 * 1.049)
    # above every finished run at its last step, it reads as over the incumbent
    ahead = record(TrialState.PRUNED, "candidate", {100: 1.4, 125: 1.4}, 0.8)
    assert dict((p["x"], v) for p, v in structured_points([incumbent, leader, ahead])[0])[0.8] == pytest.approx(1.4)


def test_a_candidate_behind_on_the_far_reading_but_not_on_the_near_one_runs_on() -> None:
    # Reports read to the run's horizon; each trial also records its rate read to its own last
    # step. A run far below the incumbent's horizon reading but level with its near reading
    # (a curve that has not bent yet: its far reading is mostly noise) runs on; behind on both,
    # it is stopped.
    from verl_sweep.search.database.records import probe_rates_attrs

    pruner = IncumbentPruner(n_warmup_steps=100, patience=2)
    study = optuna.create_study(direction="maximize")
    study.add_trial(create_trial(
        state=TrialState.COMPLETE, value=1.0, params={"x": 0.5}, distributions={"x": FloatDistribution(0, 1)},
        user_attrs={"role": "incumbent", "seed": 11, **probe_rates_attrs({s: 2.0 for s in STEPS})},
        intermediate_values={s: 1.0 for s in STEPS},
    ))  # fmt: skip

    def candidate(near: float) -> optuna.trial.FrozenTrial:
        trial = study.ask()
        trial.set_user_attr("role", "candidate")
        trial.set_user_attr("seed", 11)
        for key, value in probe_rates_attrs({s: near for s in STEPS}).items():
            trial.set_user_attr(key, value)
        for step in STEPS:
            trial.report(0.8, step)
        return study._storage.get_trial(trial._trial_id)

    assert not pruner.prune(study, candidate(near=2.0))
    assert not pruner.prune(study, candidate(near=1.95))  # within the margin (3%)
    assert pruner.prune(study, candidate(near=1.8))
