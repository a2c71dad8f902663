"""Fitting a systems point to the memory estimate (``verl_sweep.verl_knowledge.memory``): its estimated
peak, whether it fits, its batching knobs grown as far as they fit, its memory fraction
lowered until it fits."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping

from verl_sweep import verl_knowledge as V
from verl_sweep.verl_knowledge import Config, merge
from verl_sweep.spaces.systems.choices import SystemsChoices
from verl_sweep.spaces.systems.knobs import MEMORY

if TYPE_CHECKING:
    import optuna

#: a point's estimated peak stays within this share of the usable memory (the estimate's own
#: error, and the allocator's fragmentation at larger passes)
FIT_HEADROOM = 0.8

Suggest = Callable[["optuna.trial.BaseTrial", Config], Config]


class MemoryFit:
    """Reads points through the space's own ``suggest``, so a point fits exactly when the
    config the space would build for it does."""

    def __init__(self, choices: SystemsChoices, suggest: Suggest) -> None:
        self.choices = choices
        self.suggest = suggest

    def config_of(self, params: dict[str, Any], base: Config) -> Config | None:
        """The config of the point ``params`` (None: verl-sweep cannot build it)."""
        import optuna

        try:
            with warnings.catch_warnings():  # a fraction over its ceiling: the estimate says so
                warnings.simplefilter("ignore", UserWarning)
                return merge(base, self.suggest(optuna.trial.FixedTrial(params), base))
        except (KeyError, ValueError):
            return None

    def peak_gb(self, params: dict[str, Any], base: Config) -> float | None:
        """The point's estimated peak GPU memory (0: not estimated; None: it cannot be built)."""
        config = self.config_of(params, base)
        found = None if config is None else V.estimate(self.choices.model, self.choices.hardware, config)
        return None if config is None else 0.0 if found is None else found.peak_gb

    def headroom_gb(self) -> float:
        """The default limit of ``fits``."""
        return FIT_HEADROOM * V.usable_gb(self.choices.hardware)

    def fits(self, params: dict[str, Any], base: Config, *, limit_gb: float | None = None) -> bool:
        """Whether the estimated peak of the point stays within ``limit_gb`` (by default
        ``FIT_HEADROOM`` of the usable memory); a point verl-sweep cannot build does not fit."""
        peak = self.peak_gb(params, base)
        return peak is not None and peak <= (self.headroom_gb() if limit_gb is None else limit_gb)

    def grown(self, point: dict[str, Any], knobs: Mapping[str, list[Any]], base: Config, *,
              limit_gb: float | None = None) -> dict[str, Any] | None:
        """``point`` with the batching ``knobs`` each at its smallest value, then each grown as
        far as the memory estimate says it fits; None when it does not fit at the smallest."""
        sized = [(name, [v for v in values if v is not None]) for name, values in knobs.items()]
        if any(not values for _, values in sized):
            return None
        point = {**point, **{name: values[0] for name, values in sized}}
        for name, values in sized:
            for value in reversed(values):
                if self.fits({**point, name: value}, base, limit_gb=limit_gb):
                    point[name] = value
                    break
        return point if self.fits(point, base, limit_gb=limit_gb) else None

    def fitted(self, params: dict[str, Any], base: Config) -> dict[str, Any] | None:
        """The point with its memory fraction lowered to where the estimate fits (the sampler's
        own ceiling, ``fitting_fraction``); None when even the layout's floor does not fit."""
        config = self.config_of(params, base)
        if config is None or MEMORY not in params:
            return params
        fit = V.fitting_fraction(self.choices.model, self.choices.hardware, config, base=base)
        if params[MEMORY] <= fit:
            return params
        return {**params, MEMORY: fit} if fit >= self.choices.floors[config[V.ROLLOUT_TP]] else None
