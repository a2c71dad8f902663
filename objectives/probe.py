"""One probe: start a short verl run through a launcher, follow its metrics live, stop it at
step N from outside, and turn what happened into an outcome the driver can tell Optuna.

The probe keeps the full run's learning-rate horizon in its config (verl would squeeze a
cosine schedule into ``total_training_steps``) and stops the run itself when step N arrives.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from typing import Any

from verl_sweep.launchers.base import Launcher, RunHandle, RunSpec, RunStatus
from verl_sweep.objectives.failures import FailureKind, diagnose, failure_text
from verl_sweep.objectives.health import HealthVerdict, screen
from verl_sweep.objectives.metrics import STEP_TIME_KEY, MetricsFollower, StepMetrics
from verl_sweep.objectives.sources import run_sources
from verl_sweep.objectives.score import (
    MIN_RUNNING_STEPS,
    MIN_SCORED_STEPS,
    Metric,
    Score,
    ScoreError,
    score_reward_rate,
    score_throughput,
    settled_at,
)
from verl_sweep.objectives.utilisation import read_samples, summarise

logger = logging.getLogger(__name__)

#: a probe counts as hung only after this many real seconds without new metrics as well
MIN_REAL_HANG_S = 10.0
#: a plateau stops a probe only below this rise of the reward since its first steps: a run
#: that rose and levelled off has converged (long probes after a slow start reach their
#: ceiling), and its rate over the whole probe is the result, not a fault
CONVERGED_RISE = 0.05
#: a plateau window no run fills
NEVER = 2**62
#: bootstrap resamples for the score a stopped (pruned, unhealthy) run keeps
KEPT_N_BOOT = 200


class ProbeState(enum.Enum):
    RUNNING = "running"
    COMPLETE = "complete"  # reached step N (or finished) and was scored
    STOPPED = "stopped"  # stopped by the health screen (diverging, plateau)
    PRUNED = "pruned"  # stopped by the driver's pruner
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    steps: int
    #: what the probe is scored on (``verl_sweep.search.method.stage.Stage`` says, from what the knobs move)
    metric: Metric = Metric.REWARD_RATE
    warmup_steps: int = 0
    hang_timeout_s: float = 1800.0
    #: stop a run that diverges or plateaus (learning probes; a speed probe's reward is noise)
    health_screen: bool = True
    n_gpus: int = 1
    #: bootstrap resamples of a finished probe's score (its interval). The rate itself is
    #: fitted on the data alone: a caller that reads only the rate may pass 0.
    n_boot: int = 500
    #: a speed-only probe ends as complete once its last two scored steps' tokens/s agree
    #: within this fraction (0: it runs all ``steps``)
    settle_tolerance: float = 0.0
    #: a learning probe's score (running and final) reads its fitted curve to this step (the
    #: full run's length: a study chooses the config of a whole run); None: to the probe's end
    horizon_steps: int | None = None
    #: the health screen calls a flat reward stuck (a train-mode branch late in the run may be
    #: near its ceiling from its first step: flat, and not stuck)
    plateau_screen: bool = True
    #: how the reward's rise is read (``verl_sweep.objectives.score.ESTIMATORS``): a saturating
    #: curve from the run's start, or a line over the probe's steps (a train-mode branch's
    #: window, late on a curve whose start it never saw)
    estimator: str = "curve"


@dataclasses.dataclass(frozen=True)
class ProbeOutcome:
    state: ProbeState
    score: Score | None = None
    failure: FailureKind | None = None
    reason: str = ""
    last_step: int = 0
    startup_s: float | None = None
    #: GPU-seconds the probe held (its launcher's ``run_time``, × GPUs)
    gpu_time_s: float = 0.0
    stderr_tail: str = ""
    #: GPU utilisation summary and diagnosis (verl_sweep.objectives.utilisation), when samples exist
    gpu: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "state": self.state.value,
            "reason": self.reason,
            "last_step": self.last_step,
            "startup_s": None if self.startup_s is None else round(self.startup_s, 3),
            "gpu_time_s": round(self.gpu_time_s, 3),
        }
        if self.failure is not None:
            data["failure_kind"] = self.failure.value
        return data


def score_steps(settings: ProbeSettings, steps: list[StepMetrics], *, n_boot: int | None = None,
                final: bool = True, min_steps: int = MIN_SCORED_STEPS) -> Score:
    """A run's ``steps`` scored as a probe with ``settings`` scores its own (raises ``ScoreError``);
    ``final``: the finished run's score (a running one fits no ceiling)."""
    n_boot = settings.n_boot if n_boot is None else n_boot
    if settings.metric is Metric.THROUGHPUT:
        return score_throughput(steps, warmup_steps=settings.warmup_steps, n_gpus=settings.n_gpus, n_boot=n_boot)
    return score_reward_rate(
        steps, warmup_steps=settings.warmup_steps, fit_ceiling=final, n_boot=n_boot, min_steps=min_steps,
        horizon_steps=settings.horizon_steps, estimator=settings.estimator,
    )


