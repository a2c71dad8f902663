"""Refusals made before any probe runs, on every launcher: the baseline must fit the GPU's memory.
``validate`` and ``run`` report them, ``resume`` and ``worker`` check them first, and the driver
keeps the check as the library's own guard."""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl_sweep.search.spec.errors import BadInputError

if TYPE_CHECKING:
    from verl_sweep.search.spec.study_file import StudySpec

MEMORY_REMEDY = ("Lower the memory fraction or the micro-batch, switch gradient checkpointing or offload on, or "
                 "declare larger GPUs (hardware.gpu_memory_gb).")


def memory_refusal(spec: StudySpec) -> str | None:
    """The memory pre-flight's refusal of a study, on every launcher (a simulator's too): its
    baseline's estimated peak exceeds the GPU's memory, and its bf16 weights do not fit even
    vLLM's share (``verl_sweep.verl_knowledge.memory.fit_limit_gb``: where they do, the estimate is known to be
    short for the run, LoRA, offload or MoE, and the baseline is the user's own run). One line
    naming the phase that sets the peak and its arithmetic; None when it fits or has no
    estimate. The one check of ``validate`` and ``run`` (``validate_study``), ``resume`` and
    ``worker`` (``check_memory``, at the start of ``StudyRunner.run``)."""
    from verl_sweep.verl_knowledge import fit_limit_gb, over_limit_problem

    base = spec.baseline_config()
    problem = over_limit_problem(spec.model, spec.hardware, base,
                                 limit_gb=fit_limit_gb(spec.model, spec.hardware, base))
    return None if problem is None else f"baseline: {problem}. {MEMORY_REMEDY}"


def check_memory(spec: StudySpec) -> None:
    """``memory_refusal`` as an error: BadInputError (one line, exit 2) before any probe starts."""
    refusal = memory_refusal(spec)
    if refusal is not None:
        raise BadInputError(refusal)
