"""Where a probe shows up in the user's own tracker: verl's ``trainer.logger`` (W&B, TensorBoard,
SwanLab, MLflow, …), kept from the baseline.

A probe keeps the loggers the baseline asks for, plus the console and file loggers verl-sweep
reads its metrics from, and is named the way verl names a run, so that it lands where the
user's own runs do:

- W&B (verl: ``wandb.init(project=trainer.project_name, name=trainer.experiment_name)``):
  name = the run id ``<study>.<stage>.t<trial>``, group = the study, job type = the stage
  (``WANDB_RUN_GROUP`` / ``WANDB_JOB_TYPE``, which wandb reads), and a W&B run id of its own per
  start (``WANDB_RUN_ID``), so that the study can add the trial's outcome to the same run.
- TensorBoard (verl: ``$TENSORBOARD_DIR``, else ``tensorboard_log/<project>/<experiment>``):
  ``<root>/<study>/<stage>/<run id>``, root = the user's ``$TENSORBOARD_DIR`` or verl's
  ``tensorboard_log/<project>``; ``tensorboard --logdir <root>`` shows a study's runs together.

The names travel as environment variables of verl's Ray actors, set by overrides (as the file
logger's path is); ``ProbeTracking.of_argv`` reads them back from a run's recorded argv.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path
from typing import Mapping, Sequence

#: the override prefix that sets an environment variable of verl's Ray actors
ENV_OVERRIDE = "+ray_kwargs.ray_init.runtime_env.env_vars."
#: verl's loggers every probe has: verl-sweep reads the file logger, and the console as a fallback
PROBE_LOGGERS = ("console", "file")
#: verl 0.9.1's ``trainer.project_name`` when a config sets none
VERL_DEFAULT_PROJECT = "verl_examples"
#: a RunSpec's metadata that keeps its probe out of the user's trackers (only our own loggers)
NO_TRACKERS: Mapping[str, str] = {"trackers": "off"}

_LOGGER, _PROJECT, _EXPERIMENT = "trainer.logger", "trainer.project_name", "trainer.experiment_name"
_GROUP, _JOB_TYPE, _WANDB_ID, _TENSORBOARD = "WANDB_RUN_GROUP", "WANDB_JOB_TYPE", "WANDB_RUN_ID", "TENSORBOARD_DIR"


def _value(overrides: Sequence[str], key: str) -> str | None:
    """The last value ``overrides`` give ``key`` (with or without ``+`` prefixes), as written."""
    found = None
    for item in overrides:
        name, _, value = item.partition("=")
        if name.lstrip("+~") == key.lstrip("+"):
            found = value
    return found


def parse_loggers(value: str | None) -> list[str]:
    """``[console,wandb]`` / ``['console','wandb']`` / ``console`` → the logger names."""
    if not value:
        return []
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    return [name.strip().strip("'\"") for name in text.split(",") if name.strip().strip("'\"")]


@dataclasses.dataclass(frozen=True)
class ProbeTracking:
    """How one probe is named in the user's trackers (see the module docstring)."""

    loggers: tuple[str, ...]
    project: str
    name: str
    group: str | None = None
    job_type: str | None = None
    wandb_id: str | None = None
    tensorboard_dir: Path | None = None

    @property
    def user_loggers(self) -> tuple[str, ...]:
        """The trackers the user asked for (not the ones verl-sweep adds for itself)."""
        return tuple(name for name in self.loggers if name not in PROBE_LOGGERS)

    @classmethod
    def plan(cls, run_id: str, overrides: Sequence[str], metadata: Mapping[str, str], *,
             env: Mapping[str, str] | None = None) -> ProbeTracking:
        """A probe's names from its overrides (the baseline's loggers and project) and the
        ``study`` / ``stage`` its spec's metadata give (``NO_TRACKERS``: only our own loggers);
        a fresh W&B run id each start."""
        env = os.environ if env is None else env
        off = all(metadata.get(key) == value for key, value in NO_TRACKERS.items())
        asked = [] if off else parse_loggers(_value(overrides, _LOGGER))
        loggers = tuple(dict.fromkeys([*PROBE_LOGGERS, *asked]))
        project = (_value(overrides, _PROJECT) or VERL_DEFAULT_PROJECT).strip("'\"")
        study, stage = metadata.get("study"), metadata.get("stage")
        tensorboard = None
        if "tensorboard" in loggers:
            root = Path(env[_TENSORBOARD]) if env.get(_TENSORBOARD) else Path("tensorboard_log") / project
            tensorboard = (root.joinpath(*(p for p in (study, stage) if p)) / run_id).absolute()
        wandb_id = f"{run_id}-{secrets.token_hex(3)}" if "wandb" in loggers else None
        return cls(loggers, project, run_id, study, stage, wandb_id, tensorboard)

    def logger_pin(self) -> str:
        """The loggers verl starts: the user's and verl-sweep's own."""
        return f"{_LOGGER}=[{','.join(self.loggers)}]"

    def env_pins(self, default_tensorboard_dir: Path) -> list[str]:
        """The environment of verl's actors that gives its trackers these names
        (``trainer.experiment_name`` is pinned with the probe's other pins);
        ``default_tensorboard_dir``: where TensorBoard events go when the user asks for none."""
        pins = [f"{ENV_OVERRIDE}{_TENSORBOARD}={self.tensorboard_dir or default_tensorboard_dir}"]
        if self.wandb_id is not None:
            pins.append(f"{ENV_OVERRIDE}{_WANDB_ID}={self.wandb_id}")
            pins += [f"{ENV_OVERRIDE}{var}={value}" for var, value in ((_GROUP, self.group), (_JOB_TYPE, self.job_type))
                     if value]
        return pins

    @classmethod
    def of_argv(cls, argv: Sequence[str]) -> ProbeTracking | None:
        """The names a probe was started with (its recorded argv); None without an experiment name."""
        name = _value(argv, _EXPERIMENT)
        if name is None:
            return None
        env = {var: _value(argv, ENV_OVERRIDE + var) for var in (_GROUP, _JOB_TYPE, _WANDB_ID, _TENSORBOARD)}
        loggers = tuple(parse_loggers(_value(argv, _LOGGER)))
        tensorboard = env[_TENSORBOARD]
        return cls(loggers, (_value(argv, _PROJECT) or VERL_DEFAULT_PROJECT).strip("'\""), name,
                   env[_GROUP], env[_JOB_TYPE], env[_WANDB_ID],
                   Path(tensorboard) if "tensorboard" in loggers and tensorboard else None)
