"""The space interface: one stage's parameters, suggested only inside the safe bounds."""

from __future__ import annotations

import abc
import enum
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping, Protocol, Sequence, TypeVar

from verl_sweep.verl_knowledge import Config

if TYPE_CHECKING:
    import optuna


class Moves(enum.Enum):
    """What a space's knobs move: the stage built on it (``verl_sweep.search.method.stage.Stage``) derives from
    this its probe length and warm-up, what it scores and whether it may be stretched."""

    #: throughput only (the layout, the token budget): short probes scored on tokens per second
    SPEED = "speed"
    #: how the policy learns (lr, KL, mini-batch): full probes scored on reward per second
    LEARNING = "learning"
    #: both at once (e.g. ``rollout.n``): full probes, scored on reward per second, which
    #: already holds the speed
    BOTH = "speed and learning"


class SpaceError(ValueError):
    """A bound or a config that breaks a rule; the message names the key, value and rule."""


class Space(abc.ABC):
    """Suggests the settings of one stage on top of a base config.

    ``suggest`` returns only the keys this stage sets (plus the switches they need, such as
    ``use_kl_loss``); the driver merges them over the base. Every value it can return is one
    that verl accepts for the study's model and hardware (checked when the space is built).
    """

    #: its name in study files (``stages[].space``) and in ``SPACES``: spelled here, once
    kind: str = ""
    #: a stage of this space first tries the leaders that earlier stages could not decide
    #: (above 1 + tolerance, interval reaching it), moved onto its own base (the polish stage)
    takes_earlier_leaders: bool = False
    #: the space keeps every later suggestion below a value that ran out of memory (a bound
    #: learned from OOMs, ``verl_sweep.spaces.oom``), so the stage's sampler need not learn them too
    oom_clamped: bool = False
    #: its first candidates include the source's layout for the model size and GPU count
    #: (``verl_knowledge.template_for``)
    tries_template: bool = False
    #: what its knobs move; read by ``verl_sweep.search.method.stage.Stage`` alone
    moves: ClassVar[Moves] = Moves.LEARNING
    #: points the space proposes after its starting points (``follow_up_points``), one as
    #: another ends, with at most ``follow_ups_per_round`` of them in flight; 0: none
    n_follow_ups: int = 0
    follow_ups_per_round: int = 1
    #: whether the stage's sampler draws points of its own once the starting points (and
    #: follow-ups) are queued; False: a pattern search, the stage ends with its last round
    sampler_draws: bool = True
    #: follow-ups end the stage instead: the sampler draws all but the last
    #: ``min(n_follow_ups, max_trials // 5)`` trials of the budget, then the space's follow-ups
    #: read every candidate so far (the sampler's draws too): a local search around its leader
    follow_ups_last: bool = False

    @abc.abstractmethod
    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config: ...

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        """Optuna parameter values that reproduce ``base`` (to enqueue the incumbent), or
        None when the base is not a point of this space (e.g. KL switched off)."""
        return None

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        """Up to ``n`` Optuna parameter dicts to try first (the method's first moves, or points
        spread over the range), so a stage does not start from blind random draws."""
        return []

    def follow_up_points(self, base: Config, readings: Sequence[tuple[dict[str, Any], float]],
                         n: int) -> list[dict[str, Any]]:
        """Up to ``n`` points to try next, from the ``readings`` of the starting points and
        follow-ups so far: (params, η: finished, or running when it was stopped, 0 when its run
        failed, NaN while it still runs). Search that goes where the points so far pointed;
        none by default."""
        return []

    #: whether what the space proposes is fitted to the memory estimate (``fitted``, the systems
    #: stage's fraction ceiling, the KL's reference policy): on where probes run on real GPUs
    #: (``on_real_gpus``); a simulator's own world decides what runs out of memory
    fits_memory: bool = False

    def on_real_gpus(self, real: bool) -> "Space":
        """This space, fitting what it proposes to the memory estimate when ``real``."""
        self.fits_memory = real
        return self

    def fitted(self, params: dict[str, Any], base: Config) -> dict[str, Any] | None:
        """The point ``params`` changed, where the space can, so that the memory estimate says it
        fits; None when it cannot fit. Unchanged by default: a stage whose knobs leave memory
        alone proposes only what fits where the base fits."""
        return params

    def explain(self) -> list[str]:
        """Human-readable lines: the bounds and the arithmetic behind them."""
        return []


class SpaceFactory(Protocol):
    """A space class, or a function that picks one by the base config (``systems``: FSDP's or
    Megatron's); called with the study's facts, it builds the space. ``kind``: its name in
    study files; ``moves``: what every space it builds moves."""

    @property
    def kind(self) -> str: ...

    @property
    def moves(self) -> Moves: ...


#: every space a study file may name, by its kind (``register_space`` fills it; the spaces of
#: verl-sweep register when ``verl_sweep.spaces`` is imported)
SPACES: dict[str, SpaceFactory] = {}
Registered = TypeVar("Registered")


def register_space(factory: Registered) -> Registered:
    """Register a space class (or factory) under its ``kind``: a study's stages may then name it.
    Used as a class decorator; registering a second factory under a taken kind is an error."""
    kind = getattr(factory, "kind", "")
    if not kind or not isinstance(kind, str):
        raise SpaceError(f"a space to register needs its kind, but {factory!r} has none. Set its class attribute `kind`.")
    if SPACES.get(kind, factory) is not factory:
        raise SpaceError(f"space kind {kind!r} is registered already ({SPACES[kind]!r}). Give the new space its own kind.")
    SPACES[kind] = factory  # type: ignore[assignment]
    return factory


def check_options(options: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    if not isinstance(options, Mapping):
        raise SpaceError(f"{where}: must be a mapping of parameter options, but got {options!r}. Use e.g. {{low: .., high: ..}}.")
    allowed = sorted(allowed)
    for key in options:
        if key not in allowed:
            raise SpaceError(
                f"{where}.{key}: must be one of {allowed}, but got {key!r}. Remove or rename it."
            )


def where_or(where: str, default: str) -> str:
    return where or default
