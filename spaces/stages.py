"""The one-knob stage spaces of the method (docs/method.md §1-2); the polish is
:mod:`verl_sweep.spaces.polish`, the systems stage :mod:`verl_sweep.spaces.systems` (and :mod:`verl_sweep.spaces.megatron`),
and :mod:`verl_sweep.spaces.registry` registers them all by name. A space's ``suggest`` only returns values verl accepts: conditional parameters are asked only
when they apply, so nothing is sampled and then rejected.

Learning from OOM: see :mod:`verl_sweep.spaces.oom`; the systems stage is :mod:`verl_sweep.spaces.systems`.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Mapping

from verl_sweep.spaces import bounds as B
from verl_sweep import verl_knowledge as V
from verl_sweep.spaces import limits as L
from verl_sweep.spaces.base import Moves, Space, SpaceError, check_options, register_space, where_or
from verl_sweep.spaces.batching import reference_fill
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.spaces.oom import (FAILURE_KIND_ATTR, HARDWARE_ATTR, OOM_KIND, TrialHistory, asked_range, hardware_tag,
                                   highest_that_ran, oom_ceiling, trial_history)
from verl_sweep.verl_knowledge import Config, get
from verl_sweep.spaces.systems import MAX_TOKEN_LEN_CHOICES, SystemsSpace

if TYPE_CHECKING:
    import optuna

logger = logging.getLogger(__name__)

__all__ = ["FAILURE_KIND_ATTR", "HARDWARE_ATTR", "MAX_TOKEN_LEN_CHOICES", "OOM_KIND", "SystemsSpace",
           "hardware_tag", "oom_ceiling"]

#: how close (a fraction of the value) the memory edge's bisection gets before the sampler draws
#: freely below it again
EDGE_RESOLUTION = 0.05


class BoundedSpace(Space):
    """A space over one float/int knob (``param``, verl's ``key``) with a safe bound, optionally
    clamped by OOMs. A subclass that declares its ``BOUND`` needs nothing more: built from the
    study's facts, it asks the knob inside the bound (widened to hold the base's value,
    narrowed by the stage's options) and maps the incumbent onto it."""

    param: str = ""
    key: str = ""
    #: the knob's safe bound, for a subclass that declares it instead of passing one
    BOUND: B.ParamBound | None = None

    def __init__(self, bound: B.ParamBound | None = None, *, hardware: HardwareFacts, where: str = "",
                 base: Config | None = None, options: Mapping[str, Any] | None = None, **facts: Any) -> None:
        if bound is None:
            if self.BOUND is None:
                raise SpaceError(f"{type(self).__name__} needs its BOUND. Declare the knob's safe bound on the class.")
            where = where_or(where, self.kind)
            check_options(options or {}, B.BOUND_OPTIONS, where)
            value = V.setting(base or {}, self.key)
            bound = (self.BOUND if value is None else self.BOUND.including(value)).narrowed(options or {}, where=where)
        self.bound = bound
        self.hardware_tag = hardware_tag(hardware)
        self.where = where

    def _upper(self, history: TrialHistory) -> tuple[float, bool]:
        """The highest value a draw may take, and whether to take exactly that value: the next
        midpoint of the memory edge while it is wider than ``EDGE_RESOLUTION``."""
        high, trials = self.bound.high, history.others
        ceiling = oom_ceiling(trials, self.param, hardware=self.hardware_tag)
        if ceiling is None or ceiling > high:
            return high, False
        # Strictly below the value that OOMed; never below the floor (which we must allow).
        below = math.ceil(ceiling) - 1 if self.bound.is_int else ceiling * (1 - 1e-6)
        if below < self.bound.low:
            logger.warning(
                "%s: OOM at %s is at or below the lower bound %s; suggesting the lower bound",
                self.param, ceiling, self.bound.low,
            )
            return self.bound.low, False
        ran = highest_that_ran(trials, self.param, below=ceiling)
        if ran is None or ceiling - ran <= EDGE_RESOLUTION * ceiling:
            return below, False
        # Bisect the memory edge: half way (on the knob's scale) from the highest value that ran
        # to the lowest that ran out of memory. Throughput often peaks just below the edge, and
        # the sampler's draws under each OOM walked down to it one OOM probe at a time.
        middle = math.sqrt(ran * ceiling) if self.bound.log and ran > 0 else (ran + ceiling) / 2
        middle = max(ran, min(below, math.floor(middle) if self.bound.is_int else middle))
        running = any(t.state.name == "RUNNING" and t.params.get(self.param) == middle for t in trials)
        return middle, not running  # a second slot meanwhile draws below the midpoint

    def _suggest_value(self, trial: "optuna.trial.BaseTrial") -> float:
        low, high = self.bound.low, self.bound.high
        if self.oom_clamped:  # the only narrowing, and the only read of the study
            history = trial_history(trial)
            high, exact = self._upper(history)
            low, high = asked_range(history.fixed, self.param, high if exact else low, high)
        if self.bound.is_int:
            return trial.suggest_int(self.param, int(low), int(high), log=self.bound.log)
        return trial.suggest_float(self.param, low, high, log=self.bound.log)

    def _in_bound(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.bound.is_int and not float(value).is_integer():
            return False
        return self.bound.contains(value)

    def explain(self) -> list[str]:
        return [f"{self.kind}: {self.key} — {self.bound.describe()}"]

    def _spread(self, n: int, exclude: Any = None, high: float | None = None) -> list[float]:
        """``n`` values spread evenly over the bound (up to ``high`` when given), both ends
        included (on the log scale where it is log): a safe range often ends where the optimum
        lies (docs/method.md, Evidence)."""
        low, high = float(self.bound.low), float(self.bound.high if high is None else high)
        values = []
        for i in range(n):
            q = i / (n - 1) if n > 1 else 0.5
            if self.bound.log:
                v = math.exp(math.log(low) + q * (math.log(high) - math.log(low)))
            else:
                v = low + q * (high - low)
            v = int(round(v)) if self.bound.is_int else float(f"{v:.3g}")
            if v != exclude and self.bound.contains(v) and v not in values:
                values.append(v)
        return values

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        return [{self.param: v} for v in self._spread(n, exclude=V.setting(base, self.key))]

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        return {self.key: self._suggest_value(trial)}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = V.setting(base, self.key)
        return {self.param: float(value)} if self._in_bound(value) else None


@register_space
class MiniBatchSpace(Space):
    """``ppo_mini_batch_size`` over the valid values within baseline ±25% (categorical)."""

    kind = "mini_batch"
    param = "mini_batch"
    OPTIONS = B.BOUND_OPTIONS | {"choices"}

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "mini_batch")
        check_options(options, self.OPTIONS, where)
        baseline = V.setting(base, V.MINI_BATCH)
        if isinstance(baseline, bool) or not isinstance(baseline, int):
            raise SpaceError(f"{V.MINI_BATCH}: must be an integer in the base config, but got {baseline!r}. Fix the base config.")
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
                        V.mini_batch_problem(value, base, hardware) if isinstance(value, int) else None
                    ) or f"outside [{int(self.bound.low)}, {int(self.bound.high)}] ({self.bound.source})"
                    raise SpaceError(
                        f"{where}.choices[{i}]: must be a valid mini-batch size, but got {value!r} "
                        f"({problem}). Pick from {L.short_list(choices)}."
                    )
            choices = sorted(set(asked))
        if not choices:
            raise SpaceError(
                f"{where}: needs at least one valid mini-batch size in [{int(self.bound.low)}, "
                f"{int(self.bound.high)}], but got none ({self.lines[0]}). Widen the bound or change "
                "rollout.n / the micro-batch."
            )
        self.choices = choices

    @property
    def _grid_step(self) -> int | None:
        """The spacing when the valid sizes are evenly spaced (then an ordered integer is
        suggested, which TPE models far better than an unordered categorical)."""
        c = self.choices
        if len(c) < 3:
            return None
        step = c[1] - c[0]
        return step if all(b - a == step for a, b in zip(c, c[1:])) else None

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        step = self._grid_step
        if step is not None:
            return {V.MINI_BATCH: trial.suggest_int(self.param, self.choices[0], self.choices[-1], step=step)}
        return {V.MINI_BATCH: trial.suggest_categorical(self.param, self.choices)}

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        """The method's first moves: down toward 0.7× the baseline (here the −25% bound),
        a smaller step down, and one up (+15%)."""
        baseline = int(V.setting(base, V.MINI_BATCH))
        points: list[dict[str, Any]] = []
        for factor in (0.75, 0.85, 1.15, 0.95, 1.05)[:n]:
            value = min(self.choices, key=lambda c: abs(c - factor * baseline))
            if value != baseline and {self.param: value} not in points:
                points.append({self.param: value})
        return points

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = V.setting(base, V.MINI_BATCH)
        return {self.param: value} if value in self.choices else None

    def explain(self) -> list[str]:
        return [f"mini_batch: {V.MINI_BATCH} — {self.bound.describe()}", *self.lines]


