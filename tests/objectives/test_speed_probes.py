"""Stage 0 on real hardware: speed probes that end once their throughput has settled, and a
systems space that asks only the knobs that can matter (the batching of every pass, vLLM's
batch and CUDA graphs) and sets the ones that have a single valid value."""

from __future__ import annotations

import dataclasses

import re
from pathlib import Path
from typing import Any

import optuna
import pytest

from support import REPO

from verl_sweep.launchers.base import Launcher, RunHandle, RunSpec, RunState, RunStatus
from verl_sweep.objectives.metrics import StepMetrics
from verl_sweep.objectives.score import Metric, throughput_settled
from verl_sweep.spaces import build_space
from verl_sweep import verl_knowledge as L
from verl_sweep.spaces import systems as S
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.verl_knowledge import merge

DATA = REPO / "tests" / "data" / "real-verl-0.9.1"
H200 = HardwareFacts(gpus_per_node=1, gpu_memory_gb=141)
QWEN_05B = ModelFacts(hidden_size=896, num_attention_heads=14, n_params_b=0.358, max_prompt_length=256,
                      max_response_length=1024, num_hidden_layers=24, num_key_value_heads=2, intermediate_size=4864,
                      vocab_size=320)
#: the H200 study's systems options: vLLM's own knobs listed, so they are swept too
VLLM_KNOBS: dict[str, Any] = {"max_num_seqs": [256, 512], "enforce_eager": [False, True],
                              "free_cache_engine": [True, False]}
QUICKSTART: dict[str, Any] = {
    L.TRAIN_BATCH: 64, L.MINI_BATCH: 16, L.MICRO_BATCH: 4, L.ROLLOUT_N: 8, L.ROLLOUT_NAME: "vllm",
    L.ADV_ESTIMATOR: "grpo", L.ROLLOUT_TP: 1, L.GPU_MEMORY: 0.4, S.ROLLOUT_LOG_PROB_MICRO: 8,
    S.REF_LOG_PROB_MICRO: 8, L.USE_REMOVE_PADDING: False,
}


def steps(rates: list[tuple[float, float]]) -> list[StepMetrics]:
    return [StepMetrics(i + 1, {"perf/total_num_tokens": tokens, "timing_s/step": seconds})
            for i, (tokens, seconds) in enumerate(rates)]


def test_throughput_settles_on_two_scored_steps_within_the_tolerance() -> None:
    warm = (1000.0, 100.0)  # step 1 (vLLM's first calls) is left out
    assert not throughput_settled(steps([warm, (1000, 10)]), warmup_steps=1, tolerance=0.05)
    assert throughput_settled(steps([warm, (1000, 10), (1040, 10)]), warmup_steps=1, tolerance=0.05)
    assert not throughput_settled(steps([warm, (1000, 10), (1200, 10)]), warmup_steps=1, tolerance=0.05)
    # the last two decide: a slow step 2 followed by two that agree
    assert throughput_settled(steps([warm, (1000, 20), (1000, 10), (1010, 10)]), warmup_steps=1, tolerance=0.05)


class _OneLineAPoll(Launcher):
    """A real run's metrics file, one more step each poll, as a run writes it."""

    name = "one-line-a-poll"

    def __init__(self, root: Path, recording: Path, *, lines_a_poll: int = 1) -> None:
        super().__init__(root)
        self.lines = recording.read_text().splitlines(keepends=True)
        self.shown = 0
        self.lines_a_poll = lines_a_poll
        self.cancelled = False

    @property
    def max_concurrent(self) -> int:
        return 1

    def _start(self, spec: RunSpec) -> RunHandle:
        return RunHandle.in_dir(spec.run_id, self.name, self._run_dir(spec.run_id))

    def _poll(self, handle: RunHandle) -> RunState:
        self.shown = min(len(self.lines), self.shown + self.lines_a_poll)
        handle.metrics_path.write_text("".join(self.lines[:self.shown]))
        return RunState(RunStatus.RUNNING)

    def _cancel(self, handle: RunHandle) -> None:
        self.cancelled = True


