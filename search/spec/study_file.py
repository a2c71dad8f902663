"""Study files (``studies/*.yaml``): the schema, loading, and errors that name the field."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from verl_sweep.launchers import DEFAULT_KIND
from verl_sweep.launchers.user_files import UserFileError, load_json, parse_yaml, read_user_text
from verl_sweep.search.spec.errors import BadInputError
from verl_sweep.search.spec.masking import mask_url
from verl_sweep.search.spec.plain import check_plain as _check_plain, short as _short
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.verl_knowledge import OverrideError, check_key, format_value, merge

#: the name of the final check's study beside the stages' (``<study>.final``)
FINAL_STAGE = "final"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$"
MAX_FILE_BYTES = 1_000_000
# Strict types: YAML already types its values, so `true` is no integer and "3" no number
# (pydantic's lax mode would take both). StrictFloat still takes an integer.
Int = StrictInt
Float = StrictFloat


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LauncherSection(_Strict):
    #: a registered launcher kind (``launchers.LAUNCHERS``)
    kind: StrictStr = DEFAULT_KIND
    max_concurrent: Int = Field(default=2, ge=1, le=1024)
    #: the options the launcher declares (``Launcher.OPTIONS``: e.g. time_scale, landscape,
    #: address, gpu_ids), checked against them by ``verl_sweep.search.commands.launch``
    options: dict[str, Any] = Field(default_factory=dict)

    _check_options = field_validator("options")(_check_plain)

    @field_validator("kind")
    @classmethod
    def _registered_kind(cls, kind: str) -> str:
        from verl_sweep.launchers import LAUNCHERS

        if kind not in LAUNCHERS:
            kinds = [repr(k) for k in LAUNCHERS]
            raise ValueError(f"must be {', '.join(kinds[:-1])} or {kinds[-1]}, but got {_short(kind)}")
        return kind


class Budget(_Strict):
    max_trials: Int = Field(ge=1, le=100_000)
    max_wall_clock_s: Float | None = Field(default=None, gt=0, le=1e9)


class StopRule(_Strict):
    """End a stage early when none of the last ``stable_trials`` finished candidates beat the
    best so far (the incumbent at first) by more than ``tolerance`` in η — the method's
    "η stable in 0.98-1.02: done". ``count_pruned``: candidates the pruner stopped count too."""

    stable_trials: Int = Field(default=4, ge=1, le=10_000)
    tolerance: Float = Field(default=0.02, gt=0, lt=1)
    #: a pruned candidate (behind the incumbent on both readings) counts as one that did not beat the best
    count_pruned: StrictBool = False


class SamplerSettings(_Strict):
    name: Literal["tpe", "random", "gp", "grid"] = "tpe"
    seed: Int | None = Field(default=None, ge=0, le=2**31 - 1)
    n_startup_trials: Int = Field(default=3, ge=0, le=10_000)
    #: TPE only: model the parameters jointly (grouped by which ones a trial has), so
    #: coupled knobs such as TP × memory fraction are learned together
    multivariate: StrictBool = False

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
    interval_steps: Int = Field(default=25, ge=1, le=100_000)
    #: no pruning before this step (default: half of a learning probe). A running rate read to
    #: the run's horizon from fewer steps extrapolates a curve that has not bent yet, and curves
    #: differ in shape early (KL on starts slower and ends higher), so an earlier bar stops
    #: candidates that would win (docs/method.md, Evidence). The incumbent pruner leaves a
    #: candidate that changes KL, or the mini-batch and lr both, until 3/4 of the probe
    #: (``IncumbentPruner.late_from``).
    warmup_steps: Int | None = Field(default=None, ge=0, le=100_000)
    #: trials that must finish before pruning starts (median, patient)
    n_startup_trials: Int = Field(default=2, ge=0, le=10_000)
    #: reports in a row below the bar before a trial is stopped (incumbent, patient)
    patience: Int = Field(default=2, ge=1, le=1000)
    #: incumbent: how far below the incumbent's running rate counts as "clearly below": a
    #: candidate that starts slower runs a few percent below the incumbent early and may still
    #: end above it (docs/method.md, Evidence).
    margin: Float = Field(default=0.03, ge=0, lt=1)
    percentile: Float = Field(default=25.0, gt=0, lt=100)


class StageSettings(_Strict):
    name: StrictStr = Field(pattern=NAME_PATTERN)
    space: StrictStr = Field(description="A registered space kind (verl_sweep.spaces.SPACES; a wrong one is refused with the list).")
    params: dict[str, Any] = Field(default_factory=dict)
    budget: Budget
    stop: StopRule = Field(default_factory=StopRule)
    sampler: SamplerSettings = Field(default_factory=SamplerSettings)
    pruner: PrunerSettings = Field(default_factory=PrunerSettings)
    #: before a winner is declared, the top this-many candidates are re-run on fresh seeds
    #: and the winner is chosen on the mean (0: no re-runs)
    confirm_top: Int = Field(default=3, ge=0, le=100)
    #: a leader whose η interval still reaches the tolerance (a gain the runs so far can
    #: neither confirm nor rule out) is re-run on further fresh seeds, up to this many runs
    confirm_max_runs: Int = Field(default=3, ge=2, le=100)
    #: probe length for this stage (default: the study's probe.steps; in train mode, its
    #: branches' length, default train.branch_steps)
    probe_steps: Int | None = Field(default=None, ge=2, le=10_000_000)

    _check_params = field_validator("params")(_check_plain)


class FinalCheckSettings(_Strict):
    """The final check: after the last stage, the final config and the baseline run side by
    side on ``runs`` fresh paired seeds, which measures the overall gain against the user's own
    baseline (``verl_sweep.search.engine.final_check``; the baseline's runs are its learning at
    the speed stages' layout, re-timed to its own). ``final_check: false`` in the study file
    skips it. Two pairs by default: the check decides nothing, and a third pair of 500-step
    probes cost the demo about 0.4 R (the baseline's then ran at its own, slowest speed) to
    narrow its gain's 90% interval from ±5.3% to ±4.5% (docs/method.md, Evidence)."""

    runs: Int = Field(default=2, ge=0, le=100)

    @model_validator(mode="before")
    @classmethod
    def _from_bool(cls, data: Any) -> Any:
        if data is False:
            return {"runs": 0}
        if data is True:
            return {}
        return data

    @property
    def enabled(self) -> bool:
        return self.runs > 0


class TrainSettings(_Strict):
    """Train mode: the study is the run (``verl_sweep.search.engine.chain``). Each learning stage
    branches its runs from the chain's checkpoint, ``branch_steps`` steps each; its winner's
    branch is the chain the next stage branches from; after the last stage the winner trains
    on to the run's end, and that checkpoint is the model."""

    branch_steps: Int = Field(default=150, ge=2, le=10_000_000)
    #: the study's whole cost, tuning and the run, in runs of the baseline (R): a learning
    #: stage starts only the runs the room left holds, or is skipped (None: no cap)
    max_cost_r: Float | None = Field(default=1.5, gt=0, le=1000)


class ProbeSettings(_Strict):
    steps: Int = Field(default=500, ge=2, le=10_000_000)
    #: steps at the start that the score leaves out (engine warm-up)
    warmup_steps: Int = Field(default=0, ge=0, le=10_000_000)
    #: probe length for speed-only stages (token budget, systems), scored on throughput
    speed_steps: Int = Field(default=30, ge=2, le=10_000_000)
    #: steps at the start of a speed-only probe left out of its throughput (warm-up: step 1
    #: holds vLLM's and the optimizer's first calls; docs/method.md, Evidence)
    speed_warmup_steps: Int = Field(default=1, ge=0, le=10_000_000)
    #: a speed-only probe ends before ``speed_steps`` once its last two scored steps' tokens/s
    #: agree within this fraction (0: never): each step costs minutes, and a settled reading
    #: moves by less than the speed stages' 1% bar over more steps
    speed_settle_tolerance: Float = Field(default=0.05, ge=0, lt=1)
    #: how often the incumbent of each stage is run (paired seeds with candidates)
    incumbent_repeats: Int = Field(default=2, ge=1, le=100)
    #: a probe that writes no new metrics for this long (simulated seconds on the
    #: simulator) is stopped as hung
    hang_timeout_s: Float = Field(default=1800.0, gt=0, le=1e9)
    #: retries of a probe lost to infrastructure (NCCL timeout, dead worker, hang)
    max_retries: Int = Field(default=2, ge=0, le=100)
    #: a slow start: when the first learning stage's incumbent runs show the reward still
    #: accelerating at the probe's end (``verl_sweep.search.method.policy.SLOW_START_LATE_GAIN``), the later
    #: learning stages probe this many times ``steps`` (the short rate would judge early
    #: speed, not the run's); 1 never lengthens them. 2, not more: probes are read to the
    #: run's end, and a 1,000-step probe of a 2,000-step run sees its curve bend at half the
    #: cost of a 2,000-step one (docs/method.md, Evidence)
    slow_start_factor: Int = Field(default=2, ge=1, le=100)
    #: each probe logs to the trackers the baseline's ``trainer.logger`` names (W&B, TensorBoard,
    #: SwanLab, …; ``verl_sweep.launchers.trackers``); false keeps the probes out of them (only verl-sweep's
    #: own console and file loggers), while the exported config keeps the baseline's loggers
    trackers: bool = True

    @model_validator(mode="after")
    def _warmup_inside_probe(self) -> "ProbeSettings":
        # A probe scored only on steps after its warm-up: no step left, no score.
        for warmup, steps in (("warmup_steps", "steps"), ("speed_warmup_steps", "speed_steps")):
            if getattr(self, warmup) >= getattr(self, steps):
                raise ValueError(f"probe.{warmup}: must be < probe.{steps} ({getattr(self, steps)}), but got "
                                 f"{getattr(self, warmup)}: the score leaves the warm-up steps out, so no step "
                                 "would be scored. Lower it or lengthen the probe.")
        return self


class StudySpec(_Strict):
    name: StrictStr = Field(pattern=NAME_PATTERN)
    storage: StrictStr | None = None
    launcher: LauncherSection = Field(default_factory=LauncherSection)
    model: ModelFacts
    hardware: HardwareFacts
    algorithm: Algorithm
    baseline: dict[str, Any] = Field(default_factory=dict)
    #: baseline keys allowed outside the method's safe bounds (a toy model that learns only
    #: at a far larger lr, say); ``validate`` lists each one it lets through
    unsafe_baseline: list[str] = Field(default_factory=list)
    probe: ProbeSettings = Field(default_factory=ProbeSettings)
    #: the full run's length in steps, the horizon every learning probe is judged at and the
    #: length of R (one full run of the baseline); default: the baseline's own
    #: (``trainer.total_training_steps``, or epochs × the local train files' steps), else 2,000
    run_steps: Int | None = Field(default=None, ge=1, le=10_000_000)
    seeds: list[Int] = Field(default_factory=lambda: [1, 2, 3, 4, 5, 6], min_length=1)
    stages: list[StageSettings] = Field(default_factory=list)
    #: stop early on a study whose baseline is already near-optimal: once this many stages in
    #: a row from the first found no gain above 2% (``StageResult.flat``: kept the incumbent
    #: with no candidate above 1 + tolerance, none left undecided, or won by at most 2%), the
    #: stages after them are skipped, each recorded with that reason (0: never)
    stop_when_flat: Int = Field(default=0, ge=0, le=1000)
    #: the final config against the baseline on fresh paired seeds, after the last stage
    #: (``{runs: N}``; ``false``: none)
    final_check: FinalCheckSettings = Field(default_factory=FinalCheckSettings)
    #: train mode (``{branch_steps: N}``): the study trains the model as it tunes; None: search mode
    train: TrainSettings | None = None
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

    @model_validator(mode="before")
    @classmethod
    def _lengths_from_baseline(cls, data: Any) -> Any:
        """The model's prompt and response lengths default to the baseline's ``data.*``: one
        fact, written once (init writes both; a study may leave model's out)."""
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict) or not isinstance(data.get("baseline"), dict):
            return data
        model = dict(data["model"])
        for field in ("max_prompt_length", "max_response_length"):
            value = data["baseline"].get(f"data.{field}")
            if field not in model and isinstance(value, int) and not isinstance(value, bool):
                model[field] = value
        return {**data, "model": model}

    @model_validator(mode="after")
    def _lengths_agree(self) -> "StudySpec":
        # A mismatch would bound the search for one length and run the other.
        for field in ("max_prompt_length", "max_response_length"):
            value = self.baseline.get(f"data.{field}")
            if isinstance(value, int) and not isinstance(value, bool) and value != getattr(self.model, field):
                raise ValueError(f"model.{field}: must equal the baseline's data.{field} ({value}), but got "
                                 f"{getattr(self.model, field)}: the bounds are computed from one and the run uses the "
                                 f"other. Remove model.{field} (it is taken from the baseline) or make them equal")
        return self

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
        if FINAL_STAGE in names:
            raise ValueError(f"stage names must not be {FINAL_STAGE!r}, but got it at stages[{names.index(FINAL_STAGE)}]: "
                             "the final check's study has that name. Rename the stage")
        repeats = self.probe.incumbent_repeats
        for i, stage in enumerate(self.stages):
            if stage.budget.max_trials <= repeats:
                raise ValueError(
                    f"stages[{i}].budget.max_trials: must be more than probe.incumbent_repeats ({repeats}), but got "
                    f"{stage.budget.max_trials}: the incumbent's runs count in the budget, so no candidate would run"
                )
        return self

    def baseline_config(self) -> dict[str, Any]:
        """The baseline overrides plus what the study's facts imply (algorithm, GPU count,
        sequence lengths); the base config of stage 1."""
        from verl_sweep.verl_knowledge import implied_engine

        implied = {
            "algorithm.adv_estimator": self.algorithm.adv_estimator,
            "trainer.n_gpus_per_node": self.hardware.gpus_per_node,
            "trainer.nnodes": self.hardware.nodes,
            "data.max_prompt_length": self.model.max_prompt_length,
            "data.max_response_length": self.model.max_response_length,
            **implied_engine(self.baseline),
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


#: the speed stages' bar: 1 + 1%, not the learning stages' 2%. A speed knob leaves the
#: learning alone, so a throughput gain is the same gain in η on any run length, and its
#: probes read throughput, paired by seed, far more tightly than a reward rate
SPEED_TOLERANCE = 0.01
#: a one-knob stage ends after 2 candidates in a row within 2% of the best; KL, lr and λ count
#: pruned ones (starting points at both ends of the range), the mini-batch's (both below) not
LEARNING_STOP, BOTH_ENDS_STOP = StopRule(stable_trials=2), StopRule(stable_trials=2, count_pruned=True)


def default_stages(algorithm: Algorithm) -> list[StageSettings]:
    """Stage 0 (parallel layout and memory, scored on throughput), the method's four steps
    with the speed-only token budget first (step 4 is lr then λ, λ only with GAE, never both
    at once), then the polish: mini-batch × lr (× KL) together from the chain's winner."""
    from verl_sweep.spaces.polish import PolishSpace
    from verl_sweep.spaces.stages import KLSpace, LamSpace, LRSpace, MiniBatchSpace, TokenBudgetSpace
    from verl_sweep.spaces.systems import SystemsSpace

    stages = [
        # Speed probes end once their tokens/s settles (3-4 steps): a 64-trial sweep of the 8
        # coupled layout knobs, modelled jointly, costs about a tenth of a full run (docs/method.md,
        # Evidence). The last 16 are a local search around the sampler's leader (``SystemsSpace``).
        StageSettings(name="systems", space=SystemsSpace.kind, budget=Budget(max_trials=64), confirm_top=1,
                      stop=StopRule(stable_trials=64, tolerance=SPEED_TOLERANCE),
                      sampler=SamplerSettings(multivariate=True)),
        # The token budget is the other speed-only knob (speed probes): right after the
        # layout, so that the learning stages are judged, and their 500-step probes paid, at
        # the final throughput (docs/method.md, Evidence).
        StageSettings(name="tokens", space=TokenBudgetSpace.kind, budget=Budget(max_trials=10),
                      stop=StopRule(tolerance=SPEED_TOLERANCE)),
        # The one-knob stages confirm their leader alone (``confirm_top`` 1), try 3 candidates
        # and end after 2 in a row that do not beat the best by 2% (``stable_trials``): the
        # fourth candidate and the 2nd and 3rd best's re-runs chased 1-2% differences the polish
        # settles anyway (docs/method.md, Evidence).
        StageSettings(name="minibatch", space=MiniBatchSpace.kind, budget=Budget(max_trials=5), confirm_top=1,
                      stop=LEARNING_STOP),
        StageSettings(name="kl", space=KLSpace.kind, budget=Budget(max_trials=5), confirm_top=1, stop=BOTH_ENDS_STOP),
        # lr gains of 4-6% need more than 3 runs to clear the 2% rule
        StageSettings(name="lr", space=LRSpace.kind, budget=Budget(max_trials=5), confirm_top=1, stop=BOTH_ENDS_STOP,
                      confirm_max_runs=5),
    ]
    # The final pass over the coupled knobs, from the chain's winner: a pattern search of a
    # first pass (2 coupled moves) and up to 3 follow-ups, then it ends (``PolishSpace``).
    # Its bar is 1 + 1%, not 2%: the chain's winner is already at the one-at-a-time optimum,
    # so what the polish can add is small (a few percent), and its leader gets up to 5 runs
    # to show it.
    polish = StageSettings(name="polish", space=PolishSpace.kind, budget=Budget(max_trials=7), stop=StopRule(tolerance=0.01),
                           sampler=SamplerSettings(n_startup_trials=4), confirm_top=1, confirm_max_runs=5)
    if algorithm is Algorithm.PPO:
        stages.append(StageSettings(name="lam", space=LamSpace.kind, budget=Budget(max_trials=4), confirm_top=1,
                                    stop=BOTH_ENDS_STOP))
    return [*stages, polish]


# -- loading ---------------------------------------------------------------------------------


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
        if message.startswith(f"{path}.") or message.startswith(f"{path}["):
            return message
        return message if not error["loc"] and re.match(r"[\w\[\]]+(\.[\w\[\]]+)*: ", message) else f"{path}: {message}"
    return f"{path}: {error['msg']}, but got {_short(value)}"


#: what a model's config.json may fill in (the file's own names are the study's)
_CONFIG_JSON_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                       "intermediate_size", "vocab_size")
#: what a config.json implies besides (``verl_sweep.verl_knowledge.model_config``): the KV cache's shape, the size
_DERIVED_FIELDS = ("head_dim", "kv_cache_layers", "kv_lora_dim", "n_params_b", "expert_params_b")


def _with_config_json(data: dict[str, Any], source_dir: Path | None) -> tuple[dict[str, Any], set[str]]:
    """The study with ``model.config_json`` read (through the one user-file reader) and the
    sizes it has filled in where the file leaves them out, so that they are validated like
    values written in the file. Returns the data and the fields taken from config.json."""
    from verl_sweep.verl_knowledge import facts_from_config, language_config

    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("config_json"), str):
        return data, set()
    path = Path(model["config_json"])
    if source_dir is not None and not path.is_absolute():
        path = source_dir / path
    model = {**model, "config_json": str(path)}
    missing = [k for k in (*_CONFIG_JSON_FIELDS, *_DERIVED_FIELDS) if model.get(k) is None]
    if missing:
        try:
            config = load_json(path, what="model config.json")
        except UserFileError as e:
            raise BadInputError(f"model.config_json: {e}") from None
        if not isinstance(config, dict):
            raise BadInputError(f"model.config_json: {path} must hold a JSON object, but got {type(config).__name__}.")
        shape = language_config(config)
        for key in _CONFIG_JSON_FIELDS:  # as written, so that a wrong type is named as such
            if key in missing and key in shape:
                model[key] = shape[key]
        derived = facts_from_config(config)
        for key in _DERIVED_FIELDS:
            if key in missing and key in derived:
                model[key] = derived[key]
    return {**data, "model": model}, {f"model.{k}" for k in missing if k in model}