class Probe:
    """Follows one run. The driver calls ``poll()`` in its loop until it returns an outcome."""

    def __init__(self, launcher: Launcher, spec: RunSpec, settings: ProbeSettings) -> None:
        self.launcher = launcher
        self.spec = spec
        self.settings = settings
        self.handle: RunHandle | None = None
        self.follower: MetricsFollower | None = None
        self.started_at = 0.0
        self.first_step_at: float | None = None
        self._outcome: ProbeOutcome | None = None
        self._real_last_progress = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> RunHandle:
        self.handle = self.launcher.start(self.spec)
        self._follow(self.handle)
        return self.handle

    def attach(self, handle: RunHandle) -> None:
        """Follow a run started earlier (a re-attached Ray job)."""
        self.handle = handle
        self._follow(handle)

    def _follow(self, handle: RunHandle) -> None:
        self.started_at = self.launcher.clock()
        self._real_last_progress = time.monotonic()
        self.follower = MetricsFollower(run_sources(handle.run_dir, metrics_path=handle.metrics_path),
                                        clock=self.launcher.clock)

    def _real_silence_s(self) -> float:
        """Real seconds since the last new metrics (or the start). On a compressed clock (the
        simulator) a busy machine's scheduling jitter alone spans simulated hours."""
        return time.monotonic() - self._real_last_progress

    @property
    def steps(self) -> list[StepMetrics]:
        """The steps read, up to where the probe's own rule ends it (``end_step``)."""
        assert self.follower is not None
        end = self.end_step()
        return [s for s in self.follower.series if 1 <= s.step <= end]

    def end_step(self) -> int:
        """The probe's last step by its own rule: ``settings.steps``, or for a speed probe the
        first step at which its tokens/s settled. A driver that reads a batch of steps at once
        (on the simulator's compressed clock one poll spans tens of steps) scores, and charges,
        the probe up to there, as a driver reading each step as it comes would have stopped it."""
        assert self.follower is not None
        if self.settings.metric is Metric.THROUGHPUT and self.settings.settle_tolerance > 0:
            read = [s for s in self.follower.series if 1 <= s.step <= self.settings.steps]
            settled = settled_at(read, warmup_steps=self.settings.warmup_steps, tolerance=self.settings.settle_tolerance)
            if settled is not None:
                return settled
        return self.settings.steps

    def running_score(self, *, n_boot: int = 0) -> Score | None:
        """The score of the steps so far, or None if too few. Intermediate reports need only
        its value, so by default there is no bootstrap (the interval is infinite); a score
        that is kept (a stopped run's) passes a real ``n_boot``."""
        try:
            return self._score(self.steps, n_boot=n_boot, final=False, min_steps=MIN_RUNNING_STEPS)
        except ScoreError:
            return None

    def stop(self, state: ProbeState, reason: str) -> ProbeOutcome:
        """Stop the run from outside (pruned, or stopped by the driver) and close the probe."""
        assert self.handle is not None
        self.launcher.cancel(self.handle)
        score = self.running_score(n_boot=KEPT_N_BOOT)
        self._outcome = self._finish(state, reason=reason, score=score)
        return self._outcome

    # -- the loop ----------------------------------------------------------------------------
    def poll(self) -> ProbeOutcome | None:
        """Read new metrics and the run state; returns the outcome once the probe is over."""
        if self._outcome is not None:
            return self._outcome
        assert self.handle is not None and self.follower is not None
        new = self.follower.read_new()
        now = self.launcher.clock()
        if new:
            self._real_last_progress = time.monotonic()
        if new and self.first_step_at is None:
            first = next((s for s in self.follower.series if s.step >= 1), None)
            if first is not None:
                self.first_step_at = now - float(first.data.get(STEP_TIME_KEY) or 0.0)
        # Screen before the last-step check: a run that diverges in its last steps is unhealthy too.
        verdict = self._health_verdict() if new else None
        if verdict is not None:
            return self._stopped_by_health(verdict)
        if self.follower.last_step >= self.end_step():
            self.launcher.cancel(self.handle)
            self._outcome = self._scored_outcome()
            return self._outcome
        state = self.launcher.poll(self.handle)
        if state.status.is_finished:
            if self.follower.read_new(final=True) and (verdict := self._health_verdict()) is not None:  # the last lines
                return self._stopped_by_health(verdict)
            if self.follower.last_step >= self.settings.steps or (
                state.status is RunStatus.SUCCEEDED and self.follower.last_step > 0
            ):
                self._outcome = self._scored_outcome()
                return self._outcome
            # diagnose takes the most specific signature anywhere in the text
            stderr = failure_text(stderr=self.handle.stderr_path, stdout=self.handle.stdout_path,
                                  worker_errors=self.handle.worker_errors_path)
            failure = diagnose(
                stderr,
                state.exit_code,
                last_step=self.follower.last_step,
                expected_steps=self.settings.steps,
            )
            if failure is None:
                self._outcome = self._scored_outcome()
                return self._outcome
            reason = f"{failure.kind.value}: {failure.evidence.strip()[:200] or state.message}"
            self._outcome = self._finish(ProbeState.FAILED, reason=reason, failure=failure.kind, stderr=stderr)
            return self._outcome
        last_update = self.follower.last_update_time or self.started_at
        if now - last_update > self.settings.hang_timeout_s and self._real_silence_s() > MIN_REAL_HANG_S:
            self.launcher.cancel(self.handle)
            reason = f"no new metrics for {now - last_update:.0f} s (hang timeout {self.settings.hang_timeout_s:.0f} s)"
            self._outcome = self._finish(ProbeState.FAILED, reason=reason, failure=FailureKind.HANG)
            return self._outcome
        return None

    def _health_verdict(self) -> HealthVerdict | None:
        if not self.settings.health_screen:
            return None
        if not self.settings.plateau_screen:
            return screen(self.steps, plateau_steps=NEVER)
        return screen(self.steps, plateau_max_rise=CONVERGED_RISE)

    def _stopped_by_health(self, verdict: HealthVerdict) -> ProbeOutcome:
        assert self.handle is not None
        self.launcher.cancel(self.handle)
        self._outcome = self._finish(
            ProbeState.STOPPED, reason=f"{verdict.kind}: {verdict.reason}", score=self.running_score(n_boot=KEPT_N_BOOT)
        )
        return self._outcome

    def score_of(self, steps: list[StepMetrics]) -> Score:
        """``steps`` scored as this probe scores its own (raises ``ScoreError``)."""
        return score_steps(self.settings, steps)

    def _score(self, steps: list[StepMetrics], *, n_boot: int | None = None, final: bool = True,
               min_steps: int = MIN_SCORED_STEPS) -> Score:
        return score_steps(self.settings, steps, n_boot=n_boot, final=final, min_steps=min_steps)

    def _scored_outcome(self) -> ProbeOutcome:
        try:
            score = self._score(self.steps)
        except ScoreError as e:
            return self._finish(ProbeState.FAILED, reason=f"cannot be scored: {e}", failure=FailureKind.CRASH)
        return self._finish(ProbeState.COMPLETE, score=score, reason="")

    def _finish(
        self,
        state: ProbeState,
        *,
        reason: str,
        score: Score | None = None,
        failure: FailureKind | None = None,
        stderr: str = "",
    ) -> ProbeOutcome:
        assert self.handle is not None
        last_step = self.follower.last_step if self.follower else 0
        if state is ProbeState.COMPLETE:  # ended by its rule: not past the step the rule ends it
            last_step = min(last_step, self.end_step())
        ran = self.launcher.run_time(self.handle, started_at=self.started_at, ended_at=self.launcher.clock(),
                                     first_step_at=self.first_step_at, last_step=last_step)
        return ProbeOutcome(
            state=state,
            score=score,
            failure=failure,
            reason=reason,
            last_step=last_step,
            startup_s=ran.startup_s,
            gpu_time_s=ran.held_s * max(1, self.spec.n_gpus),
            stderr_tail=stderr,
            gpu=self._gpu_summary(),
        )

    def _gpu_summary(self) -> dict[str, Any] | None:
        if self.handle is None:
            return None
        samples = read_samples(self.handle.files.gpu_samples)
        return summarise(samples, self.follower.series if self.follower else [])
