"""Stage spaces: bounds checked when built, suggestions inside them, incumbents, OOM learning."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from typing import Any, Iterator

import optuna
import pytest

from verl_sweep.spaces import SPACES, Moves, SpaceError, build_space
from verl_sweep.spaces.base import Space
from verl_sweep import verl_knowledge as L
from verl_sweep.spaces import limits as SL
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.spaces.bounds import KL_COEF, ParamBound
from verl_sweep.verl_knowledge import merge
from verl_sweep.spaces.stages import FAILURE_KIND_ATTR, HARDWARE_ATTR, hardware_tag, oom_ceiling

pytestmark = pytest.mark.fast

optuna.logging.set_verbosity(optuna.logging.WARNING)

MODEL_7B = ModelFacts(hidden_size=4096, num_attention_heads=32, n_params_b=7)
A100x8 = HardwareFacts(gpus_per_node=8, gpu_memory_gb=80)
GRPO_BASE: dict[str, Any] = {
    "data.train_batch_size": 1024,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 512,
    "actor_rollout_ref.rollout.n": 4,
    "actor_rollout_ref.rollout.name": "vllm",
    "algorithm.adv_estimator": "grpo",
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.9,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 4,
}
PPO_BASE = merge(GRPO_BASE, {"algorithm.adv_estimator": "gae", "actor_rollout_ref.rollout.n": 1})


def build(kind: str, algorithm: Algorithm = Algorithm.GRPO, **options: Any) -> Any:
    base = GRPO_BASE if algorithm is Algorithm.GRPO else PPO_BASE
    return build_space(kind, model=MODEL_7B, hardware=A100x8, algorithm=algorithm, base=base, options=options)


def sample(space: Any, base: dict[str, Any], n: int = 30, seed: int = 0) -> list[dict[str, Any]]:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        trial = study.ask()
        out.append(space.suggest(trial, base))
        study.tell(trial, 0.0)
    return out


def test_registry_names_and_unknown_kind() -> None:
    assert {"mini_batch", "kl", "token_budget", "lr", "lam", "systems"} <= set(SPACES)
    with pytest.raises(SpaceError, match=r"stages\[1\]\.space must be one of .*'lr'.*, but got 'learning_rate'"):
        build_space("learning_rate", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO,
                    base=GRPO_BASE, options={}, where="stages[1]")


def test_unknown_option_is_rejected() -> None:
    with pytest.raises(SpaceError, match=r"lr\.hgih: must be one of \['high', 'low', 'unsafe'\], but got 'hgih'"):
        build("lr", hgih=1e-6)


def test_widening_needs_unsafe_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(
        SpaceError,
        match=r"^stages\[2\]\.params\.high: must be ≤ 0\.01 \(safe bound: the method's KL range 0\.0005-0\.01\), "
        r"but got 0\.05\. Narrow it, or set unsafe: true on this parameter\.$",
    ):
        build_space("kl", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=GRPO_BASE,
                    options={"high": 0.05}, where="stages[2].params")
    with caplog.at_level(logging.WARNING, logger="verl_sweep.spaces.bounds"):
        space = build("kl", high=0.05, unsafe=True)
    assert space.bound.high == 0.05
    assert "outside the safe bound" in caplog.text
    with pytest.raises(SpaceError, match=r"lr\.low: must be ≥ 5e-07 .* but got 1e-07"):
        build("lr", low=1e-7)


def test_narrowing_is_allowed_and_low_above_high_is_not() -> None:
    space = build("lr", low=1e-6, high=2e-6)
    values = [c[L.LR] for c in sample(space, GRPO_BASE)]
    assert all(1e-6 <= v <= 2e-6 for v in values)
    with pytest.raises(SpaceError, match=r"lr: low must be ≤ high, but got low=3e-06, high=2e-06"):
        build("lr", low=3e-6, high=2e-6)
    with pytest.raises(SpaceError, match=r"lam\.high: must be a finite number, but got 'x'"):
        build("lam", Algorithm.PPO, high="x")


def test_param_bound_rejects_inverted_range() -> None:
    with pytest.raises(SpaceError, match="low ≤ high"):
        ParamBound("x", 2, 1, False, "test")
    assert KL_COEF.log and KL_COEF.low == 0.0005


def test_mini_batch_suggests_only_valid_values_within_25_percent() -> None:
    space = build("mini_batch")
    for config in sample(space, GRPO_BASE, n=40):
        mini = config[L.MINI_BATCH]
        assert 384 <= mini <= 640
        assert L.mini_batch_problem(mini, merge(GRPO_BASE, config), A100x8) is None
        assert set(config) == {L.MINI_BATCH}  # the critic's follows through verl's interpolation
    # With a micro-batch of 16, per-GPU mini = mini × 4 ÷ 8 must be a multiple of 16 → mini % 32 == 0.
    base = merge(GRPO_BASE, {L.MICRO_BATCH: 16})
    space = build_space("mini_batch", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=base, options={})
    assert space.choices == list(range(384, 641, 32))
    assert space.incumbent_params(base) == {"mini_batch": 512}


def test_mini_batch_choices_must_be_valid() -> None:
    with pytest.raises(SpaceError, match=r"mini_batch\.choices\[1\]: must be a valid mini-batch size, but got 401"):
        build("mini_batch", choices=[400, 401])
    assert build("mini_batch", choices=[400, 448]).choices == [400, 448]


def test_bounded_starting_points_include_both_ends_of_the_safe_range() -> None:
    """lr's optimum often sits at its safe bound (5e-6): a first probe must land there, and at
    the other end, whatever the number of points."""
    for n in (2, 3, 4, 6):
        lrs = [p["lr"] for p in build("lr").starting_points(GRPO_BASE, n)]
        assert lrs[0] == 5e-7 and lrs[-1] == 5e-6 and lrs == sorted(lrs) and len(set(lrs)) == len(lrs)
    lams = [p["lam"] for p in build("lam", algorithm=Algorithm.PPO).starting_points(PPO_BASE, 3)]
    assert lams[0] == 0.95 and lams[-1] == 0.99


def test_kl_grpo_sets_the_loss_keys() -> None:
    for config in sample(build("kl"), GRPO_BASE):
        assert config[L.USE_KL_LOSS] is True
        assert 0.0005 <= config[L.KL_LOSS_COEF] <= 0.01
        assert not any(k.startswith("algorithm.") for k in config)


def test_kl_starting_points_span_the_bounds_ends_included() -> None:
    """An optimum at a bound (strong KL at 0.01) must get a first probe near it, not only the
    interior of the log range."""
    assert [p["kl_coef"] for p in build("kl").starting_points(GRPO_BASE, 5)] == [0.0005, 0.00106, 0.00224, 0.00473, 0.01]
    narrowed = [p["kl_coef"] for p in build("kl", low=0.001, high=0.004).starting_points(GRPO_BASE, 3)]
    assert narrowed == [0.001, 0.002, 0.004]


def test_kl_ppo_is_conditional_on_controller_type() -> None:
    configs = sample(build("kl", Algorithm.PPO), PPO_BASE, n=40)
    kinds = {c[L.KL_CTRL_TYPE] for c in configs}
    assert kinds == {"fixed", "adaptive"}
    for c in configs:
        assert c[L.USE_KL_IN_REWARD] is True and 0.0005 <= c[L.KL_CTRL_COEF] <= 0.01
        if c[L.KL_CTRL_TYPE] == "adaptive":
            assert 0.05 <= c[L.KL_CTRL_TARGET] <= 0.15 and c[L.KL_CTRL_HORIZON] > 0
        else:
            assert L.KL_CTRL_TARGET not in c and L.KL_CTRL_HORIZON not in c
        assert L.check_config(merge(PPO_BASE, c), model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.PPO) == []
    with pytest.raises(SpaceError, match=r"kl\.types: must be a non-empty list of fixed/adaptive"):
        build("kl", Algorithm.PPO, types=["pid"])
    with pytest.raises(SpaceError, match=r"kl\.types: must be one of \['high', 'low', 'unsafe'\]"):
        build("kl", Algorithm.GRPO, types=["fixed"])


def test_incumbents_reproduce_the_base() -> None:
    assert build("kl").incumbent_params(GRPO_BASE) is None  # KL loss off in the base
    on = merge(GRPO_BASE, {L.USE_KL_LOSS: True, L.KL_LOSS_COEF: 0.002})
    space = build_space("kl", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=on, options={})
    params = space.incumbent_params(on)
    assert params == {"kl_coef": 0.002}
    assert space.suggest(optuna.trial.FixedTrial(params), on) == {L.USE_KL_LOSS: True, L.KL_LOSS_COEF: 0.002}
    assert build("lr").incumbent_params(GRPO_BASE) == {"lr": 1e-6}  # verl's default
    assert build("lam", Algorithm.PPO).incumbent_params(PPO_BASE) is None  # verl's λ 1.0 is outside
    assert build("token_budget").incumbent_params(GRPO_BASE) == {"token_budget": 8192}


def test_token_budget_bound_and_arithmetic() -> None:
    space = build("token_budget")
    assert (space.bound.low, space.bound.high) == (2048, 100_000)
    assert space.moves is Moves.SPEED
    text = "\n".join(space.explain())
    assert "106,496" in text and "100,000" in text
    for config in sample(space, GRPO_BASE):
        assert 2048 <= config[L.TOKEN_BUDGET] <= 100_000
        assert config[L.CHUNKED_PREFILL] is True
    with pytest.raises(SpaceError, match=r"token_budget\.high: must be ≤ 100,000"):
        build("token_budget", high=200_000)


def test_a_lone_token_budget_starting_point_is_the_most_a_step_can_schedule() -> None:
    """A 0.5B model on 141 GB: its pool holds millions of tokens, but vLLM schedules at most
    max_num_seqs sequences of max_model_len tokens a step. A stage with one place tries that
    budget, not the range's middle (a third of the gain) nor its top (no more tokens a step)."""
    small = ModelFacts(hidden_size=896, num_attention_heads=14, n_params_b=0.358, max_prompt_length=256,
                       max_response_length=1024, num_hidden_layers=24, num_key_value_heads=2)
    h200 = HardwareFacts(gpus_per_node=1, gpu_memory_gb=141)
    base = merge(GRPO_BASE, {L.GPU_MEMORY: 0.4, L.ROLLOUT_TP: 1})
    space = build_space("token_budget", model=small, hardware=h200, algorithm=Algorithm.GRPO, base=base, options={})
    assert space.bound.high > 1_000_000
    assert space.starting_points(base, 1) == [{"token_budget": 256 * 1280}]  # verl's max_num_seqs
    assert space.starting_points(merge(base, {L.MAX_NUM_SEQS: 512}), 1) == [{"token_budget": 512 * 1280}]
    spread = [p["token_budget"] for p in space.starting_points(base, 3)]
    assert spread[0] == 2048 and spread[-1] == 256 * 1280 and len(spread) == 3
    # where the memory bound is the lower, it is the top
    assert build("token_budget").starting_points(GRPO_BASE, 1) == [{"token_budget": 100_000}]
    assert build("token_budget").starting_points(merge(GRPO_BASE, {L.TOKEN_BUDGET: 100_000}), 1) == []


