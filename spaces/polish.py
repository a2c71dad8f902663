"""The polish stage: mini-batch × lr (× KL strength when it is on) together from the chain's
winner, within the baseline's bounds (docs/method.md): a first pass of coupled moves in both
directions, then a pattern search (``PolishSpace.follow_up_points``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from verl_sweep import verl_knowledge as V
from verl_sweep.spaces.base import Space, check_options, register_space, where_or
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.verl_knowledge import Config
from verl_sweep.spaces.stages import KLSpace, LRSpace, MiniBatchSpace

if TYPE_CHECKING:
    import optuna


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

    def on_real_gpus(self, real: bool) -> Space:
        self.kl.on_real_gpus(real)
        return super().on_real_gpus(real)

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        if trial.suggest_categorical(self.param, [False, True]):
            return self.kl.suggest(trial, base)
        return {self.kl.switch_key: False}

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        on = self.kl.incumbent_params(base)
        if on is not None:
            return {self.param: True, **on}
        return None if V.setting(base, self.kl.switch_key) else {self.param: False}

    def explain(self) -> list[str]:
        return [f"kl: {self.kl.switch_key} off (the chain's) or on, {self.kl.coef_key} — {self.kl.bound.describe()}"]


@register_space
class PolishSpace(CompositeSpace):
    """The final pass: mini-batch × lr (× KL strength when the chain runs with KL on) together,
    from the chain's winner. One-at-a-time stages miss coupled optima (a larger mini-batch
    tolerates a larger lr); the bounds stay the method's: mini-batch ±25% of the study's
    baseline, lr 5e-7 - 5e-6, KL 0.0005 - 0.01."""

    kind = "polish"
    #: built with the study's baseline too: its bounds stay relative to it
    takes_baseline = True
    OPTIONS = frozenset({"mini_batch", "kl", "lr"})
    #: a mini-batch, KL or lr gain an earlier stage found but could not decide is tried again
    #: here, on the chain's winner (docs/method.md, Evidence)
    takes_earlier_leaders = True

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "",
                 baseline: Config | None = None) -> None:
        where = where_or(where, "polish")
        check_options(options, self.OPTIONS, where)
        facts: dict[str, Any] = {"model": model, "hardware": hardware, "algorithm": algorithm}
        # The mini-batch bound is ±25% of the study's baseline, not of the chain's winner.
        origin = {**base, V.MINI_BATCH: V.setting(baseline or base, V.MINI_BATCH)}
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

    def on_real_gpus(self, real: bool) -> Space:
        for part in self.parts:
            part.on_real_gpus(real)
        return super().on_real_gpus(real)

    #: the first pass: lr up, with the mini-batch moved either way. Which way lets lr climb
    #: depends on how the loss scales with the mini-batch (averaged over it, a larger one
    #: tolerates more lr; summed, a smaller one does): both are tried, neither assumed
    FIRST_PASS = ((1.25, 2.0), (0.8, 2.0))

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        """The first pass (``FIRST_PASS``): coupled moves the one-at-a-time stages could not
        make, in both directions; ``follow_up_points`` goes on from the better one."""
        return self._moves(base, [(mini, rate, None) for mini, rate in self.FIRST_PASS])[:n]

    #: the pattern search after the first pass (``follow_up_points``): three rounds of two,
    #: and no draws of the sampler's own: far from the chain's winner in a joint space of
    #: three knobs they read poorly, and the KL-on ones run long before they can be stopped
    n_follow_ups = 6
    follow_ups_per_round = 2
    sampler_draws = False
    #: the smallest move worth a probe (mini-batch ×1.1, lr ×1.15): a point nearer the
    #: incumbent differs from it by less than the stage's noise, and runs a whole probe to say so
    MIN_MOVE = (math.log(1.1), math.log(1.15))

    def follow_up_points(self, base: Config, readings: Sequence[tuple[dict[str, Any], float]],
                         n: int) -> list[dict[str, Any]]:
        """The next round, a pattern search from the point that read highest so far (ties: the
        larger mini-batch), as its factors (m, r) of the incumbent's mini-batch and lr: when it
        beat the incumbent, twice as far (m², r²) and, with KL off in it, the same mini-batch
        with lr doubled and a KL pull at the middle of KL's log range (a pull lets lr climb past
        where it turns unstable; at a stable lr it only costs speed); when it did not, half way
        (√m, √r) first, then the pull at its own lr. Then half way, then the same
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
        # one pull is tried at a time: a pulled point that ended below the best says a pull does
        # not pay here
        pulled = [value for params, value in readings if params.get(KLSwitchSpace.param)]
        if isinstance(kl, KLSwitchSpace) and not best.get(KLSwitchSpace.param, False) and not pulled:
            pull = {KLSwitchSpace.param: True, **kl.kl.starting_points(base, 3)[1]}
        far, half, softer = (m * m, r * r, own_kl), (math.sqrt(m), math.sqrt(r), own_kl), (m, math.sqrt(r), own_kl)
        # A pull lets lr climb past where it turns unstable: from a point that beat the
        # incumbent (its lr still stable) with lr further up; from one that did not, at its lr.
        with_pull = [(m, r * 2 if reading > 1.0 else r, pull)] if pull else []
        if reading > 1.0:
            # After the pattern move, one knob at a time around the best, further along its own
            # direction first, then back: on a narrow ridge the pattern move overshoots, and
            # the direction the ridge runs in is what these readings tell.
            # (lr's step is the finer: its ridge is the narrower, instability growing with lr)
            step_m, step_r = max(abs(math.log(m)) / 2, math.log(1.1)), max(abs(math.log(r)) / 4, math.log(1.15))
            up_m, up_r = math.copysign(step_m, math.log(m)), math.copysign(step_r, math.log(r))
            further = [(m * math.exp(up_m), r, own_kl), (m, r * math.exp(up_r), own_kl)]
            back = [(m * math.exp(-up_m), r, own_kl)]
            moves = [far, *with_pull, *further, softer, *back, half]
        else:
            moves = [half, *with_pull, softer]
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
            near = (abs(math.log(value / incumbent[mini.param])) < self.MIN_MOVE[0]
                    and abs(math.log(rate / incumbent[lr.param])) < self.MIN_MOVE[1])
            if near and {k: v for k, v in point.items() if k not in (mini.param, lr.param)} == \
                    {k: v for k, v in incumbent.items() if k not in (mini.param, lr.param)}:
                continue
            if point != incumbent and point not in points:
                points.append(point)
        return points

    def explain(self) -> list[str]:
        return [line for part in self.parts for line in part.explain()]
