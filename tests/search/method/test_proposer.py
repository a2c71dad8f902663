"""The proposer yields a stage's points in one order, read from records alone (a board of
frozen trials, no storage): first points (earlier leaders, starting points, a template), the
space's follow-up rounds (the sampler waiting meanwhile), confirmations once the budget is
used, then the stage's end; the sampler draws when nothing is queued. A stage's tick is
ask → admit → start → poll → tell."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import BaseDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from support import REPO
from verl_sweep.search.database.records import (
    FOLLOW_UP_ORIGIN, START_ORIGIN, Assignment, Role, StageView, records,
)
from verl_sweep.search.engine.stage_loop import StageLoop
from verl_sweep.search.engine.trials import TrialRunner
from verl_sweep.search.method.policy import Start, StagePolicy
from verl_sweep.search.method.proposer import Proposer, Tick, first_points
from verl_sweep.search.method.stage import Stage
from verl_sweep.search.method.stopper import Stopper
from verl_sweep.search.spec.study_file import load_study

DEMO = load_study(REPO / "studies" / "demo.yaml")  # seeds 11-16, incumbent on 11 and 12
MINIBATCH = next(i for i, s in enumerate(DEMO.stages) if s.name == "minibatch")


def _with_stage(spec: Any, index: int, **settings: Any) -> Any:
    data = spec.model_dump(mode="json")
    data["stages"][index].update(settings)
    return type(spec).model_validate(data)


# The machinery's cases, apart from the demo's tuning: 2 incumbent runs, 4 first points and a
# draw in 7 trials; the top 3 confirmed.
SPEC = _with_stage(DEMO, MINIBATCH, budget={"max_trials": 7}, confirm_top=3)

pytestmark = pytest.mark.fast


class _Space:
    """A space of one knob ``x``: 99 never fits; follow-ups step 10 past the best so far."""

    kind = "fake"
    tries_template = False
    n_follow_ups = 0
    follow_ups_per_round = 1
    sampler_draws = True
    follow_ups_last = False

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)

    def incumbent_params(self, base: dict[str, Any]) -> dict[str, Any]:
        return {"x": base.get("x", 1)}

    def fitted(self, point: dict[str, Any], base: dict[str, Any]) -> dict[str, Any] | None:
        return None if point.get("x") == 99 else point

    def starting_points(self, base: dict[str, Any], n: int) -> list[dict[str, Any]]:
        return [{"x": 2}, {"x": 99}, {"x": 3}][:n]

    def follow_up_points(self, base: dict[str, Any], readings: list[tuple[dict[str, Any], float]],
                         n: int) -> list[dict[str, Any]]:
        best = max((r for r in readings if r[1] == r[1]), key=lambda r: r[1])[0]
        return [{"x": best["x"] + 10 * (i + 1)} for i in range(n)]


class _Board:
    """The stage's trials as frozen records; ``queue`` adds a WAITING trial."""

    name = "demo.minibatch"

    def __init__(self) -> None:
        self.trials: list[optuna.trial.FrozenTrial] = []
        self.queued: list[tuple[dict[str, Any], Assignment]] = []

    def view(self, *, fresh: bool = False) -> StageView:
        return StageView(records(self.trials))

    def add(self, state: TrialState, role: str, *, x: int | None = None, rate: float | None = None,
            seed: int = 11, **attrs: Any) -> None:
        user_attrs: dict[str, Any] = {"role": role, "seed": seed, **attrs}
        if rate is not None:
            user_attrs["score"] = {"rate": rate, "gain": rate * 100, "train_time_s": 100.0, "n_steps": 500,
                                   "ci_low": rate * 0.999, "ci_high": rate * 1.001, "rate_se": rate * 0.0005}
            user_attrs["eta"] = rate
        params = {} if x is None else {"x": x}
        dists: dict[str, BaseDistribution] = {} if x is None else {"x": FloatDistribution(0, 1000)}
        t = create_trial(state=state, value=rate if state == TrialState.COMPLETE else None, params=params,
                         distributions=dists, user_attrs=user_attrs)
        t.number = len(self.trials)
        self.trials.append(t)

    def queue(self, params: dict[str, Any], assignment: Assignment) -> None:
        self.queued.append((params, assignment))
        t = create_trial(state=TrialState.WAITING, user_attrs=assignment.user_attrs(),
                         system_attrs={"fixed_params": params})
        t.number = len(self.trials)
        self.trials.append(t)

    def run(self, number: int, *, x: int, rate: float) -> None:
        """The queued trial ``number`` ran to the end at ``rate``."""
        attrs = {k: v for k, v in self.trials[number].user_attrs.items()}
        role = attrs.pop("role")
        seed = attrs.pop("seed")
        t = create_trial(state=TrialState.COMPLETE, value=rate, params={"x": x},
                         distributions={"x": FloatDistribution(0, 1000)},
                         user_attrs={"role": role, "seed": seed, **attrs,
                                     "score": {"rate": rate, "gain": rate * 100, "train_time_s": 100.0,
                                               "n_steps": 500, "ci_low": rate * 0.999, "ci_high": rate * 1.001,
                                               "rate_se": rate * 0.0005}, "eta": rate})
        t.number = number
        self.trials[number] = t