def test_token_budget_with_no_room_is_an_error() -> None:
    tiny = HardwareFacts(gpus_per_node=8, gpu_memory_gb=16)
    base = merge(GRPO_BASE, {L.GPU_MEMORY: 0.3, L.ROLLOUT_TP: 1})  # 4.8 GB − 14 GB of weights
    with pytest.raises(SpaceError, match=r"token budget: the memory bound must be ≥ the floor"):
        build_space("token_budget", model=MODEL_7B, hardware=tiny, algorithm=Algorithm.GRPO, base=base, options={})


def test_lam_only_with_gae() -> None:
    with pytest.raises(SpaceError, match=r"stages\[4\]\.params: λ only matters with GAE"):
        build_space("lam", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=GRPO_BASE,
                    options={}, where="stages[4].params")
    values = [c[L.LAM] for c in sample(build("lam", Algorithm.PPO), PPO_BASE)]
    assert all(0.95 <= v <= 0.99 for v in values)


def _oom(study: optuna.Study, trial: optuna.Trial, hardware: str | None) -> None:
    trial.set_user_attr(FAILURE_KIND_ATTR, "oom")
    if hardware:
        trial.set_user_attr(HARDWARE_ATTR, hardware)
    trial.set_constraint("oom", 1.0)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)


def test_oom_at_budget_keeps_later_trials_below_it() -> None:
    space = build("token_budget")
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=1))
    study.enqueue_trial({"token_budget": 60_000})
    first = study.ask()
    assert space.suggest(first, GRPO_BASE)[L.TOKEN_BUDGET] == 60_000
    _oom(study, first, hardware_tag(A100x8))
    seen = []
    for i in range(25):
        trial = study.ask()
        budget = space.suggest(trial, GRPO_BASE)[L.TOKEN_BUDGET]
        seen.append(budget)
        if i == 10:  # a second, lower OOM tightens the ceiling further
            _oom(study, trial, hardware_tag(A100x8))
            ceiling = budget
        else:
            study.tell(trial, float(budget))
    assert all(b < 60_000 for b in seen)
    assert all(b < ceiling for b in seen[11:])
    assert oom_ceiling(study.get_trials(), "token_budget") == ceiling


