"""How the views write numbers and configs: a cost in R, a trial's changes, a rounded value."""

from __future__ import annotations

from typing import Any, Iterable


def r_number(r: float) -> str:
    """A cost in R (full runs of the baseline) as printed: 12, 6.7, 0.31, 0.042 (two significant
    figures under 1)."""
    if abs(r) >= 10:
        return f"{r:,.0f}"
    return f"{r:.1f}" if abs(r) >= 1 else f"{r:.2g}"


def r_text(r: float) -> str:
    """``r_number`` with its unit: 6.7 R."""
    return f"{r_number(r)} R"


def format_params(overrides: dict[str, Any]) -> str:
    if not overrides:
        return "baseline"
    parts = []
    for key, value in sorted(overrides.items()):
        short = _shortest_unique_suffix(key, overrides)
        parts.append(f"{short}={value:.4g}" if isinstance(value, float) else f"{short}={value}")
    return ", ".join(parts)


def _shortest_unique_suffix(key: str, keys: Iterable[str]) -> str:
    """The key's last name, or as many more as tell it apart from the others (the actor's and
    the reference model's ``ulysses_sequence_parallel_size`` are both in the systems stage)."""
    parts = key.split(".")
    for n in range(1, len(parts)):
        suffix = ".".join(parts[-n:])
        if not any(other != key and (other == suffix or other.endswith("." + suffix)) for other in keys):
            return suffix
    return key


SIGNIFICANT_DIGITS = 4


def rounded(value: Any) -> Any:
    """``value`` with a float cut to ``SIGNIFICANT_DIGITS`` (ints, booleans and text as they are)."""
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    if isinstance(value, list):
        return [rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value