def _proposer(space: _Space, board: _Board, notes: list[str] | None = None, *, spec: Any = SPEC) -> Proposer:
    policy = StagePolicy(Stage.of(spec, MINIBATCH))
    return Proposer(policy, Stopper(policy), space, spec.baseline_config(), board, free_slots=lambda: 1,
                    note=(notes if notes is not None else []).append, leaves=lambda trials: False)


def _ask(proposer: Proposer, *, mine: tuple[int, ...] = ()) -> tuple[Tick, bool]:
    ask = proposer.ask(allowed=True, over_time=False, mine=mine)
    return ask.then, ask.start


def test_first_points_are_earlier_leaders_then_starting_points_then_the_template() -> None:
    stage = Stage.of(SPEC, MINIBATCH)
    leaders = [("kl", {"x": 5}), ("lr", {"x": 1}), ("tokens", {"x": 5})]  # the incumbent's, a twin: left out
    points = first_points(stage, _Space(), {"x": 1}, incumbent={"x": 1}, leaders=leaders)
    assert [(p, a.origin) for p, a in points] == [({"x": 5}, "leader of kl"), ({"x": 2}, START_ORIGIN),
                                                 ({"x": 3}, START_ORIGIN)]  # 99 does not fit
    assert all(a.role is Role.CANDIDATE and a.seed == SPEC.seeds[0] for _, a in points)
    with_template = first_points(stage, _Space(tries_template=True), {"x": 1}, incumbent={"x": 0})
    assert with_template[-1][1].origin.startswith("template ")


def test_a_budget_of_one_place_goes_to_a_starting_point_not_a_blind_draw() -> None:
    """The H200 study's token stage: the incumbent and one candidate. The sampler's first draw
    reads nothing yet: the space's starting point takes the place (a draw below the
    incumbent's budget kept the baseline in 2 of 10 runs, SIMULATED)."""
    import yaml

    from verl_sweep.search.spec.study_file import parse_study

    data = yaml.safe_load((REPO / "studies" / "h200-05b-throughput.yaml").read_text())
    tokens = next(i for i, s in enumerate(data["stages"]) if s["space"] == "token_budget")
    spec = parse_study(data)
    assert spec.stages[tokens].budget.max_trials - spec.probe.incumbent_repeats == 1
    points = first_points(Stage.of(spec, tokens), _Space(), {"x": 1}, incumbent={"x": 1})
    assert [(p, a.origin) for p, a in points] == [({"x": 2}, START_ORIGIN)]
    # two places: one is left to the sampler
    data["stages"][tokens]["budget"]["max_trials"] = 3
    points = first_points(Stage.of(parse_study(data), tokens), _Space(), {"x": 1}, incumbent={"x": 1})
    assert [p for p, _ in points] == [{"x": 2}]


