"""Real verl 0.9.1 + vLLM 0.24.0 runs on an H200, replayed on CPU through the metrics reader,
the scorer, the health screen and the failure classifier (tests/data/real-verl-0.9.1/, see
its PROVENANCE.md). Each test states what the device run itself did, so a reader, scorer or
classifier that drifts from real verl fails here."""

from __future__ import annotations

import gzip
import json
import math
import shutil
from pathlib import Path

import optuna
import pytest

from support import REPO

from verl_sweep.launchers.base import Launcher, RunHandle, RunSpec, RunState, RunStatus
from verl_sweep.objectives.failures import FailureKind, diagnose, failure_text, tail
from verl_sweep.objectives.health import screen
from verl_sweep.objectives.metrics import MetricsFollower, parse_console_line, read_all
from verl_sweep.objectives.sources import FileLoggerSource
from verl_sweep.objectives.score import eta, score_reward_rate, score_throughput

pytestmark = pytest.mark.fast

DATA = REPO / "tests" / "data" / "real-verl-0.9.1"
DEVICE_RUN = REPO / "tests" / "data" / "device-run-2026-12-01"
PROBE_STEPS = 11  # studies/tiny-h200.yaml's probe.steps in the device run
WARMUP = 1


def _probe(name: str) -> list:
    return read_all(DATA / f"{name}.metrics.jsonl")


@pytest.mark.parametrize(("name", "steps"), [("probe_baseline", 11), ("probe_kl_loss", 11), ("probe_speed", 6),
                                             ("grpo_37_steps", 37), ("train_from_export", 2)])
def test_reader_reads_every_real_step(name: str, steps: int) -> None:
    series = _probe(name)
    assert [s.step for s in series] == list(range(1, steps + 1))
    for s in series:  # the keys the scorer, the health screen and the GPU summary read
        for key in ("critic/score/mean", "timing_s/step", "actor/grad_norm", "actor/entropy", "perf/throughput"):
            assert isinstance(s.get(key), float), (name, s.step, key)


