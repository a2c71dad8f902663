"""The stage spaces of the method (docs/method.md §1-2), registered by name in :data:`SPACES`.

``build_space(kind, ...)`` builds one from the study's facts, the base config and the stage's
parameter options, checking every bound then (SpaceError names the study-file field). A
space's ``suggest`` only returns values verl accepts: conditional parameters are asked only
when they apply, so nothing is sampled and then rejected.

Learning from OOM: see :mod:`spaces.oom`; the systems stage is :mod:`spaces.systems`.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, cast

from spaces import bounds as B
from spaces import limits as L
from spaces.base import Moves, Space, SpaceError, check_options, where_or
from spaces.batching import reference_fill
from spaces.facts import Algorithm, HardwareFacts, ModelFacts
from spaces.oom import FAILURE_KIND_ATTR, HARDWARE_ATTR, OOM_KIND, hardware_tag, oom_ceiling, study_trials
from spaces.overrides import Config, get
from spaces.megatron import systems_space
from spaces.systems import MAX_TOKEN_LEN_CHOICES, SystemsSpace

if TYPE_CHECKING:
    import optuna

logger = logging.getLogger(__name__)

__all__ = ["FAILURE_KIND_ATTR", "HARDWARE_ATTR", "MAX_TOKEN_LEN_CHOICES", "OOM_KIND", "SPACES", "SystemsSpace",
           "build_space", "hardware_tag", "oom_ceiling", "space_class"]

class _BoundedSpace(Space):
    """A space over one float/int parameter with a safe bound, optionally clamped by OOMs."""

    param: str = ""
    key: str = ""

    def __init__(self, bound: B.ParamBound, *, hardware: HardwareFacts, where: str) -> None:
        self.bound = bound
        self.hardware_tag = hardware_tag(hardware)
        self.where = where

    def _upper(self, trial: "optuna.trial.BaseTrial") -> float:
        high = self.bound.high
        if not self.oom_clamped:
            return high
        ceiling = oom_ceiling(study_trials(trial), self.param, hardware=self.hardware_tag)
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

    def _spread(self, n: int, exclude: Any = None) -> list[float]:
        """``n`` values spread evenly over the bound, both ends included (on the log scale where
        it is log): a safe range often ends where the optimum lies (in the simulated benchmark the best config's
        lr was the 5e-6 bound in 4 of the 5 runs diagnosed that missed 95% of the best)."""
        low, high = float(self.bound.low), float(self.bound.high)
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
        return [{self.param: v} for v in self._spread(n, exclude=L.setting(base, self.key))]


class MiniBatchSpace(Space):
    """``ppo_mini_batch_size`` over the valid values within baseline ±25% (categorical)."""

    kind = "mini_batch"
    param = "mini_batch"
    OPTIONS = B.BOUND_OPTIONS | {"choices"}

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "mini_batch")
        check_options(options, self.OPTIONS, where)
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
            return {L.MINI_BATCH: trial.suggest_int(self.param, self.choices[0], self.choices[-1], step=step)}
        return {L.MINI_BATCH: trial.suggest_categorical(self.param, self.choices)}

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        """The method's first moves: down toward 0.7× the baseline (here the −25% bound),
        a smaller step down, and one up (+15%)."""
        baseline = int(L.setting(base, L.MINI_BATCH))
        points: list[dict[str, Any]] = []
        for factor in (0.75, 0.85, 1.15, 0.95, 1.05)[:n]:
            value = min(self.choices, key=lambda c: abs(c - factor * baseline))
            if value != baseline and {self.param: value} not in points:
                points.append({self.param: value})
        return points

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = L.setting(base, L.MINI_BATCH)
        return {self.param: value} if value in self.choices else None

    def explain(self) -> list[str]:
        return [f"mini_batch: {L.MINI_BATCH} — {self.bound.describe()}", *self.lines]


#: trial params of a KL pull (``KLSpace``, ``KLSwitchSpace``): a run that changes them starts
#: slower and may end higher, so an early running rate misjudges it (``search.pruning``)
KL_PARAMS = frozenset({"kl_coef", "use_kl", "kl_ctrl_type", "target_kl", "horizon"})


class KLSpace(Space):
    """KL strength: GRPO's KL loss coefficient, or PPO's in-reward KL controller."""

    kind = "kl"
    param = "kl_coef"
    OPTIONS = B.BOUND_OPTIONS | {"types", "target_kl", "horizon"}

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "kl")
        self.switch_key, self.coef_key = L.kl_keys_in_use(algorithm, base)
        #: the in-reward KL has a controller (fixed/adaptive); the KL loss a coefficient only
        self.in_reward = self.switch_key == L.USE_KL_IN_REWARD
        allowed = self.OPTIONS if self.in_reward else B.BOUND_OPTIONS
        check_options(options, allowed, where)
        self.algorithm = algorithm
        on_coef = L.setting(base, self.coef_key) if L.setting(base, self.switch_key) else None
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
        if not L.setting(base, self.switch_key):  # switched on: verl then builds a reference policy,
            config.update(reference_fill({**base, **config}))  # under static batching with a micro-batch
        if self.in_reward:
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
        if self.in_reward:
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
            lines.append(f"kl: {L.KL_CTRL_TYPE} ∈ {self.types}; adaptive adds {self.target.describe()}, "
                         f"{self.horizon.describe()}")
        return lines


class TokenBudgetSpace(_BoundedSpace):
    """``rollout.max_num_batched_tokens`` in [max(2048, prompt+response), memory bound]."""

    kind = "token_budget"
    param = "token_budget"
    key = L.TOKEN_BUDGET
    oom_clamped = True
    moves = Moves.SPEED

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "token_budget")
        check_options(options, B.BOUND_OPTIONS, where)
        self.budget = L.token_budget(model, hardware, base)
        ceiling, arithmetic = self.budget.suggested_max, self.budget.lines[2]
        own = get(base, self.key)
        if ceiling < self.budget.floor and isinstance(own, int) and own >= self.budget.floor:
            # The run holds its own budget: the memory estimate is the one that is short.
            ceiling, arithmetic = own, f"{arithmetic}; below the floor, so the base config's {own:,} instead"
        safe = B.token_budget_bound(self.budget.floor, ceiling, arithmetic)
        super().__init__(safe.including(get(base, self.key)).narrowed(options, where=where), hardware=hardware, where=where)

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        # Chunked prefill on: otherwise verl raises the budget to max_model_len behind our back.
        return {self.key: int(self._suggest_value(trial)), L.CHUNKED_PREFILL: True}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = L.setting(base, self.key)
        return {self.param: int(value)} if self._in_bound(value) else None

    def explain(self) -> list[str]:
        return [*super().explain(), *self.budget.lines]


class LRSpace(_BoundedSpace):
    """``actor.optim.lr`` on a log scale in 5e-7 - 5e-6."""

    kind = "lr"
    param = "lr"
    key = L.LR

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "lr")
        check_options(options, B.BOUND_OPTIONS, where)
        super().__init__(B.LR.including(get(base, L.LR)).narrowed(options, where=where), hardware=hardware,
                         where=where)

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
        where = where_or(where, "lam")
        L.require_gae(algorithm, where=where)
        check_options(options, B.BOUND_OPTIONS, where)
        super().__init__(B.LAM.including(get(base, L.LAM)).narrowed(options, where=where), hardware=hardware,
                         where=where)

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        return {self.key: self._suggest_value(trial)}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = L.setting(base, self.key)
        return {self.param: float(value)} if self._in_bound(value) else None


class EntropySpace(_BoundedSpace):
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
        value = L.setting(base, self.key)
        return self.VERL_DEFAULT if value is None else value

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        return {self.key: self._suggest_value(trial)}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        value = self._value(base)
        return {self.param: float(value)} if self._in_bound(value) else None

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        return [{self.param: v} for v in self._spread(n, exclude=self._value(base))]


class CompositeSpace(Space):
    """Several spaces asked together on one base: their suggestions merged; an incumbent only
    when every part has one."""

    parts: list[Space]

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        config: Config = {}
        for part in self.parts:
            config.update(part.suggest(trial, base))
        return config

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        params: dict[str, Any] = {}
        for part in self.parts:
            own = part.incumbent_params(base)
            if own is None:
                return None
            params.update(own)
        return params


class KLSwitchSpace(Space):
    """KL off (the incumbent) or on at a coefficient of ``kl``'s range: the polish stage's KL
    when the chain runs without it."""

    kind = "kl_switch"
    param = "use_kl"

    def __init__(self, kl: KLSpace) -> None:
        self.kl = kl

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        if trial.suggest_categorical(self.param, [False, True]):
            return self.kl.suggest(trial, base)
        return {self.kl.switch_key: False}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        on = self.kl.incumbent_params(base)
        if on is not None:
            return {self.param: True, **on}
        return None if L.setting(base, self.kl.switch_key) else {self.param: False}

    def explain(self) -> list[str]:
        return [f"kl: {self.kl.switch_key} off (the chain's) or on, {self.kl.coef_key} — {self.kl.bound.describe()}"]


def _beyond(point: Mapping[str, Any], best: Mapping[str, Any], incumbent: Mapping[str, Any],
            keys: tuple[str, ...]) -> bool:
    """``point`` lies past ``best`` as seen from ``incumbent``: further out along every key on
    which best moved, and on no key back toward the incumbent."""
    moved = False
    for key in keys:
        step, further = best[key] - incumbent[key], point[key] - best[key]
        if step == 0:
            if further != 0:
                return False
            continue
        if further * step < 0:
            return False
        moved |= further != 0
    return moved


class PolishSpace(CompositeSpace):
    """The final pass: mini-batch × lr (× KL strength when the chain runs with KL on) together,
    from the chain's winner. One-at-a-time stages miss coupled optima (a larger mini-batch
    tolerates a larger lr); the bounds stay the method's: mini-batch ±25% of the study's
    baseline, lr 5e-7 - 5e-6, KL 0.0005 - 0.01."""

    kind = "polish"
    OPTIONS = frozenset({"mini_batch", "kl", "lr"})
    #: a mini-batch, KL or lr gain an earlier stage found but could not decide (on
    #: the report landscapes true 4-7% gains of the mini-batch stage) is tried again here,
    #: on the chain's winner
    takes_earlier_leaders = True

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "",
                 baseline: Config | None = None) -> None:
        where = where_or(where, "polish")
        check_options(options, self.OPTIONS, where)
        facts: dict[str, Any] = {"model": model, "hardware": hardware, "algorithm": algorithm}
        # The mini-batch bound is ±25% of the study's baseline, not of the chain's winner.
        origin = {**base, L.MINI_BATCH: L.setting(baseline or base, L.MINI_BATCH)}
        self.parts: list[Space] = [
            MiniBatchSpace(base=origin, options=options.get("mini_batch", {}), where=f"{where}.mini_batch", **facts),
            LRSpace(base=base, options=options.get("lr", {}), where=f"{where}.lr", **facts),
        ]
        kl = KLSpace(base=base, options=options.get("kl", {}), where=f"{where}.kl", **facts)
        if kl.incumbent_params(base) is not None:  # the KL stage chose "on": polish its strength
            self.parts.append(kl)
        else:
            # The KL stage kept KL off, judged at the lr of its time: a stronger KL pull may
            # only pay with a larger lr (it tolerates more), so the polish may turn it on.
            self.parts.append(KLSwitchSpace(kl))

    #: the first pass: lr up, with the mini-batch moved either way. Which way lets lr climb
    #: depends on how the loss scales with the mini-batch (averaged over it, a larger one
    #: tolerates more lr; summed, a smaller one does): both are tried, neither assumed
    FIRST_PASS = ((1.25, 2.0), (0.8, 2.0))

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        """The first pass (``FIRST_PASS``): coupled moves the one-at-a-time stages could not
        make, in both directions; ``follow_up_points`` goes on from the better one."""
        return self._moves(base, [(mini, rate, None) for mini, rate in self.FIRST_PASS])[:n]

    #: the pattern search after the first pass (``follow_up_points``): three rounds of two
    n_follow_ups = 6
    follow_ups_per_round = 2

    def follow_up_points(self, base: Config, readings: Sequence[tuple[dict[str, Any], float]],
                         n: int) -> list[dict[str, Any]]:
        """The next round, a pattern search from the point that read highest so far (ties: the
        larger mini-batch), as its factors (m, r) of the incumbent's mini-batch and lr: when it
        beat the incumbent, twice as far (m², r²) and, with KL off in it, the same move with a
        KL pull at the middle of KL's log range (a pull lets lr climb past where it turns
        unstable); when it did not, half way (√m, √r) first. Then half way, then the same
        mini-batch with half the lr step. Points already tried are skipped."""
        incumbent = self.incumbent_params(base)
        mini, lr, kl = self.parts
        assert isinstance(mini, MiniBatchSpace) and isinstance(lr, LRSpace)
        if incumbent is None or n <= 0:
            return []
        read = [(reading, params) for params, reading in readings
                if mini.param in params and lr.param in params and not math.isnan(reading)]
        if not read:
            return []
        reading, best = max(read, key=lambda item: (item[0], item[1][mini.param]))
        m, r = best[mini.param] / incumbent[mini.param], best[lr.param] / incumbent[lr.param]
        own_kl = {k: v for k, v in best.items() if k not in (mini.param, lr.param)}
        pull = None
        if isinstance(kl, KLSwitchSpace) and not best.get(KLSwitchSpace.param, False):
            pull = {KLSwitchSpace.param: True, **kl.kl.starting_points(base, 3)[1]}
        far, half, softer = (m * m, r * r, own_kl), (math.sqrt(m), math.sqrt(r), own_kl), (m, math.sqrt(r), own_kl)
        with_pull = [(m, r, pull)] if pull else []
        moves = [far, *with_pull, half, softer] if reading > 1.0 else [half, *with_pull, softer]
        # A step past a best that beat the incumbent read lower (it slowed, or turned unstable
        # and was stopped): half way between the two first (a pattern search's contraction).
        beyond = [(params[mini.param] / incumbent[mini.param], params[lr.param] / incumbent[lr.param])
                  for value, params in read if value < reading and _beyond(params, best, incumbent, (mini.param, lr.param))]
        if beyond and reading > 1.0:
            bm, br = min(beyond, key=lambda f: abs(math.log(f[0] / m)) + abs(math.log(f[1] / r)))
            moves.insert(0, (math.sqrt(m * bm), math.sqrt(r * br), own_kl))
        tried = [params for params, _ in readings]
        return [p for p in self._moves(base, moves) if p not in tried][:n]

    def _moves(self, base: Config, moves: Sequence[tuple[float, float, dict[str, Any] | None]]) -> list[dict[str, Any]]:
        """Each (mini-batch factor, lr factor, KL point or None) as a point from the incumbent:
        the nearest valid mini-batch, lr clamped to its bound; the incumbent itself and repeats
        left out."""
        incumbent = self.incumbent_params(base)
        if incumbent is None:
            return []
        mini, lr = self.parts[0], self.parts[1]
        assert isinstance(mini, MiniBatchSpace) and isinstance(lr, LRSpace)
        points: list[dict[str, Any]] = []
        for mini_factor, lr_factor, kl_point in moves:
            value = min(mini.choices, key=lambda c: abs(c - mini_factor * incumbent[mini.param]))
            rate = min(lr.bound.high, max(lr.bound.low, float(f"{incumbent[lr.param] * lr_factor:.3g}")))
            point = {**incumbent, mini.param: value, lr.param: rate}
            if kl_point is not None:
                point = {mini.param: value, lr.param: rate, **kl_point}
            if point != incumbent and point not in points:
                points.append(point)
        return points

    def explain(self) -> list[str]:
        return [line for part in self.parts for line in part.explain()]


class SpaceFactory(Protocol):
    """A space class, or a function that picks one by the base config (``systems``: FSDP's or
    Megatron's); called with the study's facts, it builds the space. ``moves``: what every
    space it builds moves."""

    @property
    def moves(self) -> Moves: ...


SPACES: dict[str, SpaceFactory] = {
    "mini_batch": MiniBatchSpace,
    "kl": KLSpace,
    "token_budget": TokenBudgetSpace,
    "lr": LRSpace,
    "lam": LamSpace,
    "entropy": EntropySpace,
    "systems": cast(SpaceFactory, systems_space),  # FSDP's SystemsSpace or MegatronSystemsSpace, by the base's engine
    "polish": PolishSpace,
}


def space_class(kind: str, *, where: str = "") -> SpaceFactory:
    """The space registered as ``kind``; SpaceError naming the registered ones."""
    if kind not in SPACES:
        raise SpaceError(
            f"{where + '.' if where else ''}space must be one of {sorted(SPACES)}, but got {kind!r}. "
            "Use one of those."
        )
    return SPACES[kind]


def build_space(
    kind: str,
    *,
    model: ModelFacts,
    hardware: HardwareFacts,
    algorithm: Algorithm,
    base: Config,
    options: Mapping[str, Any] | None = None,
    where: str = "",
    baseline: Config | None = None,
) -> Space:
    """Build the space ``kind`` for a study; raises SpaceError on an unknown kind or a bad bound.

    ``where`` prefixes error messages with the study-file field (e.g. ``stages[2].params``);
    ``baseline`` is the study's baseline (the polish stage keeps its bounds relative to it).
    """
    factory = space_class(kind, where=where)
    extra = {"baseline": dict(baseline or base)} if factory is PolishSpace else {}
    make = cast(Callable[..., Space], factory)  # every registered space takes the study's facts
    return make(
        model=model, hardware=hardware, algorithm=algorithm, base=dict(base),
        options=dict(options or {}), where=where, **extra,
    )
