"""A landscape: the simulated model, hardware and training dynamics of a verl run.

One YAML file (``landscapes/<name>.yaml``) holds the facts and the parameters; this module
turns a flat verl config into (a) a noise-free expectation and (b) a seeded step-by-step
trace. The simulated process (``python -m verl_sweep.launchers.simulator``) and the in-process API used
by tests and benchmarks share :meth:`Landscape.simulate`, so they cannot drift apart.

The model, in short (every constant lives in the landscape file):

- Reward follows R(t) = R0 + (A − R0) / (1 + (t_mid / t)^B) in steps. ``t_mid`` scales with
  updates per step (mini-batch), train batch, group size, KL strength and lr; the ceiling A
  drops for a too weak or too strong KL, for too many updates per rollout (stale data), and in
  the unstable region of lr × updates-per-step. Far past that region the run diverges: KL and
  grad norm explode, reward collapses and becomes NaN.
- Step time = generation + log-prob passes + actor (and critic) update + optimiser steps;
  generation speed follows the token budget, memory fraction and rollout layout; the update
  follows padding (dynamic batching), recomputation, offload, ulysses and the FSDP flavour.
- GPU memory decides OOM (token budget activations, KV cache room, FSDP states + micro-batch
  activations); pathological layouts hang until the NCCL timeout.
- Checkpoints (``trainer.save_freq``, ``trainer.resume_mode``; files in
  :mod:`verl_sweep.launchers.simulator.checkpoints`): a save costs :meth:`Landscape.checkpoint_s`
  inside its step; a resumed run (a branch) keeps what verl 0.9.1 restores (the step, the lr)
  and takes the rest from its new config, entering the new config's reward curve at the
  checkpoint's reward, so every landscape file works unchanged (:meth:`Landscape.simulate`).

Noise: one run's random stream is seeded by the landscape seed and ``data.seed``; it draws
three numbers for the run, then a fixed six a step, whatever the config. So two configs under
one seed are paired, and a run resumed at step N skips the 6·N draws of steps 1..N: step t
draws the same numbers whether the run started at 1 or resumed. Branches from one checkpoint
under one ``data.seed`` are paired, and a branch with the saving run's config and seed repeats
that run. (Real verl ignores ``data.seed`` on resume for the data order, but its rollouts'
sampling is fresh in every run: the simulator's seed stands for that run-to-run noise.)

Calibration "effect" of a parameter (``tests/launchers/test_simulator_calibration.py``): over its safe
range (the table in docs/method.md §1) with everything else at the landscape's baseline config,
effect = (max − min) / (2 · value at the baseline) of a measured quantity, each point the mean
of 10 seeded runs. Quantities: steps to converge (first step where the 10-run mean reward,
smoothed over 25 steps, reaches R0 + 0.9·(A − R0) of that config) for mini-batch, KL and lr;
tokens/s/GPU (``perf/throughput``) for the token budget; the variance of the step-to-step
reward noise for GAE's λ.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from typing import Any, Callable, Iterator, Mapping

from verl_sweep.launchers.simulator import memory
from verl_sweep.launchers.simulator.config import ConfigError, DEFAULTS, get
from verl_sweep.launchers.simulator.outcomes import CheckpointState, Expectation, Failure, LandscapeError, StepRecord
from verl_sweep.launchers.simulator.outcomes import number as _f, value as _value

__all__ = ["CheckpointState", "Expectation", "Failure", "Landscape", "LandscapeError", "StepRecord", "load_landscape",
           "shipped_landscapes"]

LR_KEY = "actor_rollout_ref.actor.optim.lr"
# A checkpoint holds fp32 weights and Adam's two fp32 moments: 12 bytes a parameter, for the
# actor and again for a critic (docs/verl-resume.md §6), moved at an assumed 4 GB/s to or from
# the node's local disk over all ranks together.
CHECKPOINT_BYTES_PER_PARAM = 12.0
CHECKPOINT_BYTES_PER_S = 4e9
StepPhases = Callable[[float], tuple[dict[str, float], float, float, float]]


@dataclasses.dataclass(frozen=True)
class Landscape:
    """Parameters of one simulated world; build with :func:`load_landscape`."""

    name: str
    data: Mapping[str, Any]

    # -- sections ---------------------------------------------------------------------------
    def _s(self, name: str) -> Mapping[str, Any]:
        section = self.data.get(name)
        if not isinstance(section, Mapping):
            raise LandscapeError(f"landscape {self.name!r} needs a mapping {name!r}, but got {section!r}.")
        return section

    @property
    def seed(self) -> int:
        return int(self.data.get("seed", 0))

    @property
    def baseline(self) -> dict[str, Any]:
        """The config the calibration figures and η are relative to (flat verl keys)."""
        return dict(self._s("baseline"))

    @property
    def gpu_memory_gb(self) -> float:
        env = os.environ.get("VERL_SIM_GPU_MEMORY_GB")
        return float(env) if env else _f(self._s("hardware"), "gpu_memory_gb")

    def config_value(self, config: Mapping[str, Any], key: str) -> Any:
        """A key's value: given in ``config``, else verl's default (not the baseline's)."""
        return get(config, key)

    # -- noise-free model -------------------------------------------------------------------
    def expected(self, config: Mapping[str, Any]) -> Expectation:
        """The noise-free behaviour of ``config`` (flat verl keys; missing → verl defaults).

        Raises ``ConfigError`` for values the model cannot read (verl's own checks are in
        ``verl_sweep.launchers.simulator.config.check_config``).
        """
        g = lambda key: _value(config, key)  # noqa: E731
        model, rw, mb, kl, lrs, lam = (self._s(s) for s in ("model", "reward", "mini_batch", "kl", "lr", "lam"))
        base = self.baseline
        gb = lambda key: _value(base, key)  # noqa: E731

        adv = str(g("algorithm.adv_estimator"))
        n_gpus = int(g("trainer.n_gpus_per_node")) * int(g("trainer.nnodes"))
        batch = float(g("data.train_batch_size"))
        mini = float(g("actor_rollout_ref.actor.ppo_mini_batch_size"))
        n = max(1.0, float(g("actor_rollout_ref.rollout.n")))
        epochs = max(1.0, float(g("actor_rollout_ref.actor.ppo_epochs")))
        updates = epochs * batch / max(mini, 1.0)
        ref_updates = float(gb("data.train_batch_size")) / float(gb("actor_rollout_ref.actor.ppo_mini_batch_size"))
        lr = float(g("actor_rollout_ref.actor.optim.lr"))
        k = _kl_strength(config)
        k_eff = k if k > 0 else _f(kl, "none_equivalent")

        # Speed of learning (t_mid in steps).
        t_mid = _f(rw, "t_mid_steps")
        t_mid *= (ref_updates / updates) ** _f(mb, "speed_exponent")
        t_mid *= (float(gb("data.train_batch_size")) / batch) ** _f(mb, "train_batch_exponent")
        t_mid *= (float(gb("actor_rollout_ref.rollout.n")) / n) ** _f(mb, "group_exponent")
        t_mid *= (k_eff / _f(kl, "ref")) ** _f(kl, "speed_exponent")
        t_mid *= (_f(lrs, "ref") / lr) ** _f(lrs, "speed_exponent")
        if adv == "gae":
            t_mid *= _f(rw, "gae_speed_factor")
        warmup = float(g("actor_rollout_ref.actor.optim.lr_warmup_steps"))
        steepness = _f(rw, "steepness")

        # Stability: lr × updates-per-step, scaled by the KL's restoring pull.
        instability = (lr / _f(lrs, "ref")) * (updates / ref_updates) ** _f(lrs, "batch_coupling")
        instability *= (_f(kl, "ref") / max(k_eff, _f(kl, "ref"))) ** _f(lrs, "kl_tolerance_exponent")
        unstable_above, diverge_above = _f(lrs, "unstable_above"), _f(lrs, "diverge_above")
        diverges = instability >= diverge_above or k >= _f(kl, "diverge_above")
        diverge_step: int | None = None
        if diverges:
            severity = max(instability / diverge_above, k / _f(kl, "diverge_above"), 1.0)
            diverge_step = max(3, int(_f(lrs, "diverge_steps") / severity**2))

        # Ceiling.
        ceiling = _f(rw, "ceiling")
        k_opt = _f(kl, "optimum")
        ratio = math.log(k_eff / k_opt)
        ceiling -= _f(kl, "weak_penalty") * max(0.0, -ratio) + _f(kl, "strong_penalty") * max(0.0, ratio)
        stale = max(0.0, updates - _f(mb, "max_updates_per_step"))
        # Quadratic near the threshold, saturating far past it: verl's default (4 updates/step)
        # still learns, just towards a lower ceiling.
        cap = _f(mb, "staleness_max_loss")
        ceiling -= cap * (1.0 - math.exp(-_f(mb, "staleness_penalty") * stale**2 / cap))
        if instability > unstable_above:
            ceiling -= _f(lrs, "unstable_penalty") * (instability / unstable_above - 1.0)
        if adv == "gae":
            lam_value = float(g("algorithm.lam"))
            ceiling -= _f(lam, "bias_penalty") * max(0.0, 1.0 - lam_value) / 0.05
            # Optional: a high λ's variance hurts the critic (an interior λ optimum).
            ceiling -= float(lam.get("variance_penalty", 0.0)) * max(0.0, lam_value - _f(lam, "ref")) / _f(lam, "step")
        ceiling -= self._knob_losses(config)
        r0 = _f(rw, "r0")
        ceiling = max(r0 + 0.02, ceiling)
        steps_to_converge = t_mid * 9.0 ** (1.0 / steepness) + max(0.0, warmup) / 2.0

        # Reward noise: GAE's λ moves the variance linearly (see the module docstring).
        reward_sd = _f(self._s("noise"), "reward_sd")
        if adv == "gae":
            lam_value = float(g("algorithm.lam"))
            var_scale = 1.0 + _f(lam, "variance_per_step") * (lam_value - _f(lam, "ref")) / _f(lam, "step")
            reward_sd *= math.sqrt(max(0.05, var_scale))
        if instability > unstable_above:
            reward_sd *= 1.0 + 0.5 * (instability / unstable_above - 1.0)
        # Optional heteroscedastic noise: growing with lr and with updates per step.
        noise = self._s("noise")
        reward_sd *= (lr / _f(lrs, "ref")) ** float(noise.get("lr_exponent", 0.0))
        reward_sd *= (updates / ref_updates) ** float(noise.get("updates_exponent", 0.0))

        phases, tokens, util, _ = self._step_phases(config)(0.0)
        step_time = sum(phases.values())
        failure = memory.failure(self._s("model"), self._s("memory"), self.data.get("failures", {}) or {},
                                 self.gpu_memory_gb, config)
        total_steps, per_epoch = self._run_length(config)
        return Expectation(
            step_time_s=step_time,
            phases_s=phases,
            tokens_per_step=tokens,
            throughput=tokens / step_time / n_gpus,
            gpu_util=util,
            r0=r0,
            ceiling=ceiling,
            t_mid=t_mid,
            steepness=steepness,
            steps_to_converge=steps_to_converge,
            instability=instability,
            unstable=instability > unstable_above,
            diverges=diverges,
            diverge_step=diverge_step,
            failure=failure,
            reward_sd=reward_sd,
            # a fixed part (imports, engine start: it dominates a small model's start-up) and
            # one growing with the model (docs/method.md, Evidence)
            startup_s=float(self._s("timing").get("startup_fixed_s", 0.0))
            + _f(self._s("timing"), "startup_s") * (_f(model, "n_params_b") / 7.0) ** 0.5,
            steps_per_epoch=per_epoch,
            total_steps=total_steps,
            n_gpus=n_gpus,
        )

    def _knob_losses(self, config: Mapping[str, Any]) -> float:
        """What the verl keys a landscape names under ``knobs`` take off the ceiling, each
        ``penalty × ((value − optimum) / width)²`` (value: the config's, else the entry's
        ``default``): how a new stage's knob gets a response without a change to this model."""
        loss = 0.0
        for key, shape in dict(self.data.get("knobs") or {}).items():
            value = get(config, key)
            value = shape.get("default", value) if value is None and isinstance(shape, Mapping) else value
            loss += _f(shape, "penalty") * ((float(_value({key: value}, key)) - _f(shape, "optimum")) / _f(shape, "width")) ** 2
        return loss

    def _run_length(self, config: Mapping[str, Any]) -> tuple[int, int]:
        per_epoch = max(1, int(self.data.get("dataset_size", 100000)) // int(_value(config, "data.train_batch_size")))
        by_epochs = per_epoch * int(_value(config, "trainer.total_epochs"))
        steps = _value(config, "trainer.total_training_steps")
        return (min(int(steps), by_epochs) if steps is not None else by_epochs), per_epoch

    def _step_phases(self, config: Mapping[str, Any]) -> StepPhases:
        """progress → (phase → simulated seconds, tokens in the step, GPU util %, response length);
        what the config fixes is read once per run. Each phase time is ``ideal / efficiency``; the
        ideal rates are fixed so that the landscape's baseline config takes ``timing.*_s`` at step 1."""
        timing = self._s("timing")
        ideal = self._ideal_rates()
        work_at = self._work(config)
        effs = self._efficiencies(config)
        other_s, floor, slope = _f(timing, "other_s"), _f(timing, "util_floor"), _f(timing, "util_slope")

        def phases_at(progress: float) -> tuple[dict[str, float], float, float, float]:
            work, tokens, response = work_at(progress)
            phases: dict[str, float] = {}
            busy = 0.0
            for phase, amount in work.items():
                if amount <= 0:
                    continue
                ideal_s = amount / ideal[phase]
                phases[phase] = ideal_s / effs[phase]
                busy += ideal_s if phase in ("gen", "optimizer") else ideal_s * (1.0 - effs["host_share"])
            phases["other"] = other_s
            total = sum(phases.values())
            # Affine in the busy fraction: fitted to the source (a bad layout 42%, a fitting one 79%).
            util = min(99.0, max(1.0, floor + slope * busy / total))
            return phases, tokens, util, response

        return phases_at

    def _work(self, config: Mapping[str, Any]) -> Callable[[float], tuple[dict[str, float], float, float]]:
        """progress → (work per phase per GPU: tokens or optimiser steps, total tokens, response length)."""
        g = lambda key: _value(config, key)  # noqa: E731
        batch = float(g("data.train_batch_size"))
        n = max(1.0, float(g("actor_rollout_ref.rollout.n")))
        epochs = max(1.0, float(g("actor_rollout_ref.actor.ppo_epochs")))
        n_gpus = int(g("trainer.n_gpus_per_node")) * int(g("trainer.nnodes"))
        rl = self._s("response_length")
        prompt, start, end = float(rl.get("prompt", 300)), _f(rl, "start"), _f(rl, "end")
        has_ref, has_critic = _kl_strength(config) > 0, str(g("algorithm.adv_estimator")) == "gae"
        optimizer = epochs * batch / max(1.0, float(g("actor_rollout_ref.actor.ppo_mini_batch_size")))
        batch_n = batch * n  # the products below associate left, so this is the same float

        def work_at(progress: float) -> tuple[dict[str, float], float, float]:
            response = start + (end - start) * min(1.0, max(0.0, progress))
            tokens = batch_n * (prompt + response)
            per_gpu = tokens / n_gpus
            work = {"gen": batch_n * response / n_gpus, "old_log_prob": per_gpu, "ref": per_gpu if has_ref else 0.0,
                    "values": per_gpu if has_critic else 0.0, "update_actor": per_gpu * epochs,
                    "update_critic": per_gpu * epochs if has_critic else 0.0, "optimizer": optimizer}
            return work, tokens, response

        return work_at

    def _ideal_rates(self) -> dict[str, float]:
        """Work units per simulated second at efficiency 1, from the baseline's phase times."""
        cached = self.__dict__.get("_rates")
        if cached is not None:
            return cached
        timing = self._s("timing")
        base = self.baseline
        work, _, _ = self._work(base)(0.0)
        effs = self._efficiencies(base)
        rates: dict[str, float] = {}
        for phase, seconds_key in (
            ("gen", "gen_s"), ("old_log_prob", "log_prob_s"), ("ref", "log_prob_s"),
            ("values", "log_prob_s"), ("update_actor", "update_s"), ("update_critic", "update_s"),
            ("optimizer", "optimizer_step_s"),
        ):  # fmt: skip
            seconds = _f(timing, seconds_key)
            if phase == "optimizer":
                rates[phase] = 1.0 / (seconds * effs[phase])
                continue
            amount = work[phase] if work[phase] > 0 else work["old_log_prob"]
            rates[phase] = amount / (seconds * effs[phase])
        object.__setattr__(self, "_rates", rates)  # frozen dataclass: cache by hand
        return rates

    def _efficiencies(self, config: Mapping[str, Any]) -> dict[str, float]:
        """Fraction of peak each phase reaches under this layout (1 = the ideal)."""
        g = lambda key: _value(config, key)  # noqa: E731
        lay, mem, model = self._s("layout"), self._s("memory"), self._s("model")
        tp = int(g("actor_rollout_ref.rollout.tensor_model_parallel_size"))
        pp = int(g("actor_rollout_ref.rollout.pipeline_model_parallel_size"))
        table = lay.get("rollout_efficiency", {}) or {}
        rollout_eff = float(table.get(f"{tp}x{pp}", lay.get("rollout_efficiency_other", 0.5)))
        budget = float(g("actor_rollout_ref.rollout.max_num_batched_tokens"))
        half = _f(lay, "budget_half_tokens")
        budget_eff = budget / (budget + half)
        peak = float(lay.get("budget_peak_tokens", 0) or 0)
        if peak and budget > peak:  # past the sweet spot: preemption and fragmentation
            budget_eff *= max(0.2, 1.0 - _f(lay, "budget_decline") * (budget - peak) / peak)
        frac = float(g("actor_rollout_ref.rollout.gpu_memory_utilization"))
        weights_gb = _f(model, "n_params_b") * 2.0 / (tp * pp)
        kv_gb = max(0.1, frac * self.gpu_memory_gb - weights_gb)
        kv_half = _f(mem, "kv_half_gb")
        kv_eff = kv_gb / (kv_gb + kv_half)
        gen = rollout_eff * budget_eff * kv_eff

        dynamic = bool(g("actor_rollout_ref.actor.use_dynamic_bsz"))
        train = _f(lay, "dynamic_bsz_efficiency") if dynamic else _f(lay, "static_bsz_efficiency")
        sp = int(g("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"))
        train *= float((lay.get("ulysses_efficiency", {}) or {}).get(sp, 0.6))
        if str(g("actor_rollout_ref.actor.strategy")) == "fsdp2":
            train *= _f(lay, "fsdp2_gain")
        elif bool(g("actor_rollout_ref.actor.fsdp_config.forward_prefetch")):
            train *= _f(lay, "forward_prefetch_gain")
        update = train / _f(lay, "recompute_cost") if g("actor_rollout_ref.model.enable_gradient_checkpointing") else train
        if bool(g("actor_rollout_ref.model.enable_activation_offload")):
            update /= _f(lay, "activation_offload_cost")
        offload = 1.0
        if bool(g("actor_rollout_ref.actor.fsdp_config.param_offload")):
            offload *= _f(lay, "param_offload_cost")
        if bool(g("actor_rollout_ref.actor.fsdp_config.optimizer_offload")):
            offload *= _f(lay, "optimizer_offload_cost")
        passes, update, host = train / offload**0.5, update / offload, float(self._s("timing").get("host_share", 0.0))
        if host:  # timing.host_share: the passes' host work (launches, Python, copies), which no layout knob moves
            passes, update = 1.0 / (host + (1.0 - host) / passes), 1.0 / (host + (1.0 - host) / update)
        return {"gen": gen, "old_log_prob": passes, "ref": passes, "values": passes, "host_share": host,
                "update_actor": update, "update_critic": update, "optimizer": 1.0 / offload}

    def memory_gb(self, config: Mapping[str, Any]) -> dict[str, float]:
        """Peak GPU memory (GiB) of each phase and the limits it is held against."""
        return memory.memory_gb(self._s("model"), self._s("memory"), self.gpu_memory_gb, config)

    def checkpoint_s(self, config: Mapping[str, Any]) -> float:
        """Simulated seconds to save, or to load, one checkpoint of ``config``'s models.

        Landscape-free: 12 bytes a parameter (``model.n_params_b``) for the actor, and the same
        again for GAE's critic, at 4 GB/s: 3 s per billion parameters of each model, no fixed
        part. A save counts in its step's ``timing_s/step`` (verl times it inside the step) and
        is logged as ``timing_s/save_checkpoint``; a load lengthens the start-up.
        """
        models = 2.0 if str(_value(config, "algorithm.adv_estimator")) == "gae" else 1.0
        params = _f(self._s("model"), "n_params_b") * 1e9
        return models * params * CHECKPOINT_BYTES_PER_PARAM / CHECKPOINT_BYTES_PER_S

    # -- rates --------------------------------------------------------------------------------
    def true_rate(self, config: Mapping[str, Any], steps: int = 500) -> float:
        """Noise-free reward gain per simulated second of training over the first ``steps``.

        (R(steps) − R0) / Σ step times (start-up excluded, as η requires). NaN when the run
        cannot be scored: OOM, hang, or a reward that turns NaN before ``steps``.
        """
        exp = self.expected(config)
        if exp.failure is not None or (exp.diverge_step is not None and exp.diverge_step <= steps):
            return math.nan
        phases_at = self._step_phases(config)  # fixed for the run: built once
        seconds = sum(self.step_time(config, t, exp, phases_at=phases_at) for t in range(1, steps + 1))
        return (exp.reward(steps) - exp.r0) / seconds

    def step_time(self, config: Mapping[str, Any], step: int, exp: Expectation | None = None,
                  *, phases_at: StepPhases | None = None) -> float:
        """Noise-free simulated seconds of ``step`` (responses grow as reward rises)."""
        exp = exp or self.expected(config)
        progress = (exp.reward(step) - exp.r0) / max(1e-9, exp.ceiling - exp.r0)
        phases, _, _, _ = (phases_at or self._step_phases(config))(progress)
        return sum(phases.values())

    def eta(self, config: Mapping[str, Any], baseline: Mapping[str, Any] | None = None, steps: int = 500) -> float:
        """The source's η: (ΔR1/T1) / (ΔR0/T0) over ``steps`` steps, noise-free."""
        return self.true_rate(config, steps) / self.true_rate(self.baseline if baseline is None else baseline, steps)

    # -- seeded trace -------------------------------------------------------------------------
    def simulate(
        self, config: Mapping[str, Any], *, max_steps: int | None = None, resume: CheckpointState | None = None
    ) -> Iterator[StepRecord]:
        """Step records of one seeded run (seed = landscape seed + ``data.seed``).

        The random stream draws the same numbers in the same order whatever the config, so
        two configs under one seed share their noise (paired comparisons stay paired).
        Stops at the run length, at step ``max_steps``, or just before a failure's step.

        With ``trainer.save_freq`` K > 0 the records of every K-th step and of the last step
        carry the checkpoint verl saves there. With ``resume`` (a checkpoint of step N) the run
        is a branch, steps N+1 on, as verl 0.9.1 resumes one (docs/verl-resume.md):

        - it trains at the checkpoint's lr (``base_lr``: verl restores the optimizer's param
          groups and the scheduler's ``base_lrs``), under the new config's warm-up shape at the
          restored step; every other key (mini-batch, KL, batch, rollout) is the new config's;
        - it enters the new config's reward curve where that curve reaches the checkpoint's
          reward (its closest point if it never does) and moves along it a step a step;
        - its noise is the stream of its own ``data.seed`` advanced past steps 1..N, so step t
          draws the same numbers whether the run started at 1 or resumed: a branch with the
          saving run's config and seed repeats that run's steps, and branches from one
          checkpoint under one seed are paired;
        - a diverging config counts its blow-up from the first step it trained (N+1, or the
          checkpoint's ``diverging_since`` if the checkpoint's run diverged too);
        - a failure's step counts from N+1 (an OOM at step 1 fails step N+1).
        """
        given = config
        if resume is not None:
            config = {**{k: v for k, v in config.items() if k.lstrip("+") != LR_KEY}, LR_KEY: resume.base_lr}
        exp = self.expected(config)
        noise = self._s("noise")
        data_seed = _value(config, "data.seed")
        rng = random.Random(f"{self.seed}:{0 if data_seed is None else int(data_seed)}")
        t_mid_factor = math.exp(rng.gauss(0.0, _f(noise, "t_mid_sd")))
        ceiling_shift = rng.gauss(0.0, _f(noise, "ceiling_sd"))
        run_time_factor = math.exp(rng.gauss(0.0, _f(noise, "run_time_sd")))
        step_sd = _f(noise, "step_time_sd")
        curve = dataclasses.replace(exp, t_mid=exp.t_mid * t_mid_factor, ceiling=exp.ceiling + ceiling_shift)
        g = lambda key: _value(config, key)  # noqa: E731
        lr = float(g("actor_rollout_ref.actor.optim.lr"))
        warmup = max(0, int(g("actor_rollout_ref.actor.optim.lr_warmup_steps")))
        k = _kl_strength(config)
        use_kl_loss = bool(g("actor_rollout_ref.actor.use_kl_loss"))
        kl_cfg = self._s("kl")
        kl_ref_scale = _f(kl_cfg, "ref_kl_at_convergence") * (_f(kl_cfg, "ref") / max(k, _f(kl_cfg, "none_equivalent"))) ** 0.5
        unstable_excess = max(0.0, exp.instability / _f(self._s("lr"), "unstable_above") - 1.0)
        # Fixed for the run, out of the step loop (products associate left: the same floats).
        excess, grad_scale = 1.0 + unstable_excess, 0.3 * (1.0 + 2.0 * unstable_excess)
        ppo_kl_scale = 1e-3 * (exp.instability**1.5) * excess
        entropy_scale = 1.0 + 0.2 * math.log(max(k, 1e-6) / _f(kl_cfg, "ref")) * -0.2
        kl_in_reward = bool(g("algorithm.use_kl_in_reward"))
        # verl's adaptive in-reward controller (core_algos.AdaptiveKLController): it logs the
        # coefficient it applied, then moves it toward target_kl, per response of the batch.
        # It is not saved: a resumed run starts it again at kl_ctrl.kl_coef, as verl does.
        adaptive = kl_in_reward and g("algorithm.kl_ctrl.type") == "adaptive"
        kl_coef, kl_loss_coef = float(g("algorithm.kl_ctrl.kl_coef")), float(g("actor_rollout_ref.actor.kl_loss_coef"))
        target_kl, horizon = float(g("algorithm.kl_ctrl.target_kl")), float(g("algorithm.kl_ctrl.horizon"))
        prompt = float(self._s("response_length").get("prompt", 300))
        span, gauss = max(1e-9, curve.ceiling - curve.r0), rng.gauss
        start = 0 if resume is None else resume.step
        stop = exp.total_steps if max_steps is None else min(exp.total_steps, max_steps)
        if exp.failure is not None:
            stop = min(stop, start + exp.failure.at_step - 1)
        n_gpus = exp.n_gpus
        phases_at = self._step_phases(config)  # fixed for the run: built once
        mem = self.memory_gb(config)
        used_gb = max(mem["reserved_gb"], mem["train_gb"])
        # Warm-up delays learning by half its length; a branch takes the rest of it from the
        # restored step and enters the curve at the checkpoint's reward.
        lag = lambda s: max(0.0, s - warmup / 2.0)  # noqa: E731
        entry = 0.0 if resume is None else curve.steps_at(resume.reward) - lag(start)
        diverging_since = None if exp.diverge_step is None else start + 1
        if diverging_since is not None and resume is not None and resume.diverging_since is not None:
            diverging_since = resume.diverging_since
        diverge_step = None if diverging_since is None else diverging_since - 1 + int(exp.diverge_step or 0)
        save_freq = int(g("trainer.save_freq") or -1)
        configured = g("trainer.total_training_steps")
        last_step = int(configured) if configured is not None else exp.steps_per_epoch * int(g("trainer.total_epochs"))
        save_s = self.checkpoint_s(config)
        # A run's first step, fresh or resumed, carries vLLM's and the workers' first calls: on
        # real verl 0.9.1 ~22-30 s more than the steps after it at 3.2M and 0.36B parameters
        # alike, mostly outside the timed phases (docs/device-runs/2026-12-07-h100-branch-resume)
        first_step_s = float(self._s("timing").get("first_step_s", 0.0))
        batch, mini = int(g("data.train_batch_size")), int(g("actor_rollout_ref.actor.ppo_mini_batch_size"))
        rollouts = int(g("actor_rollout_ref.rollout.n"))  # responses a prompt: the KL controller's n_steps
        updates = max(1, int(g("actor_rollout_ref.actor.ppo_epochs"))) * -(-batch // mini)
        elapsed = exp.startup_s if resume is None else resume.elapsed_s + exp.startup_s + save_s
        for _ in range(6 * start):
            gauss(0.0, 1.0)
        for step in range(start + 1, stop + 1):
            z = [gauss(0.0, 1.0) for _ in range(6)]  # fixed count: keeps configs paired
            t_eff = lag(step) + entry
            smooth = curve.reward(t_eff)
            progress = (smooth - curve.r0) / span
            phases, tokens, util, response = phases_at(progress)
            factor = run_time_factor * math.exp(step_sd * z[0])
            for p in phases:  # a fresh dict each step: scaled in place
                phases[p] *= factor
            step_time = sum(phases.values()) + (first_step_s if step == start + 1 else 0.0)
            reward = smooth + curve.reward_sd * z[1]
            ref_kl = kl_ref_scale * progress * excess * math.exp(0.05 * z[2])
            ppo_kl = ppo_kl_scale * math.exp(0.2 * z[3])
            grad_norm = grad_scale * math.exp(0.15 * z[4])
            entropy = 1.2 - 0.7 * progress * entropy_scale
            policy = smooth  # the reward the weights reach, noise-free: what a checkpoint keeps
            if diverge_step is not None and step >= diverge_step:
                # everything is NaN from 12 steps on: the factors stop there (3.0**650 overflows)
                blow = min(step - diverge_step, 12)
                ref_kl *= 2.0**blow
                ppo_kl *= 3.0**blow
                grad_norm *= 3.0**blow
                policy = smooth * math.exp(-blow / 4.0)
                reward = policy + curve.reward_sd * z[1]
                if blow >= 12:
                    reward = ref_kl = ppo_kl = grad_norm = entropy = policy = math.nan
            lr_now = lr * min(1.0, step / warmup) if warmup > 0 else lr
            metrics: dict[str, float | int] = {
                "critic/score/mean": reward,
                "critic/rewards/mean": reward - (k * ref_kl if kl_in_reward else 0.0),
                "actor/ppo_kl": ppo_kl,
                "actor/pg_clipfrac": min(1.0, 0.002 + 2.0 * ppo_kl) if ppo_kl == ppo_kl else math.nan,
                "actor/grad_norm": grad_norm,
                "actor/entropy": entropy,
                "actor/lr": lr_now,
                "response_length/mean": response * math.exp(0.02 * z[5]),
                "prompt_length/mean": prompt,
                "timing_s/gen": phases["gen"],
                "timing_s/old_log_prob": phases.get("old_log_prob", 0.0),
                "timing_s/update_actor": phases.get("update_actor", 0.0) + phases.get("optimizer", 0.0),
                "timing_s/step": step_time,
                "perf/total_num_tokens": int(tokens),
                "perf/time_per_step": step_time,
                "perf/throughput": tokens / step_time / n_gpus,
                "training/global_step": step,
                "training/epoch": (step - 1) // exp.steps_per_epoch,
            }
            if use_kl_loss:
                metrics["actor/kl_loss"] = ref_kl
                metrics["actor/kl_coef"] = kl_loss_coef  # verl's losses.py: the loss term's own coefficient
            if "ref" in phases:
                metrics["timing_s/ref"] = phases["ref"]
            if "values" in phases:
                metrics["timing_s/values"] = phases["values"]
                metrics["timing_s/update_critic"] = phases["update_critic"]
            if kl_in_reward:
                metrics["actor/reward_kl_penalty"] = ref_kl
                metrics["actor/reward_kl_penalty_coeff"] = kl_coef
                if adaptive:
                    kl_coef *= 1 + min(max(ref_kl / target_kl - 1, -0.2), 0.2) * batch * rollouts / horizon
            checkpoint = None
            if save_freq > 0 and (step % save_freq == 0 or step >= last_step):
                step_time += save_s  # verl times the save inside the step
                metrics.update({"timing_s/save_checkpoint": save_s, "timing_s/step": step_time,
                                "perf/time_per_step": step_time, "perf/throughput": tokens / step_time / n_gpus})
            elapsed += step_time
            if "timing_s/save_checkpoint" in metrics:
                checkpoint = CheckpointState(
                    step=step, reward=policy, lr=lr_now, base_lr=lr, optimizer_steps=(resume.optimizer_steps if resume else 0)
                    + updates * (step - start), samples_seen=(step % exp.steps_per_epoch) * batch, elapsed_s=elapsed,
                    diverging_since=diverging_since, config=dict(given))  # fmt: skip
            yield StepRecord(step, step_time, metrics, util, used_gb, checkpoint)


def _kl_strength(config: Mapping[str, Any]) -> float:
    """The KL coefficient in force: the GRPO loss term and/or the PPO in-reward penalty."""
    k = 0.0
    if bool(get(config, "actor_rollout_ref.actor.use_kl_loss")):
        k += float(get(config, "actor_rollout_ref.actor.kl_loss_coef"))
    if bool(get(config, "algorithm.use_kl_in_reward")):
        k += float(get(config, "algorithm.kl_ctrl.kl_coef"))
    return k
