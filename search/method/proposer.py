"""The proposer: every point a stage tries, and in which order.

A stage's points come, in this order of priority:

1. its first points, queued once when the stage opens (``first_points``, after the incumbent
   runs): earlier stages' undecided leaders, the space's starting points, a template layout;
2. the space's follow-up rounds (``Space.follow_up_points``), each once the points before it
   ended, the sampler's draws waiting meanwhile;
3. confirmations, the incumbent runs that pair a leader, and an early confirmation
   (``StagePolicy``), queued while this worker would otherwise sit idle or end the stage;
4. the sampler's own draws: Optuna's ``ask`` when nothing is queued, as long as the space lets
   it draw (not a pattern search; not the budget left to follow-ups that end the stage).

``Proposer.ask`` runs once per tick of the stage loop: it queues what is due on its
``Board`` (the stage study) and says whether trials start this pass; ``wants_more`` says,
after each start, whether another may. Whether the stage may start anything at all is the
stopper's (``verl_sweep.search.method.stopper``). Apart from the board it reads and writes,
it is pure: test it on records.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import math
from typing import TYPE_CHECKING, Any, Callable, Collection, Protocol, Sequence

from optuna.trial import TrialState

from verl_sweep.search.database.records import FOLLOW_UP_ORIGIN, START_ORIGIN, Assignment, Role, StageView, TrialRecord
from verl_sweep.search.method.policy import QueuedRun, structured_points
from verl_sweep.verl_knowledge import Config, merge, template_for

if TYPE_CHECKING:
    from verl_sweep.search.method.policy import StagePolicy
    from verl_sweep.search.method.stage import Stage
    from verl_sweep.search.method.stopper import Stopper
    from verl_sweep.spaces.base import Space

Trials = Sequence[TrialRecord]
#: a point to queue: its params and what it is for
Point = tuple[dict[str, Any], Assignment]


class Tick(enum.Enum):
    """What the driver does after a tick of a stage loop."""

    GO_ON = "go on"
    OVER = "over"  # the stage is over, for every worker: decide it
    LEAVE = "leave"  # a worker with nothing left in the last stage
    RUN_AHEAD = "run ahead"  # idle while other workers finish the stage, nothing of it to re-run


class Board(Protocol):
    """Where the proposer reads the stage's trials and queues its points (``StageStudy``)."""

    @property
    def name(self) -> str: ...

    def view(self, *, fresh: bool = False) -> StageView: ...

    def queue(self, params: dict[str, Any], assignment: Assignment) -> None: ...


@dataclasses.dataclass(frozen=True)
class Ask:
    """``Proposer.ask``'s answer for one pass: what the driver does after it (``then``),
    whether trials start now (``start``: queued points first, then the sampler's draws), and
    the stage as last read."""

    then: Tick
    start: bool
    view: StageView


def first_points(stage: Stage, space: Space, base: Config, *, incumbent: dict[str, Any],
                 leaders: Sequence[tuple[str, Config]] = ()) -> list[Point]:
    """The stage's first candidates, in order: earlier stages' undecided leaders moved onto
    ``base`` (``leaders``: (stage name, overrides); only points of this space other than the
    ``incumbent``'s), the space's starting points, the template layout (``Space.tries_template``).
    Each is fitted to the memory estimate first (``Space.fitted``): one that cannot fit is
    never queued. The starting points leave at least one place in the budget for the sampler,
    unless the budget has only one place: a draw before any reading is blind."""
    spec = stage.spec
    seed = spec.seeds[0]
    places = stage.budget.max_trials - spec.probe.incumbent_repeats
    room = places - 1 if places > 1 else places
    points: list[Point] = []
    taken: list[dict[str, Any]] = []
    for name, overrides in leaders:
        point = space.incumbent_params(merge(base, overrides))
        point = point and space.fitted(point, base)
        if point and point != incumbent and point not in taken and len(taken) < room:
            taken.append(point)
            points.append((point, Assignment(role=Role.CANDIDATE, seed=seed, origin=f"leader of {name}")))
    n_start = min(stage.settings.sampler.n_startup_trials, room - len(taken))
    for point in space.starting_points(base, n_start):
        point = space.fitted(point, base)
        if point and point not in taken:
            points.append((point, Assignment(role=Role.CANDIDATE, seed=seed, origin=START_ORIGIN)))
    if space.tries_template:
        template = template_for(spec.model, spec.hardware, spec.algorithm)
        template_params = space.incumbent_params(merge(base, template.config))
        template_params = template_params and space.fitted(template_params, base)
        if template_params and template_params != incumbent:
            points.append((template_params, Assignment(role=Role.CANDIDATE, seed=seed,
                                                       origin=f"template {template.name}")))
    return points