#: trial params of a KL pull (``KLSpace``, ``KLSwitchSpace``): a run that changes them starts
#: slower and may end higher, so an early running rate misjudges it (``verl_sweep.search.method.pruning``)
KL_PARAMS = frozenset({"kl_coef", "use_kl", "kl_ctrl_type", "target_kl", "horizon"})


@register_space
class KLSpace(Space):
    """KL strength: GRPO's KL loss coefficient, or PPO's in-reward KL controller."""

    kind = "kl"
    param = "kl_coef"
    OPTIONS = B.BOUND_OPTIONS | {"types", "target_kl", "horizon"}

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "kl")
        self.switch_key, self.coef_key = V.kl_keys_in_use(algorithm, base)
        #: the in-reward KL has a controller (fixed/adaptive); the KL loss a coefficient only
        self.in_reward = self.switch_key == V.USE_KL_IN_REWARD
        allowed = self.OPTIONS if self.in_reward else B.BOUND_OPTIONS
        check_options(options, allowed, where)
        self.algorithm, self.model, self.hardware = algorithm, model, hardware
        on_coef = V.setting(base, self.coef_key) if V.setting(base, self.switch_key) else None
        self.bound = B.KL_COEF.including(on_coef).narrowed({k: options[k] for k in B.BOUND_OPTIONS if k in options},
                                                           where=where)
        self.types: list[str] = ["fixed", "adaptive"]
        self.target = B.TARGET_KL
        self.horizon = B.KL_HORIZON
        if self.in_reward:
            types = options.get("types", self.types)
            if not isinstance(types, list) or not types or any(t not in ("fixed", "adaptive") for t in types):
                raise SpaceError(f"{where}.types: must be a non-empty list of fixed/adaptive, but got {types!r}. Use [fixed, adaptive].")
            self.types = sorted(set(types), key=["fixed", "adaptive"].index)
            for name, attr in (("target_kl", "target"), ("horizon", "horizon")):
                sub = options.get(name, {})
                if not isinstance(sub, Mapping):
                    raise SpaceError(f"{where}.{name}: must be a mapping like {{low: .., high: ..}}, but got {sub!r}. Use a mapping.")
                check_options(sub, B.BOUND_OPTIONS, f"{where}.{name}")
                setattr(self, attr, getattr(self, attr).narrowed(sub, where=f"{where}.{name}"))

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        config: Config = {
            self.switch_key: True,
            self.coef_key: trial.suggest_float(self.param, self.bound.low, self.bound.high, log=True),
        }
        if not V.setting(base, self.switch_key):  # switched on: verl then builds a reference policy,
            config.update(reference_fill({**base, **config}))  # under static batching with a micro-batch,
            config.update(self._room_for_reference(base, config))  # its memory taken from vLLM's share
        if self.in_reward:
            kind = trial.suggest_categorical("kl_ctrl_type", self.types)
            config[V.KL_CTRL_TYPE] = kind
            if kind == "adaptive":  # target and horizon are read only by the adaptive controller
                config[V.KL_CTRL_TARGET] = trial.suggest_float("target_kl", self.target.low, self.target.high)
                config[V.KL_CTRL_HORIZON] = trial.suggest_int(
                    "horizon", int(self.horizon.low), int(self.horizon.high), log=True
                )
        return config

    def _room_for_reference(self, base: Config, config: Config) -> Config:
        """vLLM's memory fraction lowered as far as the reference policy needs where the estimate
        says the GPU is full with it (stage 0 may have taken the memory up to that edge): the
        reference's memory must come from somewhere, and verl would otherwise run out of it.
        {} where it fits as it is (or no fraction would)."""
        fraction = V.setting(base, V.GPU_MEMORY)
        if not self.fits_memory or isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            return {}
        fit = V.fitting_fraction(self.model, self.hardware, {**base, **config}, base=base)
        return {V.GPU_MEMORY: fit} if 0 < fit < fraction else {}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        if not V.setting(base, self.switch_key):
            return None
        coef = V.setting(base, self.coef_key)
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not self.bound.contains(coef):
            return None
        params: dict[str, Any] = {self.param: float(coef)}
        if self.in_reward:
            kind = V.setting(base, V.KL_CTRL_TYPE)
            if kind not in self.types:
                return None
            params["kl_ctrl_type"] = kind
            if kind == "adaptive":
                target, horizon = V.setting(base, V.KL_CTRL_TARGET), V.setting(base, V.KL_CTRL_HORIZON)
                if not (self.target.contains(target) and self.horizon.contains(horizon)):
                    return None
                params.update(target_kl=float(target), horizon=int(horizon))
        return params

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        """Coefficients spread evenly over the log range, both bounds included: an optimum
        at a bound (the method's KL range ends where strong KL still helps some runs) gets a
        first probe near it (fixed control; PPO's adaptive controller is left to the sampler)."""
        low, high = math.log(self.bound.low), math.log(self.bound.high)
        points = []
        for i in range(n):
            fraction = i / (n - 1) if n > 1 else 0.5
            point: dict[str, Any] = {self.param: float(f"{math.exp(low + fraction * (high - low)):.3g}")}
            if self.in_reward and "fixed" in self.types:
                point["kl_ctrl_type"] = "fixed"
            points.append(point)
        return points

    def explain(self) -> list[str]:
        lines = [f"kl: {self.switch_key}=true, {self.coef_key} — {self.bound.describe()}"]
        if self.in_reward:
            lines.append(f"kl: {V.KL_CTRL_TYPE} ∈ {self.types}; adaptive adds {self.target.describe()}, "
                         f"{self.horizon.describe()}")
        return lines