def test_oom_on_other_hardware_does_not_clamp() -> None:
    space = build("token_budget")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    study.enqueue_trial({"token_budget": 3000})
    trial = study.ask()
    space.suggest(trial, GRPO_BASE)
    _oom(study, trial, "1x8x40GB")
    values = []
    for _ in range(20):
        t = study.ask()
        values.append(space.suggest(t, GRPO_BASE)[L.TOKEN_BUDGET])
        study.tell(t, 0.0)
    assert max(values) > 3000


def test_systems_suggests_only_valid_combinations() -> None:
    long_model = ModelFacts(hidden_size=4096, num_attention_heads=32, n_params_b=7, max_prompt_length=2048,
                            max_response_length=6144)
    base = merge(GRPO_BASE, {L.MICRO_BATCH: 8})
    space = build_space("systems", model=long_model, hardware=A100x8, algorithm=Algorithm.GRPO, base=base, options={})
    assert space.moves is Moves.SPEED
    seen_prefetch_fsdp2 = False
    configs = sample(space, base, n=80, seed=5)
    for config in configs:
        merged = merge(base, config)
        assert L.check_config(merged, model=long_model, hardware=A100x8, algorithm=Algorithm.GRPO) == [], config
        if config[L.STRATEGY] == "fsdp2":
            seen_prefetch_fsdp2 |= config[L.FORWARD_PREFETCH]
        if config[L.USE_DYNAMIC_BSZ]:
            assert config[L.MAX_TOKEN_LEN] * config[L.ULYSSES] >= 8192
        assert 0.3 <= config[L.GPU_MEMORY] <= 0.9
    assert seen_prefetch_fsdp2  # verl 0.9.1 prefetches under FSDP2 too (utils/fsdp_utils.py apply_fsdp2)
    assert {c[L.ULYSSES] for c in configs} == {1, 2, 4}
    assert {c[L.ROLLOUT_TP] for c in configs} == {1, 2, 4, 8}


def test_systems_options_and_incumbent() -> None:
    with pytest.raises(SpaceError, match=r"systems\.rollout_tp\[0\]: must be one of \[1, 2, 4, 8\], but got 3"):
        build("systems", rollout_tp=[3])
    with pytest.raises(SpaceError, match=r"systems\.gpu_memory_utilization\.high: must be ≤ 0\.9"):
        build("systems", gpu_memory_utilization={"high": 0.95})
    space = build("systems", rollout_tp=[2, 4], strategy=["fsdp"])
    params = space.incumbent_params(GRPO_BASE)
    assert params is not None and params["rollout_tp"] == 4 and params["forward_prefetch"] is False
    config = space.suggest(optuna.trial.FixedTrial(params), GRPO_BASE)
    assert config[L.ROLLOUT_TP] == 4 and config[L.GPU_MEMORY] == 0.9
    assert space.incumbent_params(merge(GRPO_BASE, {L.ROLLOUT_TP: 8})) is None


