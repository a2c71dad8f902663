"""The systems stage's starting points: the fewest, largest passes that fit.

When host work per pass sets the pace, a step shrinks with the number of passes, and memory
is what bounds their size. Recomputation lets them grow but repeats each forward pass:
where the arithmetic, not the number of passes, sets the pace, the largest passes without
it are faster, so both are tried. Only where the layout has one choice (one GPU): there the
batching is the whole search; where layouts differ, the sampler's own first draws over
them do better."""

from __future__ import annotations

from typing import Any

from verl_sweep import verl_knowledge as V
from verl_sweep.verl_knowledge import Config
from verl_sweep.spaces.systems.choices import SystemsChoices
from verl_sweep.spaces.systems.fitting import MemoryFit


def starting_points(s: SystemsChoices, fit: MemoryFit, incumbent: dict[str, Any] | None, base: Config,
                    n: int) -> list[dict[str, Any]]:
    """Up to ``n`` points from the ``incumbent``'s layout and memory fraction: CUDA graphs
    on, vLLM's batch as large as can matter, and the largest micro-batches (static) with
    gradient checkpointing on, then off, then the largest token limits (dynamic batching)
    likewise, whose estimated peak fits (``MemoryFit.grown``)."""
    c, names = s.choices, s.knobs
    if incumbent is None or n < 1 or len(c["rollout_tp"]) > 1 or len(c["ulysses"]) > 1:
        return []
    sp = V.ulysses_size(base)
    common = {**incumbent}
    for name, value in (("activation_offload", False),
                        ("max_num_seqs", c["max_num_seqs"][-1]), ("enforce_eager", False),
                        ("free_cache_engine", True)):
        if len(c[name]) > 1 and value in c[name]:
            common[name] = value
    for stale in [k for k in common if (knob := names.knob(k)) is not None and knob.batching]:
        del common[stale]
    points: list[dict[str, Any]] = []
    for dynamic, recompute in ((False, True), (False, False), (True, True), (True, False)):
        if dynamic not in c["use_dynamic_bsz"] or recompute not in c["gradient_checkpointing"]:
            continue
        point = {**common}
        if len(c["use_dynamic_bsz"]) > 1:
            point["use_dynamic_bsz"] = dynamic
        if len(c["gradient_checkpointing"]) > 1:
            point["gradient_checkpointing"] = recompute
        knobs = {name: names.values(name) for name in names.batching(sp, dynamic)}
        grown = fit.grown(point, knobs, base)
        if grown is not None and grown != incumbent and grown not in points:
            points.append(grown)
    return points[:n]
