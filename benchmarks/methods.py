"""The search methods the benchmark compares, each on its own ReplayLauncher.

- ``verl-sweep``: :class:`verl_sweep.search.engine.driver.StudyRunner` as shipped, on the demo study's stages.
- the HPO peers (random, TPE, GP, BOHB-style, SMAC3, DEHB) are in :mod:`benchmarks.peers`,
  over :class:`benchmarks.joint.FairJointSpace` (every config the chain can reach, KL off
  and the chain's highest token budget included).
- ``manual``: the source's procedure (docs/method.md §1), one parameter at a time, one probe at a
  time, on the same Probe and η code.

Each returns a :class:`Trace`: the chosen config after every decision, with the GPU-hours
spent by then (read from the launcher's own slot accounting).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Callable, Collection

from verl_sweep.launchers.replay import ReplayLauncher
from verl_sweep.objectives.probe import Probe, ProbeSettings, ProbeState
from verl_sweep.objectives.score import Score, eta as eta_of
from verl_sweep.search.views.console import Console
from verl_sweep.search.engine.driver import StageResult, StudyRunner
from verl_sweep.search.engine.events import StudyListener
from verl_sweep.search.spec.study_file import StudySpec
from verl_sweep.verl_knowledge import Config, merge, to_overrides

logger = logging.getLogger(__name__)

#: virtual seconds between two driver polls (about 2 steps of a 7B probe): a finished run is
#: still seen at once (the replay clock stops at every exit), a probe at step N within ~3 steps
POLL_S = 900.0


@dataclasses.dataclass
class Trace:
    """What a method chose over time: (GPU-hours spent, config chosen then)."""

    points: list[tuple[float, Config]]
    gpu_h: float = 0.0  # total at the end
    pruned_saved_gpu_h: float = 0.0
    idle_fraction: float = 0.0
    n_probes: int = 0


def gpu_hours(launcher: ReplayLauncher) -> float:
    return sum(u.gpu_s for u in launcher.usage()) / 3600.0


def finish_trace(trace: Trace, launcher: ReplayLauncher, probe_steps: int, startup_s: float,
                 stopped_early: Collection[str] = ()) -> Trace:
    """Fill in totals: GPU-hours, GPU-hours pruning saved, idle slot share.

    ``stopped_early``: the run ids the driver pruned or stopped by the health screen (every
    probe is stopped from outside at its own step N, so "cancelled" alone says nothing)."""
    usage = launcher.usage()
    trace.gpu_h = gpu_hours(launcher)
    trace.n_probes = len(usage)
    saved = 0.0
    for u in usage:
        ran_s = u.ended_at - u.started_at
        if u.run_id in stopped_early and 0 < u.last_step < probe_steps and ran_s > startup_s:
            full_s = startup_s + (ran_s - startup_s) * probe_steps / u.last_step
            saved += (full_s - ran_s) * u.n_gpus
    trace.pruned_saved_gpu_h = saved / 3600.0
    elapsed = launcher.clock()
    busy = sum(u.ended_at - u.started_at for u in usage)
    trace.idle_fraction = 1.0 - busy / (launcher.max_concurrent * elapsed) if elapsed > 0 else 0.0
    return trace


class StageTrace(StudyListener):
    """Follows a study (``verl_sweep.search.engine.events``): each decision and each told trial, with the
    GPU-hours the launcher had spent by then."""

    def __init__(self, launcher: ReplayLauncher) -> None:
        self.launcher = launcher
        self.base: Config = {}
        self.stage_ends: list[tuple[float, Config]] = []
        self.trials: list[tuple[float, str, Config, float | None]] = []
        self.stopped_early: set[str] = set()

    def stage_started(self, index: int, stage: Any, base: dict[str, Any], explain: list[str], budget: int) -> None:
        self.base = dict(base)

    def stage_finished(self, name: str, result: StageResult) -> None:
        self.stage_ends.append((gpu_hours(self.launcher), dict(result.config)))

    def trial_finished(self, study: Any, number: int, role: Any, overrides: dict[str, Any], **details: Any) -> None:
        self.trials.append((gpu_hours(self.launcher), role, merge(self.base, overrides), details.get("eta")))
        if details.get("state") == "pruned":  # the driver's run id (verl_sweep.search.engine.trials.TrialRunner._start_asked)
            self.stopped_early.add(f"{study.study_name}.t{number:04d}")


def _storage() -> Any:
    from verl_sweep.search.database.optuna_forks import storage_class

    # One private in-memory database per run: the driver needs an RDB storage (heartbeats);
    # the storage class users get (search/database/storage.py), so the benchmark times what they run.
    return storage_class()("sqlite:///:memory:", heartbeat_interval=60, grace_period=120)


def run_staged(spec: StudySpec, launcher: ReplayLauncher, *, trace: StageTrace | None = None) -> Trace:
    """verl-sweep as shipped: the staged driver, followed by a ``StageTrace``; the choice
    changes at each stage's end."""
    trace = trace or StageTrace(launcher)
    StudyRunner(spec, _storage(), launcher, console=Console(quiet=True), listeners=[trace], poll_interval_s=POLL_S).run()
    points = [(0.0, spec.baseline_config()), *trace.stage_ends]
    return finish_trace(Trace(points), launcher, spec.probe.steps, launcher_startup_s(launcher), trace.stopped_early)


