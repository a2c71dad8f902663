"""The systems stage's Optuna parameters: each one's name (as studies store it), the stage
option that lists its values, and the Ulysses size it belongs to.

Some knobs are asked once per Ulysses size, as their valid values depend on it (e.g.
``micro_batch_sp2``). Their names are built here, once, and read back through the table:
nothing else builds or parses a parameter name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

#: the memory fraction: a float, asked last
MEMORY = "gpu_memory_utilization"
#: knobs asked once per Ulysses size
PER_ULYSSES = ("ppo_max_token_len_per_gpu", "micro_batch", "log_prob_micro_batch")
#: the batching knobs of each branch: dynamic batching (token limits) or static (micro-batches)
DYNAMIC_BATCHING = ("ppo_max_token_len_per_gpu", "log_prob_token_factor")
STATIC_BATCHING = ("micro_batch", "log_prob_micro_batch")


@dataclass(frozen=True)
class Knob:
    """One Optuna parameter: its ``name``, the stage option ``key`` that lists its values, and
    the Ulysses size ``sp`` of a per-size knob (None: one knob for every size)."""

    name: str
    key: str
    sp: int | None = None

    @property
    def batching(self) -> bool:
        return self.key in DYNAMIC_BATCHING or self.key in STATIC_BATCHING


class KnobTable:
    """Every parameter the space can ask and its valid values (categorical ones; the memory
    fraction, a float, has none listed)."""

    def __init__(self, plain: Mapping[str, list[Any]], per_ulysses: Mapping[str, Mapping[int, list[Any]]],
                 sps: Iterable[int]) -> None:
        self._by_name: dict[str, Knob] = {}
        self._by_key: dict[tuple[str, int | None], Knob] = {}
        self._values: dict[str, list[Any]] = {}
        for key, values in plain.items():
            self._add(Knob(key, key), values)
        self._add(Knob(MEMORY, MEMORY), [])
        for key, by_sp in per_ulysses.items():
            for sp in sorted(set(sps) | set(by_sp)):
                self._add(Knob(f"{key}_sp{sp}", key, sp), by_sp.get(sp, []))

    def _add(self, knob: Knob, values: list[Any]) -> None:
        self._by_name[knob.name] = self._by_key[(knob.key, knob.sp)] = knob
        self._values[knob.name] = values

    def name(self, key: str, sp: int | None = None) -> str:
        """The parameter name of option ``key`` (at Ulysses size ``sp`` for a per-size knob)."""
        return self._by_key[(key, sp if key in PER_ULYSSES else None)].name

    def knob(self, name: str) -> Knob | None:
        """The knob of parameter ``name`` (None: not one of this space's)."""
        return self._by_name.get(name)

    def values(self, name: str) -> list[Any]:
        """The valid values of parameter ``name``, in their order (none: not a categorical knob
        of this space)."""
        return self._values.get(name, [])

    def batching(self, sp: int, dynamic: bool) -> list[str]:
        """The batching knobs asked under Ulysses size ``sp`` with dynamic batching on or off."""
        return [self.name(key, sp) for key in (DYNAMIC_BATCHING if dynamic else STATIC_BATCHING)]

    def moved_to(self, name: str, sp: int) -> str:
        """Parameter ``name`` at Ulysses size ``sp`` (itself when not a per-size knob)."""
        knob = self._by_name[name]
        return name if knob.sp is None else self.name(knob.key, sp)

    def __iter__(self) -> Iterator[Knob]:
        return iter(self._by_name.values())
