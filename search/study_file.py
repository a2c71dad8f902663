"""Study files (``studies/*.yaml``): the schema, loading, and errors that name the field."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from search.errors import BadInputError
from spaces.facts import Algorithm, HardwareFacts, ModelFacts
from spaces.overrides import OverrideError, check_key, format_value, merge

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$"
MAX_FILE_BYTES = 1_000_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LauncherSection(_Strict):
    kind: Literal["sim", "local", "ray", "replay"] = "sim"
    max_concurrent: int = Field(default=2, ge=1, le=1024)
    #: passed to the launcher's constructor (e.g. time_scale, landscape, address, gpu_ids)
    options: dict[str, Any] = Field(default_factory=dict)


class Budget(_Strict):
    max_trials: int = Field(ge=1, le=100_000)
    max_wall_clock_s: float | None = Field(default=None, gt=0, le=1e9)


class StopRule(_Strict):
    """End a stage early when none of the last ``stable_trials`` finished candidates beat the
    best so far (the incumbent at first) by more than ``tolerance`` in η — the method's
    "η stable in 0.98-1.02: done"."""

    stable_trials: int = Field(default=4, ge=1, le=10_000)
    tolerance: float = Field(default=0.02, gt=0, lt=1)


class SamplerSettings(_Strict):
    name: Literal["tpe", "random", "gp", "grid"] = "tpe"
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    n_startup_trials: int = Field(default=3, ge=0, le=10_000)
    #: TPE only: model the parameters jointly (grouped by which ones a trial has), so
    #: coupled knobs such as TP × memory fraction are learned together
    multivariate: bool = False

    @model_validator(mode="after")
    def _multivariate_is_tpe(self) -> "SamplerSettings":
        if self.multivariate and self.name != "tpe":
            raise ValueError(f"multivariate applies to the tpe sampler only, but the sampler is "
                             f"{self.name!r}. Remove multivariate or use tpe.")
        return self


class PrunerSettings(_Strict):
    # "incumbent" (the default) stops a candidate that runs clearly below the incumbent on
    # the same seed; it can never stop a candidate that could win the stage. Optuna's
    # median/percentile/Wilcoxon rules are available too (benchmarks/compare_pruners.py).
    name: Literal["none", "incumbent", "median", "patient", "wilcoxon"] = "incumbent"
    #: report intermediate values every this many steps
    interval_steps: int = Field(default=25, ge=1, le=100_000)
    #: no pruning before this step. Curves differ in shape early (KL on starts slower and
    #: ends higher): at 50-75 steps the incumbent pruner stopped every KL candidate of the
    #: kl_edge landscape, true η up to 1.28; from 100 it keeps them.
    warmup_steps: int = Field(default=100, ge=0, le=100_000)
    #: trials that must finish before pruning starts (median, patient)
    n_startup_trials: int = Field(default=2, ge=0, le=10_000)
    #: reports in a row below the bar before a trial is stopped (incumbent, patient)
    patience: int = Field(default=2, ge=1, le=1000)
    #: incumbent: how far below the incumbent's running rate counts as "clearly below". At
    #: 100-125 steps paired KL-on candidates ran 0-3% below the incumbent and ended 3-23%
    #: above it (kl_edge): with no margin the pruner stopped all five of them.
    margin: float = Field(default=0.03, ge=0, lt=1)
    percentile: float = Field(default=25.0, gt=0, lt=100)


class StageSettings(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    space: str = Field(description="Space kind: systems, mini_batch, kl, token_budget, lr, lam, polish.")
    params: dict[str, Any] = Field(default_factory=dict)
    budget: Budget
    stop: StopRule = Field(default_factory=StopRule)
    sampler: SamplerSettings = Field(default_factory=SamplerSettings)
    pruner: PrunerSettings = Field(default_factory=PrunerSettings)
    #: before a winner is declared, the top this-many candidates are re-run on fresh seeds
    #: and the winner is chosen on the mean (0: no re-runs)
    confirm_top: int = Field(default=3, ge=0, le=100)
    #: a leader whose η interval still reaches the tolerance (a gain the runs so far can
    #: neither confirm nor rule out) is re-run on further fresh seeds, up to this many runs
    confirm_max_runs: int = Field(default=3, ge=2, le=100)
    #: probe length for this stage (default: the study's probe.steps)
    probe_steps: int | None = Field(default=None, ge=2, le=10_000_000)


class ProbeSettings(_Strict):
    steps: int = Field(default=500, ge=2, le=10_000_000)
    #: steps at the start that the score leaves out (engine warm-up)
    warmup_steps: int = Field(default=0, ge=0, le=10_000_000)
    #: probe length for speed-only stages (token budget, systems), scored on throughput
    speed_steps: int = Field(default=30, ge=2, le=10_000_000)
    #: steps at the start of a speed-only probe left out of its throughput (warm-up)
    speed_warmup_steps: int = Field(default=3, ge=0, le=10_000_000)
    #: how often the incumbent of each stage is run (paired seeds with candidates)
    incumbent_repeats: int = Field(default=2, ge=1, le=100)
    #: a probe that writes no new metrics for this long (simulated seconds on the
    #: simulator) is stopped as hung
    hang_timeout_s: float = Field(default=1800.0, gt=0, le=1e9)
    #: retries of a probe lost to infrastructure (NCCL timeout, dead worker, hang)
    max_retries: int = Field(default=2, ge=0, le=100)


class StudySpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    storage: str | None = None
    launcher: LauncherSection = Field(default_factory=LauncherSection)
    model: ModelFacts
    hardware: HardwareFacts
    algorithm: Algorithm
    baseline: dict[str, Any] = Field(default_factory=dict)
    #: baseline keys allowed outside the method's safe bounds (a toy model that learns only
    #: at a far larger lr, say); ``validate`` lists each one it lets through
    unsafe_baseline: list[str] = Field(default_factory=list)
    probe: ProbeSettings = Field(default_factory=ProbeSettings)
    seeds: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5, 6], min_length=1)
    stages: list[StageSettings] = Field(default_factory=list)
    #: where the study file lives (set by the loader; storage and paths are relative to it)
    source_dir: Path | None = Field(default=None, exclude=True)

    @field_validator("baseline")
    @classmethod
    def _check_baseline(cls, baseline: dict[str, Any]) -> dict[str, Any]:
        for key, value in baseline.items():
            try:
                check_key(key)
                format_value(value)
            except OverrideError as e:
                raise ValueError(f"{key}: {e}") from None
        return baseline

    @field_validator("seeds")
    @classmethod
    def _check_seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must be distinct, but got {seeds}")
        if any(not 0 <= s < 2**31 for s in seeds):
            raise ValueError(f"seeds must be in [0, 2^31), but got {seeds}")
        return seeds

    @model_validator(mode="after")
    def _default_stages(self) -> "StudySpec":
        if not self.stages:
            object.__setattr__(self, "stages", default_stages(self.algorithm))
        names = [s.name for s in self.stages]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"stage names must be distinct, but got {duplicates} twice")
        repeats = self.probe.incumbent_repeats
        for i, stage in enumerate(self.stages):
            if stage.budget.max_trials <= repeats:
                raise ValueError(
                    f"stages[{i}].budget.max_trials: must be more than probe.incumbent_repeats ({repeats}), but got "
                    f"{stage.budget.max_trials}: the incumbent's runs count in the budget, so no candidate would run"
                )
        return self

    def stage_probe_steps(self, stage: StageSettings, *, speed_only: bool = False) -> int:
        return stage.probe_steps or (self.probe.speed_steps if speed_only else self.probe.steps)

    def baseline_config(self) -> dict[str, Any]:
        """The baseline overrides plus what the study's facts imply (algorithm, GPU count,
        sequence lengths); the base config of stage 1."""
        implied = {
            "algorithm.adv_estimator": self.algorithm.adv_estimator,
            "trainer.n_gpus_per_node": self.hardware.gpus_per_node,
            "trainer.nnodes": self.hardware.nodes,
            "data.max_prompt_length": self.model.max_prompt_length,
            "data.max_response_length": self.model.max_response_length,
        }
        return merge(implied, self.baseline)

    def storage_url(self) -> str:
        """The file's ``storage``, else $VERL_SWEEP_STORAGE (where ``worker`` and ``status``
        look too), else ``NAME.db`` beside the file."""
        if self.storage:
            return self.storage
        if os.environ.get("VERL_SWEEP_STORAGE"):
            return os.environ["VERL_SWEEP_STORAGE"]
        base = self.source_dir or Path.cwd()
        return f"sqlite:///{(base / f'{self.name}.db').resolve()}"


def default_stages(algorithm: Algorithm) -> list[StageSettings]:
    """Stage 0 (parallel layout and memory, scored on throughput), the method's four steps
    (step 4 is lr then λ, λ only with GAE, never both at once), then the polish: mini-batch
    × lr (× KL) together from the chain's winner."""
    stages = [
        # Speed probes are 30 steps: a full 30-trial sweep of the 8 coupled layout knobs,
        # modelled jointly, costs about two 500-step runs and picks clearly better layouts.
        StageSettings(name="systems", space="systems", budget=Budget(max_trials=30), confirm_top=1,
                      stop=StopRule(stable_trials=30), sampler=SamplerSettings(multivariate=True)),
        StageSettings(name="minibatch", space="mini_batch", budget=Budget(max_trials=8)),
        StageSettings(name="kl", space="kl", budget=Budget(max_trials=8)),
        StageSettings(name="tokens", space="token_budget", budget=Budget(max_trials=10)),
        # lr gains of 4-6% need more than 3 runs to clear the 2% rule
        StageSettings(name="lr", space="lr", budget=Budget(max_trials=8), confirm_max_runs=5),
    ]
    # The final pass over the coupled knobs, from the chain's winner: 4 starting points
    # (coupled moves) leave 8 trials for the sampler.
    polish = StageSettings(name="polish", space="polish", budget=Budget(max_trials=12),
                           sampler=SamplerSettings(n_startup_trials=4), confirm_max_runs=5)
    if algorithm is Algorithm.PPO:
        stages.append(StageSettings(name="lam", space="lam", budget=Budget(max_trials=6)))
    return [*stages, polish]


