"""Everything a person sees while a study runs: stage headers, a progress bar per stage, and
one line per finished trial in Optuna's "Trial N finished with value … Best is trial K" form.

On a terminal it draws rich progress bars that log lines do not break; otherwise it prints
plain lines. Library code logs; only this module writes to the console.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, Iterable, TextIO

from rich.console import Console as RichConsole
from rich.table import Column
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from objectives.metrics import REWARD_KEY
from search.events import StudyListener

if TYPE_CHECKING:
    import optuna

    from objectives.probe import Probe
    from objectives.utilisation import Finding
    from search.records import Role, StageResult
    from search.study_file import StageSettings


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


class Console(StudyListener):
    """What the driver shows. On a terminal (``live``): per stage a bar of trials done against
    the budget with the best η so far and an ETA from the median probe time, and one bar per
    running probe with its step and current reward; finished trials print one line each above
    the bars. Otherwise plain lines only. The driver calls the public methods below."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None, quiet: bool = False) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.quiet = quiet
        self.rich = RichConsole(file=self.stream, force_terminal=self.live, highlight=False,
                                soft_wrap=not self.live)
        self._progress: Progress | None = None
        self._task: Any = None
        self._budget = 0
        self._stage = ""
        self._running: dict[int, Any] = {}  # trial number -> its probe's progress task (or None)
        self._started_at: dict[int, float] = {}
        self._durations: list[float] = []
        self._done = 0
        self._reruns = 0
        self._max_parallel = 1
        self._best: tuple[int, float] | None = None

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
        self._stage = stage.name
        self._running.clear()
        self._started_at.clear()
        self._durations = []
        self._done = self._reruns = 0
        self._max_parallel = 1
        self._best = None
        if self.live and not self.quiet:
            self._progress = Progress(
                # fixed, unwrapped columns: a long status is cut, never the names and bars
                TextColumn("{task.description}", table_column=Column(no_wrap=True)),
                BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[status]}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
                console=self.rich, transient=True, refresh_per_second=4,
            )
            self._progress.start()
            self._task = self._progress.add_task(f"stage {stage.name}", total=budget, status="")
            self._refresh_stage()

    def stage_skipped(self, name: str, result: "StageResult") -> None:
        self.line(f"== stage {name}: already finished ({result.summary})")

    def stage_finished(self, name: str, result: "StageResult") -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self.line(f"== stage {name} done: {result.summary}")

    def eta_s(self) -> float | None:
        """Seconds until the stage's budget is used: median probe time × trials left ÷ the
        most probes seen running at once (None before the first probe finished)."""
        if not self._durations:
            return None
        left = max(0, self._budget - self._done)
        return statistics.median(self._durations) * math.ceil(left / max(1, self._max_parallel))

    def _stage_status(self) -> str:
        parts = []
        if self._best is not None:
            parts.append(f"best η {self._best[1]:.3f} (trial {self._best[0]})")
        if self._reruns:
            parts.append(f"+{self._reruns} re-run{'s' if self._reruns > 1 else ''}")
        eta = self.eta_s()
        if eta is not None:
            parts.append(f"ETA {_duration(eta)}")
        return " · ".join(parts)

    def _refresh_stage(self) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=min(self._done, self._budget), status=self._stage_status())

    # -- trials --------------------------------------------------------------------------------
    def trial_started(self, stage: str, number: int, role: "Role", overrides: dict[str, Any]) -> None:
        self._started_at[number] = time.monotonic()
        task = None
        if self._progress is not None:
            task = self._progress.add_task(f"  trial {number} ({role})", total=None,
                                           status=_shorten(f"starting: {format_params(overrides)}", 60))
        self._running[number] = task
        self._max_parallel = max(self._max_parallel, len(self._running))
        if not self.live:
            self.line(f"[{stage}] trial {number} started ({role}): {format_params(overrides)}")

    def trial_progress(self, stage: str, number: int, probe: "Probe") -> None:
        task = self._running.get(number)
        if self._progress is None or task is None or probe.follower is None:
            return
        series = probe.follower.series
        reward = series[-1].data.get(REWARD_KEY) if series else None
        reward_text = "—" if reward is None else f"{reward:.3f}"
        step = probe.follower.last_step
        self._progress.update(task, total=probe.settings.steps, completed=min(step, probe.settings.steps),
                              status=f"step {step} · reward {reward_text}")

    def trial_finished(
        self,
        study: "optuna.Study",
        number: int,
        role: "Role",
        overrides: dict[str, Any],
        *,
        eta: float | None = None,
        interval: tuple[float, float] | None = None,
        state: str = "complete",
        reason: str = "",
        requeued: bool = False,
        stderr_tail: str = "",
    ) -> None:
        """``requeued``: the trial's assignment was queued again (it runs later, and counts then)."""
        task = self._running.pop(number, None)
        if self._progress is not None and task is not None:
            self._progress.remove_task(task)
        started = self._started_at.pop(number, None)
        if started is not None and state != "failed":
            self._durations.append(time.monotonic() - started)
        from search.records import Role

        if role == Role.RERUN:
            self._reruns += 1
        elif not requeued:
            self._done += 1  # a trial queued again runs later and counts then
        params = format_params(overrides)
        if eta is not None:
            best = None if self.quiet else _best_trial(study)  # a read of the study, for text no one sees
            if best is not None:
                self._best = best
            best_text = f" Best is trial {best[0]} with η {best[1]:.3f}." if best else ""
            ci = f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
            self.line(f"[{study.study_name}] Trial {number} ({role}) finished with η {eta:.3f}{ci} "
                      f"and parameters: {params}.{best_text}")
        else:
            self.line(f"[{study.study_name}] Trial {number} ({role}) {state}: {reason}. Parameters: {params}.")
            for text in stderr_tail.strip().splitlines()[-5:]:
                self.line(f"    | {text}")
        self._refresh_stage()


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _best_trial(study: "optuna.Study") -> tuple[int, float] | None:
    from optuna.trial import TrialState

    from search.records import Role, role_of

    # Candidates and their re-runs: an incumbent run's η is against the runs before it (1.022
    # for the second of two), which says nothing about what beats the incumbent.
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None and role_of(t) is not Role.INCUMBENT]
    if not done:
        return None
    best = max(done, key=lambda t: t.value)  # type: ignore[arg-type,return-value]
    return best.number, float(best.value)  # type: ignore[arg-type]


