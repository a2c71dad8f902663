"""``SystemsSpace``: stage 0 of the method under FSDP, composed of its parts (the choices,
suggesting, starting points, follow-ups, memory fitting)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from verl_sweep.spaces.base import Moves, Space, where_or
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.verl_knowledge import Config
from verl_sweep.spaces.systems import suggest as ask
from verl_sweep.spaces.systems.choices import LISTS, OPTIONS, declare
from verl_sweep.spaces.systems.fitting import MemoryFit
from verl_sweep.spaces.systems.follow_ups import PatternSearch
from verl_sweep.spaces.systems.starts import starting_points

if TYPE_CHECKING:
    import optuna


class SystemsSpace(Space):
    """Stage 0: the parallel layout and memory knobs (docs/method.md §2); speed only.

    Conditional, so only valid combinations are asked: the dynamic-batch token limit only with
    dynamic batching (and per Ulysses size, so that limit × ulysses ≥ prompt + response always
    holds), static micro-batches only without it (per Ulysses size, dividing the per-GPU
    batch), rollout TP and Ulysses sizes only among the values that fit the heads, the GPUs,
    the base's mini-batch and the token budget. A knob with one valid value (the layout on one
    GPU) is set, not asked: a sampler would spend nothing on it, and a reader of the trial sees
    only what was searched.

    Besides the layout, what decides a small model's step time is host work per pass: the
    micro-batches of the update and the log-prob passes (or dynamic batching with token limits
    for each), swept by default where the layout has one choice. vLLM's sequences per batch,
    CUDA graphs (``enforce_eager``) and whether the engine frees its cache between phases are
    swept when the stage lists them.
    """

    kind = "systems"
    moves = Moves.SPEED
    tries_template = True
    #: the stage ends with a local search around the sampler's leader (``follow_up_points``)
    n_follow_ups = 16
    follow_ups_per_round = 4
    follow_ups_last = True
    LISTS = LISTS
    OPTIONS = OPTIONS

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        self.declared = d = declare(model=model, hardware=hardware, algorithm=algorithm, base=base,
                                    options=options, where=where_or(where, "systems"))
        # what other code reads of a systems space
        self.model, self.hardware, self.algorithm, self.hardware_tag = model, hardware, algorithm, d.hardware_tag
        self.memory, self.floors, self.lines = d.memory, d.floors, d.lines
        self.choices, self.token_lens = d.choices, d.token_lens
        self.micro_choices, self.log_prob_choices = d.micro_choices, d.log_prob_choices
        self.fit = MemoryFit(d, self.suggest)
        self.pattern_search = PatternSearch(d, self.fit)

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        return ask.suggest(self.declared, trial, base, fits_memory=self.fits_memory)

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        return ask.incumbent_params(self.declared, base)

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        return starting_points(self.declared, self.fit, self.incumbent_params(base), base, n)

    def follow_up_points(self, base: Config, readings: Sequence[tuple[dict[str, Any], float]],
                         n: int) -> list[dict[str, Any]]:
        return self.pattern_search.points(base, readings, n)

    def fitted(self, params: dict[str, Any], base: Config) -> dict[str, Any] | None:
        return self.fit.fitted(params, base) if self.fits_memory else params

    def explain(self) -> list[str]:
        return list(self.lines)