def test_follow_up_rounds_then_confirmations_then_the_end() -> None:
    """A pattern search (the sampler never draws): its starting points, then one round of
    follow-ups read from them (nothing else starts while a round runs), then the top
    candidate's confirmation once the budget is used, then the stage is over."""
    board = _Board()
    for seed in (11, 12):
        board.add(TrialState.COMPLETE, "incumbent", rate=1.0, seed=seed)
    for x in (2, 3):
        board.queue({"x": x}, Assignment(role=Role.CANDIDATE, seed=11, origin=START_ORIGIN))
    proposer = _proposer(_Space(n_follow_ups=3, follow_ups_per_round=3, sampler_draws=False), board)
    assert _ask(proposer) == (Tick.GO_ON, True)  # the starting points are queued: start them
    board.run(2, x=2, rate=1.3)
    assert board.trials[3].state == TrialState.WAITING
    board.run(3, x=3, rate=1.1)
    assert _ask(proposer) == (Tick.GO_ON, True)
    assert [(p, a.origin) for p, a in board.queued[2:]] == [({"x": 12}, FOLLOW_UP_ORIGIN), ({"x": 22}, FOLLOW_UP_ORIGIN),
                                                           ({"x": 32}, FOLLOW_UP_ORIGIN)]  # from the best, x=2
    for number, x, rate in ((4, 12, 1.05), (5, 22, 1.0), (6, 32, 0.9)):
        board.run(number, x=x, rate=rate)
    # 7 counted trials: the budget is used. The top candidates are confirmed on a fresh seed ...
    assert _ask(proposer) == (Tick.GO_ON, False)
    reruns = [a for _, a in board.queued[5:]]
    assert [(a.role, a.rerun_of, a.seed) for a in reruns][:2] == [(Role.RERUN, 2, 12), (Role.RERUN, 3, 12)]
    assert _ask(proposer) == (Tick.GO_ON, True)  # ... which start on the next pass
    for number, a in enumerate(reruns, start=7):
        board.run(number, x=board.trials[a.rerun_of].params["x"], rate=float(board.trials[a.rerun_of].value))
    assert _ask(proposer) == (Tick.OVER, False)


def test_the_sampler_draws_when_nothing_is_queued_and_waits_for_a_round_in_flight() -> None:
    board = _Board()
    for seed in (11, 12):
        board.add(TrialState.COMPLETE, "incumbent", rate=1.0, seed=seed)
    proposer = _proposer(_Space(), board)
    then, start = _ask(proposer)
    assert (then, start) == (Tick.GO_ON, True) and board.queued == []  # Optuna's ask: the sampler's draw
    assert proposer.wants_more(board.view())
    board.add(TrialState.RUNNING, "candidate", x=2, origin=START_ORIGIN)  # a starting point, ours
    mine = (len(board.trials) - 1,)
    assert _ask(_proposer(_Space(n_follow_ups=2), board), mine=mine) == (Tick.GO_ON, False)  # its round runs
    assert _ask(_proposer(_Space(), board), mine=mine) == (Tick.GO_ON, True)  # no rounds: the sampler draws


def test_the_sampler_waits_for_a_running_candidate_that_may_end_the_stage() -> None:
    """The stop rule ends the stage after 2 candidates in a row within 2% of the best. One
    ended flat and one still runs: a draw started now is wasted whenever that one ends flat
    too, so nothing starts until it ends; it beat the best, and the sampler draws."""
    board = _Board()
    for seed in (11, 12):
        board.add(TrialState.COMPLETE, "incumbent", rate=1.0, seed=seed)
    board.add(TrialState.COMPLETE, "candidate", x=2, rate=0.99, origin=START_ORIGIN)
    board.add(TrialState.RUNNING, "candidate", x=3, origin=START_ORIGIN)
    mine = (3,)
    assert _ask(_proposer(_Space(), board), mine=mine) == (Tick.GO_ON, False)
    board.run(3, x=3, rate=1.1)
    assert _ask(_proposer(_Space(), board)) == (Tick.GO_ON, True)


