"""What happens in a study, as the driver tells it: the events a listener follows.

The console shows them (``verl_sweep.search.views.console.Console``); a benchmark traces them (the GPU-hours
spent when each stage decides); a tracker may log them. The driver, its stage loops and its
trial runners tell one ``StudyListener``; ``Broadcast`` hands every event to several.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import optuna

    from verl_sweep.objectives.probe import Probe
    from verl_sweep.search.database.records import Role, StageResult
    from verl_sweep.search.spec.study_file import StageSettings


class StudyListener:
    """Every event of a study, each doing nothing here: override the ones you follow."""

    def note(self, text: str) -> None:
        """Something worth a line (a resume, runs carried over, re-runs queued)."""

    def stage_started(self, index: int, stage: StageSettings, base: dict[str, Any], explain: list[str],
                      budget: int) -> None:
        """Stage ``index`` starts (or this process starts following it) from the config ``base``."""

    def stage_skipped(self, name: str, result: StageResult) -> None:
        """A stage decided before (a resume, another worker): its stored result."""

    def stage_finished(self, name: str, result: StageResult) -> None:
        """A stage decided (or was skipped by ``stop_when_flat``)."""

    def trial_started(self, stage: str, number: int, role: Role, overrides: dict[str, Any]) -> None:
        """A trial's run started."""

    def trial_progress(self, stage: str, number: int, probe: Probe) -> None:
        """A running trial's probe was polled."""

    def trial_finished(self, study: optuna.Study, number: int, role: Role, overrides: dict[str, Any], *,
                       eta: float | None = None, interval: tuple[float, float] | None = None,
                       state: str = "complete", reason: str = "", requeued: bool = False,
                       stderr_tail: str = "", log_path: str = "") -> None:
        """A trial was told: complete with its η, pruned, or failed (``requeued``: its
        assignment was queued again; ``log_path``: its probe's log)."""


class Broadcast(StudyListener):
    """Hands every event to each of ``listeners`` in turn."""

    def __init__(self, *listeners: StudyListener) -> None:
        self.listeners = listeners

    def note(self, text: str) -> None:
        for listener in self.listeners:
            listener.note(text)

    def stage_started(self, index: int, stage: StageSettings, base: dict[str, Any], explain: list[str],
                      budget: int) -> None:
        for listener in self.listeners:
            listener.stage_started(index, stage, base, explain, budget)

    def stage_skipped(self, name: str, result: StageResult) -> None:
        for listener in self.listeners:
            listener.stage_skipped(name, result)

    def stage_finished(self, name: str, result: StageResult) -> None:
        for listener in self.listeners:
            listener.stage_finished(name, result)

    def trial_started(self, stage: str, number: int, role: Role, overrides: dict[str, Any]) -> None:
        for listener in self.listeners:
            listener.trial_started(stage, number, role, overrides)

    def trial_progress(self, stage: str, number: int, probe: Probe) -> None:
        for listener in self.listeners:
            listener.trial_progress(stage, number, probe)

    def trial_finished(self, study: optuna.Study, number: int, role: Role, overrides: dict[str, Any], *,
                       eta: float | None = None, interval: tuple[float, float] | None = None,
                       state: str = "complete", reason: str = "", requeued: bool = False,
                       stderr_tail: str = "", log_path: str = "") -> None:
        for listener in self.listeners:
            listener.trial_finished(study, number, role, overrides, eta=eta, interval=interval, state=state,
                                    reason=reason, requeued=requeued, stderr_tail=stderr_tail, log_path=log_path)
