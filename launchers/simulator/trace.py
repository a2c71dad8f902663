"""What the simulated verl writes for one step, shared by the simulator process and the replay
launcher so the two write the same bytes: real verl 0.9.1's step record (its keys in its
order, from a real H200 run) with the landscape's modelled values, as a file-logger JSON line
(NaN/inf as null) and as a console line (plain floats, NaN as nan)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any, Mapping


@functools.lru_cache(maxsize=1)
def real_record() -> dict[str, Any]:
    """A real verl 0.9.1 step record (GRPO on an H200): its keys, in verl's order, and the
    values it logged. The keys the landscape does not model keep those values, so every
    reader sees a record of verl's full shape (90 keys), not a sketch of it."""
    path = Path(__file__).with_name("verl_step_record.json")
    return dict(json.loads(path.read_text())["data"])


def full_record(template: Mapping[str, Any], step: int, modelled: Mapping[str, float | int]) -> dict[str, Any]:
    """The real record's keys with the model's values where it has them; a ``…/min`` or
    ``…/max`` beside a modelled ``…/mean`` takes the mean (no spread rather than a spread
    that contradicts the mean)."""
    data = {**template, "training/global_step": step, **modelled} if template else dict(modelled)
    for key in template:
        head, _, tail = key.rpartition("/")
        if tail in ("min", "max") and f"{head}/mean" in modelled:
            data[key] = modelled[f"{head}/mean"]
    return data


def clean(value: Any) -> Any:
    """verl's file logger writes NaN and inf as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def json_line(template: Mapping[str, Any], step: int, modelled: Mapping[str, float | int]) -> str:
    data = {k: clean(v) for k, v in full_record(template, step, modelled).items()}
    return json.dumps({"step": step, "data": data}) + "\n"


def console_line(prefix: str, template: Mapping[str, Any], step: int, modelled: Mapping[str, float | int]) -> str:
    """``(TaskRunnerV1 pid=N) step:N - key:value - …`` as real verl 0.9.1 prints it."""
    data = full_record(template, step, modelled)
    return f"{prefix} step:{step} - " + " - ".join(f"{k}:{v}" for k, v in data.items()) + "\n"