class Proposer:
    """The points of one stage as this process proposes them, on ``board``. ``free_slots``:
    the launcher's free slots; ``note``: a line for the console; ``leaves``: whether this
    worker, idle in the last stage, has nothing left there (``StageLoop.nothing_left_for_me``)."""

    def __init__(self, policy: StagePolicy, stopper: Stopper, space: Space, base: Config, board: Board, *,
                 free_slots: Callable[[], int], note: Callable[[str], None],
                 leaves: Callable[[Trials], bool]) -> None:
        self.policy = policy
        self.stopper = stopper
        self.stage = policy.stage
        self.space = space
        self.base = base
        self.board = board
        self.free_slots = free_slots
        self.note = note
        self.leaves = leaves
        #: the number of readings from which the space proposed no follow-up
        self.no_follow_up_after = -1

    # -- one pass ---------------------------------------------------------------------------------
    def ask(self, *, allowed: bool, over_time: bool, mine: Collection[int]) -> Ask:
        """What this pass tries. ``allowed``: new trials may start (False: follow the runs in
        flight only); ``over_time``: the stage's wall-clock budget is spent; ``mine``: the
        trial numbers whose runs this process follows.

        Gates, in order: the sampler or a queued point may start now; else, idle, on the
        database as it is now: queued work another worker added; while other workers finish
        the stage, confirmations (required ones first, then extra ones that fit in the wait,
        then an early one), or leave, or run ahead; with nobody running, the required
        confirmations, or the stage is over. Then a follow-up round where one is due (the
        sampler waits while a round runs), and a sampler that may not draw starts only what
        is queued."""
        board, stopper = self.board, self.stopper
        view = board.view()  # this pass's view: read again only after events that add or close trials
        may_start = allowed and stopper.may_start(view) and self._may_draw(view)
        then = Tick.GO_ON
        if not mine and not may_start:
            view = board.view(fresh=True)  # decide on the database as it is now
            if allowed and stopper.may_start(view) and self._may_draw(view):
                # The view held was behind: another worker queued work (e.g. a required
                # confirmation) that this stage still needs; never decide without it.
                may_start = True
            elif self._waiting_on_others(view, mine):
                # Idle while other workers finish the stage: confirm the top candidates now
                # (required re-runs first), then re-run them again while that fits in the
                # wait; with nothing to re-run, start the next stage from the current leader.
                if allowed and self.free_slots() > 0:
                    if (self._queue_confirmations(view, extra=False) or self._queue_confirmations(view, extra=True)
                            or self._queue_early_confirmation(view)):
                        pass
                    elif self.leaves(view):
                        self.note(f"{board.name}: only other workers' confirmations are left; "
                                  "leaving (they finish the study)")
                        return Ask(Tick.LEAVE, False, view)
                    else:
                        then = Tick.RUN_AHEAD
            elif over_time or not self._queue_confirmations(view, extra=False):
                return Ask(Tick.OVER, False, view)
        if allowed and self.space.n_follow_ups and self.free_slots() > 0:
            if self._queue_follow_ups(view):
                may_start = True
            elif may_start and self._round_in_flight(view):
                # The sampler's draws wait for the round: drawn now, they would spend the
                # budget that the next round's points, read from this one, are for.
                may_start = False
        if may_start and not self._sampler_may_draw(view):
            view = board.view()
            may_start = self._queued(view)  # its own points only, never the sampler's
        return Ask(then, may_start, view)

    def wants_more(self, view: Trials) -> bool:
        """After a start (``view``: the stage read since): may another trial start this pass?"""
        return self.stopper.may_start(view) and (self._sampler_may_draw(view) or self._queued(view))

    # -- the gates --------------------------------------------------------------------------------
    @staticmethod
    def _queued(trials: Trials) -> bool:
        return any(t.state == TrialState.WAITING for t in trials)

    @staticmethod
    def _waiting_on_others(trials: Trials, mine: Collection[int]) -> bool:
        """Trials RUNNING in other processes (workers) that this stage's result needs."""
        return any(t.state == TrialState.RUNNING and t.number not in mine for t in trials)

    def _may_draw(self, trials: Trials) -> bool:
        """Whether this pass may start a trial: always, unless the sampler may not draw (a
        pattern search, or follow-ups that end the stage) with nothing queued and no follow-up
        round to come."""
        if self._sampler_may_draw(trials) or self._queued(trials):
            return True
        _, ended, pending, more = self._follow_ups(trials)
        return more and bool(pending or ended)

    def _sampler_may_draw(self, trials: Trials) -> bool:
        """The sampler draws, unless the space is a pattern search or its follow-ups end the
        stage (``Space.follow_ups_last``) and the budget left is theirs."""
        if not self.space.follow_ups_last:
            return self.space.sampler_draws
        return self.policy.counted(trials) < self.stage.budget.max_trials - self._n_follow_ups()

    # -- follow-up rounds -------------------------------------------------------------------------
    def _n_follow_ups(self) -> int:
        n = self.space.n_follow_ups
        return min(n, self.stage.budget.max_trials // 5) if self.space.follow_ups_last else n

    def _follow_ups(self, trials: Trials) -> tuple[int, list[tuple[dict[str, Any], float]], list[dict[str, Any]], bool]:
        """The follow-ups run so far, the structured points that ended (with their η) and those
        pending, and whether the space may still propose follow-ups from them."""
        done = sum(1 for t in trials if t.assignment.origin == FOLLOW_UP_ORIGIN)
        ended, pending = structured_points(trials, every_candidate=self.space.follow_ups_last)
        more = done < self._n_follow_ups() and len(ended) != self.no_follow_up_after
        return done, ended, pending, more and not (self.space.follow_ups_last and self._sampler_may_draw(trials))

    def _round_in_flight(self, trials: Trials) -> bool:
        """A round of follow-ups (or the starting points) still runs, nothing is queued, and the
        space may have more to propose once it ended."""
        if self._queued(trials):
            return False
        _, _, pending, more = self._follow_ups(trials)
        return more and bool(pending)

    def _queue_follow_ups(self, trials: Trials) -> bool:
        """In rounds: once the starting points and the follow-ups so far all ended, the space's
        next ``Space.follow_ups_per_round`` points from what they read
        (``Space.follow_up_points``), up to ``Space.n_follow_ups``, inside the stage's budget."""
        def wanted(trials: Trials) -> tuple[int, list[tuple[dict[str, Any], float]], list[dict[str, Any]]]:
            done, ended, pending, more = self._follow_ups(trials)
            if pending or not ended or not more:
                return 0, ended, pending
            return min(self.space.follow_ups_per_round - len(pending), self._n_follow_ups() - done,
                       self.stage.budget.max_trials - self.policy.counted(trials)), ended, pending

        if wanted(trials)[0] <= 0:
            return False
        n, ended, pending = wanted(self.board.view(fresh=True))  # another worker may have queued some
        if n <= 0:
            return False
        points = self.space.follow_up_points(self.base, [*ended, *((p, math.nan) for p in pending)], n)
        points = [p for p in (self.space.fitted(p, self.base) for p in points) if p]  # only what fits
        if not points:
            self.no_follow_up_after = len(ended)  # nothing new from these: ask again after more ended
        for point in points:
            self.board.queue(point, Assignment(role=Role.CANDIDATE, seed=self.policy.spec.seeds[0],
                                               origin=FOLLOW_UP_ORIGIN))
        if points:
            params, best = max(ended, key=lambda r: r[1])
            self.note(f"{self.board.name}: {len(points)} more point(s) from the best so far "
                      f"({', '.join(f'{k}={v}' for k, v in params.items())}: η {best:.3f})")
        return bool(points)

    # -- confirmations ----------------------------------------------------------------------------
    def _queue(self, reruns: Sequence[QueuedRun]) -> bool:
        for rerun in reruns:
            self.board.queue(rerun.of.params, rerun.assignment)
        return bool(reruns)

    def _queue_confirmations(self, trials: Trials, *, extra: bool) -> bool:
        reruns = self.policy.confirmations(trials, extra=extra, now=datetime.datetime.now())
        if self._queue(reruns):
            partners = [r.assignment for r in reruns if r.assignment.role is Role.INCUMBENT]
            if partners:
                self.note(f"{self.board.name}: running the incumbent on seed(s) "
                          f"{', '.join(str(a.seed) for a in partners)}: it {partners[0].origin}")
            else:
                self.note(f"{self.board.name}: re-running on fresh seeds: "
                          + ", ".join(f"trial {r.of.number}" for r in reruns))
        return bool(reruns)

    def _queue_early_confirmation(self, trials: Trials) -> bool:
        rerun = self.policy.early_confirmation(trials)
        if rerun is None:
            return False
        self._queue([rerun])
        self.note(f"{self.board.name}: re-running trial {rerun.of.number} on a fresh seed "
                  "while its first run is still going (it runs ahead of the incumbent)")
        return True
