"""The root exception of the driver package; the CLI maps each kind to an exit code."""

from __future__ import annotations


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