@pytest.mark.parametrize("lines_a_poll", [1, 100])
@pytest.mark.parametrize(("tolerance", "last_step"), [(0.0, 6), (0.10, 3), (0.02, 6)])
def test_a_real_speed_probe_ends_where_its_throughput_settled(tmp_path: Path, tolerance: float,
                                                              last_step: int, lines_a_poll: int) -> None:
    """The tiny H200 recording's tokens/s after step 1: 1619, 1713 (5.6% apart), 1350, 1553,
    1528 (1.6% apart): a 10% tolerance ends the probe at step 3, 2% at step 6, and none runs
    every step. A driver that reads every step in one poll (the simulator's compressed clock)
    scores and charges the probe as one reading each step as it comes: to the same step."""
    from verl_sweep.objectives.probe import Probe, ProbeSettings, ProbeState

    launcher = _OneLineAPoll(tmp_path, DATA / "probe_speed.metrics.jsonl", lines_a_poll=lines_a_poll)
    settings = ProbeSettings(steps=6, metric=Metric.THROUGHPUT, health_screen=False, warmup_steps=1,
                             settle_tolerance=tolerance, n_boot=0)
    probe = Probe(launcher, RunSpec(run_id="speed", overrides=()), settings)
    probe.start()
    outcome = None
    for _ in range(20):
        launcher.poll(probe.handle)  # type: ignore[arg-type]
        outcome = probe.poll()
        if outcome is not None:
            break
    assert outcome is not None and outcome.state is ProbeState.COMPLETE, outcome
    assert outcome.last_step == last_step and launcher.cancelled
    assert outcome.score is not None and outcome.score.n_steps == last_step - 1


def sample(space: Any, base: dict[str, Any], n: int, seed: int = 0) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        trial = study.ask()
        config = space.suggest(trial, base)
        out.append((dict(trial.params), config))
        study.tell(trial, 0.0)
    return out


def test_one_gpu_systems_space_asks_the_batching_not_the_layout() -> None:
    default = build_space("systems", model=QWEN_05B, hardware=H200, algorithm=Algorithm.GRPO, base=QUICKSTART,
                          options={})
    asked_by_default = {name for params, _ in sample(default, QUICKSTART, n=20) for name in params}
    # vLLM's own knobs keep the base's values unless the stage lists them
    assert not asked_by_default & {"max_num_seqs", "enforce_eager", "free_cache_engine"}
    assert {c[S.MAX_NUM_SEQS] for _, c in sample(default, QUICKSTART, n=5)} == {256}
    space = build_space("systems", model=QWEN_05B, hardware=H200, algorithm=Algorithm.GRPO, base=QUICKSTART,
                        options=VLLM_KNOBS)
    drawn = sample(space, QUICKSTART, n=60)
    asked = {name for params, _ in drawn for name in params}
    # one GPU: one rollout TP and one Ulysses size, so neither is asked
    assert not asked & {"rollout_tp", "ulysses"}
    assert {"use_dynamic_bsz", "micro_batch_sp1", "log_prob_micro_batch_sp1", "max_num_seqs", "enforce_eager",
            "free_cache_engine", "log_prob_token_factor", "gpu_memory_utilization"} <= asked
    for params, config in drawn:
        merged = merge(QUICKSTART, config)
        assert L.check_config(merged, model=QWEN_05B, hardware=H200, algorithm=Algorithm.GRPO) == []
        assert config[L.ROLLOUT_TP] == 1 and config[L.ULYSSES] == 1
        if config[L.USE_DYNAMIC_BSZ]:
            assert config[S.ROLLOUT_LOG_PROB_TOKENS] == config[S.REF_LOG_PROB_TOKENS] >= config[L.MAX_TOKEN_LEN]
            assert L.MICRO_BATCH not in config
        else:
            # each pass's micro-batch divides its per-GPU batch: 16 × 8 for the update, 64 × 8 for log-probs
            assert 128 % config[L.MICRO_BATCH] == 0 and 512 % config[S.ROLLOUT_LOG_PROB_MICRO] == 0
            assert config[S.ROLLOUT_LOG_PROB_DYNAMIC] is False
        assert config[S.MAX_NUM_SEQS] in (256, 512)