# -- loading ---------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader (no Python tags) that also refuses duplicate keys instead of keeping the last."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def _field_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("function-after[_read_config_json()]",) or str(part).startswith("function-"):
            continue
        else:
            path += ("." if path else "") + str(part)
    return path or "(top level)"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_error(error: Any) -> str:
    """One pydantic error → ``path: must …, but got …``."""
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    path = _field_path(tuple(error["loc"]))
    bounds = {
        "greater_than_equal": ("≥", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("≤", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in bounds:
        op, name = bounds[kind]
        return f"{path}: must be {op} {ctx[name]}, but got {_short(value)}"
    if kind == "missing":
        return f"{path}: is required, but it is missing"
    if kind == "extra_forbidden":
        return f"{path}: is not a known field (check the spelling; see the README's study-file reference)"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"{path}: must be an integer, but got {_short(value)}"
    if kind in ("float_type", "float_parsing"):
        return f"{path}: must be a number, but got {_short(value)}"
    if kind == "finite_number":
        return f"{path}: must be a finite number, but got {_short(value)}"
    if kind in ("bool_type", "bool_parsing"):
        return f"{path}: must be true or false, but got {_short(value)}"
    if kind in ("string_type",):
        return f"{path}: must be a string, but got {_short(value)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"{path}: must be a mapping, but got {_short(value)}"
    if kind == "list_type":
        return f"{path}: must be a list, but got {_short(value)}"
    if kind in ("literal_error", "enum"):
        return f"{path}: must be {ctx.get('expected', 'one of the listed values')}, but got {_short(value)}"
    if kind == "string_pattern_mismatch":
        return (
            f"{path}: must be 1-64 letters, digits, '_' or '-' (starting with a letter or digit), "
            f"but got {_short(value)}"
        )
    if kind == "too_short":
        return f"{path}: must not be empty, but got {_short(value)}"
    if kind == "value_error":
        message = str(ctx.get("error", error["msg"]))
        # A check across fields (after the model) names its own field path.
        return message if not error["loc"] and re.match(r"[\w\[\]]+(\.[\w\[\]]+)*: ", message) else f"{path}: {message}"
    return f"{path}: {error['msg']}, but got {_short(value)}"


def parse_study(data: Any, *, source_dir: Path | None = None) -> StudySpec:
    """Validate a study mapping; raises BadInputError with one line per problem."""
    if not isinstance(data, dict):
        raise BadInputError(
            f"a study file must be a YAML mapping, but got {type(data).__name__}. "
            "See studies/demo.yaml for an example."
        )
    if "model" in data and isinstance(data["model"], dict) and source_dir is not None:
        config_json = data["model"].get("config_json")
        if isinstance(config_json, str) and not Path(config_json).is_absolute():
            data = {**data, "model": {**data["model"], "config_json": str(source_dir / config_json)}}
    try:
        spec = StudySpec.model_validate(data)
    except ValidationError as e:
        raise BadInputError("\n".join(describe_error(err) for err in e.errors())) from None
    return spec.model_copy(update={"source_dir": source_dir})


def load_study(path: Path | str) -> StudySpec:
    """Read and validate a study file. Creates nothing; raises BadInputError on any problem."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise BadInputError(f"{path}: a study file must be under 1 MB, but it is larger.")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInputError(f"{path}: no such study file. Check the path.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInputError(f"{path}: cannot read the study file ({e}).") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise BadInputError(f"{path}: not valid YAML{where}: {problem}.") from None
    try:
        return parse_study(data, source_dir=path.resolve().parent)
    except BadInputError as e:
        raise BadInputError("\n".join(f"{path.name}: {line}" for line in str(e).splitlines())) from None


def spec_to_dict(spec: StudySpec) -> dict[str, Any]:
    """A JSON-safe form of the study, stored in the database so that resume needs no file."""
    data = spec.model_dump(mode="json", exclude={"source_dir"})
    data["source_dir"] = str(spec.source_dir) if spec.source_dir else None
    return data


def spec_from_dict(data: dict[str, Any]) -> StudySpec:
    data = dict(data)
    source_dir = data.pop("source_dir", None)
    spec = StudySpec.model_validate(data)
    return spec.model_copy(update={"source_dir": Path(source_dir) if source_dir else None})

