"""Safe search spaces for verl: bounds from the method, limits from the hardware, verl checks.

``spaces`` imports no other package of verl-sweep; verl itself is imported lazily
(:mod:`verl_sweep.spaces.verl_check`).
"""

from __future__ import annotations

from verl_sweep.spaces.base import Moves, Space, SpaceError
from verl_sweep.spaces.bounds import SAFE_BOUNDS, ParamBound
from verl_sweep.spaces.facts import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.spaces.limits import Limit, check_config, token_budget
from verl_sweep.spaces.registry import SPACES, build_space, space_class
from verl_sweep.spaces.stages import hardware_tag, oom_ceiling
from verl_sweep.spaces.templates import Template, template_for

__all__ = [
    "SPACES",
    "SAFE_BOUNDS",
    "Algorithm",
    "HardwareFacts",
    "Limit",
    "Moves",
    "ModelFacts",
    "ParamBound",
    "Space",
    "SpaceError",
    "Template",
    "build_space",
    "check_config",
    "hardware_tag",
    "oom_ceiling",
    "space_class",
    "template_for",
    "token_budget",
]