#: a number YAML 1.1 reads as a string (PyYAML: `1e-6`, `5E+3` lack the dot it wants)
_YAML12_FLOAT = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+$")


def numbers_as_meant(value: Any) -> Any:
    """``1e-6``, copied from every verl script into a study file, is a string to YAML 1.1
    (PyYAML) and a number to YAML 1.2, Hydra and the user: read as the number."""
    if isinstance(value, str) and _YAML12_FLOAT.match(value):
        return float(value)
    if isinstance(value, dict):
        return {k: numbers_as_meant(v) for k, v in value.items()}
    if isinstance(value, list):
        return [numbers_as_meant(v) for v in value]
    return value


def parse_study(data: Any, *, source_dir: Path | None = None) -> StudySpec:
    """Validate a study mapping; raises BadInputError with one line per problem."""
    if not isinstance(data, dict):
        raise BadInputError(
            f"a study file must be a YAML mapping, but got {type(data).__name__}. "
            "See studies/demo.yaml for an example."
        )
    try:
        data = numbers_as_meant(data)
    except RecursionError:
        raise BadInputError("a study file's values must not be nested this deeply.") from None
    data, from_json = _with_config_json(data, source_dir)
    try:
        spec = StudySpec.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            line = describe_error(err)
            if _field_path(tuple(err["loc"])) in from_json:
                line += " (read from model.config_json)"
            lines.append(line)
        raise BadInputError("\n".join(lines)) from None
    except RecursionError:  # a value nested deeper than the checks can walk
        raise BadInputError("a study file's values must not be nested this deeply.") from None
    return spec.model_copy(update={"source_dir": source_dir})


