"""The joint space every peer searches: one flat, static set of parameters that covers every
config the stage chain can reach.

Built from the study's own stage spaces, not merely merged on the baseline (that would cap
what the peers can reach below what the chain reaches):

- the KL term is a choice (``use_kl`` on/off), as in the chain, where the KL stage may keep
  the baseline's "off";
- the token budget's upper bound is the highest bound the chain's token stage can reach: the
  bound at the largest memory fraction the systems stage may choose, for the rollout TP that
  allows the most, not the baseline's fraction and TP (docs/method.md, Evidence);
- the layout knobs are the systems stage's own choices.

Flat and static (every parameter is asked in every trial; an inactive one, such as the KL
coefficient with KL off, is ignored by :meth:`FairJointSpace.to_config`), so the same
parameters map onto Optuna distributions and onto a ConfigSpace for SMAC3 and DEHB.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Mapping

from verl_sweep.search.spec.study_file import StudySpec
from verl_sweep import verl_knowledge as V
from verl_sweep.spaces.base import Space
from verl_sweep.verl_knowledge import Algorithm
from verl_sweep.verl_knowledge import Config
from verl_sweep.spaces import systems as S
from verl_sweep.spaces.stages import KLSpace, LamSpace, LRSpace, MiniBatchSpace, SystemsSpace, TokenBudgetSpace

if TYPE_CHECKING:
    import optuna


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter: ``float`` / ``int`` in [low, high] (log scale, int step), or ``cat``."""

    name: str
    kind: str
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: int = 1
    choices: tuple[Any, ...] = ()

    def contains(self, value: Any) -> bool:
        if self.kind == "cat":
            return any(value == c and type(value) is type(c) for c in self.choices)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and (not float(value).is_integer() or (int(value) - int(self.low)) % self.step):
            return False
        return self.low * (1 - 1e-9) <= value <= self.high * (1 + 1e-9)


def _stage_options(spec: StudySpec, kind: str) -> dict[str, Any]:
    for stage in spec.stages:
        if stage.space == kind:
            return dict(stage.params or {})
    return {}


