"""Every stage space by the kind a study file names (:data:`SPACES`, filled by ``register_space``); ``build_space(kind,
...)`` builds one from the study's facts, the base config and the stage's parameter options,
checking every bound then (SpaceError names the study-file field)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, cast

# Importing the spaces' modules registers them (``register_space``), in this order.
from verl_sweep.spaces import stages  # noqa: F401, I001
from verl_sweep.spaces import megatron  # noqa: F401, I001
from verl_sweep.spaces import polish  # noqa: F401, I001
from verl_sweep.spaces.base import SPACES, Space, SpaceError, SpaceFactory
from verl_sweep.verl_knowledge import Algorithm, Config, HardwareFacts, ModelFacts

__all__ = ["SPACES", "SpaceFactory", "build_space", "space_class"]


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
    extra = {"baseline": dict(baseline or base)} if getattr(factory, "takes_baseline", False) else {}
    make = cast(Callable[..., Space], factory)  # every registered space takes the study's facts
    return make(
        model=model, hardware=hardware, algorithm=algorithm, base=dict(base),
        options=dict(options or {}), where=where, **extra,
    )
