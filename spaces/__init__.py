"""Safe search spaces for verl: bounds from the method, limits from the hardware.

``spaces`` imports no other package of verl-sweep but :mod:`verl_sweep.verl_knowledge` (verl's
keys, defaults, rules, memory model and templates).
"""

from __future__ import annotations

from verl_sweep.spaces.base import Moves, Space, SpaceError, register_space
from verl_sweep.spaces.bounds import SAFE_BOUNDS, ParamBound
from verl_sweep.spaces.limits import token_budget
from verl_sweep.spaces.registry import SPACES, build_space, space_class
from verl_sweep.spaces.stages import BoundedSpace, hardware_tag, oom_ceiling

__all__ = [
    "SPACES",
    "BoundedSpace",
    "SAFE_BOUNDS",
    "Moves",
    "ParamBound",
    "Space",
    "SpaceError",
    "build_space",
    "hardware_tag",
    "oom_ceiling",
    "register_space",
    "space_class",
    "token_budget",
]
