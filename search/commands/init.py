"""``verl-sweep init``: a study file from the verl run the user already has.

The launch (``verl_sweep.search.commands.launch_script``) gives verl's overrides as verl's Hydra reads them; they
become the study's ``baseline`` unchanged (numbers stay numbers: Hydra's own parser types
them). The rest is read off them: the algorithm (``algorithm.adv_estimator``: GAE is the PPO
chain, every other estimator the GRPO-style one), the hardware (``trainer.n_gpus_per_node``,
``trainer.nnodes``; the GPUs' memory from NVML or ``--gpu-memory-gb``), the lengths
(``data.max_prompt_length`` / ``max_response_length``), the model's shape (the config.json at
``actor_rollout_ref.model.path``: a local directory, or the local Hugging Face cache for an id;
never the network), the stages that fit the config (the systems stage for the engine in use,
the token budget only where the rollout engine reads it, λ only with GAE) and probe lengths
that fit the run (``verl_sweep.search.method.run_length``). ``build_study`` returns the data and what it could
not resolve; the CLI writes it and validates it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Callable

from verl_sweep.launchers.local import LocalLauncher
from verl_sweep.search.spec.errors import BadInputError
from verl_sweep.search.commands.launch_script import LaunchCommand
from verl_sweep.search.spec.study_file import NAME_PATTERN, ProbeSettings, default_stages
from verl_sweep.verl_knowledge import ENGINES, MODEL_ENGINE, SEARCHED_ENGINES, engine

MODEL_PATH = "actor_rollout_ref.model.path"
#: rollout engines that read rollout.max_num_batched_tokens in verl 0.9.1 (SGLang never gets it)
TOKEN_BUDGET_ENGINES = ("vllm", "trtllm")
#: verl's own config names, as --config-name gives them
_VERL_CONFIGS = {"ppo_trainer": None, "ppo_megatron_trainer": "megatron"}


@dataclasses.dataclass
class InitResult:
    """The study's data, and the lines init tells the user (what it could not resolve, what it
    changed and why)."""

    data: dict[str, Any]
    remarks: list[str]


def parse_overrides(command: LaunchCommand) -> tuple[dict[str, Any], list[str]]:
    """verl's overrides → the baseline (Hydra's own parser types each value), and remarks."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    baseline: dict[str, Any] = {}
    remarks: list[str] = []
    for item in command.overrides:
        if "=" in item and item.split("=", 1)[1] == "":
            remarks.append(f"`{item}` has no value ({command.why_empty(item[:-1].lstrip('+'))}): left out")
            continue
        try:
            [override] = parser.parse_overrides([item])
        except HydraException as e:
            raise BadInputError(f"`{item[:80]}`: must be a key=value override verl's Hydra reads, but it is not "
                                f"({' '.join(str(e).split())[:120]}). Fix it in the command.") from None
        key = override.key_or_group
        if override.package:
            remarks.append(f"`{item}` left out: a config group package (@) cannot be tuned")
            continue
        if override.is_sweep_override():
            raise BadInputError(f"`{item}`: must be one value, but it is a Hydra sweep. Give the value the run uses.")
        if override.type is OverrideType.DEL:
            remarks.append(f"`{item}` left out: deleting a key (~) is not kept in a study")
            continue
        prefix = {OverrideType.ADD: "+", OverrideType.FORCE_ADD: "++"}.get(override.type, "")
        value = override.value()
        baseline.pop(key, None)  # a later override of the same key wins, as in Hydra
        baseline[prefix + key] = value
    return baseline, remarks


def _config_name(command: LaunchCommand, baseline: dict[str, Any]) -> None:
    name = (command.config_name or "ppo_trainer").removesuffix(".yaml")
    path = (command.config_path or "config").rstrip("/")
    if path not in ("config", "./config") and not path.endswith("verl/trainer/config"):
        shown = path if len(path) <= 50 else "…/" + "/".join(Path(path).parts[-3:])  # not the scratch folder
        raise BadInputError(f"--config-path {shown} (--config-name {name}): must be verl's own config directory, but it "
                            "names the project's own. verl-sweep composes against verl's ppo_trainer: give the run's "
                            "settings as overrides of it.")
    if name not in _VERL_CONFIGS:
        raise BadInputError(f"--config-name {name}: must be one of verl's {', '.join(_VERL_CONFIGS)}, but got {name!r}. "
                            "Give the run's settings as overrides of ppo_trainer.")
    chosen = _VERL_CONFIGS[name]
    if chosen and MODEL_ENGINE not in baseline:
        baseline[MODEL_ENGINE] = chosen  # ppo_megatron_trainer is ppo_trainer with model_engine: megatron


