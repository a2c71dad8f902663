"""The systems stage's last trials: a pattern search around the config that read fastest.

Each knob one notch either way (memory ±0.05), a Ulysses or batching-mode move carrying the
batching knobs over; a move the memory estimate says no longer fits takes the batching knobs
down until it does (checkpointing off costs activation memory: with a smaller token limit
it may be faster, a pair of moves no single knob makes). Untried points only, the knob
values that read faster in the draws so far first."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from verl_sweep.verl_knowledge import Config
from verl_sweep.spaces.systems.choices import SystemsChoices
from verl_sweep.spaces.systems.fitting import MemoryFit
from verl_sweep.spaces.systems.knobs import MEMORY


class PatternSearch:
    """Proposes follow-ups from the readings so far (``Space.follow_up_points``)."""

    def __init__(self, choices: SystemsChoices, fit: MemoryFit) -> None:
        self.s = choices
        self.fit = fit

    def points(self, base: Config, readings: Sequence[tuple[dict[str, Any], float]], n: int) -> list[dict[str, Any]]:
        """Up to ``n`` untried points around the fastest finished reading."""
        finished = [(params, eta) for params, eta in readings if math.isfinite(eta) and eta > 0]
        if not finished:
            return []
        best = max(finished, key=lambda r: r[1])[0]
        tried = [params for params, _ in readings]
        # The leader ran: a point estimated no larger than it fits as well as it did.
        limit = max(self.fit.headroom_gb(), self.fit.peak_gb(best, base) or 0.0)

        def mean_eta(name: str, value: Any) -> float | None:
            etas = [eta for params, eta in finished if params.get(name) == value]
            return sum(etas) / len(etas) if etas else None

        moves: list[tuple[float, dict[str, Any]]] = []
        # A move that failed (out of memory, where the estimate let it through) again with
        # smaller passes: first, as the failure says its memory, not the move, was short. Not
        # a memory fraction's failure: the fraction's own OOM ceiling rules those out, and
        # smaller passes do not make room for a larger vLLM pool.
        batching = self.branch_of(best)
        for params, eta in readings:
            moved = [k for k in params if params.get(k) != best.get(k) and k not in batching]
            if eta == 0 and len(moved) == 1 and moved != [MEMORY] and set(params) == set(best):
                smaller = self.smaller(params, [k for k in batching if k in params])
                if smaller is not None and smaller not in tried:
                    moves.append((math.inf, smaller))
        for name, value in best.items():
            if name == MEMORY:
                continue
            values = self.s.knobs.values(name)
            if value not in values:
                continue
            here = mean_eta(name, value) or 0.0
            i = values.index(value)
            for new in (values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)):
                point = self.moved(best, name, new, base, limit)
                if point is not None and point not in tried and all(point != p for _, p in moves):
                    moves.append(((mean_eta(name, new) or here) - here, point))
        tp = best.get("rollout_tp", self.s.choices["rollout_tp"][0])
        memory = best.get(MEMORY)
        if isinstance(memory, float):
            for new_memory in (memory - 0.05, memory + 0.05):
                new_memory = round(min(self.s.memory.high, max(self.s.floors[tp], new_memory)), 3)
                point = {**best, MEMORY: new_memory}
                if new_memory != memory and point not in tried and self.fit.fits(point, base, limit_gb=limit):
                    moves.append((0.0, point))
        moves.sort(key=lambda m: -m[0])  # stable: equal estimates keep the knobs' order
        return [point for _, point in moves[:n]]

    def branch_of(self, params: Mapping[str, Any]) -> dict[str, list[Any]]:
        """The batching knobs asked at the point ``params``' Ulysses size and batching mode, and
        their valid values (a knob with one value is set, not asked)."""
        c = self.s.choices
        sp = params.get("ulysses", c["ulysses"][0])
        dynamic = params.get("use_dynamic_bsz", c["use_dynamic_bsz"][0])
        values = {name: self.s.knobs.values(name) for name in self.s.knobs.batching(sp, dynamic)}
        return {name: v for name, v in values.items() if len(v) > 1}

    def moved(self, best: dict[str, Any], name: str, new: Any, base: Config, limit_gb: float) -> dict[str, Any] | None:
        """``best`` with knob ``name`` at ``new``: the batching knobs carried to the new branch,
        the memory at least the new TP's floor, and shrunk to fit; None when nothing fits."""
        point = {**best, name: new}
        sp = point.get("ulysses", self.s.choices["ulysses"][0])
        knobs = self.branch_of(point)
        if name in ("ulysses", "use_dynamic_bsz"):
            old = {k: v for k, v in best.items() if k in self.branch_of(best)}
            for k in old:
                del point[k]
            carried = {k: v for k, v in ((self.s.knobs.moved_to(k, sp), v) for k, v in old.items())
                       if k in knobs and v in knobs[k]}
            missing = {k: values for k, values in knobs.items() if k not in carried}
            point.update(carried)
            grown = self.fit.grown(point, missing, base, limit_gb=limit_gb) if missing else point
            if grown is None:
                return None
            point = grown
        if name == "rollout_tp" and isinstance(point.get(MEMORY), float):
            point[MEMORY] = max(self.s.floors[new], point[MEMORY])
        shrinkable = [k for k in knobs if k != name and k in point]
        while not self.fit.fits(point, base, limit_gb=limit_gb):
            smaller = self.smaller(point, shrinkable)
            if smaller is None:
                return None
            point = smaller
        return point

    def smaller(self, point: dict[str, Any], knobs: Sequence[str]) -> dict[str, Any] | None:
        """``point`` with the batching knob furthest up its range a notch down (None: none can go)."""
        values = self.s.knobs.values
        lower = [(k, values(k).index(point[k])) for k in knobs if point.get(k) in values(k)]
        lower = [(k, i) for k, i in lower if i > 0 and values(k)[i - 1] is not None]
        if not lower:
            return None
        k, i = max(lower, key=lambda ki: ki[1])
        return {**point, k: values(k)[i - 1]}
