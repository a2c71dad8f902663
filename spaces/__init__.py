"""Safe search spaces for verl: bounds from the method, limits from the hardware, verl checks.

``spaces`` imports no other package of verl-sweep; verl itself is imported lazily
(:mod:`spaces.verl_check`).
"""

from __future__ import annotations

from spaces.base import Moves, Space, SpaceError
from spaces.bounds import SAFE_BOUNDS, ParamBound
from spaces.facts import Algorithm, HardwareFacts, ModelFacts
from spaces.limits import Limit, check_config, token_budget
from spaces.registry import SPACES, build_space, space_class
from spaces.stages import hardware_tag, oom_ceiling
from spaces.templates import Template, template_for

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
