"""Every stage space by the name a study file gives it (:data:`SPACES`); ``build_space(kind,
...)`` builds one from the study's facts, the base config and the stage's parameter options,
checking every bound then (SpaceError names the study-file field)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, cast

from verl_sweep.spaces.base import Moves, Space, SpaceError
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.spaces.megatron import systems_space
from verl_sweep.verl_knowledge import Config
from verl_sweep.spaces.polish import PolishSpace
from verl_sweep.spaces.stages import EntropySpace, KLSpace, LamSpace, LRSpace, MiniBatchSpace, TokenBudgetSpace


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
