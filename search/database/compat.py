"""Studies stored by earlier releases of verl-sweep, read here and nowhere else.

A stage's result stored by release 0de9162 or earlier holds its decision as a sentence only,
and a trial closed as wasted by a still earlier release says so in its reason's first word
instead of in ``closed_as``. These readers turn such records into what this release stores, once, where
they are read (``verl_sweep.search.database.records``); no other code reads a decision or a reason's text.
``tests/search/database/test_stored_compat.py`` reads a database made by release 0de9162 through them.
"""

from __future__ import annotations

from typing import Any, Mapping

#: how the sentences of the releases up to 0de9162 began, per decision (in the order they
#: are tried; a result with a winner is a win, one that says none of these was undecided)
_DECISION_HEADS = (
    ("kept the incumbent", "kept"),
    ("slow start", "slow start"),
    ("skipped", "skipped"),
    ("no significant gain", "undecided"),
)
#: a trial those releases closed as wasted: its reason began with this
_WASTED_HEAD = "wasted: "


def stage_result_fields(stored: Mapping[str, Any]) -> dict[str, Any]:
    """``StageResult``'s fields of a result stored as {stage, winner_trial, eta, eta_low,
    eta_high, decision (a sentence), config, overrides}: the sentence becomes the summary, the
    decision is read off it."""
    text = str(stored.get("decision") or "")
    return {**stored, "decision": decision_of(text, winner_trial=stored.get("winner_trial")), "summary": text}


def decision_of(text: str, *, winner_trial: int | None) -> str:
    """The ``Decision`` value of a stored sentence."""
    if winner_trial is not None:
        return "won on balance" if " on balance" in text else "won"
    return next((decision for head, decision in _DECISION_HEADS if text.startswith(head)), "undecided")


def close_of(closed_as: str | None, reason: str | None) -> tuple[str | None, str | None]:
    """(``CloseReason`` value or None, reason) of a trial: one closed as wasted before
    ``closed_as`` was stored is read as such; the old reasons' head is dropped (the close
    reason says it)."""
    if reason is not None and reason.startswith(_WASTED_HEAD) and closed_as in (None, "wasted"):
        return "wasted", reason[len(_WASTED_HEAD):]
    return closed_as, reason