#: one systems-stage point but its memory fraction
LAYOUT = {"rollout_tp": 4, "strategy": "fsdp2", "forward_prefetch": False, "ulysses": 1, "use_dynamic_bsz": False,
          "gradient_checkpointing": True, "activation_offload": False, "micro_batch_sp1": None,
          "log_prob_micro_batch_sp1": None, "max_num_seqs": 512, "enforce_eager": False, "free_cache_engine": True}


def test_oom_at_memory_fraction_keeps_the_same_layout_below_it() -> None:
    space = build("systems")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=2))
    layout = dict(LAYOUT)
    study.enqueue_trial({**layout, "gpu_memory_utilization": 0.5})
    trial = study.ask()
    assert space.suggest(trial, GRPO_BASE)[L.GPU_MEMORY] == 0.5
    _oom(study, trial, hardware_tag(A100x8))
    for _ in range(10):
        study.enqueue_trial(layout)
        t = study.ask()
        assert space.suggest(t, GRPO_BASE)[L.GPU_MEMORY] < 0.5
        study.tell(t, 0.0)
    # Another layout may have run out for a reason the fraction does not change (training
    # memory): it keeps the whole range.
    others = []
    for _ in range(20):
        t = study.ask()
        config = space.suggest(t, GRPO_BASE)
        if {k: v for k, v in t.params.items() if k != "gpu_memory_utilization"} != layout:
            others.append(config[L.GPU_MEMORY])
        study.tell(t, 0.0)
    assert others and max(others) > 0.5


@contextlib.contextmanager
def _counted_reads(study: optuna.Study) -> Iterator[list[int]]:
    """How often a space reads the study's trials (a full read on PostgreSQL) while it asks."""
    reads = [0]
    read = study.get_trials

    def counting(*args: Any, **kwargs: Any) -> Any:
        reads[0] += 1
        return read(*args, **kwargs)

    study.get_trials = counting  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        del study.get_trials


def test_a_layouts_rerun_after_a_nearby_oom_keeps_its_memory_fraction_and_optuna_stays_quiet() -> None:
    """A leader that ran at 0.88 is re-run after the same layout ran out of memory at 0.885:
    the sampler's draws stay under 0.875, the re-run keeps its 0.88 with no Optuna warning."""
    space = build("systems")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=2))
    layout = dict(LAYOUT)
    for fraction, ooms in ((0.88, False), (0.885, True)):
        study.enqueue_trial({**layout, "gpu_memory_utilization": fraction})
        trial = study.ask()
        space.suggest(trial, GRPO_BASE)
        if ooms:
            _oom(study, trial, hardware_tag(A100x8))
        else:
            study.tell(trial, 1.0)
    study.enqueue_trial({**layout, "gpu_memory_utilization": 0.88})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rerun = study.ask()
        with _counted_reads(study) as reads:
            assert space.suggest(rerun, GRPO_BASE)[L.GPU_MEMORY] == 0.88
        assert reads == [1]  # OOMs and the fixed point from one read of the study
        study.tell(rerun, 1.0)
        study.enqueue_trial(layout)
        assert space.suggest(study.ask(), GRPO_BASE)[L.GPU_MEMORY] < 0.88


def test_templates_follow_the_brief() -> None:
    from verl_sweep.verl_knowledge import MEGATRON_TP, MODEL_ENGINE, template_for

    small = template_for(MODEL_7B, A100x8, Algorithm.GRPO)
    assert small.config[L.ROLLOUT_TP] == 4 and small.config[L.GPU_MEMORY] == 0.6
    assert small.config[L.USE_DYNAMIC_BSZ] and small.config[L.MAX_TOKEN_LEN] >= 4096
    assert small.config[L.GRADIENT_CHECKPOINTING]
    big = template_for(ModelFacts(hidden_size=5120, num_attention_heads=40, n_params_b=32), A100x8, Algorithm.PPO)
    assert big.config[MODEL_ENGINE] == "megatron" and big.config[MEGATRON_TP] == 8
    # A long sequence raises the per-GPU token limit so that limit × ulysses still covers it.
    long_model = ModelFacts(hidden_size=4096, num_attention_heads=32, n_params_b=7, max_response_length=31744)
    t = template_for(long_model, A100x8, Algorithm.GRPO)
    assert t.config[L.MAX_TOKEN_LEN] * t.config[L.ULYSSES] >= long_model.max_seq_len