def print_status_table(data: dict[str, Any]) -> None:
    """``verl-sweep status``: the stages as a table that fits 80 columns, then one line per trial."""
    from rich import box
    from rich.console import Console as RichConsole
    from rich.table import Table

    from objectives.utilisation import findings

    console = RichConsole(highlight=False)
    # No vertical rules, and no number broken in two: in 80 columns a winner such as
    # "lr=4.997e-06" stays whole, the counts and the winner wrap between words, and η's
    # interval goes under η.
    table = Table(title=f"study {data['study']} ({data['algorithm']})", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)
    for column in ("stage", "state", "trials", "GPU-h", "GPU-h\nsaved", "winner", "η [90% interval]"):
        words = column in ("trials", "winner")
        table.add_column(column, no_wrap=not words, min_width=12 if column == "winner" else None)
    interval_apart = "\n" if console.width < 100 else " "
    for stage in data["stages"]:
        counts = stage.get("counts", {})
        winner = stage.get("winner") or {}
        eta = (f"{winner['eta']:.3f}{interval_apart}[{winner['eta_low']:.3f}, {winner['eta_high']:.3f}]"
               if winner else "—")
        table.add_row(
            stage["name"], stage["state"],
            "\n".join(f"{n} {s}" for s, n in sorted(counts.items())) or "—",
            f"{stage.get('gpu_hours', 0.0):.1f}",
            f"{stage.get('gpu_hours_saved', 0.0):.1f}",
            _winner_cell(winner),
            eta,
        )
    console.print(table)
    # One line per trial, whatever the width: lines a user can grep.
    for stage in data["stages"]:
        if stage.get("winner"):
            console.print(f"{stage['name']}: {stage['winner']['summary']}", markup=False, soft_wrap=True)
        if stage.get("ended_early"):
            console.print(f"  {stage['ended_early']}", markup=False, soft_wrap=True)
        if stage.get("reasons"):
            console.print("  trials not completed: " + ", ".join(f"{n} {r}" for r, n in sorted(stage["reasons"].items())),
                          markup=False, soft_wrap=True)
        by_finding: dict[tuple[str, str], list[int]] = {}
        for row in stage.get("trials", []):
            if row["state"] in ("waiting", "skipped"):
                continue
            found = findings(row.get("gpu") or {})
            console.print("  " + _trial_line(row, found), markup=False, soft_wrap=True)
            for finding in found:
                by_finding.setdefault((finding.name, finding.advice), []).append(row["number"])
        # Once per stage, not on every trial line: on a big stage the same advice repeated.
        for (what, advice), numbers in by_finding.items():
            console.print(f"  GPU: {what} in trial{'s' * (len(numbers) > 1)} {', '.join(map(str, numbers))}"
                          + (f": {advice}" if advice else ""), markup=False, soft_wrap=True)


#: the longest one-word winner the status table shows whole in 80 columns (else its trial)
MAX_ONE_WORD_WINNER = 16


def _winner_cell(winner: dict[str, Any]) -> str:
    """The winner's changes, or only its trial number when they would not fit in a column (a
    systems winner changes ~10 keys; its trial's line below the table lists them)."""
    if not winner:
        return "—"
    if winner.get("winner_trial") is None:
        return "incumbent"
    changes = format_params(winner.get("overrides", {}))
    # Words wrap, but one long word (ppo_mini_batch_size=408) would be cut in 80 columns.
    if len(changes) <= 40 and (" " in changes or len(changes) <= MAX_ONE_WORD_WINNER):
        return changes
    n = len(winner["overrides"])
    return f"trial {winner['winner_trial']} ({n} change{'s' * (n > 1)})"


def _trial_line(row: dict[str, Any], found: list[Finding]) -> str:
    """One trial; ``found``: its GPU findings (their advice is printed once per stage)."""
    text = f"trial {row['number']} {row['role']} {row['state']}"
    if row.get("eta") is not None:
        low, high = row.get("eta_interval") or (row["eta"], row["eta"])
        text += f" η {row['eta']:.3f} [{low:.3f}, {high:.3f}]"
    text += f" ({format_params(row.get('params') or {})})"
    if row.get("carried_from"):
        text += f", the run of {row['carried_from']} carried over"
    if row["state"] in ("pruned", "fail") and row.get("reason"):
        text += f": {row['reason']}"
    if row.get("owner"):
        text += f", on {row['owner']}"
    gpu = row.get("gpu")
    if gpu:
        text += (f" | GPU util {gpu.get('mean_util_pct')}%, idle {100 * (gpu.get('idle_fraction') or 0):.0f}%, "
                 f"peak {gpu.get('peak_mem_gb')} GB"
                 + (": " + "; ".join(f"{f.name} ({f.measured})" for f in found) if found else ""))
    return text