@register_space
class TokenBudgetSpace(BoundedSpace):
    """``rollout.max_num_batched_tokens`` in [max(2048, prompt+response), memory bound]."""

    kind = "token_budget"
    param = "token_budget"
    key = V.TOKEN_BUDGET
    oom_clamped = True
    moves = Moves.SPEED

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "token_budget")
        check_options(options, B.BOUND_OPTIONS, where)
        self.max_seq_len = model.max_seq_len
        self.budget = L.token_budget(model, hardware, base)
        ceiling, arithmetic = self.budget.suggested_max, self.budget.lines[2]
        own = get(base, self.key)
        if ceiling < self.budget.floor and isinstance(own, int) and own >= self.budget.floor:
            # The run holds its own budget: the memory estimate is the one that is short.
            ceiling, arithmetic = own, f"{arithmetic}; below the floor, so the base config's {own:,} instead"
        safe = B.token_budget_bound(self.budget.floor, ceiling, arithmetic)
        super().__init__(safe.including(get(base, self.key)).narrowed(options, where=where), hardware=hardware, where=where)

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        """The range's ends and points between, up to the largest budget a step can use
        (``useful_top``). One point alone is that largest budget: throughput rises with the
        budget up to the memory edge, and the range's middle would give most of the gain away."""
        own, top = V.setting(base, self.key), self.useful_top(base)
        values = [top] if n == 1 else self._spread(n, exclude=own, high=top)
        return [{self.param: v} for v in values if v != own]

    def useful_top(self, base: Config) -> int:
        """The bound's top, or the most tokens a step can schedule if fewer: vLLM runs at most
        max_num_seqs sequences of max_model_len tokens a step, so a larger budget schedules
        nothing more and only reserves more activation memory."""
        seqs = V.setting(base, V.MAX_NUM_SEQS)
        most = seqs * self.max_seq_len if V.is_int(seqs) and seqs > 0 else self.bound.high
        return int(max(self.bound.low, min(self.bound.high, most)))

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        # Chunked prefill on: otherwise verl raises the budget to max_model_len behind our back.
        return {self.key: int(self._suggest_value(trial)), V.CHUNKED_PREFILL: True}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = V.setting(base, self.key)
        return {self.param: int(value)} if self._in_bound(value) else None

    def explain(self) -> list[str]:
        return [*super().explain(), *self.budget.lines]