def test_the_quickstart_baseline_is_the_incumbent_and_round_trips() -> None:
    space = build_space("systems", model=QWEN_05B, hardware=H200, algorithm=Algorithm.GRPO, base=QUICKSTART,
                        options=VLLM_KNOBS)
    params = space.incumbent_params(QUICKSTART)
    assert params is not None
    assert params["micro_batch_sp1"] == 4 and params["log_prob_micro_batch_sp1"] == 8
    assert params["max_num_seqs"] == 256 and params["enforce_eager"] is False
    assert "rollout_tp" not in params and "ulysses" not in params
    config = space.suggest(optuna.trial.FixedTrial(params), QUICKSTART)
    # every key the incumbent's config sets holds what the baseline already meant (its own
    # value, else verl's default; the log-prob passes follow the update's static batching)
    follows = {S.ROLLOUT_LOG_PROB_DYNAMIC: False, S.REF_LOG_PROB_DYNAMIC: False}
    for key, value in config.items():
        meant = QUICKSTART.get(key, L.VERL_DEFAULTS.get(key, follows.get(key)))
        assert value == meant, key


def test_a_base_with_no_micro_batch_keeps_it_unset() -> None:
    """verl refuses a per-GPU micro-batch beside the older global one: a base that sets the
    global key, or none, keeps its own choice as the incumbent's (None), not one of ours."""
    base = {k: v for k, v in QUICKSTART.items() if k != L.MICRO_BATCH}
    space = build_space("systems", model=QWEN_05B, hardware=H200, algorithm=Algorithm.GRPO, base=base, options={})
    params = space.incumbent_params(base)
    assert params is not None and params["micro_batch_sp1"] is None
    assert L.MICRO_BATCH not in space.suggest(optuna.trial.FixedTrial(params), base)
    legacy = {**base, S.DEPRECATED_MICRO: 8}  # it divides the mini-batch 16, as verl checks
    space = build_space("systems", model=QWEN_05B, hardware=H200, algorithm=Algorithm.GRPO, base=legacy, options={})
    for _, config in sample(space, legacy, n=30):
        assert L.MICRO_BATCH not in config


def test_the_shipped_h200_study_validates_with_verl() -> None:
    pytest.importorskip("verl")
    from verl_sweep.search.spec.study_file import load_study
    from verl_sweep.search.commands.validate import validate_study

    spec = load_study(REPO / "studies" / "h200-05b-throughput.yaml")
    problems, lines = validate_study(spec)
    assert problems == []
    assert spec.probe.speed_settle_tolerance == 0.10 and spec.launcher.options["probes_per_gpu"] == 1


