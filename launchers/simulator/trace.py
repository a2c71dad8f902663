"""What the simulated verl writes for one step, shared by the simulator process and the replay
launcher so the two write the same bytes: real verl 0.9.1's step record (its keys in its
order, ``verl_step_record.json``) with the landscape's modelled values, as a file-logger JSON line
(NaN/inf as null) and as a console line (plain floats, NaN as nan)."""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path
from typing import Any, Mapping

from verl_sweep.launchers.simulator.config import get


@functools.lru_cache(maxsize=1)
def real_record() -> dict[str, Any]:
    """A step record real verl 0.9.1 logged (GRPO): its keys, in verl's order, and the
    values it logged. The keys the landscape does not model keep those values, so every
    reader sees a record of verl's full shape (90 keys), not a sketch of it."""
    path = Path(__file__).with_name("verl_step_record.json")
    return dict(json.loads(path.read_text())["data"])


def full_record(template: Mapping[str, Any], step: int, modelled: Mapping[str, float | int]) -> dict[str, Any]:
    """The real record's keys with the model's values where it has them; a ``…/min`` or
    ``…/max`` beside a modelled ``…/mean`` takes the mean (no spread rather than a spread
    that contradicts the mean)."""
    data = {**template, "training/global_step": step, **modelled} if template else dict(modelled)
    for key, mean in _spreads(tuple(template)):
        if mean in modelled:
            data[key] = modelled[mean]
    return data


@functools.lru_cache(maxsize=4)
def _spreads(keys: tuple[str, ...]) -> list[tuple[str, str]]:
    """A template's (``…/min`` or ``…/max`` key, its ``…/mean`` key) pairs: found once, not each step."""
    return [(key, key.rpartition("/")[0] + "/mean") for key in keys if key.rpartition("/")[2] in ("min", "max")]


def json_line(template: Mapping[str, Any], step: int, modelled: Mapping[str, float | int]) -> str:
    """verl's file logger writes NaN and inf as null."""
    record = full_record(template, step, modelled) if template else modelled  # no copy needed
    isfinite = math.isfinite  # tested inline: a call per value was most of a line's cost
    data = {k: None if isinstance(v, float) and not isfinite(v) else v for k, v in record.items()}
    return json.dumps({"step": step, "data": data}) + "\n"


def console_line(prefix: str, template: Mapping[str, Any], step: int, modelled: Mapping[str, float | int]) -> str:
    """``(TaskRunnerV1 pid=N) step:N - key:value - …`` as real verl 0.9.1 prints it."""
    data = full_record(template, step, modelled)
    return f"{prefix} step:{step} - " + " - ".join(f"{k}:{v}" for k, v in data.items()) + "\n"


def gpu_sample(
    t: float, util: float, mem_gb: float, n_gpus: int, gpu_mb: float, config: Mapping[str, Any], rng: random.Random
) -> dict[str, Any]:
    """One NVML-sampler line (``gpu_samples.jsonl``): per-GPU util, memory and PCIe traffic at
    simulated time ``t``; ``rng`` is the run's jitter stream."""
    tp = int(get(config, "actor_rollout_ref.rollout.tensor_model_parallel_size"))
    sp = int(get(config, "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"))
    pcie = 2000.0 * (1.0 + 0.4 * math.log2(tp) + 0.8 * math.log2(sp))
    gpus = []
    for i in range(n_gpus):
        gpus.append({
            "index": i,
            "util": round(min(100.0, max(0.0, util + rng.gauss(0.0, 2.0))), 1),
            "mem_used_mb": round(min(gpu_mb, mem_gb * 1024.0 * (1.0 + rng.gauss(0.0, 0.01))), 1),
            "mem_total_mb": round(gpu_mb, 1),
            "pcie_mbps": round(max(0.0, pcie * (1.0 + rng.gauss(0.0, 0.05))), 1),
        })  # fmt: skip
    return {"t": round(t, 3), "gpus": gpus}