@register_space
class LRSpace(BoundedSpace):
    """``actor.optim.lr`` on a log scale in 5e-7 - 5e-6."""

    kind = "lr"
    param = "lr"
    key = V.LR

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "lr")
        check_options(options, B.BOUND_OPTIONS, where)
        super().__init__(B.LR.including(get(base, V.LR)).narrowed(options, where=where), hardware=hardware,
                         where=where)


@register_space
class LamSpace(BoundedSpace):
    """``algorithm.lam`` in 0.95-0.99; GAE only."""

    kind = "lam"
    param = "lam"
    key = V.LAM

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "lam")
        L.require_gae(algorithm, where=where)
        check_options(options, B.BOUND_OPTIONS, where)
        super().__init__(B.LAM.including(get(base, V.LAM)).narrowed(options, where=where), hardware=hardware,
                         where=where)


@register_space
class EntropySpace(BoundedSpace):
    """``actor.entropy_coeff`` in 0-0.01 (off by default: no default stage asks it)."""

    kind = "entropy"
    param = "entropy_coeff"
    key = "actor_rollout_ref.actor.entropy_coeff"
    #: verl 0.9.1's value where the config sets none (actor.yaml): no bonus
    VERL_DEFAULT = 0.0

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "entropy")
        check_options(options, B.BOUND_OPTIONS, where)
        super().__init__(B.ENTROPY_COEFF.narrowed(options, where=where), hardware=hardware, where=where)

    def _value(self, base: Config) -> Any:
        value = V.setting(base, self.key)
        return self.VERL_DEFAULT if value is None else value

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        return {self.key: self._suggest_value(trial)}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = self._value(base)
        return {self.param: float(value)} if self._in_bound(value) else None

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        return [{self.param: v} for v in self._spread(n, exclude=self._value(base))]