def test_polish_tunes_mini_batch_and_lr_together_within_the_baselines_bounds() -> None:
    chain = merge(GRPO_BASE, {L.MINI_BATCH: 384, L.LR: 2e-6})  # the chain moved mini-batch down
    space = build_space("polish", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=chain,
                        options={}, baseline=GRPO_BASE)
    configs = sample(space, chain, n=40)
    # KL is off in the chain: the polish may turn it on (with a larger lr it may pay), or not
    # switching KL on also gives the reference policy verl then builds its log-prob micro-batch
    ref_micro = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
    assert all(set(c) - {L.KL_LOSS_COEF, ref_micro} == {L.MINI_BATCH, L.LR, L.USE_KL_LOSS} for c in configs)
    assert all((ref_micro in c) == c[L.USE_KL_LOSS] for c in configs)
    assert {c[L.USE_KL_LOSS] for c in configs} == {False, True}
    assert all(0.0005 <= c[L.KL_LOSS_COEF] <= 0.01 for c in configs if c[L.USE_KL_LOSS])
    assert all(L.KL_LOSS_COEF not in c for c in configs if not c[L.USE_KL_LOSS])
    minis = {c[L.MINI_BATCH] for c in configs}
    assert min(minis) >= 384 and max(minis) <= 640  # ±25% of the baseline's 512, not of 384
    assert max(minis) > 480
    assert all(5e-7 <= c[L.LR] <= 5e-6 for c in configs)
    assert space.incumbent_params(chain) == {"mini_batch": 384, "lr": 2e-6, "use_kl": False}
    points = space.starting_points(chain, 4)
    # the first pass: lr up with the mini-batch moved either way (neither coupling assumed);
    # here the chain's 384 is the lower bound, so "down" keeps the mini-batch
    assert points == [{"mini_batch": 480, "lr": 4e-6, "use_kl": False}, {"mini_batch": 384, "lr": 4e-6, "use_kl": False}]
    for p in points:
        config = space.suggest(optuna.trial.FixedTrial(p), chain)
        assert config[L.USE_KL_LOSS] is p["use_kl"] and config[L.LR] == p["lr"]
        assert p["mini_batch"] in space.parts[0].choices and 5e-7 <= p["lr"] <= 5e-6


def _polish_from(mini: int, lr: float) -> tuple[Space, dict[str, object]]:
    chain = merge(GRPO_BASE, {L.MINI_BATCH: mini, L.LR: lr})
    return build_space("polish", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=chain,
                       options={}, baseline=GRPO_BASE), chain


def test_polish_follows_the_direction_its_first_pass_read_either_way() -> None:
    """A smaller mini-batch that tolerates a larger lr (a loss summed over the mini-batch) is
    followed as a larger one is (a loss averaged over it): the second pass goes on from the
    starting point that read highest, twice as far, with a KL pull (and lr ×2), then one knob at a time
    around it (further along its direction first, then back), then half way."""
    space, chain = _polish_from(512, 1e-6)
    up, down = space.starting_points(chain, 4)
    assert up["mini_batch"] > 512 and down["mini_batch"] < 512 and up["lr"] == down["lr"] == 2e-6
    for better, worse, side in ((down, up, -1), (up, down, 1)):
        follow = space.follow_up_points(chain, [(better, 1.08), (worse, 0.6)], 8)
        assert better not in follow and worse not in follow
        far, pull, *around, half = follow
        assert side * (far["mini_batch"] - better["mini_batch"]) >= 0 and far["lr"] == 4e-6  # up: 640 is the bound
        # the pull comes with lr doubled: at the same lr it only costs speed
        assert pull["use_kl"] and (pull["mini_batch"], pull["lr"]) == (better["mini_batch"], 2 * better["lr"])
        assert all(sum(p[k] != better[k] for k in ("mini_batch", "lr")) == 1 and not p["use_kl"] for p in around)
        assert 2e-6 < around[0 if side > 0 else 1]["lr"] < 4e-6  # lr further up, finer than the pattern move
        if side < 0:  # 410 → the bound 384; 640 is the bound already
            assert around[0]["mini_batch"] < better["mini_batch"]
        assert any(p["lr"] < 2e-6 for p in around) and any(side * (p["mini_batch"] - better["mini_batch"]) < 0 for p in around)
        assert side * (half["mini_batch"] - 512) > 0 and side * (better["mini_batch"] - half["mini_batch"]) > 0
        assert 1e-6 < half["lr"] < 2e-6 and not far["use_kl"] and not half["use_kl"]
    # a pull that read below the best is not tried again
    pulled = {**up, "use_kl": True, "kl_coef": 0.00224}
    assert not any(p["use_kl"] for p in space.follow_up_points(chain, [(up, 1.08), (down, 0.6), (pulled, 0.9)], 8))
    # nothing beat the incumbent: half way first, on the better side still, then the pull at
    # the better point's own lr (its lr turned unstable: the pull is to steady it)
    follow = space.follow_up_points(chain, [(down, 0.97), (up, 0.4)], 2)
    assert follow[0]["mini_batch"] < 512 and 1e-6 < follow[0]["lr"] < 2e-6
    assert follow[1]["use_kl"] and (follow[1]["mini_batch"], follow[1]["lr"]) == (down["mini_batch"], down["lr"])
    # a point still running (NaN) is neither followed nor proposed again
    follow = space.follow_up_points(chain, [(down, 1.08), (up, math.nan)], 5)
    assert up not in follow and all(p["mini_batch"] <= 512 for p in follow)
    # the next round goes on from the best point so far, with its KL
    pulled = {**down, "use_kl": True, "kl_coef": 0.00224}
    follow = space.follow_up_points(chain, [(down, 1.08), (up, 0.6), (pulled, 1.15)], 1)
    assert follow[0]["use_kl"] and follow[0]["kl_coef"] == 0.00224 and follow[0]["mini_batch"] < down["mini_batch"]
    assert space.follow_up_points(chain, [], 2) == [] and space.follow_up_points(chain, [(down, 1.1)], 0) == []