class FairJointSpace(Space):
    """Every knob of the study's stages at once, on the study's baseline (see the module)."""

    kind = "joint"

    def __init__(self, spec: StudySpec) -> None:
        base = spec.baseline_config()
        self.base = base
        facts = {"model": spec.model, "hardware": spec.hardware, "algorithm": spec.algorithm}
        self.algorithm = spec.algorithm
        self.max_seq_len = spec.model.max_seq_len
        kinds = {stage.space for stage in spec.stages}
        self.systems = SystemsSpace(base=base, options=_stage_options(spec, "systems"), **facts) if "systems" in kinds else None
        self.mini = MiniBatchSpace(base=base, options=_stage_options(spec, "mini_batch"), **facts)
        self.kl = KLSpace(base=base, options={k: v for k, v in _stage_options(spec, "kl").items()
                                               if k in ("low", "high", "log")}, **facts)  # fmt: skip
        self.lr = LRSpace(base=base, options=_stage_options(spec, "lr"), **facts)
        self.lam = LamSpace(base=base, options=_stage_options(spec, "lam"), **facts) if "lam" in kinds else None
        self.switch_key, self.coef_key = V.kl_keys(spec.algorithm)
        params: list[Param] = []
        if self.systems is not None:
            c = self.systems.choices
            for name in ("rollout_tp", "strategy", "forward_prefetch", "ulysses", "use_dynamic_bsz",
                         "ppo_max_token_len_per_gpu", "gradient_checkpointing", "activation_offload", "micro_batch",
                         "log_prob_micro_batch", "log_prob_token_factor", "max_num_seqs", "enforce_eager",
                         "free_cache_engine"):  # fmt: skip
                params.append(Param(name, "cat", choices=tuple(c[name])))
            params.append(Param("gpu_memory_utilization", "float", self.systems.memory.low, self.systems.memory.high))
        # Valid mini-batch sizes depend on the Ulysses size (the data-parallel ranks): the
        # chain's mini-batch stage runs on the systems stage's winner, so it may reach sizes
        # the baseline's layout does not allow. The space holds their union; a point maps to
        # the nearest size valid for its own Ulysses size.
        self.mini_by_sp: dict[int, list[int]] = {1: list(self.mini.choices)}
        if self.systems is not None:
            for sp in self.systems.choices["ulysses"]:
                on_sp = {**base, V.ULYSSES: sp, V.ULYSSES_LEGACY: sp}
                self.mini_by_sp[sp] = list(MiniBatchSpace(base=on_sp, options=_stage_options(spec, "mini_batch"), **facts).choices)
        union = sorted({m for sizes in self.mini_by_sp.values() for m in sizes})
        step = math.gcd(*[b - a for a, b in zip(union, union[1:])]) if len(union) > 2 else 0
        if step and all((m - union[0]) % step == 0 for m in union) and len(union) == (union[-1] - union[0]) // step + 1:
            params.append(Param("mini_batch", "int", union[0], union[-1], step=step))
        else:
            params.append(Param("mini_batch", "cat", choices=tuple(union)))
        params.append(Param("use_kl", "cat", choices=(False, True)))
        params.append(Param("kl_coef", "float", self.kl.bound.low, self.kl.bound.high, log=True))
        if "token_budget" in kinds:
            tokens = TokenBudgetSpace(base=base, options=_stage_options(spec, "token_budget"), **facts)
            high = tokens.bound.high
            if self.systems is not None:  # the highest bound the chain's token stage can reach
                for tp in self.systems.choices["rollout_tp"]:
                    tuned = {**base, V.GPU_MEMORY: self.systems.memory.high, V.ROLLOUT_TP: tp}
                    reach = TokenBudgetSpace(base=tuned, options=_stage_options(spec, "token_budget"), **facts)
                    high = max(high, reach.bound.high)
            params.append(Param("token_budget", "int", tokens.bound.low, high))
        params.append(Param("lr", "float", self.lr.bound.low, self.lr.bound.high, log=True))
        if self.lam is not None:
            params.append(Param("lam", "float", self.lam.bound.low, self.lam.bound.high))
        self.params = params
        self.by_name = {p.name: p for p in params}

    # -- the mapping -------------------------------------------------------------------------
    def to_config(self, values: Mapping[str, Any]) -> Config:
        """The verl overrides of one point (every parameter given)."""
        v = values
        config: Config = {}
        if self.systems is not None:
            config[V.ROLLOUT_TP] = int(v["rollout_tp"])
            config[V.STRATEGY] = v["strategy"]
            config[V.FORWARD_PREFETCH] = bool(v["forward_prefetch"])  # verl 0.9.1 prefetches under FSDP1 and FSDP2 alike
            sp = int(v["ulysses"])
            config[V.ULYSSES] = sp
            config[V.ULYSSES_LEGACY] = sp
            if sp > 1:
                config[V.USE_REMOVE_PADDING] = True
            config[V.USE_DYNAMIC_BSZ] = bool(v["use_dynamic_bsz"])
            if config[V.USE_DYNAMIC_BSZ]:
                # The dynamic-batch limit must cover the longest sequence: the smallest valid
                # limit at or above the one asked (the systems stage asks among those only).
                valid = self.systems.token_lens[sp]
                asked = int(v["ppo_max_token_len_per_gpu"])
                config[V.MAX_TOKEN_LEN] = min((t for t in valid if t >= asked), default=valid[-1])
                for key in (S.ROLLOUT_LOG_PROB_DYNAMIC, S.REF_LOG_PROB_DYNAMIC):
                    config[key] = True
                for key in (S.ROLLOUT_LOG_PROB_TOKENS, S.REF_LOG_PROB_TOKENS):
                    config[key] = config[V.MAX_TOKEN_LEN] * int(v["log_prob_token_factor"])
            else:
                # Static batching: the micro-batches valid for this Ulysses size nearest to the
                # ones asked (None: the baseline's own, unset), as the systems stage asks them.
                for key in (S.ROLLOUT_LOG_PROB_DYNAMIC, S.REF_LOG_PROB_DYNAMIC):
                    config[key] = False
                micro = _nearest(self.systems.micro_choices.get(sp, []), v["micro_batch"])
                if micro is not None:
                    config[V.MICRO_BATCH] = micro
                log_prob = _nearest(self.systems.log_prob_choices.get(sp, []), v["log_prob_micro_batch"])
                if log_prob is not None:
                    config[S.ROLLOUT_LOG_PROB_MICRO] = config[S.REF_LOG_PROB_MICRO] = log_prob
            config[S.MAX_NUM_SEQS] = int(v["max_num_seqs"])
            config[S.ENFORCE_EAGER] = bool(v["enforce_eager"])
            config[S.FREE_CACHE_ENGINE] = bool(v["free_cache_engine"])
            config[V.GRADIENT_CHECKPOINTING] = bool(v["gradient_checkpointing"])
            config[V.ACTIVATION_OFFLOAD] = bool(v["activation_offload"])
            config[V.GPU_MEMORY] = float(v["gpu_memory_utilization"])
        sizes = self.mini_by_sp.get(int(v["ulysses"]) if self.systems is not None else 1, self.mini_by_sp[1])
        config[V.MINI_BATCH] = min(sizes, key=lambda m: (abs(m - int(v["mini_batch"])), m))
        config[self.switch_key] = bool(v["use_kl"])
        if config[self.switch_key]:
            config[self.coef_key] = float(v["kl_coef"])
            if self.algorithm is Algorithm.PPO:
                config[V.KL_CTRL_TYPE] = "fixed"
        if "token_budget" in self.by_name:
            config[V.TOKEN_BUDGET] = int(v["token_budget"])
            config[V.CHUNKED_PREFILL] = True
        config[V.LR] = float(v["lr"])
        if self.lam is not None:
            config[V.LAM] = float(v["lam"])
        return config

    def params_for(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """A point of this space whose config equals ``config`` on every key the space sets
        (keys it does not set must equal the baseline's), or None when there is none."""
        g = lambda key: V.setting(config, key)  # noqa: E731
        values: dict[str, Any] = {}
        if self.systems is not None:
            sp = V.ulysses_size(config)
            dynamic = bool(g(V.USE_DYNAMIC_BSZ))
            values.update(
                rollout_tp=g(V.ROLLOUT_TP), strategy=g(V.STRATEGY),
                forward_prefetch=bool(g(V.FORWARD_PREFETCH)),
                ulysses=sp, use_dynamic_bsz=dynamic,
                ppo_max_token_len_per_gpu=g(V.MAX_TOKEN_LEN) if dynamic else self.by_name["ppo_max_token_len_per_gpu"].choices[0],
                gradient_checkpointing=bool(g(V.GRADIENT_CHECKPOINTING)),
                activation_offload=bool(g(V.ACTIVATION_OFFLOAD)),
                gpu_memory_utilization=g(V.GPU_MEMORY),
                micro_batch=None if dynamic else g(V.MICRO_BATCH),
                log_prob_micro_batch=None if dynamic else S.effective(dict(config), S.ROLLOUT_LOG_PROB_MICRO),
                max_num_seqs=S.effective(dict(config), S.MAX_NUM_SEQS),
                enforce_eager=bool(S.effective(dict(config), S.ENFORCE_EAGER)),
                free_cache_engine=bool(S.effective(dict(config), S.FREE_CACHE_ENGINE)),
            )  # fmt: skip
            limit, log_prob_limit = g(V.MAX_TOKEN_LEN), S.effective(dict(config), S.ROLLOUT_LOG_PROB_TOKENS)
            factor = log_prob_limit // limit if dynamic and isinstance(limit, int) and isinstance(log_prob_limit, int) else None
            values["log_prob_token_factor"] = factor if factor else self.by_name["log_prob_token_factor"].choices[0]
            for name in ("micro_batch", "log_prob_micro_batch"):  # unset under dynamic batching
                if values[name] is None and None not in self.by_name[name].choices:
                    values[name] = self.by_name[name].choices[0]
        on = bool(g(self.switch_key))
        values.update(mini_batch=g(V.MINI_BATCH), use_kl=on, lr=g(V.LR))
        coef = g(self.coef_key)
        values["kl_coef"] = coef if on else min(max(float(coef or 0.001), self.kl.bound.low), self.kl.bound.high)
        if "token_budget" in self.by_name:
            values["token_budget"] = g(V.TOKEN_BUDGET)
        if self.lam is not None:
            values["lam"] = g(V.LAM)
        for name, value in values.items():
            p = self.by_name[name]
            if not p.contains(value):
                return None
            if p.kind == "float":  # within rounding of a bound: exactly on it
                values[name] = min(p.high, max(p.low, float(value)))
        from verl_sweep.verl_knowledge import merge

        rebuilt = merge(self.base, self.to_config(values))
        for key in set(rebuilt) | set(config):
            a, b = S.effective(rebuilt, key), S.effective(dict(config), key)
            if key in (V.CHUNKED_PREFILL, V.KL_CTRL_TYPE) or (key == self.coef_key and not on):
                continue
            if a != b and not (isinstance(a, float) and isinstance(b, (int, float)) and math.isclose(a, b)):
                return None
        return values

    # -- Optuna ------------------------------------------------------------------------------
    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        return self.to_config(self.suggest_values(trial))

    def suggest_values(self, trial: "optuna.trial.BaseTrial") -> dict[str, Any]:
        values: dict[str, Any] = {}
        for p in self.params:
            if p.kind == "cat":
                values[p.name] = trial.suggest_categorical(p.name, list(p.choices))
            elif p.kind == "int":
                values[p.name] = trial.suggest_int(p.name, int(p.low), int(p.high), step=p.step)
            else:
                values[p.name] = trial.suggest_float(p.name, p.low, p.high, log=p.log)
        return values

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        return self.params_for(base)

    # -- ConfigSpace (SMAC3, DEHB) -------------------------------------------------------------
    def config_space(self, *, seed: int = 0) -> Any:
        """The same parameters as a ``ConfigSpace.ConfigurationSpace`` (categoricals keep
        their Python values; integers with a step become an ordinal over the valid values)."""
        from ConfigSpace import Categorical, ConfigurationSpace, Float, Integer

        cs = ConfigurationSpace(seed=seed)
        for p in self.params:
            if p.kind == "cat":
                cs.add(Categorical(p.name, [cs_value(c) for c in p.choices]))
            elif p.kind == "int" and p.step > 1:
                # ConfigSpace integers have no step: index the valid values instead.
                cs.add(Integer(p.name + "__index", (0, int((p.high - p.low) // p.step))))
            elif p.kind == "int":
                cs.add(Integer(p.name, (int(p.low), int(p.high)), log=p.log))
            else:
                cs.add(Float(p.name, (float(p.low), float(p.high)), log=p.log))
        return cs

    def from_config_space(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """A ConfigSpace configuration (as a dict) back to this space's values."""
        out: dict[str, Any] = {}
        for p in self.params:
            if p.kind == "cat":
                raw = values[p.name]
                out[p.name] = next(c for c in p.choices if cs_value(c) == raw)
            elif p.kind == "int" and p.step > 1:
                out[p.name] = int(p.low) + int(values[p.name + "__index"]) * p.step
            elif p.kind == "int":
                out[p.name] = int(values[p.name])
            else:
                out[p.name] = float(values[p.name])
        return out

    def to_config_space_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for p in self.params:
            if p.kind == "cat":
                out[p.name] = cs_value(values[p.name])
            elif p.kind == "int" and p.step > 1:
                out[p.name + "__index"] = (int(values[p.name]) - int(p.low)) // p.step
            else:
                out[p.name] = values[p.name]
        return out

    def explain(self) -> list[str]:
        lines = []
        for p in self.params:
            if p.kind == "cat":
                lines.append(f"joint: {p.name} ∈ {list(p.choices)}")
            else:
                lines.append(f"joint: {p.name} ∈ [{p.low:g}, {p.high:g}]{' log' if p.log else ''}"
                             f"{f' step {p.step}' if p.step > 1 else ''}")  # fmt: skip
        return lines


def _nearest(valid: list[Any], asked: Any) -> Any:
    """The value of ``valid`` nearest to ``asked`` (None, the baseline's unset choice, only when
    asked and valid)."""
    if asked in valid or not valid:
        return asked if valid else None
    numbers = [v for v in valid if v is not None]
    if asked is None or not numbers:
        return valid[0]
    return min(numbers, key=lambda v: (abs(v - asked), v))


def cs_value(value: Any) -> Any:
    """ConfigSpace categoricals hold str/int/float; booleans and None travel as strings."""
    return str(value) if isinstance(value, bool) or value is None else value