def load_study(path: Path | str) -> StudySpec:
    """Read and validate a study file. Creates nothing; raises BadInputError on any problem."""
    path = Path(path)
    try:
        text = read_user_text(path, what="study file", max_bytes=MAX_FILE_BYTES)
        data = parse_yaml(text, source=str(path), what="study file")
    except UserFileError as e:
        raise BadInputError(str(e)) from None
    try:
        return parse_study(data, source_dir=path.resolve().parent)
    except BadInputError as e:
        raise BadInputError("\n".join(f"{path.name}: {line}" for line in str(e).splitlines())) from None


def spec_to_dict(spec: StudySpec) -> dict[str, Any]:
    """A JSON-safe form of the study, stored in the database so that resume needs no file."""
    data = spec.model_dump(mode="json", exclude={"source_dir"})
    if data.get("storage"):  # a password is never stored (resume takes --storage or the file's)
        data["storage"] = mask_url(data["storage"])
    data["source_dir"] = str(spec.source_dir) if spec.source_dir else None
    return data


def spec_from_dict(data: dict[str, Any]) -> StudySpec:
    data = dict(data)
    source_dir = data.pop("source_dir", None)
    try:
        spec = StudySpec.model_validate(data)
    except ValidationError as e:  # stored by a version of verl-sweep with other rules
        problems = "; ".join(describe_error(err) for err in e.errors()[:3])
        raise BadInputError(f"the stored definition of study {data.get('name')!r} does not pass this version's "
                            f"checks ({problems}). Run it with the verl-sweep that created it, or start a new "
                            "study from a corrected file.") from None
    return spec.model_copy(update={"source_dir": Path(source_dir) if source_dir else None})

