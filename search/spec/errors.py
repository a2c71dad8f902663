"""The root exception of the driver package; the CLI maps each kind to an exit code."""

from __future__ import annotations

import time
from collections.abc import Callable


class SweepError(Exception):
    """Root of verl-sweep's expected errors. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class BadInputError(SweepError):
    """The user's input (study file, option, name) is wrong: exit 2, database untouched."""

    exit_code = 2


class StudyNotFoundError(BadInputError):
    """No study of that name in the database (a worker may wait for it: ``--wait``)."""


class StorageError(SweepError):
    """The study database cannot be reached or used; the message carries the real cause."""

    exit_code = 1


class Interrupted(SweepError):
    """The driver was asked to stop (Ctrl-C, SIGTERM: ``why``); its trials were re-queued."""

    exit_code = 130

    def __init__(self, why: str) -> None:
        super().__init__(f"stopped by {why}")
        self.why = why


def never_stopped() -> str | None:
    """The ``stop_requested`` of a caller nothing asks to stop: why it was asked (never)."""
    return None


def pause(seconds: float, stop_requested: Callable[[], str | None] = never_stopped) -> None:
    """Sleep ``seconds``; raises Interrupted as soon as ``stop_requested`` gives a reason (a
    SIGTERM must not wait out a minute's back-off)."""
    deadline = time.monotonic() + seconds
    while not (why := stop_requested()):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(0.2, left))
    raise Interrupted(why)
