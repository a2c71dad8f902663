"""Stage 0 of the method: the parallel layout and memory knobs, scored on speed.

One module per job: ``choices`` (what each knob may take for the model, hardware and base),
``knobs`` (the Optuna parameter names and the table that builds and reads them), ``suggest``
(asking the sampler; the incumbent's point), ``starts`` (starting points), ``follow_ups``
(the closing pattern search), ``fitting`` (the memory estimate), ``keys`` (the keys it sets
and what a config means for one it leaves unset); ``space`` composes them into ``SystemsSpace``.
"""

from __future__ import annotations

from verl_sweep.spaces.systems.choices import (
    LOG_PROB_TOKEN_FACTORS, MAX_NUM_SEQS_CHOICES, MAX_TOKEN_LEN_CHOICES, MICRO_BATCH_CHOICES, SystemsChoices)
from verl_sweep.spaces.systems.fitting import FIT_HEADROOM
from verl_sweep.spaces.systems.keys import (
    DEPRECATED_CRITIC_MICRO, DEPRECATED_LOG_PROB_MICRO, DEPRECATED_MICRO, ENFORCE_EAGER, FREE_CACHE_ENGINE,
    MAX_NUM_SEQS, REF_LOG_PROB_DYNAMIC, REF_LOG_PROB_MICRO, REF_LOG_PROB_TOKENS, ROLLOUT_LOG_PROB_DYNAMIC,
    ROLLOUT_LOG_PROB_MICRO, ROLLOUT_LOG_PROB_TOKENS, effective, rollout_expert_parallel)
from verl_sweep.spaces.systems.knobs import Knob, KnobTable
from verl_sweep.spaces.systems.space import SystemsSpace

__all__ = [
    "DEPRECATED_CRITIC_MICRO", "DEPRECATED_LOG_PROB_MICRO", "DEPRECATED_MICRO", "ENFORCE_EAGER",
    "FIT_HEADROOM", "FREE_CACHE_ENGINE", "LOG_PROB_TOKEN_FACTORS", "MAX_NUM_SEQS", "MAX_NUM_SEQS_CHOICES",
    "MAX_TOKEN_LEN_CHOICES", "MICRO_BATCH_CHOICES", "REF_LOG_PROB_DYNAMIC", "REF_LOG_PROB_MICRO",
    "REF_LOG_PROB_TOKENS", "ROLLOUT_LOG_PROB_DYNAMIC", "ROLLOUT_LOG_PROB_MICRO", "ROLLOUT_LOG_PROB_TOKENS",
    "Knob", "KnobTable", "SystemsChoices", "SystemsSpace", "effective", "rollout_expert_parallel",
]
