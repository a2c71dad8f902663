"""The stage spaces of the method (BRIEF §2-3), registered by name in :data:`SPACES`.

``build_space(kind, ...)`` builds one from the study's facts, the base config and the stage's
parameter options, checking every bound then (SpaceError names the study-file field). A
space's ``suggest`` only returns values verl accepts: conditional parameters are asked only
when they apply, so nothing is sampled and then rejected.

Learning from OOM: the driver marks a trial that died of OOM with the user attrs
``failure_kind="oom"`` and ``hardware=hardware_tag(hardware)`` (and
``trial.set_constraint("oom", 1.0)``); every later ``suggest`` in that study keeps the
memory-bound parameters (token budget, memory fraction) below the smallest value that OOMed.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from spaces import bounds as B
from spaces import limits as L
from spaces.base import Space, SpaceError
from spaces.facts import Algorithm, HardwareFacts, ModelFacts
from spaces.overrides import Config

if TYPE_CHECKING:
    import optuna

logger = logging.getLogger(__name__)

OOM_KIND = "oom"
FAILURE_KIND_ATTR = "failure_kind"
HARDWARE_ATTR = "hardware"


def hardware_tag(hardware: HardwareFacts) -> str:
    """Identifies the hardware an OOM happened on (OOM limits do not carry across GPUs)."""
    return f"{hardware.nodes}x{hardware.gpus_per_node}x{hardware.gpu_memory_gb:g}GB"


def oom_ceiling(
    trials: Iterable["optuna.trial.FrozenTrial"], param: str, *, hardware: str | None = None
) -> float | None:
    """The smallest value of ``param`` among trials that died of OOM (on ``hardware``), or None.

    Trials without a ``hardware`` attr count on every hardware (the cautious reading).
    """
    ceiling: float | None = None
    for t in trials:
        if t.user_attrs.get(FAILURE_KIND_ATTR) != OOM_KIND or param not in t.params:
            continue
        tag = t.user_attrs.get(HARDWARE_ATTR)
        if hardware is not None and tag is not None and tag != hardware:
            continue
        value = t.params[param]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            ceiling = value if ceiling is None else min(ceiling, value)
    return ceiling


def _study_trials(trial: "optuna.trial.BaseTrial") -> list["optuna.trial.FrozenTrial"]:
    study = getattr(trial, "study", None)
    if study is None:  # FixedTrial / FrozenTrial: no history to learn from
        return []
    own = getattr(trial, "number", None)
    return [t for t in study.get_trials(deepcopy=False) if t.number != own]


def _check_options(options: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    if not isinstance(options, Mapping):
        raise SpaceError(f"{where}: must be a mapping of parameter options, but got {options!r}. Use e.g. {{low: .., high: ..}}.")
    allowed = sorted(allowed)
    for key in options:
        if key not in allowed:
            raise SpaceError(
                f"{where}.{key}: must be one of {allowed}, but got {key!r}. Remove or rename it."
            )


def _where(where: str, default: str) -> str:
    return where or default


class _BoundedSpace(Space):
    """A space over one float/int parameter with a safe bound, optionally clamped by OOMs."""

    param: str = ""
    key: str = ""
    oom_clamped: bool = False

    def __init__(self, bound: B.ParamBound, *, hardware: HardwareFacts, where: str) -> None:
        self.bound = bound
        self.hardware_tag = hardware_tag(hardware)
        self.where = where

    def _upper(self, trial: "optuna.trial.BaseTrial") -> float:
        high = self.bound.high
        if not self.oom_clamped:
            return high
        ceiling = oom_ceiling(_study_trials(trial), self.param, hardware=self.hardware_tag)
        if ceiling is None or ceiling > high:
            return high
        # Strictly below the value that OOMed; never below the floor (which we must allow).
        below = math.ceil(ceiling) - 1 if self.bound.is_int else ceiling * (1 - 1e-6)
        clamped = max(self.bound.low, below)
        if below < self.bound.low:
            logger.warning(
                "%s: OOM at %s is at or below the lower bound %s; suggesting the lower bound",
                self.param, ceiling, self.bound.low,
            )
        return clamped

    def _suggest_value(self, trial: "optuna.trial.BaseTrial") -> float:
        high = self._upper(trial)
        if self.bound.is_int:
            return trial.suggest_int(self.param, int(self.bound.low), int(high), log=self.bound.log)
        return trial.suggest_float(self.param, self.bound.low, high, log=self.bound.log)

    def _in_bound(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.bound.is_int and not float(value).is_integer():
            return False
        return self.bound.contains(value)

    def explain(self) -> list[str]:
        return [f"{self.kind}: {self.key} — {self.bound.describe()}"]


class MiniBatchSpace(Space):
    """``ppo_mini_batch_size`` over the valid values within baseline ±25% (categorical)."""

    kind = "mini_batch"
    param = "mini_batch"
    OPTIONS = B.BOUND_OPTIONS | {"choices"}

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = _where(where, "mini_batch")
        _check_options(options, self.OPTIONS, where)
        baseline = L.setting(base, L.MINI_BATCH)
        if isinstance(baseline, bool) or not isinstance(baseline, int):
            raise SpaceError(f"{L.MINI_BATCH}: must be an integer in the base config, but got {baseline!r}. Fix the base config.")
        self.bound = B.mini_batch_bound(baseline).narrowed(
            {k: v for k, v in options.items() if k != "choices"}, where=where
        )
        valid = L.valid_mini_batches(base, hardware, low=int(self.bound.low), high=int(self.bound.high))
        self.lines = list(valid.lines)
        choices: list[int] = list(valid.value)
        if "choices" in options:
            asked = options["choices"]
            if not isinstance(asked, list) or not asked:
                raise SpaceError(f"{where}.choices: must be a non-empty list, but got {asked!r}. List the mini-batch sizes to try.")
            for i, value in enumerate(asked):
                if value not in choices:
                    problem = (
                        L.mini_batch_problem(value, base, hardware) if isinstance(value, int) else None
                    ) or f"outside [{int(self.bound.low)}, {int(self.bound.high)}] ({self.bound.source})"
                    raise SpaceError(
                        f"{where}.choices[{i}]: must be a valid mini-batch size, but got {value!r} "
                        f"({problem}). Pick from {L._short_list(choices)}."
                    )
            choices = sorted(set(asked))
        if not choices:
            raise SpaceError(
                f"{where}: needs at least one valid mini-batch size in [{int(self.bound.low)}, "
                f"{int(self.bound.high)}], but got none ({self.lines[0]}). Widen the bound or change "
                "rollout.n / the micro-batch."
            )
        self.choices = choices

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        return {L.MINI_BATCH: trial.suggest_categorical(self.param, self.choices)}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = L.setting(base, L.MINI_BATCH)
        return {self.param: value} if value in self.choices else None

    def explain(self) -> list[str]:
        return [f"mini_batch: {L.MINI_BATCH} — {self.bound.describe()}", *self.lines]


class KLSpace(Space):
    """KL strength: GRPO's KL loss coefficient, or PPO's in-reward KL controller."""

    kind = "kl"
    param = "kl_coef"
    OPTIONS = B.BOUND_OPTIONS | {"types", "target_kl", "horizon"}

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = _where(where, "kl")
        allowed = self.OPTIONS if algorithm is Algorithm.PPO else B.BOUND_OPTIONS
        _check_options(options, allowed, where)
        self.algorithm = algorithm
        self.bound = B.KL_COEF.narrowed({k: options[k] for k in B.BOUND_OPTIONS if k in options}, where=where)
        self.switch_key, self.coef_key = L.kl_keys(algorithm)
        self.types: list[str] = ["fixed", "adaptive"]
        self.target = B.TARGET_KL
        self.horizon = B.KL_HORIZON
        if algorithm is Algorithm.PPO:
            types = options.get("types", self.types)
            if not isinstance(types, list) or not types or any(t not in ("fixed", "adaptive") for t in types):
                raise SpaceError(f"{where}.types: must be a non-empty list of fixed/adaptive, but got {types!r}. Use [fixed, adaptive].")
            self.types = sorted(set(types), key=["fixed", "adaptive"].index)
            for name, attr in (("target_kl", "target"), ("horizon", "horizon")):
                sub = options.get(name, {})
                if not isinstance(sub, Mapping):
                    raise SpaceError(f"{where}.{name}: must be a mapping like {{low: .., high: ..}}, but got {sub!r}. Use a mapping.")
                _check_options(sub, B.BOUND_OPTIONS, f"{where}.{name}")
                setattr(self, attr, getattr(self, attr).narrowed(sub, where=f"{where}.{name}"))

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        config: Config = {
            self.switch_key: True,
            self.coef_key: trial.suggest_float(self.param, self.bound.low, self.bound.high, log=True),
        }
        if self.algorithm is Algorithm.PPO:
            kind = trial.suggest_categorical("kl_ctrl_type", self.types)
            config[L.KL_CTRL_TYPE] = kind
            if kind == "adaptive":  # target and horizon are read only by the adaptive controller
                config[L.KL_CTRL_TARGET] = trial.suggest_float("target_kl", self.target.low, self.target.high)
                config[L.KL_CTRL_HORIZON] = trial.suggest_int(
                    "horizon", int(self.horizon.low), int(self.horizon.high), log=True
                )
        return config

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        if not L.setting(base, self.switch_key):
            return None
        coef = L.setting(base, self.coef_key)
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not self.bound.contains(coef):
            return None
        params: dict[str, Any] = {self.param: float(coef)}
        if self.algorithm is Algorithm.PPO:
            kind = L.setting(base, L.KL_CTRL_TYPE)
            if kind not in self.types:
                return None
            params["kl_ctrl_type"] = kind
            if kind == "adaptive":
                target, horizon = L.setting(base, L.KL_CTRL_TARGET), L.setting(base, L.KL_CTRL_HORIZON)
                if not (self.target.contains(target) and self.horizon.contains(horizon)):
                    return None
                params.update(target_kl=float(target), horizon=int(horizon))
        return params

    def explain(self) -> list[str]:
        lines = [f"kl: {self.switch_key}=true, {self.coef_key} — {self.bound.describe()}"]
        if self.algorithm is Algorithm.PPO:
            lines.append(f"kl: {L.KL_CTRL_TYPE} ∈ {self.types}; adaptive adds {self.target.describe()}, "
                         f"{self.horizon.describe()}")
        return lines


class TokenBudgetSpace(_BoundedSpace):
    """``rollout.max_num_batched_tokens`` in [max(2048, prompt+response), memory bound]."""

    kind = "token_budget"
    param = "token_budget"
    key = L.TOKEN_BUDGET
    oom_clamped = True

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = _where(where, "token_budget")
        _check_options(options, B.BOUND_OPTIONS, where)
        self.budget = L.token_budget(model, hardware, base)
        safe = B.token_budget_bound(self.budget.floor, self.budget.suggested_max, self.budget.lines[2])
        super().__init__(safe.narrowed(options, where=where), hardware=hardware, where=where)

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        # Chunked prefill on: otherwise verl raises the budget to max_model_len behind our back.
        return {self.key: int(self._suggest_value(trial)), L.CHUNKED_PREFILL: True}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = L.setting(base, self.key)
        return {self.param: int(value)} if self._in_bound(value) else None

    def explain(self) -> list[str]:
        return [*super().explain(), *self.budget.lines]

    @property
    def speed_only(self) -> bool:
        return True


class LRSpace(_BoundedSpace):
    """``actor.optim.lr`` on a log scale in 5e-7 - 5e-6."""

    kind = "lr"
    param = "lr"
    key = L.LR

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = _where(where, "lr")
        _check_options(options, B.BOUND_OPTIONS, where)
        super().__init__(B.LR.narrowed(options, where=where), hardware=hardware, where=where)

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        return {self.key: self._suggest_value(trial)}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = L.setting(base, self.key)
        return {self.param: float(value)} if self._in_bound(value) else None


class LamSpace(_BoundedSpace):
    """``algorithm.lam`` in 0.95-0.99; GAE only."""

    kind = "lam"
    param = "lam"
    key = L.LAM

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = _where(where, "lam")
        L.require_gae(algorithm, where=where)
        _check_options(options, B.BOUND_OPTIONS, where)
        super().__init__(B.LAM.narrowed(options, where=where), hardware=hardware, where=where)

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        return {self.key: self._suggest_value(trial)}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = L.setting(base, self.key)
        return {self.param: float(value)} if self._in_bound(value) else None


SpaceFactory = Callable[..., Space]

SPACES: dict[str, SpaceFactory] = {
    "mini_batch": MiniBatchSpace,
    "kl": KLSpace,
    "token_budget": TokenBudgetSpace,
    "lr": LRSpace,
    "lam": LamSpace,
}


def build_space(
    kind: str,
    *,
    model: ModelFacts,
    hardware: HardwareFacts,
    algorithm: Algorithm,
    base: Config,
    options: Mapping[str, Any] | None = None,
    where: str = "",
) -> Space:
    """Build the space ``kind`` for a study; raises SpaceError on an unknown kind or a bad bound.

    ``where`` prefixes error messages with the study-file field (e.g. ``stages[2].params``).
    """
    if kind not in SPACES:
        raise SpaceError(
            f"{where + '.' if where else ''}space must be one of {sorted(SPACES)}, but got {kind!r}. "
            "Use one of those."
        )
    return SPACES[kind](
        model=model, hardware=hardware, algorithm=algorithm, base=dict(base),
        options=dict(options or {}), where=where,
    )