def test_starting_points_are_the_fewest_largest_passes_that_fit() -> None:
    from verl_sweep import verl_knowledge as M

    space = build_space("systems", model=QWEN_05B, hardware=H200, algorithm=Algorithm.GRPO, base=QUICKSTART,
                        options=VLLM_KNOBS)
    static, static_whole, dynamic, dynamic_whole = space.starting_points(QUICKSTART, 4)
    # on 141 GB the whole per-GPU mini-batch (16 × 8) is one pass, the log-prob batch two
    assert static["use_dynamic_bsz"] is False and static["micro_batch_sp1"] == 128
    assert static["log_prob_micro_batch_sp1"] == 256
    assert dynamic["use_dynamic_bsz"] is True and dynamic["ppo_max_token_len_per_gpu_sp1"] == 32768
    assert static["gradient_checkpointing"] and dynamic["gradient_checkpointing"]
    # then the same without recomputation, its passes as large as still fit: the first two
    # points (a study's n_startup_trials 2) try recomputation both ways
    assert static_whole["use_dynamic_bsz"] is False and static_whole["gradient_checkpointing"] is False
    assert 4 < static_whole["micro_batch_sp1"] < static["micro_batch_sp1"]
    assert dynamic_whole["use_dynamic_bsz"] is True and dynamic_whole["gradient_checkpointing"] is False
    assert space.starting_points(QUICKSTART, 2) == [static, static_whole]
    for point in (static, static_whole, dynamic, dynamic_whole):
        assert point["max_num_seqs"] == 512 and point["enforce_eager"] is False
        assert point["activation_offload"] is False
        assert point["gpu_memory_utilization"] == QUICKSTART[L.GPU_MEMORY]  # the incumbent's share
        config = merge(QUICKSTART, space.suggest(optuna.trial.FixedTrial(point), QUICKSTART))
        found = M.estimate(QWEN_05B, H200, config)
        assert found is not None and found.peak_gb <= S.FIT_HEADROOM * M.usable_gb(H200)
    # on a 24 GB GPU the same study gets smaller passes, each estimated to fit
    small = HardwareFacts(gpus_per_node=1, gpu_memory_gb=24)
    base = {**QUICKSTART, L.GPU_MEMORY: 0.3}
    space = build_space("systems", model=QWEN_05B, hardware=small, algorithm=Algorithm.GRPO, base=base,
                        options=VLLM_KNOBS)
    points = space.starting_points(base, 2)
    assert points and points[0]["micro_batch_sp1"] < 128
    for point in points:
        config = merge(base, space.suggest(optuna.trial.FixedTrial(point), base))
        found = M.estimate(QWEN_05B, small, config)
        assert found is not None and found.peak_gb <= S.FIT_HEADROOM * M.usable_gb(small)


def _recorded_config(name: str) -> dict[str, Any]:
    import json

    from verl_sweep.verl_knowledge import parse_overrides

    overrides = json.loads((DATA / "h200-0.5b" / f"{name}.spec.json").read_text())["overrides"]
    return dict(parse_overrides([o for o in overrides if "=" in o]))


@pytest.mark.parametrize("name", ["baseline", "template"])
def test_the_memory_estimate_holds_the_h200_peaks_within_a_quarter(name: str) -> None:
    """NVML's peak of each recorded probe (1 s samples, the probe alone on the GPU) against the
    pre-flight's estimate of its config: within ±25% (measured: −0.9% and −0.5%)."""
    from verl_sweep.objectives.utilisation import read_samples, summarise
    from verl_sweep import verl_knowledge as M

    config = _recorded_config(name)
    measured = summarise(read_samples(DATA / "h200-0.5b" / f"{name}.gpu_samples.jsonl"))
    assert measured is not None
    found = M.estimate(QWEN_05B, H200, config)
    assert found is not None
    assert abs(found.peak_gb / measured["peak_mem_gb"] - 1) <= 0.25, (found.lines, measured["peak_mem_gb"])


def test_validate_refuses_a_baseline_that_cannot_fit_with_the_arithmetic(tmp_path: Path) -> None:
    """A 7B model on a 1 GB GPU was accepted and run; now `validate` says why it cannot fit."""
    import yaml

    from verl_sweep.search.spec.study_file import load_study
    from verl_sweep.search.commands.validate import validate_study

    data = yaml.safe_load((REPO / "studies" / "h200-05b-throughput.yaml").read_text())
    data["model"].update(n_params_b=7.0, hidden_size=3584, num_attention_heads=28, num_hidden_layers=28,
                         intermediate_size=18944, vocab_size=152064)
    data["hardware"]["gpu_memory_gb"] = 1.0
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(data))
    problems, _ = validate_study(load_study(path), with_verl=False)
    assert any(re.match(r"baseline: estimated peak GPU memory must fit the GPU's 1 GB, but the (rollout|update|log-prob) "
                        r"phase is estimated at [\d.]+ GB per GPU \(\1 = .* GB\)\. Lower the memory fraction", p)
               for p in problems), problems


