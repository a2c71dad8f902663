"""verl's example launch scripts as a user runs them through ``verl-sweep init``: shared by
``test_verl_examples.py`` (init + validate on each) and ``test_stage_configs.py`` (many configs
of the accepted studies through verl).

How the user is played: each script runs with the environment its header asks for (two
scripts stop without one variable), models named by a Hugging Face id are found in a local
cache that holds their config.json (``tests/data/model-configs``), a model named by a local
path that does not exist here gets ``--model-config`` with its config.json, and every GPU
has 80 GB (``--gpu-memory-gb 80``: the scripts are written for 80 GB A100/H100/H200s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

from support import REPO

EXAMPLES = REPO / "tests" / "data" / "verl-examples"
CONFIGS = REPO / "tests" / "data" / "model-configs"
TABLE = REPO / "docs" / "verl-examples.md"
SCRIPTS = sorted(p.relative_to(EXAMPLES).as_posix() for p in (EXAMPLES / "examples").rglob("*.sh"))

#: what the script's header asks the user to set before it runs
ENVIRONMENT = {
    "examples/grpo_trainer/run_kimi_k2_6_glm5_1_megatron_lite.sh": {"MODEL_PATH": "moonshotai/Kimi-K2.6"},
    "examples/tuning/lora/run_qwen3_8b_from_adapter_fsdp.sh": {"LORA_ADAPTER_PATH": "/adapters/qwen3-8b-lora"},
}
#: a local model directory (absent here) → the stand-in config.json of the model it holds
LOCAL_MODELS = {"qwen3-30b-moe-merge": "Qwen--Qwen3-30B-A3B", "gpt-oss-20b-bf16": "openai--gpt-oss-20b"}


@dataclasses.dataclass(frozen=True)
class Outcome:
    script: str
    accepted: bool
    line: str  # the refusal (one line), or "" when accepted
    study: Path | None


def hf_cache(root: Path, *more: Path) -> Path:
    """A local Hugging Face cache holding the config.json of every model in CONFIGS (and in
    the folders ``more``)."""
    hub = root / "hub"
    for path in [p for folder in (CONFIGS, *more) for p in folder.glob("*.json")]:
        snapshot = hub / f"models--{path.stem}" / "snapshots" / "0"
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, snapshot / "config.json")
    return hub


def _local_config(model_path: str | None) -> Path | None:
    if not model_path or (model_path.count("/") == 1 and not model_path.startswith("/")):
        return None  # a Hugging Face id: the cache has it
    name = os.path.basename(model_path.rstrip("/")).lower()
    stems = {p.stem.split("--", 1)[1].lower(): p for p in CONFIGS.glob("*.json")}
    stem = LOCAL_MODELS.get(name)
    return CONFIGS / f"{stem}.json" if stem else stems.get(name)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def init_and_validate(script: str, hub: Path, out_dir: Path, *, root: Path = EXAMPLES,
                      environment: dict[str, str] | None = None, model_config: Path | None = None,
                      **validate: Any) -> Outcome:
    """``verl-sweep init -o … --gpu-memory-gb 80 SCRIPT`` then ``verl-sweep validate`` on the
    study, through the same functions the CLI calls (``root``: the folder ``script`` is in;
    ``environment`` and ``model_config``: the user's, else this corpus's)."""
    from verl_sweep.search.spec.errors import BadInputError
    from verl_sweep.search.commands.init import build_study, render
    from verl_sweep.search.commands.launch_script import read_script
    from verl_sweep.search.spec.study_file import load_study
    from verl_sweep.search.commands.validate import validate_study

    env = ENVIRONMENT.get(script, {}) if environment is None else environment
    with _environment({"HF_HUB_CACHE": str(hub), **env}):
        try:
            command = read_script(root / script)
            model = next((o.split("=", 1)[1] for o in command.overrides if o.startswith("actor_rollout_ref.model.path=")), None)
            name = re.sub(r"[^A-Za-z0-9_\-]", "_", Path(script).stem)[:60]
            result = build_study(command, name=name, gpu_memory_gb=80, model_config=model_config or _local_config(model))
            study = out_dir / (script.replace("/", "__") + ".yaml")
            study.write_text(render(result, source=script))
            problems, _ = validate_study(load_study(study), **validate)
        except BadInputError as e:
            return Outcome(script, False, str(e), None)
    return Outcome(script, not problems, problems[0] if problems else "", study)


def documented() -> dict[str, tuple[bool, str]]:
    """docs/verl-examples.md's table: script → (accepted, the phrase its refusal line holds)."""
    rows: dict[str, tuple[bool, str]] = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`examples/"):
            phrase = re.search(r"`([^`]+)`", cells[2]) if cells[1] == "refused" else None
            rows[cells[0].strip("`")] = (cells[1] == "accepted", phrase.group(1) if phrase else "")
    return rows
