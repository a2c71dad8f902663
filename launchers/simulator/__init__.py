"""A simulated verl: a process started like ``verl.trainer.main_ppo`` and its Python model.

``python -m verl_sweep.launchers.simulator <overrides>`` runs the process; tests and benchmarks use the
same model in-process through :func:`load_landscape` / :class:`Landscape`.
"""

from __future__ import annotations

from verl_sweep.launchers.simulator.config import ConfigError, check_config, parse_overrides
from verl_sweep.launchers.simulator.landscape import (
    CheckpointState,
    Expectation,
    Failure,
    Landscape,
    LandscapeError,
    StepRecord,
)
from verl_sweep.launchers.simulator.landscape_files import load_landscape, shipped_landscapes

__all__ = [
    "CheckpointState",
    "ConfigError",
    "Expectation",
    "Failure",
    "Landscape",
    "LandscapeError",
    "StepRecord",
    "check_config",
    "load_landscape",
    "parse_overrides",
    "shipped_landscapes",
]
