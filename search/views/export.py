"""Export the winning config as a YAML file verl composes, or as an override list.

The export is the config for the full run, not for a probe: the settings a probe pins
(logger, resume mode, validation, step limit, experiment name, seed) are never part of the
chain's config, and the method's guards are added where the baseline is silent.

In train mode the study trained the model itself: the export also says which config trained
which steps and where the model is (``verl_sweep.search.views.train.schedule``), in the YAML's
comment header and, with ``-o best.yaml``, in ``best.schedule.yaml`` beside it; the config file
itself stays the same verl config.
"""

from __future__ import annotations

import datetime
import json
import shlex
from pathlib import Path
from typing import Any

import yaml

from verl_sweep.search.views.text import SIGNIFICANT_DIGITS, rounded
from verl_sweep.search.database.records import StageResult
from verl_sweep.search.spec.study_file import StudySpec
from verl_sweep.verl_knowledge import MODEL_ENGINE
from verl_sweep.verl_knowledge import Config, get, merge, nest, to_overrides

#: the method's guards: keep the last 3 checkpoints
GUARDS: Config = {"trainer.max_actor_ckpt_to_keep": 3, "trainer.max_critic_ckpt_to_keep": 3}

FORMATS = ("yaml", "overrides", "command", "json")


def schedule_path(output: Path) -> Path:
    """Where ``export -o output`` writes train mode's schedule: ``best.yaml`` → ``best.schedule.yaml``."""
    return output.with_name(f"{output.stem}.schedule.yaml")


#: significant digits of an exported float: what verl needs (an lr of 3.162e-06, a memory
#: share of 0.8925), not the sampler's 16
def final_config(base: Config) -> Config:
    guards = {k: v for k, v in GUARDS.items() if get(base, k) is None}
    return rounded(merge(guards, base))


def header_lines(spec: StudySpec, results: list[StageResult], overall: str | None = None,
                 schedule: dict[str, Any] | None = None) -> list[str]:
    """The export's comment: the study, the overall gain against the baseline (``overall``:
    ``verl_sweep.search.views.status.overall_line``) first, then each stage's result; in train
    mode (``schedule``: ``verl_sweep.search.views.train.schedule``) then which config trained
    which steps, and the model."""
    lines = [
        f"verl-sweep export of study '{spec.name}' ({spec.algorithm.value}), "
        f"{datetime.date.today().isoformat()}",
    ]
    if overall:
        lines.append(overall)
    done = {r.stage for r in results}
    if len(done) < len(spec.stages):
        lines.append(f"PARTIAL: {len(done)} of {len(spec.stages)} stages finished; "
                     f"not tuned yet: {', '.join(s.name for s in spec.stages if s.name not in done)}")
    for result in results:
        if result.winner_trial is None:
            lines.append(f"stage {result.stage}: {result.summary}")
        else:
            lines.append(
                f"stage {result.stage}: trial {result.winner_trial}, η {result.eta:.3f} "
                f"[{result.eta_low:.3f}, {result.eta_high:.3f}]: " + ", ".join(
                    f"{k}={rounded(v)}" for k, v in sorted(result.overrides.items())
                )
            )
    if schedule is not None:
        from verl_sweep.search.views.train import schedule_comment

        lines.extend(schedule_comment(schedule))
    return lines


def to_yaml(spec: StudySpec, results: list[StageResult], config: Config, *, config_name: str = "best",
            overall: str | None = None, schedule: dict[str, Any] | None = None) -> str:
    """A primary Hydra config: ``defaults: [ppo_trainer, _self_]`` with verl's config package on
    the search path, so ``python -m verl.trainer.main_ppo --config-path DIR --config-name
    <name>`` composes it. ``schedule``: train mode's, told in the header's comment."""
    comments = header_lines(spec, results, overall, schedule) + [
        f"run: python -m verl.trainer.main_ppo --config-path <this dir> --config-name {config_name}",
    ]
    config = dict(config)
    defaults: list[Any] = ["ppo_trainer"]
    engine = config.pop(MODEL_ENGINE, None)
    if engine is not None:  # a config group, chosen in the defaults list (as ppo_megatron_trainer.yaml does)
        defaults.append({f"override {MODEL_ENGINE}": engine})
    body: dict[str, Any] = {
        "hydra": {"searchpath": ["pkg://verl.trainer.config"]},
        "defaults": [*defaults, "_self_"],
    }
    body.update(nest(config))
    text = yaml.safe_dump(body, sort_keys=False, default_flow_style=False)
    return "".join(f"# {line}\n" for line in comments) + text


def render(spec: StudySpec, results: list[StageResult], base: Config, fmt: str, *, config_name: str = "best",
           overall: dict[str, Any] | None = None, schedule: dict[str, Any] | None = None) -> str:
    """``overall``: ``status``'s overall gain (``verl_sweep.search.views.status.final_check_status``);
    ``schedule``: train mode's (``verl_sweep.search.views.train.schedule``; None in search mode),
    in the YAML's header and under the JSON's ``train``."""
    from verl_sweep.search.views.status import overall_line

    config = final_config(base)
    if fmt == "yaml":
        return to_yaml(spec, results, config, config_name=config_name,
                       overall=overall_line({"overall": overall}) if overall else None, schedule=schedule)
    overrides = to_overrides(config)
    if fmt == "overrides":
        return "\n".join(overrides) + "\n"
    if fmt == "command":
        return shlex.join(["python", "-m", "verl.trainer.main_ppo", *overrides]) + "\n"
    if fmt == "json":
        body = {"study": spec.name, "finished": len(results) == len(spec.stages),
                "stages": [rounded(r.to_attr()) for r in results], "overall": overall, "config": config}
        if schedule is not None:
            body["train"] = schedule
        return json.dumps(body, indent=2) + "\n"
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, but got {fmt!r}.")