@pytest.mark.parametrize("count_pruned", [True, False])
def test_two_pruned_starting_points_end_a_stage_that_counts_them(count_pruned: bool) -> None:
    """KL, lr and λ start at both ends of their range: both pruned say both directions lose,
    and the stage ends. The mini-batch stage's are both below: its sampler still draws."""
    board = _Board()
    for seed in (11, 12):
        board.add(TrialState.COMPLETE, "incumbent", rate=1.0, seed=seed)
    for x in (2, 3):
        board.add(TrialState.PRUNED, "candidate", x=x, origin=START_ORIGIN)
    spec = _with_stage(SPEC, MINIBATCH, stop={"stable_trials": 2, "count_pruned": count_pruned})
    assert _ask(_proposer(_Space(), board, spec=spec)) == ((Tick.OVER, False) if count_pruned else (Tick.GO_ON, True))


def test_idle_while_others_run_the_stage_it_runs_ahead() -> None:
    board = _Board()
    for seed in (11, 12):
        board.add(TrialState.COMPLETE, "incumbent", rate=1.0, seed=seed)
    for x in range(2, 6):
        board.add(TrialState.COMPLETE, "candidate", x=x, rate=0.9)
    board.add(TrialState.RUNNING, "candidate", x=9)  # another worker's: the budget's last place
    assert _ask(_proposer(_Space(), board)) == (Tick.RUN_AHEAD, False)


def test_a_tick_is_ask_admit_start_poll_tell() -> None:
    calls: list[str] = []
    view = StageView(())

    class Runner:
        active: dict[int, object] = {}

        def start_while(self, v: StageView, *, more: Any) -> StageView:
            calls.append("admit+start")
            return v

        def poll(self, v: StageView) -> None:
            calls.append("poll")

        def tell_finished(self, v: StageView) -> None:
            calls.append("tell")

    def ask(**kw: Any) -> Any:
        calls.append("ask")
        return types.SimpleNamespace(then=Tick.GO_ON, start=True, view=view)

    loop = object.__new__(StageLoop)
    loop.ctx = types.SimpleNamespace(launcher=types.SimpleNamespace(clock=lambda: 0.0))
    loop.clock = types.SimpleNamespace(used=lambda now: 0.0)
    loop.study = types.SimpleNamespace(view=lambda: view)
    loop.stopper = types.SimpleNamespace(over_time=lambda used, trials: False)
    loop.proposer = types.SimpleNamespace(ask=ask, wants_more=lambda v: False)
    loop.runner = Runner()
    loop._keep_alive = lambda used: calls.append("keep alive")  # type: ignore[method-assign]
    assert loop.tick() is Tick.GO_ON
    assert calls == ["ask", "admit+start", "poll", "tell", "keep alive"]

    # Each start: Optuna's ask (a queued point, else the sampler's draw), the policy's
    # admission on the stage read after it, then the launch.
    steps: list[str] = []
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({"x": 2.0}, user_attrs={"role": "candidate", "seed": 11})

    def ask_optuna() -> optuna.trial.Trial:
        steps.append("ask")
        return study.ask()

    board = types.SimpleNamespace(study=types.SimpleNamespace(ask=ask_optuna), heartbeat=lambda ids: None,
                                  view=lambda fresh=False: StageView(records(study.get_trials(deepcopy=False))))

    def admit(view: StageView, asked: Any, now: Any) -> Start:
        steps.append("admit")
        return Start(asked.role, 11)

    def launch(trial: Any, view: StageView, decision: Start) -> bool:
        steps.append("launch")
        return True

    policy = types.SimpleNamespace(stage=Stage.of(SPEC, MINIBATCH), spec=SPEC, admit=admit)
    runner = TrialRunner(types.SimpleNamespace(free_slots=lambda: 1), None, board, policy, None, None, {},
                         run_prefix="t")  # type: ignore[arg-type]
    runner._launch = launch  # type: ignore[method-assign]
    runner.start_while(StageView(()), more=lambda v: False)
    assert steps == ["ask", "admit", "launch"]