def test_polish_proposes_no_point_nearer_the_incumbent_than_its_smallest_move() -> None:
    """With lr at its upper bound the pattern search moves the mini-batch alone; halving a
    move that read below the incumbent again and again would creep up on the incumbent with
    whole probes that cannot tell it apart. No point is nearer than ×1.1 (mini-batch) and
    ×1.15 (lr) to the incumbent, KL unchanged."""
    space, chain = _polish_from(512, 5e-6)
    up, down = space.starting_points(chain, 4)
    assert up["lr"] == down["lr"] == 5e-6  # clamped: the first pass moves the mini-batch only
    rounds = [(up, 0.93), (down, 0.97)]
    for _ in range(4):
        follow = space.follow_up_points(chain, rounds, 2)
        for p in follow:
            if not p["use_kl"]:
                assert abs(math.log(p["mini_batch"] / 512)) >= math.log(1.1) or abs(math.log(p["lr"] / 5e-6)) >= math.log(1.15), p
        rounds += [(p, 0.98) for p in follow]
        if not follow:
            break
    assert not follow  # the search ran out of points worth a probe


def test_polish_includes_kl_strength_when_the_chain_has_kl_on() -> None:
    chain = merge(GRPO_BASE, {"actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.kl_loss_coef": 0.002})
    space = build_space("polish", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=chain, options={})
    config = sample(space, chain, n=1)[0]
    assert 0.0005 <= config["actor_rollout_ref.actor.kl_loss_coef"] <= 0.01
    assert space.incumbent_params(chain)["kl_coef"] == 0.002
    # KL already on: the starting points keep its strength (the sampler moves it)
    assert all(p["kl_coef"] == 0.002 for p in space.starting_points(chain, 4))
    with pytest.raises(SpaceError, match=r"polish\.lr\.high"):
        build_space("polish", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=chain,
                    options={"lr": {"high": 1e-4}})


def test_systems_after_the_token_stage_raises_the_memory_floor() -> None:
    """A second systems stage on a tuned base (large token budget): instead of dropping every
    rollout TP, the memory floor rises so that each proposed layout's vLLM pool holds the
    budget (at the method's lowest fraction 0.3 no TP would)."""
    base = merge(GRPO_BASE, {L.MICRO_BATCH: 8, L.TOKEN_BUDGET: 60_000})
    space = build_space("systems", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=base, options={})
    assert 0.3 < min(space.floors.values()) and max(space.floors.values()) < space.memory.high
    for config in sample(space, base, n=60, seed=3):
        merged = merge(base, config)
        assert SL.token_budget(MODEL_7B, A100x8, merged).memory_cap >= 60_000, config
        assert L.check_config(merged, model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO) == [], config
    untuned = build_space("systems", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO,
                          base=merge(GRPO_BASE, {L.MICRO_BATCH: 8}), options={})
    assert untuned.memory.low == 0.3 and min(untuned.floors.values()) == 0.3