def _hf_cache_dirs() -> list[Path]:
    dirs = []
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            dirs.append(Path(os.environ[variable]))
    home = os.environ.get("HF_HOME")
    dirs.append(Path(home) / "hub" if home else Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def find_model_config(model_path: str | None, model_config: Path | None) -> Path:
    """The config.json init reads: ``--model-config``, else ``model.path``'s own, else the local
    Hugging Face cache's for an id. Raises one BadInputError line asking for --model-config."""
    if model_config is not None:
        path = model_config / "config.json" if model_config.is_dir() else model_config
        if not path.is_file():
            raise BadInputError(f"--model-config {model_config}: must be a config.json (or a directory holding one), "
                                "but it is not. Give the model's config.json.")
        return path
    if not isinstance(model_path, str) or not model_path:
        raise BadInputError(f"the command must set {MODEL_PATH}, but it does not. Add it, or pass --model-config "
                            "PATH/config.json.")
    local = Path(model_path).expanduser()
    if (local / "config.json").is_file():
        return local / "config.json"
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", model_path) and not local.exists():
        folder = "models--" + model_path.replace("/", "--")
        for cache in _hf_cache_dirs():
            snapshots = cache / folder / "snapshots"
            ref = cache / folder / "refs" / "main"
            if ref.is_file() and (snapshots / ref.read_text().strip() / "config.json").is_file():
                return snapshots / ref.read_text().strip() / "config.json"
            found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
            if found:
                return found[-1]
    where = "the local Hugging Face cache" if "/" in model_path and not local.exists() else "that directory"
    raise BadInputError(f"{MODEL_PATH}={model_path}: init reads the model's config.json from a local directory or the "
                        f"local Hugging Face cache (never the network), but {where} has none. Pass --model-config "
                        "PATH/config.json.")


def model_facts(config_path: Path, baseline: dict[str, Any]) -> dict[str, Any]:
    from verl_sweep.launchers.user_files import UserFileError, load_json
    from verl_sweep.verl_knowledge import facts_from_config

    try:
        config = load_json(config_path, what="model config.json")
    except UserFileError as e:
        raise BadInputError(f"--model-config: {e}") from None
    facts = facts_from_config(config) if isinstance(config, dict) else {}
    if not facts.get("num_hidden_layers"):
        raise BadInputError(f"{config_path}: must hold the model's hidden_size, num_attention_heads and "
                            "num_hidden_layers, but it does not. Pass --model-config with the model's own config.json.")
    for field, key, default in (("max_prompt_length", "data.max_prompt_length", 512),
                                ("max_response_length", "data.max_response_length", 512)):
        value = baseline.get(key, default)
        facts[field] = value if isinstance(value, int) and not isinstance(value, bool) else default
    return facts


def gpu_memory(gpu_memory_gb: float | None) -> float:
    if gpu_memory_gb is not None:
        if not gpu_memory_gb > 0:
            raise BadInputError(f"--gpu-memory-gb: must be > 0, but got {gpu_memory_gb:g}. Give one GPU's memory in GB.")
        return float(gpu_memory_gb)
    from verl_sweep.launchers.gpu import has_gpus, read_gpus

    if has_gpus():
        reading = read_gpus([0])[0]
        return round(reading.mem_total_mb / 1024, 1)
    raise BadInputError("init needs one GPU's memory, but it sees no GPU here (NVML). Pass --gpu-memory-gb "
                        "(80 for an A100/H100 80 GB, 141 for an H200).")


def _int(baseline: dict[str, Any], key: str, default: int) -> int:
    value = baseline.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def _pruner_for(steps: int) -> dict[str, Any] | None:
    """A learning stage's pruner for probes shorter than the method's 500 steps: its warm-up
    and report interval scaled with the probe (100 and 25 of 500), so that it can still act."""
    if steps >= 500:
        return None
    return {"warmup_steps": max(3, steps // 5), "interval_steps": max(1, steps // 20)}


def build_study(command: LaunchCommand, *, name: str, gpu_memory_gb: float | None = None,
                model_config: Path | None = None) -> InitResult:
    """The study data for ``command``; raises BadInputError (one line) when a fact is missing."""
    from verl_sweep.objectives.score import MIN_SCORED_STEPS, MIN_SPEED_STEPS
    from verl_sweep.search.method.run_length import MAX_PROBE_FRACTION, fit_probes, min_run_steps, run_length

    if not re.match(NAME_PATTERN, name):
        raise BadInputError(f"--name: must be 1-64 letters, digits, '_' or '-', but got {name!r}. Pick another name.")
    baseline, remarks = parse_overrides(command)
    _config_name(command, baseline)
    remarks = [*(f"could not resolve {u}" for u in command.unresolved), *command.notes, *remarks]
    adv = baseline.get("algorithm.adv_estimator", "gae")
    algorithm = "ppo" if adv == "gae" else "grpo"
    if model_config is None and MODEL_PATH not in baseline and f"{MODEL_PATH}=" in command.overrides:
        raise BadInputError(f"{MODEL_PATH} must name the model, but the command leaves it empty "
                            f"({command.why_empty(MODEL_PATH)}). Set it, or pass --model-config PATH/config.json.")
    config_path = find_model_config(baseline.get(MODEL_PATH), model_config)
    model = model_facts(config_path, baseline)
    hardware = {"gpus_per_node": _int(baseline, "trainer.n_gpus_per_node", 8),
                "nodes": _int(baseline, "trainer.nnodes", 1), "gpu_memory_gb": gpu_memory(gpu_memory_gb)}
    defaults = ProbeSettings()
    run = run_length(baseline)
    fit = fit_probes(run, steps=defaults.steps, speed_steps=defaults.speed_steps,
                     slow_start_factor=defaults.slow_start_factor,
                     min_steps=MIN_SCORED_STEPS + defaults.warmup_steps,
                     min_speed_steps=MIN_SPEED_STEPS + defaults.speed_warmup_steps)
    if isinstance(fit, str):
        raise BadInputError(fit)
    remarks.append(f"run length: {run.how}" if run.steps is None else f"run length {run.steps:,} steps ({run.how})")
    stages, stage_remarks = _stages(algorithm, baseline, model, hardware, fit.steps, learning=fit.learns)
    if fit.learns:
        remarks += [fit.note] if fit.note else []
        probe: dict[str, Any] = {"steps": fit.steps, "speed_steps": fit.speed_steps}
        if fit.slow_start_factor != defaults.slow_start_factor:
            probe["slow_start_factor"] = fit.slow_start_factor
    else:  # the learning stages need a longer run: the speed stages that apply, or one line
        need = min_run_steps(MIN_SCORED_STEPS + defaults.warmup_steps, MAX_PROBE_FRACTION)
        todo = f"set trainer.total_training_steps ≥ {need} (or more trainer.total_epochs)"
        if not stages:
            raise BadInputError(f"{fit.note}, and no speed stage applies ({'; '.join(stage_remarks)}). To tune this "
                                f"run, {todo}.")
        names = ", ".join(f"{s['name']} ({s['space']})" for s in stages)
        remarks.append(f"{fit.note}: the study tunes speed only, with {fit.speed_steps}-step speed probes: {names}. "
                       f"For the learning stages too, {todo}.")
        probe = {"speed_steps": fit.speed_steps}
    remarks += stage_remarks
    data: dict[str, Any] = {
        "name": name,
        "launcher": {"kind": LocalLauncher.name},  # the user's own GPUs
        "model": model,
        "hardware": hardware,
        "algorithm": algorithm,
        "baseline": baseline,
        "probe": probe,
        "stages": stages,
    }
    _no_idle_pruners(data)
    remarks.insert(0, f"model facts from {config_path}")
    return InitResult(data, remarks)


def _no_idle_pruners(data: dict[str, Any]) -> None:
    """A stage whose probes end before its pruner could first act gets no pruner: it would
    cost nothing and do nothing, and validate would warn of it (short speed probes)."""
    from verl_sweep.search.method.stage import Stage
    from verl_sweep.search.spec.study_file import StudySpec

    spec = StudySpec.model_validate(data)
    for index, item in enumerate(data["stages"]):
        if Stage.of(spec, index).pruner_reach_warning():
            item["pruner"] = {"name": "none"}


def _stages(algorithm: str, baseline: dict[str, Any], model: dict[str, Any], hardware: dict[str, Any],
            steps: int, *, learning: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """The default stages that fit the config (``learning`` False: only those that move speed
    alone), as study-file data, and why any was left out."""
    from verl_sweep.search.method.stage import space_learns
    from verl_sweep.spaces.stages import TokenBudgetSpace
    from verl_sweep.spaces.systems import SystemsSpace
    from verl_sweep.spaces.limits import token_budget
    from verl_sweep.verl_knowledge import TOKEN_BUDGET, Algorithm, HardwareFacts, ModelFacts

    remarks = []
    kind = engine(baseline)
    rollout = baseline.get("actor_rollout_ref.rollout.name")
    chain = default_stages(Algorithm(algorithm))
    keep = []
    for stage in chain:
        if not learning and space_learns(stage.space):
            continue
        if stage.space == SystemsSpace.kind and kind not in SEARCHED_ENGINES:
            rest = "; the learning stages run as usual" if learning else ""
            remarks.append(f"no systems stage: {MODEL_ENGINE}={kind} lays out its own mesh, which stage 0 cannot "
                           f"search yet (it searches {', '.join(SEARCHED_ENGINES)}){rest}")
            continue
        if stage.space == TokenBudgetSpace.kind:
            if rollout not in TOKEN_BUDGET_ENGINES:
                remarks.append(f"no token-budget stage: verl 0.9.1 never passes rollout.max_num_batched_tokens to "
                               f"{rollout} (a knob its probes could not move)")
                continue
            facts = ModelFacts(**model)
            budget = token_budget(facts, HardwareFacts(**hardware), spec_base(algorithm, baseline, model, hardware))
            own = baseline.get(TOKEN_BUDGET)
            if budget.suggested_max < budget.floor and not (isinstance(own, int) and own >= budget.floor):
                remarks.append(f"no token-budget stage: by verl-sweep's estimate the vLLM pool holds "
                               f"{budget.memory_cap:,} tokens, below the floor {budget.floor:,} ({budget.lines[1]})")
                continue
        keep.append(stage)
    data = []
    for stage in keep:
        item = {k: v for k, v in stage.model_dump(mode="json", exclude_defaults=True).items()}
        item.setdefault("name", stage.name)
        item.setdefault("space", stage.space)
        if space_learns(stage.space):  # a speed stage's short probes are not pruned
            pruner = _pruner_for(steps)
            if pruner:
                item["pruner"] = {**item.get("pruner", {}), **pruner}
        data.append(item)
    if kind not in ENGINES:
        remarks.append(f"{MODEL_ENGINE}={kind} is not one of verl's engines")
    return data, remarks


def spec_base(algorithm: str, baseline: dict[str, Any], model: dict[str, Any], hardware: dict[str, Any]) -> dict[str, Any]:
    """The baseline with what the study's facts imply (``StudySpec.baseline_config``)."""
    implied = {"algorithm.adv_estimator": "gae" if algorithm == "ppo" else "grpo",
               "trainer.n_gpus_per_node": hardware["gpus_per_node"], "trainer.nnodes": hardware["nodes"],
               "data.max_prompt_length": model["max_prompt_length"],
               "data.max_response_length": model["max_response_length"]}
    return {**implied, **baseline}


def render(result: InitResult, *, source: str) -> str:
    """The study file's text: a header saying where it came from and what init could not
    resolve, then the data (YAML that ``load_study`` reads back to the same values)."""
    import yaml

    header = [f"verl-sweep init from {source}", *result.remarks,
              "Edit freely: `verl-sweep validate` checks every change."]
    text = yaml.safe_dump(result.data, sort_keys=False, default_flow_style=False, allow_unicode=True, width=110)
    return "".join(f"# {line}\n" for line in header) + text


def default_name(output: Path) -> str:
    stem = re.sub(r"[^A-Za-z0-9_\-]", "-", output.stem).strip("-_") or "study"
    return stem[:64]


def run_init(argv: list[str], *, output: Path, name: str | None, gpu_memory_gb: float | None,
             model_config: Path | None, force: bool, check: Callable[[Any], tuple[list[str], list[str]]]) -> int:
    """``verl-sweep init``: read the launch, write the study, validate it (``check`` is
    ``validate``'s own), print what was found. Returns the exit code (2: the study was written
    but does not validate)."""
    from verl_sweep.search.commands.launch_script import read_command
    from verl_sweep.search.spec.study_file import load_study

    if output.exists() and not force:
        raise BadInputError(f"-o {output}: exists already. Pick another path, or pass --force to replace it.")
    if output.suffix not in (".yaml", ".yml"):
        raise BadInputError(f"-o {output}: must end in .yaml, but it does not. Use -o {output.with_suffix('.yaml')}.")
    command = read_command(argv)
    source = " ".join(argv) if len(argv) <= 2 else f"{' '.join(argv[:3])} … ({len(command.overrides)} overrides)"
    result = build_study(command, name=name or default_name(output), gpu_memory_gb=gpu_memory_gb,
                         model_config=model_config)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(render(result, source=source), encoding="utf-8")
    print(f"wrote {output}: {len(result.data['baseline'])} overrides of verl's ppo_trainer as the baseline, "
          f"algorithm {result.data['algorithm']}, {result.data['hardware']['nodes']} × "
          f"{result.data['hardware']['gpus_per_node']} GPUs of {result.data['hardware']['gpu_memory_gb']:g} GB")
    for line in result.remarks:
        print(f"  {line}")
    spec = load_study(output)
    problems, lines = check(spec)
    for line in lines:
        print(line)
    if problems:
        for line in problems:
            print(f"error: {line}")
        print(f"{output}: written, but it does not validate; fix the lines above (`verl-sweep validate {output}`).")
        return 2
    print(f"{output}: OK. Run it with `verl-sweep run {output}`.")
    return 0
