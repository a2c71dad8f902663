"""Stage 0 under Megatron: the actor's parallel layout (TP × PP × CP), the rollout's TP and
the memory fraction, scored on speed (docs/method.md §2: "≥32B: Megatron hybrid parallelism";
seed 000's 7B layout on 8 GPUs: TP 4, PP 2, memory 0.6).

Only layouts verl and Megatron run are proposed, enumerated when the space is built:
TP divides the GPUs of a node, the attention heads and the KV heads (Megatron's query
groups); PP divides the layers; CP halves a sequence that divides by 2·CP; TP·PP·CP divides
the GPUs, DP = GPUs ÷ (TP·PP·CP); under static batching the base's mini-batch stays valid
for that DP (mini × n divisible by DP, the per-GPU share by the micro-batch, the train batch
by DP × micro); a MoE model's expert grid (EP × ETP) divides GPUs ÷ PP. A reference model
whose layout the base pins to the actor's follows it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping

from verl_sweep.spaces import bounds as B
from verl_sweep import verl_knowledge as V
from verl_sweep.spaces.base import Moves, Space, SpaceError, check_options, register_space, where_or
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.verl_knowledge import rollout_memory_floors
from verl_sweep.verl_knowledge import Config, get
from verl_sweep.spaces.systems import SystemsSpace, rollout_expert_parallel

if TYPE_CHECKING:
    import optuna

logger = logging.getLogger(__name__)

REF_TP = "actor_rollout_ref.ref.megatron.tensor_model_parallel_size"
REF_PP = "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size"
REF_CP = "actor_rollout_ref.ref.megatron.context_parallel_size"
ETP = "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size"
MAX_PP = 8
CP_CHOICES = (1, 2)
#: seed 000's layout for ≤ 7B on 8 GPUs (docs/method.md §2)
SEED_LAYOUT = (4, 2, 1)


def layout_name(tp: int, pp: int, cp: int) -> str:
    return f"tp{tp}-pp{pp}-cp{cp}"


def parse_layout(name: str) -> tuple[int, int, int]:
    tp, pp, cp = (int(part[2:]) for part in name.split("-"))
    return tp, pp, cp


def layout_problem(tp: int, pp: int, cp: int, *, model: ModelFacts, hardware: HardwareFacts, base: Config) -> str | None:
    """Why the actor cannot run Megatron TP ``tp`` × PP ``pp`` × CP ``cp`` over ``base``, or None."""
    heads = int(model.num_attention_heads or 1)
    kv_heads = model.num_key_value_heads or heads
    world = tp * pp * cp
    if hardware.gpus_per_node % tp or heads % tp or kv_heads % tp:
        return f"TP {tp} must divide the GPUs of a node ({hardware.gpus_per_node}), the heads ({heads}) and KV heads ({kv_heads})"
    if model.num_hidden_layers and model.num_hidden_layers % pp:
        return f"PP {pp} must divide the layers ({model.num_hidden_layers})"
    if model.max_seq_len % (2 * cp) and cp > 1:
        return f"CP {cp} needs a sequence length divisible by {2 * cp} ({model.max_seq_len})"
    if hardware.n_gpus % world:
        return f"TP·PP·CP ({world}) must divide the GPU count ({hardware.n_gpus})"
    ep = V.positive_int(base, V.MEGATRON_EP)
    etp = get(base, ETP)
    etp = etp if V.is_int(etp) and etp >= 1 else tp
    if (hardware.n_gpus // pp) % (ep * etp) or (hardware.n_gpus // pp) % (ep * tp):
        return f"the expert grid EP {ep} × ETP {etp} (and EP × TP) must divide GPUs ÷ PP ({hardware.n_gpus // pp})"
    if get(base, V.MEGATRON_VPP) is not None and pp != V.megatron_layout(base)[1]:
        return "the base sets a virtual pipeline: PP stays the base's"
    config = {**base, V.MEGATRON_TP: tp, V.MEGATRON_PP: pp, V.MEGATRON_CP: cp}
    if not V.setting(config, V.USE_DYNAMIC_BSZ):
        mini = V.int_setting(config, V.MINI_BATCH)
        problem = V.mini_batch_problem(mini, config, hardware)
        if problem:
            return problem
        micro = V.setting(config, V.MICRO_BATCH)
        dp = hardware.n_gpus // world
        train, n = V.int_setting(config, V.TRAIN_BATCH), V.int_setting(config, V.ROLLOUT_N)
        if V.is_int(micro) and micro >= 1 and (train * n) % (dp * micro):
            return f"train batch × n ({train * n}) must be divisible by DP {dp} × micro-batch {micro}"
    return None


class MegatronSystemsSpace(Space):
    """Stage 0 for a Megatron actor (``model_engine: megatron``); speed only."""

    kind = SystemsSpace.kind  # the same stage as FSDP's, by the base's engine
    moves = Moves.SPEED
    tries_template = True
    OPTIONS = frozenset({"gpu_memory_utilization", "layouts", "rollout_tp"})

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "systems")
        check_options(options, self.OPTIONS, where)
        sub = options.get("gpu_memory_utilization", {})
        if not isinstance(sub, Mapping):
            raise SpaceError(f"{where}.gpu_memory_utilization: must be a mapping like {{low: .., high: ..}}, but got {sub!r}. Use a mapping.")
        check_options(sub, B.BOUND_OPTIONS, f"{where}.gpu_memory_utilization")
        self.memory = B.GPU_MEMORY_UTILIZATION.including(get(base, V.GPU_MEMORY)).narrowed(
            sub, where=f"{where}.gpu_memory_utilization")
        self.hardware = hardware
        self.mirror_ref = {key: get(base, key) == get(base, actor)
                           for key, actor in ((REF_TP, V.MEGATRON_TP), (REF_PP, V.MEGATRON_PP), (REF_CP, V.MEGATRON_CP))
                           if get(base, key) is not None}
        layouts = []
        for tp in range(1, hardware.gpus_per_node + 1):
            for pp in range(1, MAX_PP + 1):
                for cp in CP_CHOICES:
                    if layout_problem(tp, pp, cp, model=model, hardware=hardware, base=base) is None:
                        layouts.append(layout_name(tp, pp, cp))
        floors = rollout_memory_floors(model, hardware, base, self.memory)
        self.choices: dict[str, list[Any]] = {"layouts": layouts, "rollout_tp": list(floors)}
        for name in ("layouts", "rollout_tp"):
            asked = options.get(name, self.choices[name])
            if not isinstance(asked, list) or not asked:
                raise SpaceError(f"{where}.{name}: must be a non-empty list, but got {asked!r}. List the values to try.")
            for i, value in enumerate(asked):
                if value not in self.choices[name]:
                    raise SpaceError(f"{where}.{name}[{i}]: must be one of {self.choices[name]}, but got {value!r}. "
                                     "Pick from those.")
            self.choices[name] = [v for v in self.choices[name] if v in asked]
        self.floors = {tp: floors[tp] for tp in self.choices["rollout_tp"]}
        dp_text = ", ".join(f"{name} (DP {hardware.n_gpus // (parse_layout(name)[0] * parse_layout(name)[1] * parse_layout(name)[2])})"
                            for name in layouts[:12]) + (" …" if len(layouts) > 12 else "")
        self.lines = [
            f"systems (Megatron): {V.GPU_MEMORY} — {self.memory.describe()}",
            f"systems (Megatron): actor layouts TP×PP×CP, DP = {hardware.n_gpus} GPUs ÷ (TP·PP·CP): {dp_text}",
            "systems (Megatron): rollout TP ∈ " + ", ".join(f"{t} (memory ≥ {f:g})" for t, f in self.floors.items()),
        ]

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        tp, pp, cp = parse_layout(trial.suggest_categorical("layout", self.choices["layouts"]))
        config: Config = {V.MEGATRON_TP: tp, V.MEGATRON_PP: pp, V.MEGATRON_CP: cp}
        for key, value in ((REF_TP, tp), (REF_PP, pp), (REF_CP, cp)):
            if self.mirror_ref.get(key):
                config[key] = value
        rollout_tp = trial.suggest_categorical("rollout_tp", self.choices["rollout_tp"])
        config[V.ROLLOUT_TP] = rollout_tp
        config.update(rollout_expert_parallel(base, rollout_tp))
        # never narrowed: every point enqueued here (incumbent_params, starting_points) lies in it
        config[V.GPU_MEMORY] = trial.suggest_float("gpu_memory_utilization", self.floors[rollout_tp], self.memory.high)
        return config

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        name = layout_name(*V.megatron_layout(base))
        rollout_tp, memory = V.setting(base, V.ROLLOUT_TP), V.setting(base, V.GPU_MEMORY)
        if name not in self.choices["layouts"] or rollout_tp not in self.floors:
            return None
        if not isinstance(memory, (int, float)) or not self.floors[rollout_tp] <= memory <= self.memory.high:
            return None
        return {"layout": name, "rollout_tp": rollout_tp, "gpu_memory_utilization": float(memory)}

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        """Seed 000's layout (TP 4 × PP 2, memory 0.6) where it is valid and not the base's."""
        name = layout_name(*SEED_LAYOUT)
        own = self.incumbent_params(base)
        if n < 1 or name not in self.choices["layouts"] or (own and own["layout"] == name):
            return []
        rollout_tp = V.setting(base, V.ROLLOUT_TP)
        if rollout_tp not in self.floors:
            rollout_tp = self.choices["rollout_tp"][0]
        memory = min(self.memory.high, max(self.floors[rollout_tp], 0.6))
        return [{"layout": name, "rollout_tp": rollout_tp, "gpu_memory_utilization": memory}]

    def explain(self) -> list[str]:
        return list(self.lines)


def systems_space(*, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm, base: Config,
                  options: Mapping[str, Any], where: str = "") -> Space:
    """The systems stage for the base's engine: FSDP's or Megatron's; veomni and torchtitan
    lay out their own meshes, which stage 0 cannot search yet (SpaceError)."""
    kind = V.engine(base)
    facts: dict[str, Any] = {"model": model, "hardware": hardware, "algorithm": algorithm}
    if kind == "megatron":
        return MegatronSystemsSpace(base=base, options=options, where=where, **facts)
    if kind != "dp":
        raise SpaceError(f"{where_or(where, 'systems')}: the systems stage searches FSDP and Megatron layouts, but the "
                         f"base config uses {V.MODEL_ENGINE}={kind}. Remove the systems stage (the learning stages run "
                         "on any engine).")
    return SystemsSpace(base=base, options=options, where=where, **facts)


systems_space.kind = MegatronSystemsSpace.kind  # type: ignore[attr-defined]  # FSDP's is the same kind
systems_space.moves = Moves.SPEED  # type: ignore[attr-defined]  # both engines' layouts move speed only
register_space(systems_space)