def test_the_systems_stage_gives_static_batching_the_micro_batches_verl_needs() -> None:
    """A base that batches dynamically sets no micro-batch; verl refuses static batching
    without one (its validate_config): the stage sets them where it turns dynamic batching off."""
    base = merge(GRPO_BASE, {L.USE_DYNAMIC_BSZ: True, L.MAX_TOKEN_LEN: 8192, L.USE_KL_LOSS: True})
    base = {k: v for k, v in base.items() if "micro_batch" not in k}
    space = build_space("systems", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=base, options={})
    static = [c for c in sample(space, base, n=40, seed=4) if not c[L.USE_DYNAMIC_BSZ]]
    assert static
    for config in static:
        for key in (L.MICRO_BATCH, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"):
            assert isinstance(config.get(key), int), (key, config)


def _systems_and_leader() -> tuple[Space, dict[str, Any], dict[str, Any]]:
    """A systems space on 8 GPUs (several layouts) and a leader with dynamic batching,
    checkpointing on and a token limit with room below it."""
    base = merge(GRPO_BASE, {L.MICRO_BATCH: 8})
    space = build_space("systems", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=base, options={})
    leader = {"rollout_tp": 4, "strategy": "fsdp2", "forward_prefetch": False, "ulysses": 2, "use_dynamic_bsz": True,
              "ppo_max_token_len_per_gpu_sp2": 8192, "gradient_checkpointing": True, "activation_offload": False,
              "gpu_memory_utilization": 0.8}
    space.suggest(optuna.trial.FixedTrial(leader), base)  # a point of the space
    return space, base, leader


def test_systems_follow_ups_move_one_knob_from_the_leader_and_build_valid_configs() -> None:
    space, base, leader = _systems_and_leader()
    other = {**leader, "rollout_tp": 2, "gradient_checkpointing": False}
    points = space.follow_up_points(base, [(leader, 1.3), (other, 1.1), ({**leader, "strategy": "fsdp"}, 1.2)], 16)
    assert 6 <= len(points) <= 16
    assert leader not in points and {**leader, "strategy": "fsdp"} not in points  # tried: not again
    assert len({tuple(sorted(p.items())) for p in points}) == len(points)
    for p in points:
        moved = {k for k in set(p) | set(leader) if p.get(k) != leader.get(k)}
        knobs = moved - {k for k in moved if "_sp" in k or k == "log_prob_token_factor"}
        # one knob (a batching knob alone, or one more with the batching that fits); a TP
        # move may lift the memory to that TP's floor
        assert moved and (len(knobs) <= 1 or knobs == {"rollout_tp", "gpu_memory_utilization"}), moved
        config = merge(base, space.suggest(optuna.trial.FixedTrial(p), base))
        assert L.check_config(config, model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO) == [], p
    assert {**leader, "gradient_checkpointing": False} in points
    assert space.follow_up_points(base, [(leader, float("nan"))], 4) == []  # nothing ended: nothing to move from


def test_systems_follow_up_that_ran_out_of_memory_comes_back_with_smaller_passes() -> None:
    """Checkpointing off costs activation memory the estimate may not see: the failed move is
    tried again first, with the token limit a notch down."""
    space, base, leader = _systems_and_leader()
    off = {**leader, "gradient_checkpointing": False}
    points = space.follow_up_points(base, [(leader, 1.3), (off, 0.0)], 4)
    assert points[0] == {**off, "ppo_max_token_len_per_gpu_sp2": 4096}
    smaller = space.follow_up_points(base, [(leader, 1.3), (off, 0.0), (points[0], 0.0)], 4)
    assert smaller[0] == {**off, "ppo_max_token_len_per_gpu_sp2": 2048}


def test_systems_follow_ups_do_not_shrink_the_passes_for_a_memory_fraction_that_failed() -> None:
    """A larger vLLM pool that ran out of memory is the fraction's own failure (its OOM ceiling
    keeps later fractions below it): smaller passes are no repair for it."""
    space, base, leader = _systems_and_leader()
    points = space.follow_up_points(base, [(leader, 1.3), ({**leader, "gpu_memory_utilization": 0.85}, 0.0)], 16)
    assert not any(p.get("ppo_max_token_len_per_gpu_sp2", 8192) < 8192 and p["gpu_memory_utilization"] == 0.85 for p in points)
    assert {**leader, "gradient_checkpointing": False} in points


#: a baseline near the edge of its GPUs by the memory estimate: vLLM's 0.75 of 80 GB, the
#: actor's resident states and the reference model beside it in the rollout, 72.9 GB of 80
NEAR_THE_EDGE = merge(GRPO_BASE, {L.GPU_MEMORY: 0.75, L.MICRO_BATCH: 4, L.USE_KL_LOSS: True,
                                  "actor_rollout_ref.actor.kl_loss_coef": 0.001,
                                  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 16,
                                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 16})


@pytest.mark.parametrize("kind", sorted(set(SPACES) - {"lam"}))
def test_no_space_proposes_a_config_the_memory_estimate_says_cannot_fit(kind: str) -> None:
    """Every config a stage can propose from a baseline near the edge (its corners and 150
    random draws) stays within the GPU's memory by the estimate. The systems stage's batching
    knobs are categorical (Optuna keeps their choices fixed), so there the memory fraction,
    asked last, keeps the rollout phase (and vLLM awake in the others) within it, and a
    combination of batching knobs beyond it is refused before launch (``TrialRunner``)."""
    from verl_sweep.search.commands.validate import extreme_configs
    from verl_sweep import verl_knowledge as M

    base = NEAR_THE_EDGE
    found = M.estimate(MODEL_7B, A100x8, base)
    assert found is not None and 70 < found.peak_gb <= A100x8.gpu_memory_gb  # near the edge, inside it
    space = build_space(kind, model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=base,
                        options={}).on_real_gpus(True)
    configs = extreme_configs(space, base) + [merge(base, c) for c in sample(space, base, n=150, seed=3)]
    for config in configs:
        peak = M.estimate(MODEL_7B, A100x8, config)
        assert peak is not None
        assert peak.rollout_gb <= A100x8.gpu_memory_gb, (kind, peak.lines)
        if kind != "systems" or (config.get(L.GRADIENT_CHECKPOINTING) and not config.get(L.USE_DYNAMIC_BSZ)):
            assert peak.peak_gb <= A100x8.gpu_memory_gb, (kind, peak.lines)


def test_the_systems_memory_fraction_stops_where_the_rollout_would_not_fit() -> None:
    """The fraction's ceiling follows the layout: Ulysses 2 halves the data-parallel ranks and
    doubles the actor's resident states, so the rollout leaves less room to vLLM."""
    from verl_sweep import verl_knowledge as M

    space = build_space("systems", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=NEAR_THE_EDGE,
                        options={}).on_real_gpus(True)
    highs = {}
    for sp in (1, 2):
        params = {"rollout_tp": 4, "strategy": "fsdp2", "forward_prefetch": False, "ulysses": sp,
                  "use_dynamic_bsz": False, "gradient_checkpointing": True, "activation_offload": False}
        config = merge(NEAR_THE_EDGE, space.suggest(optuna.trial.FixedTrial({**params, "gpu_memory_utilization": 0.3}),
                                                    NEAR_THE_EDGE))
        highs[sp] = M.fitting_fraction(MODEL_7B, A100x8, config, base=NEAR_THE_EDGE)
        assert space.suggest(optuna.trial.FixedTrial({**params, "gpu_memory_utilization": highs[sp]}), NEAR_THE_EDGE)
        at = M.estimate(MODEL_7B, A100x8, merge(config, {L.GPU_MEMORY: highs[sp]}))
        above = M.estimate(MODEL_7B, A100x8, merge(config, {L.GPU_MEMORY: highs[sp] + 0.01}))
        assert at is not None and above is not None
        assert at.rollout_gb <= 80 < above.rollout_gb, (sp, highs[sp], at.lines)
    assert 0.3 < highs[2] < highs[1] < 0.9


def test_on_a_simulator_the_spaces_leave_out_of_memory_to_its_world() -> None:
    """The memory fitting applies where probes run on real GPUs; a simulator's landscape decides
    its own OOMs (its worlds are not the estimate's), so there the fraction keeps its range."""
    edge = {"rollout_tp": 4, "strategy": "fsdp2", "forward_prefetch": False, "ulysses": 2, "use_dynamic_bsz": False,
            "gradient_checkpointing": True, "activation_offload": False, "gpu_memory_utilization": 0.9}
    for real in (True, False):
        space = build_space("systems", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO,
                            base=NEAR_THE_EDGE, options={}).on_real_gpus(real)
        fitted = space.fitted(edge, NEAR_THE_EDGE)
        assert fitted is not None
        assert (fitted["gpu_memory_utilization"] < 0.9) is real, fitted


def test_switching_kl_on_at_the_edge_takes_the_reference_from_vllms_share() -> None:
    """A reference policy needs memory: where the estimate says the GPU is full with it, the
    KL candidate comes with vLLM's fraction lowered so that it fits (on real GPUs)."""
    from verl_sweep import verl_knowledge as M

    off = {**NEAR_THE_EDGE, L.USE_KL_LOSS: False}
    edge = M.fitting_fraction(MODEL_7B, A100x8, off, base=off)  # stage 0 may take vLLM's share this far
    off[L.GPU_MEMORY] = edge
    assert 79 < M.estimate(MODEL_7B, A100x8, off).peak_gb <= 80  # type: ignore[union-attr]
    for real in (True, False):
        space = build_space("kl", model=MODEL_7B, hardware=A100x8, algorithm=Algorithm.GRPO, base=off,
                            options={}).on_real_gpus(real)
        config = merge(off, space.suggest(optuna.trial.FixedTrial({"kl_coef": 0.001}), off))
        assert config[L.USE_KL_LOSS] is True
        peak = M.estimate(MODEL_7B, A100x8, config)
        assert peak is not None
        if real:
            assert config[L.GPU_MEMORY] < edge and peak.peak_gb <= 80, peak.lines
        else:
            assert config[L.GPU_MEMORY] == edge and peak.peak_gb > 80


def test_a_memory_edge_is_bisected_to_within_five_percent_in_a_few_probes() -> None:
    """Throughput often peaks just under the memory edge: after an OOM, each draw halves the span
    between the highest budget that ran and the lowest that ran out of memory."""
    space = build("token_budget")
    high = int(space.bound.high)
    for edge in (0.3 * high, 0.62 * high, 0.97 * high):
        study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=2))
        study.enqueue_trial({"token_budget": int(space.bound.low)})
        study.enqueue_trial({"token_budget": high})
        ran, ooms = [], 0
        for _ in range(2 + 7):
            trial = study.ask()
            budget = space.suggest(trial, GRPO_BASE)[L.TOKEN_BUDGET]
            if budget >= edge:
                ooms += 1
                _oom(study, trial, hardware_tag(A100x8))
            else:
                ran.append(budget)
                study.tell(trial, float(budget))
        assert max(ran) >= 0.95 * edge, (edge, sorted(ran))
        assert ooms <= 5, ooms