def test_follower_reads_a_real_file_as_it_grows(tmp_path: Path) -> None:
    lines = (DATA / "probe_baseline.metrics.jsonl").read_bytes().splitlines(keepends=True)
    path = tmp_path / "metrics.jsonl"
    follower = MetricsFollower([FileLoggerSource(path)])
    with path.open("wb") as f:
        for i, line in enumerate(lines):
            f.write(line[: len(line) // 2])  # verl writes unbuffered: a poll can see half a line
            f.flush()
            follower.read_new()
            f.write(line[len(line) // 2:])
            f.flush()
            follower.read_new()
            assert follower.last_step == i + 1
    assert follower.n_garbage == 0 and follower.source == "file"


def test_the_real_console_gives_the_same_steps_as_the_file() -> None:
    with gzip.open(DATA / "probe_baseline.stdout.log.gz", "rt", errors="replace") as f:
        console = [m for m in (parse_console_line(line) for line in f) if m is not None]
    by_file = {s.step: s for s in _probe("probe_baseline")}
    # Ray forwards the worker's console lines late: the probe was stopped when the FILE
    # reached step 11, and step 11 never reached the console. The file is what counts.
    assert [m.step for m in console] == sorted(by_file)[:-1]
    for m in console:
        assert m.get("critic/score/mean") == pytest.approx(by_file[m.step].get("critic/score/mean"), rel=1e-6)


def test_the_real_probes_score_and_pass_the_health_screen() -> None:
    for name in ("probe_baseline", "probe_baseline_seed2", "probe_kl_loss", "grpo_37_steps"):
        steps = _probe(name)
        score = score_reward_rate(steps, warmup_steps=WARMUP, n_boot=50)
        assert score.rate > 0 and math.isfinite(score.rate), name  # the toy reward rose in every run
        if name != "probe_kl_loss":
            assert screen(steps) is None, name  # no KL loss, finite grads, a rising reward


def test_the_health_screen_flags_the_real_kl_loss_run_at_its_last_step() -> None:
    # With the KL loss on at lr 1e-4, actor/kl_loss climbed to 0.325 by step 11: above the
    # method's 0.3 and rising. The device run stopped the probe at step 11 before screening
    # it, so it was scored; the probe screens its last steps now (the playback tests below).
    steps = _probe("probe_kl_loss")
    assert screen(steps[:10]) is None
    verdict = screen(steps)
    assert verdict is not None and verdict.kind == "kl_divergence" and verdict.step == 11
    speed = score_throughput(_probe("probe_speed"), warmup_steps=WARMUP, n_boot=50)
    assert speed.rate > 0


def test_too_short_a_real_probe_cannot_be_scored() -> None:
    # The device's first attempt ran 8-step probes: every one failed "cannot be scored".
    from verl_sweep.objectives.score import ScoreError

    with pytest.raises(ScoreError, match=r"only 7 of 7 scored steps .* \(need 10\)"):
        score_reward_rate(_probe("probe_baseline")[:8], warmup_steps=WARMUP, n_boot=50)


def test_eta_replayed_from_the_recordings_is_what_the_device_stored(tmp_path: Path) -> None:
    """The kl stage's candidate (KL loss 0.00059) against the incumbent's two runs, scored here
    as the driver scored them on the device; the device's η is read from its database."""
    db = tmp_path / "tiny-h200.db"
    shutil.copy(DEVICE_RUN / "tiny-h200.db", db)
    stored = {t.number: t for t in optuna.load_study(study_name="tiny-h200.kl", storage=f"sqlite:///{db}").trials}
    assert stored[2].user_attrs["overrides"]["actor_rollout_ref.actor.use_kl_loss"] is True

    def final(name: str):
        return score_reward_rate(_probe(name), warmup_steps=WARMUP, fit_ceiling=True)

    incumbents = [final("probe_baseline"), final("probe_baseline_seed2")]
    replayed = eta(final("probe_kl_loss"), incumbents)
    assert replayed.value == pytest.approx(stored[2].user_attrs["eta"], rel=1e-6)
    assert replayed.value < 1  # and the stage kept the incumbent


@pytest.mark.parametrize(
    ("log", "kind", "evidence"),
    [
        # TP 2 on a 1-GPU run: verl's config checks pass; its worker refuses at start-up
        ("failure_tp2_on_1_gpu", FailureKind.CONFIG_ERROR,
         "AssertionError: rollout world_size: 1 is not divisible by infer_world_size: 2"),
        # mini-batch 20 of a 48-prompt batch: passes verl's checks, fails at step 1's log-prob pass
        ("failure_minibatch_20", FailureKind.CONFIG_ERROR,
         "AssertionError: data size must be divisible by force_group_size * micro_batch_size_per_gpu"),
        # memory fraction 1.0: vLLM's engine core dies; its reason is not in the probe's stderr
        ("failure_memory_fraction_1.0", FailureKind.ENGINE_START,
         "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"),
        # a baseline probe whose vLLM engine died while a neighbour on the GPU was failing
        ("failure_engine_start", FailureKind.ENGINE_START,
         "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"),
    ],
)
def test_real_failures_are_classified_with_their_real_cause(log: str, kind: FailureKind, evidence: str) -> None:
    stderr = tail(DATA / f"{log}.stderr.log", n_lines=40)  # what verl_sweep.objectives.probe reads
    failure = diagnose(stderr, 1, last_step=0, expected_steps=PROBE_STEPS)
    assert failure is not None
    assert (failure.kind, failure.evidence) == (kind, evidence)
    assert kind.retryable is (kind is FailureKind.ENGINE_START)


def test_provocations_of_the_device_run_are_recorded() -> None:
    # provoke.json holds what the device's own classifier said then (before the fix above):
    # "crash" with Hydra's footer as the evidence. This keeps the raw record honest.
    record = json.loads((DEVICE_RUN / "provoke.json").read_text())
    assert set(record) == {"oom_memory_fraction", "refused_tp2_on_1_gpu"}
    for case in record.values():
        assert case["state"] == "failed" and case["seconds_to_fail"] > 30


@pytest.mark.parametrize(
    ("run", "evidence"),
    [
        # memory fraction 1.0 (2nd lease): vLLM's reason reached only the probe's stdout, forwarded by Ray
        ("run_memory_fraction_1.0", "ValueError: Free memory on device cuda:0 (102.1/139.8 GiB) on startup is less "
                                    "than desired GPU memory utilization (1.0, 139.8 GiB)."),
        # a baseline probe started beside 6 others on the GPU: their KV caches, allocated while
        # it profiled, were counted as its own (why the local launcher now pins the KV cache size
        # when probes share a GPU)
        ("run_kv_cache_neighbours", "ValueError: No available memory for the cache blocks."),
    ],
)
def test_a_real_failed_run_is_classified_by_every_log_it_left(run: str, evidence: str) -> None:
    logs = DATA / run
    text = failure_text(stderr=logs / "stderr.log", stdout=logs / "stdout.log", worker_errors=logs / "worker_errors.log")
    failure = diagnose(text, 1, last_step=0, expected_steps=PROBE_STEPS)
    assert failure is not None and failure.kind is FailureKind.OOM
    assert failure.evidence.startswith(evidence)
    # the probe's stderr alone says only that the engine did not start
    alone = diagnose(tail(logs / "stderr.log", n_lines=40), 1, last_step=0, expected_steps=PROBE_STEPS)
    assert alone is not None and alone.kind is FailureKind.ENGINE_START


def test_a_real_11_step_probe_gives_its_pruner_a_running_rate_early() -> None:
    """The 2nd lease's pruning studies: with 11-step probes no trial reported a running rate
    at all (the candidate, lr 1.2e-6, ran all 11 steps unpruned); with 24-step probes the first
    report came at step 11 (1 warm-up + 10 scored steps). A running rate now exists from the
    4th step."""
    from verl_sweep.objectives.score import MIN_RUNNING_STEPS

    steps = _probe("probe_baseline")
    running = score_reward_rate(steps[:WARMUP + MIN_RUNNING_STEPS], warmup_steps=WARMUP, n_boot=0,
                                min_steps=MIN_RUNNING_STEPS)
    assert running.rate > 0  # the incumbent's reward rises from step 2 on
    reports = {}
    for run in ("side-11-step", "prune-24-step"):
        db = DEVICE_RUN / "lease2" / run / "tiny-h200-prune.db"
        study = optuna.load_study(study_name="tiny-h200-prune.lr", storage=f"sqlite:///{db}")
        reports[run] = [sorted(t.intermediate_values) for t in study.trials]
    assert reports["side-11-step"] == [[], [], []]
    assert reports["prune-24-step"][0] == [11] and not any(reports["prune-24-step"][1:])


def _running_rates(steps: list) -> dict[int, float]:
    """The intermediate values a probe reports (objectives/probe.py running_score), step by step."""
    from verl_sweep.objectives.score import MIN_RUNNING_STEPS

    return {k: score_reward_rate(steps[:k], warmup_steps=WARMUP, n_boot=0, fit_ceiling=False,
                                 min_steps=MIN_RUNNING_STEPS).rate
            for k in range(WARMUP + MIN_RUNNING_STEPS, len(steps) + 1)}


def test_the_real_pruned_probe_is_pruned_when_replayed_a_step_ahead_of_its_incumbents() -> None:
    """3rd lease: trial 2 (lr 1.3e-6, seed 1) beside two running incumbents (lr 1e-4, seeds 1
    and 2), all three started together on the GPU. Its running rate at step 4 was 12× below
    the same-seed incumbent's; it was pruned at its step 5, when the incumbents had not yet
    reported step 5. Replayed here through the scorer and the stage's pruner, the candidate is
    pruned at step 5 and a real incumbent run in its place is not."""
    from verl_sweep.search.method.pruning import IncumbentPruner

    runs = {t: _running_rates(read_all(DATA / "pruned_probe" / f"{t}.metrics.jsonl")) for t in ("t0000", "t0001", "t0002")}
    db = DEVICE_RUN / "lease3" / "prune" / "tiny-h200-prune.db"
    stored = optuna.load_study(study_name="tiny-h200-prune.lr", storage=f"sqlite:///{db}").trials
    # then SIGTERM to the driver: the incumbents stopped as failed, queued again for a resume
    State = optuna.trial.TrialState
    assert [t.state for t in stored] == [State.FAIL, State.FAIL, State.PRUNED, State.WAITING, State.WAITING]
    for run, trial in zip(runs.values(), stored[:3], strict=True):  # the replay is what the device reported
        assert all(math.isclose(run[s], v, rel_tol=1e-6) for s, v in trial.intermediate_values.items())

    def candidate_pruned(candidate: dict[int, float], seed: int) -> bool:
        study = optuna.create_study(direction="maximize")
        for inc_seed, inc in ((1, runs["t0000"]), (2, runs["t0001"])):  # running, at step 4 only
            trial = study.ask()
            trial.set_user_attr("role", "incumbent")
            trial.set_user_attr("seed", inc_seed)
            trial.report(inc[4], 4)
        trial = study.ask()
        trial.set_user_attr("role", "candidate")
        trial.set_user_attr("seed", seed)
        for step in (4, 5):
            trial.report(candidate[step], step)
        frozen = study._storage.get_trial(trial._trial_id)
        return IncumbentPruner(n_warmup_steps=3, patience=1).prune(study, frozen)

    assert candidate_pruned(runs["t0002"], seed=1)
    assert not candidate_pruned(runs["t0001"], seed=2)


class _Playback(Launcher):
    """Writes a real recording's metrics into the run directory at once, as a poll that comes
    late (a busy driver, a long poll interval) finds a run's last steps: at the start, the run
    then running (``finish=False``), or as the run exits 0 (``finish=True``: the lines its
    last poll reads)."""

    name = "playback"

    def __init__(self, root: Path, recording: Path, *, finish: bool) -> None:
        super().__init__(root)
        self.recording, self.finish = recording, finish

    @property
    def max_concurrent(self) -> int:
        return 1

    def _start(self, spec: RunSpec) -> RunHandle:
        handle = RunHandle.in_dir(spec.run_id, self.name, self._run_dir(spec.run_id))
        if not self.finish:
            shutil.copy(self.recording, handle.metrics_path)
        return handle

    def _poll(self, handle: RunHandle) -> RunState:
        if not self.finish:
            return RunState(RunStatus.RUNNING)
        shutil.copy(self.recording, handle.metrics_path)
        return RunState(RunStatus.SUCCEEDED, exit_code=0)

    def _cancel(self, handle: RunHandle) -> None:
        pass


@pytest.mark.parametrize("finish", [False, True])
def test_a_real_run_that_diverges_in_its_last_steps_is_stopped_by_the_health_screen(
        tmp_path: Path, finish: bool) -> None:
    """The device scored the KL-loss probe (kl_loss 0.325 and rising at step 11) because the
    probe reached its last step before it was screened. Its last steps are screened now, both
    when the run is stopped at step N and when it exits on its own."""
    from verl_sweep.objectives.probe import Probe, ProbeSettings, ProbeState

    launcher = _Playback(tmp_path, DATA / "probe_kl_loss.metrics.jsonl", finish=finish)
    settings = ProbeSettings(steps=PROBE_STEPS if not finish else PROBE_STEPS + 5, warmup_steps=WARMUP)
    probe = Probe(launcher, RunSpec(run_id="kl", overrides=()), settings)
    probe.start()
    outcome = probe.poll()
    assert outcome is not None and outcome.state is ProbeState.STOPPED, outcome
    assert outcome.reason.startswith("kl_divergence"), outcome.reason
    # the healthy baseline, played back the same way, is scored
    healthy = Probe(_Playback(tmp_path / "b", DATA / "probe_baseline.metrics.jsonl", finish=finish),
                    RunSpec(run_id="base", overrides=()), settings)
    healthy.start()
    result = healthy.poll()
    assert result is not None and result.state is ProbeState.COMPLETE, result


def test_the_phases_the_final_check_retimes_are_disjoint_and_cover_the_real_steps() -> None:
    """The final check re-times a run phase by phase (``verl_sweep.objectives.retime``). verl 0.9.1
    on the H200 (a 0.36B model, the baseline layout and seed 000's template, 3 and 4 steps) logs
    those phases apart: they sum to 98.5-99.2% of every step after the first (step 1 holds
    vLLM's and the optimizer's first calls: 80-84%), so the rest of a step is a sliver read with
    the whole step's ratio, and no phase is counted twice."""
    from verl_sweep.objectives.metrics import STEP_TIME_KEY
    from verl_sweep.objectives.retime import PHASES, REST, PhaseRatios, retimed

    runs = {name: read_all(DATA / "h200-0.5b" / f"{name}.metrics.jsonl") for name in ("baseline", "template")}
    for steps in runs.values():
        for s in steps:
            share = sum(s.get(p) or 0.0 for p in PHASES) / (s.get(STEP_TIME_KEY) or math.nan)
            assert (0.80 if s.step == 1 else 0.98) <= share < 1.0, (s.step, share)
            assert s.get("timing_s/gen") and s.get("timing_s/update_actor") and s.get("timing_s/old_log_prob")
    # The two layouts' steps 2-3 (same seed): by phase the baseline took 0.89-1.05 of the
    # template's time (within these steps' spread); re-timed, the template's steps take what the
    # baseline's took over the same steps, the rest read with the whole step's ratio.
    paired = {name: {(0, s.step): s for s in steps if s.step in (2, 3)} for name, steps in runs.items()}
    ratios = PhaseRatios.of(paired["baseline"], paired["template"])
    assert ratios is not None and ratios.pairs == 2 and ratios.ratios[REST] == ratios.step
    slow = retimed(list(paired["template"].values()), ratios)
    assert sum(s.get(STEP_TIME_KEY) or 0 for s in slow) == pytest.approx(
        sum(s.get(STEP_TIME_KEY) or 0 for s in paired["baseline"].values()), rel=0.01)
    print(f"real H200 phase ratios baseline/template over steps 2-3: "
          f"{ {k.split('/')[-1]: round(v, 3) for k, v in ratios.ratios.items()} }, a step {ratios.step:.3f}")
