"""Everything a person sees while a study runs: stage headers, a progress bar per stage, and
one line per finished trial in Optuna's "Trial N finished with value … Best is trial K" form.

On a terminal it draws rich progress bars that log lines do not break; otherwise it prints
plain lines. Library code logs; only this module writes to the console.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    import optuna

    from objectives.probe import Probe
    from search.driver import StageResult
    from search.study_file import StageSettings


def format_params(overrides: dict[str, Any]) -> str:
    if not overrides:
        return "baseline"
    parts = []
    for key, value in sorted(overrides.items()):
        short = key.split(".")[-1]
        parts.append(f"{short}={value:.4g}" if isinstance(value, float) else f"{short}={value}")
    return ", ".join(parts)


class Console:
    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None, quiet: bool = False) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.quiet = quiet
        self.rich = RichConsole(file=self.stream, force_terminal=self.live, highlight=False,
                                soft_wrap=not self.live)
        self._progress: Progress | None = None
        self._task: Any = None
        self._budget = 0
        self._running: dict[int, str] = {}

    # -- lines ---------------------------------------------------------------------------------
    def line(self, text: str) -> None:
        if self.quiet:
            return
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            self.rich.print(text, markup=False, highlight=False)

    def note(self, text: str) -> None:
        self.line(f"[verl-sweep] {text}")

    # -- stages --------------------------------------------------------------------------------
    def stage_started(self, index: int, stage: "StageSettings", base: dict[str, Any], explain: list[str],
                      budget: int) -> None:
        self.line(f"== stage {index + 1} {stage.name} ({stage.space}): up to {budget} trials")
        for text in explain:
            self.line(f"   {text}")
        self._budget = budget
        if self.live and not self.quiet:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
                console=self.rich, transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(stage.name, total=budget, status="")

    def stage_skipped(self, name: str, result: "StageResult") -> None:
        self.line(f"== stage {name}: already finished ({result.decision})")

    def stage_finished(self, name: str, result: "StageResult") -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self.line(f"== stage {name} done: {result.decision}")

    # -- trials --------------------------------------------------------------------------------
    def trial_started(self, stage: str, number: int, role: str, overrides: dict[str, Any]) -> None:
        self._running[number] = ""
        if not self.live:
            self.line(f"[{stage}] trial {number} started ({role}): {format_params(overrides)}")

    def trial_progress(self, stage: str, number: int, probe: "Probe") -> None:
        if self._progress is None or probe.follower is None:
            return
        series = probe.follower.series
        reward = series[-1].data.get("critic/score/mean") if series else None
        reward_text = "—" if reward is None else f"{reward:.3f}"
        self._running[number] = f"t{number}: step {probe.follower.last_step} R {reward_text}"
        self._progress.update(self._task, status="  ".join(self._running.values()))

    def trial_finished(
        self,
        study: "optuna.Study",
        number: int,
        role: str,
        overrides: dict[str, Any],
        *,
        eta: float | None = None,
        interval: tuple[float, float] | None = None,
        state: str = "complete",
        reason: str = "",
        stderr_tail: str = "",
    ) -> None:
        self._running.pop(number, None)
        if self._progress is not None:
            self._progress.advance(self._task)
        params = format_params(overrides)
        if eta is not None:
            best = _best_trial(study)
            best_text = f" Best is trial {best[0]} with η {best[1]:.3f}." if best else ""
            ci = f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
            self.line(f"[{study.study_name}] Trial {number} ({role}) finished with η {eta:.3f}{ci} "
                      f"and parameters: {params}.{best_text}")
        else:
            self.line(f"[{study.study_name}] Trial {number} ({role}) {state}: {reason}. Parameters: {params}.")
            for text in stderr_tail.strip().splitlines()[-5:]:
                self.line(f"    | {text}")


def _best_trial(study: "optuna.Study") -> tuple[int, float] | None:
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    if not done:
        return None
    best = max(done, key=lambda t: t.value)  # type: ignore[arg-type,return-value]
    return best.number, float(best.value)  # type: ignore[arg-type]