@pytest.mark.parametrize("enqueued", [0.5, 0.8, 0.99])
def test_a_point_enqueued_after_an_oom_keeps_its_value_and_optuna_stays_quiet(enqueued: float) -> None:
    """A starting point or a leader's re-run fixes its own value; the memory edge's narrowing is
    for the sampler's draws. Asking a fixed value over a narrower range makes Optuna warn on
    every such trial (and, outside it, would be a value the space never meant to give)."""
    space = build("token_budget")
    low, high = int(space.bound.low), int(space.bound.high)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=3))
    for value in (low, high):
        study.enqueue_trial({"token_budget": value})
        trial = study.ask()
        space.suggest(trial, GRPO_BASE)
        if value == high:
            _oom(study, trial, hardware_tag(A100x8))
        else:
            study.tell(trial, 1.0)
    value = int(low + enqueued * (high - low))
    study.enqueue_trial({"token_budget": value})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trial = study.ask()
        with _counted_reads(study) as reads:
            assert space.suggest(trial, GRPO_BASE)[L.TOKEN_BUDGET] == value
        assert reads == [1]  # OOMs and the fixed point from one read of the study
        study.tell(trial, 1.0)
        drawn = space.suggest(study.ask(), GRPO_BASE)[L.TOKEN_BUDGET]  # the sampler's: under the OOM
    assert drawn < high


def test_a_second_slot_does_not_probe_the_midpoint_twice() -> None:
    space = build("token_budget")
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=4))
    study.enqueue_trial({"token_budget": int(space.bound.low)})
    study.enqueue_trial({"token_budget": int(space.bound.high)})
    low = study.ask()
    space.suggest(low, GRPO_BASE)
    study.tell(low, 1.0)
    top = study.ask()
    space.suggest(top, GRPO_BASE)
    _oom(study, top, hardware_tag(A100x8))
    first, second = study.ask(), study.ask()  # both slots asked before either reports
    a = space.suggest(first, GRPO_BASE)[L.TOKEN_BUDGET]
    b = space.suggest(second, GRPO_BASE)[L.TOKEN_BUDGET]
    assert a != b and b <= a
