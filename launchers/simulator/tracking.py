"""The simulated verl's trackers: what verl 0.9.1's ``verl.utils.tracking.Tracking`` does for the
``wandb`` and ``tensorboard`` loggers, with the real libraries and verl's names, so that a
simulated study lands in W&B and TensorBoard exactly where a real one would.

verl runs its trainer in a Ray actor whose environment holds
``ray_kwargs.ray_init.runtime_env.env_vars``; the simulated actor is this process, so those
variables are set here first. Then, as verl does:

- wandb: ``wandb.init(project=trainer.project_name, name=trainer.experiment_name,
  entity=$WANDB_ENTITY, config=<the whole config>)`` (wandb itself reads ``WANDB_MODE``,
  ``WANDB_DIR``, ``WANDB_RUN_GROUP``, ``WANDB_JOB_TYPE``, ``WANDB_RUN_ID``), one ``log`` a step,
  ``finish(exit_code)`` at the end.
- tensorboard: a scalar a key and step in ``$TENSORBOARD_DIR``, else
  ``tensorboard_log/<project>/<experiment>``. verl writes through ``torch.utils.tensorboard``'s
  ``SummaryWriter``, a wrapper of tensorboard's own ``EventFileWriter`` used here (same files,
  same ``simple_value`` scalars) so that a probe does not import torch (2 s).
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping

from verl_sweep.launchers.simulator.config import DEFAULTS, get

ENV_PREFIX = "ray_kwargs.ray_init.runtime_env.env_vars."


def loggers_of(config: Mapping[str, Any]) -> list[str]:
    loggers = get(config, "trainer.logger")
    return [loggers] if isinstance(loggers, str) else list(loggers or [])


def nested(config: Mapping[str, Any]) -> dict[str, Any]:
    """The flat config (``+`` prefixes dropped) as verl's nested config tree."""
    tree: dict[str, Any] = {}
    for key, value in config.items():
        node = tree
        *parents, leaf = key.lstrip("+").split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break  # a value and a table at one path: the value stays
        else:
            node[leaf] = value
    return tree


class Tracking:
    """The trackers a config asks for (only wandb and tensorboard are simulated; the console
    and file loggers are the simulator's own)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        loggers = loggers_of(config)
        self._wandb: Any = None
        self._tensorboard: Any = None
        if not {"wandb", "tensorboard"} & set(loggers):
            return
        for key, value in config.items():  # the Ray actor's environment
            if key.lstrip("+").startswith(ENV_PREFIX) and value is not None:
                os.environ[key.lstrip("+")[len(ENV_PREFIX):]] = str(value)
        project = str(get(config, "trainer.project_name") or "verl_examples")
        experiment = str(get(config, "trainer.experiment_name") or "gsm8k")
        if "wandb" in loggers:
            import wandb

            self._wandb = wandb.init(project=project, name=experiment, entity=os.environ.get("WANDB_ENTITY"),
                                     config=nested({**DEFAULTS, **config}))  # verl logs its whole config
        if "tensorboard" in loggers:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            directory = os.environ.get("TENSORBOARD_DIR", f"tensorboard_log/{project}/{experiment}")
            os.makedirs(directory, exist_ok=True)
            self._tensorboard = EventFileWriter(directory)

    @property
    def active(self) -> bool:
        return self._wandb is not None or self._tensorboard is not None

    def log(self, data: Mapping[str, Any], step: int) -> None:
        if self._wandb is not None:
            self._wandb.log(dict(data), step=step)
        if self._tensorboard is not None:
            from tensorboard.compat.proto import event_pb2, summary_pb2

            values = [summary_pb2.Summary.Value(tag=key, simple_value=float(value)) for key, value in data.items()
                      if isinstance(value, (int, float)) and not isinstance(value, bool)]
            event = event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values))
            self._tensorboard.add_event(event)

    def finish(self, exit_code: int = 0) -> None:
        if self._wandb is not None:
            self._wandb.finish(exit_code=exit_code)
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

