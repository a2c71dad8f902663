"""A study's progress as the console shows it: stages decided of all, probes run of planned,
GPU-hours spent of estimated. Counted from the database when a driver starts
(``verl_sweep.search.views.status.study_progress``: a resumed study goes on from what it had done), then
updated by the console per event."""

from __future__ import annotations


class StageCount:
    """One stage's share of the study's progress: trials that count against its budget,
    re-runs, GPU-seconds its probes held, and whether it is decided."""

    def __init__(self, budget: int, *, done: int = 0, reruns: int = 0, gpu_s: float = 0.0,
                 finished: bool = False) -> None:
        self.budget, self.done, self.reruns, self.gpu_s, self.finished = budget, done, reruns, gpu_s, finished

    @property
    def probes(self) -> int:
        return self.done + self.reruns

    @property
    def planned(self) -> int:
        """Probes this stage runs: what it ran once decided, else at least its budget."""
        return self.probes if self.finished else max(self.budget, self.done) + self.reruns


class StudyProgress:
    """The whole study's progress: stages decided of all, probes run of planned, GPU-hours
    spent of estimated. Built from the database (``verl_sweep.search.views.status.study_progress``) so that a
    resumed study goes on counting from what it had done; the console updates it per event."""

    def __init__(self, study: str, stages: dict[str, StageCount], *, simulated: bool = False) -> None:
        self.study, self.stages, self.simulated = study, stages, simulated

    def stage_of(self, study_name: str) -> StageCount | None:
        """The stage of the Optuna study ``<study>.<stage>``."""
        return self.stages.get(study_name[len(self.study) + 1:]) if study_name.startswith(self.study + ".") else None

    @property
    def probes(self) -> int:
        return sum(s.probes for s in self.stages.values())

    @property
    def planned(self) -> int:
        return sum(s.planned for s in self.stages.values())

    def gpu_hours(self) -> tuple[float, float | None]:
        """GPU-hours spent, and the estimated total (spent + the probes left at the mean cost of
        those run; None before any probe ran)."""
        spent = sum(s.gpu_s for s in self.stages.values()) / 3600.0
        probes = self.probes
        if not probes or not spent:
            return spent, None
        return spent, spent + (self.planned - probes) * spent / probes

    def text(self, current: str | None, eta_s: float | None) -> str:
        """``study demo: stage 2/6 tokens · probes 85/126 · GPU-h 412 of ~610 (estimate) · ETA 0:01:02``"""
        names = list(self.stages)
        k = names.index(current) + 1 if current in names else sum(s.finished for s in self.stages.values())
        spent, total = self.gpu_hours()
        gpu = f"GPU-h {spent:,.1f}" + (f" of ~{total:,.0f} (estimate)" if total is not None else "")
        parts = [f"stage {k}/{len(names)} {current}" if current else f"{k}/{len(names)} stages done",
                 f"probes {self.probes}/{self.planned}", gpu + (" SIMULATED" if self.simulated else "")]
        if eta_s is not None:
            parts.append(f"ETA {duration(eta_s)}")
        return f"study {self.study}: " + " · ".join(parts)


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