@pytest.mark.parametrize(("name", "last_step", "rate"), [("baseline", 3, 2361.1156), ("template", 4, 2308.8774)])
def test_the_h200_speed_probes_replay_to_the_scores_the_study_stored(tmp_path: Path, name: str, last_step: int,
                                                                     rate: float) -> None:
    """The two probes of the 0.5B study (Dec 4), played back a step a poll through the probe
    with the study's settings: each ends where it ended on the device (the baseline's steps 2
    and 3 agree within 1.9%; the template's 3 and 4 within 2.6%, after a 21% jump) with the
    tokens/s the database holds."""
    from verl_sweep.objectives.probe import Probe, ProbeState
    from verl_sweep.search.method.stage import Stage
    from verl_sweep.search.spec.study_file import load_study

    spec = load_study(REPO / "studies" / "h200-05b-throughput.yaml")
    launcher = _OneLineAPoll(tmp_path, DATA / "h200-0.5b" / f"{name}.metrics.jsonl")
    stage = Stage.of(spec, 0)  # the throughput stage: how its probes run, as the driver runs them
    assert stage.metric is Metric.THROUGHPUT
    settings = dataclasses.replace(stage.probe, n_boot=0)
    probe = Probe(launcher, RunSpec(run_id=name, overrides=()), settings)
    probe.start()
    outcome = None
    while outcome is None and launcher.shown < len(launcher.lines) + 1:
        launcher.poll(probe.handle)  # type: ignore[arg-type]
        outcome = probe.poll()
        if launcher.shown == len(launcher.lines) and outcome is None:
            outcome = probe.poll()
            break
    assert outcome is not None and outcome.state is ProbeState.COMPLETE and outcome.last_step == last_step
    assert outcome.score is not None and outcome.score.rate == pytest.approx(rate, rel=1e-6)


def test_a_node_with_layouts_to_choose_gets_no_batching_starting_points() -> None:
    """On 8 GPUs the rollout TP and Ulysses sizes are the search's first subject: the sampler's
    own draws over them start the stage, not the largest-passes points."""
    node = HardwareFacts(gpus_per_node=8, gpu_memory_gb=80)
    base = {**QUICKSTART, L.ROLLOUT_TP: 2, L.TRAIN_BATCH: 256, L.MINI_BATCH: 64}
    space = build_space("systems", model=QWEN_05B, hardware=node, algorithm=Algorithm.GRPO, base=base, options={})
    assert len(space.choices["rollout_tp"]) > 1 and space.starting_points(base, 3) == []


def test_on_a_node_with_layouts_the_batching_is_swept_when_listed() -> None:
    node = HardwareFacts(gpus_per_node=8, gpu_memory_gb=80)
    base = {**QUICKSTART, L.ROLLOUT_TP: 2, L.TRAIN_BATCH: 256, L.MINI_BATCH: 64}
    default = build_space("systems", model=QWEN_05B, hardware=node, algorithm=Algorithm.GRPO, base=base, options={})
    asked = {name for params, _ in sample(default, base, n=40) for name in params}
    assert {"rollout_tp", "ulysses"} <= asked
    assert not {n for n in asked if n.startswith(("micro_batch", "log_prob_"))}
    listed = build_space("systems", model=QWEN_05B, hardware=node, algorithm=Algorithm.GRPO, base=base,
                         options={"micro_batch": [4, 8, 16], "log_prob_micro_batch": [8, 32]})
    asked = {name for params, _ in sample(listed, base, n=40) for name in params}
    assert {"micro_batch_sp1", "log_prob_micro_batch_sp1"} <= asked


@pytest.mark.parametrize("bad", [{L.GPU_MEMORY: None}, {L.GPU_MEMORY: "0.5"}, {L.MICRO_BATCH: "4"}, {L.STRATEGY: 3}])
def test_the_memory_estimate_leaves_a_malformed_config_to_the_rules(bad: dict[str, Any]) -> None:
    from verl_sweep import verl_knowledge as M

    config = {**QUICKSTART, **bad}
    assert M.estimate(QWEN_05B, H200, config) is None and M.fit_problem(QWEN_05B, H200, config) is None