def launcher_startup_s(launcher: ReplayLauncher) -> float:
    """The launcher's start-up seconds (120 where it knows none)."""
    return launcher.startup_s if launcher.startup_s is not None else 120.0


# -- the manual procedure ----------------------------------------------------------------------


class ManualProcedure:
    """docs/method.md §1 automated faithfully: one probe at a time, one parameter at a time.

    For each parameter in turn, starting from the current config: make the first move; a move
    whose η against the current config is > 1.05 is kept and the same move is made again;
    < 0.95 is undone and the opposite move is tried (once); within 0.98-1.02 the parameter
    is done (stable). Moves: mini-batch −0.1× baseline (first try 0.7× baseline), +0.15×;
    KL coefficient ×2 / ×0.5 in 0.0005-0.01 (turning the KL loss on at 0.001); token budget:
    the source's formula value first, −10% after an OOM; lr 2e-6 first (the source's example),
    then ×1.5 / ×0.67 in 5e-7-5e-6. Each candidate is one 500-step probe on a fresh seed.
    """

    MAX_MOVES = 6

    def __init__(self, spec: StudySpec, launcher: ReplayLauncher, *, seed: int) -> None:
        self.spec = spec
        self.launcher = launcher
        self.seed = seed
        self.n = 0
        self.points: list[tuple[float, Config]] = []

    def probe(self, config: Config) -> Score | None:
        """One probe to step N; its score, or None when it failed or was stopped."""
        self.n += 1
        config = merge(config, {"data.seed": self.seed + self.n})
        from verl_sweep.launchers.base import RunSpec

        run = RunSpec(run_id=f"manual.p{self.n:03d}", overrides=tuple(to_overrides(config)), n_gpus=self.spec.hardware.n_gpus)
        settings = ProbeSettings(steps=self.spec.probe.steps, warmup_steps=self.spec.probe.warmup_steps,
                                 hang_timeout_s=self.spec.probe.hang_timeout_s, n_gpus=self.spec.hardware.n_gpus)  # fmt: skip
        probe = Probe(self.launcher, run, settings)
        probe.start()
        while True:
            outcome = probe.poll()
            if outcome is not None:
                break
            self.launcher.wait(POLL_S)
        return outcome.score if outcome.state is ProbeState.COMPLETE else None

    def run(self) -> Trace:
        from verl_sweep import verl_knowledge as V

        current = self.spec.baseline_config()
        self.points = [(0.0, dict(current))]
        score = self.probe(current)
        if score is None:
            raise RuntimeError("the baseline probe failed; the manual procedure cannot start")
        base_mb = int(V.setting(current, V.MINI_BATCH))
        batch = int(V.setting(current, "data.train_batch_size"))

        def mb(value: float) -> Config:
            step = 16  # per-GPU mini-batch (×n ÷ 8 GPUs) must stay divisible by the micro-batch
            return {V.MINI_BATCH: int(max(step, min(batch, round(value / step) * step)))}

        current, score = self.tune(current, score, first=mb(0.7 * base_mb),
                                   lower=lambda c: mb(c[V.MINI_BATCH] - 0.1 * base_mb),
                                   raise_=lambda c: mb(c[V.MINI_BATCH] + 0.15 * base_mb))  # fmt: skip
        _, coef_key = V.kl_keys(self.spec.algorithm)
        switch_key, _ = V.kl_keys(self.spec.algorithm)
        kl_on = bool(V.setting(current, switch_key))

        def kl(value: float) -> Config:
            return {switch_key: True, coef_key: float(min(0.01, max(0.0005, value)))}

        start_kl = float(V.setting(current, coef_key) or 0.001) if kl_on else 0.001
        current, score = self.tune(current, score, first=kl(start_kl * 2 if kl_on else 0.001),
                                   lower=lambda c: kl(_num(c, coef_key, 0.001) * 0.5), raise_=lambda c: kl(_num(c, coef_key, 0.001) * 2.0))  # fmt: skip
        current, score = self.tokens(current, score)
        lr_now = float(V.setting(current, V.LR) or 1e-6)

        def lr(value: float) -> Config:
            return {V.LR: float(min(5e-6, max(5e-7, value)))}

        current, score = self.tune(current, score, first=lr(2e-6 if lr_now != 2e-6 else 3e-6),
                                   lower=lambda c: lr(_num(c, V.LR, 1e-6) / 1.5), raise_=lambda c: lr(_num(c, V.LR, 1e-6) * 1.5))  # fmt: skip
        return finish_trace(Trace(self.points), self.launcher, self.spec.probe.steps, launcher_startup_s(self.launcher))

    def _eta(self, score: Score | None, incumbent: Score) -> float:
        return 0.0 if score is None else eta_of(score, [incumbent]).value

    def tune(self, current: Config, score: Score, *, first: Config,
             lower: Callable[[Config], Config], raise_: Callable[[Config], Config]) -> tuple[Config, Score]:
        """The η rule for one parameter (see the class docstring)."""
        move_name = "lower" if first else "lower"
        candidate = merge(current, first)
        direction: str | None = None  # which move is being repeated
        flipped = False
        for _ in range(self.MAX_MOVES):
            if candidate == current:
                break
            s = self.probe(candidate)
            value = self._eta(s, score)
            if value > 1.05 and s is not None:
                current, score = candidate, s
                self.points.append((gpu_hours(self.launcher), dict(current)))
                if direction is None:
                    direction = "first"
                move = lower if direction in ("first", "lower") else raise_
                if direction == "first":
                    direction = move_name
                candidate = merge(current, move(current))
                continue
            if 0.98 <= value <= 1.02 or flipped or direction not in (None, "lower", "first"):
                break  # stable, or both directions tried
            if value < 0.95 or value < 0.98:
                flipped = True
                direction = "raise"
                candidate = merge(current, raise_(current))
                continue
            break
        return current, score

    def tokens(self, current: Config, score: Score) -> tuple[Config, Score]:
        """The source's formula (GPU GB × 0.65 × 1024² ÷ (hidden/8)), rounded down to
        thousands; −10% after each OOM; kept if η > 1.02."""
        from verl_sweep import verl_knowledge as V

        value = int(self.spec.hardware.gpu_memory_gb * 0.65 * 1024**2 / (self.spec.model.hidden_size / 8) // 1000 * 1000)
        for _ in range(self.MAX_MOVES):
            candidate = merge(current, {V.TOKEN_BUDGET: value, V.CHUNKED_PREFILL: True})
            s = self.probe(candidate)
            if s is None:  # OOM (or another failure): lower the budget
                value = int(value * 0.9)
                continue
            if self._eta(s, score) > 1.02:
                current, score = candidate, s
                self.points.append((gpu_hours(self.launcher), dict(current)))
            break
        return current, score


def run_manual(spec: StudySpec, launcher: ReplayLauncher, *, seed: int) -> Trace:
    return ManualProcedure(spec, launcher, seed=seed).run()


def replay_launcher(root: Path, landscape: str) -> ReplayLauncher:
    return ReplayLauncher(root, max_concurrent=2, landscape=landscape, gpus_per_probe=8,
                          write_console=False, write_gpu_samples=False, verl_record=False)  # fmt: skip


def _num(config: Config, key: str, default: float) -> float:
    from verl_sweep import verl_knowledge as V

    value = V.setting(config, key)
    return float(default if value is None else value)


def no_nan(value: float) -> float:
    return value if math.isfinite(value) else 0.0
