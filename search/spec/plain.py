"""Free-form study-file values (launcher options, space params): what can be stored in the
database and read back as it was written."""

from __future__ import annotations

import math
from typing import Any


def plain_problem(value: Any) -> str | None:
    """Why a free-form value (launcher options, space params) cannot be stored and read back
    as it was written, or None: a non-finite number (JSON stores it as null, and the study could
    then never be resumed) or an integer beyond 64 bits."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return f"must be a finite number, but got {item}"
        if isinstance(item, int) and not isinstance(item, bool) and abs(item) > 2**63 - 1:
            return f"must fit in 64 bits, but got {short(item)}"
        if isinstance(item, dict):
            stack.extend(item.values())
            if not all(isinstance(k, str) for k in item):
                return f"keys must be strings, but got {short(next(k for k in item if not isinstance(k, str)))}"
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif not isinstance(item, (str, int, float, bool, type(None))):
            return f"must be a number, string, list or mapping, but got {type(item).__name__}"
    return None


def check_plain(values: dict[str, Any]) -> dict[str, Any]:
    for key, value in values.items():
        problem = plain_problem(value)
        if problem:
            raise ValueError(f"{key}: {problem}")
    return values


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
