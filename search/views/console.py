"""Everything a person sees while a study runs: stage headers, a study-level progress line, a
progress bar per stage, and one short line per finished trial (trial, role, η with its
interval, what differs from the incumbent — or why it stopped).

On a terminal it draws rich progress bars that log lines do not break; otherwise it prints
plain lines. Library code logs; only this module writes to the console. No line it prints is
longer than ``WIDTH`` (a probe's own output stays in the probe's log files).
"""

from __future__ import annotations

import math
import os
import re
import statistics
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping, TextIO

from rich.console import Console as RichConsole
from rich.table import Column
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from verl_sweep.search.views.text import format_params
from verl_sweep.objectives.metrics import REWARD_KEY
from verl_sweep.search.engine.events import StudyListener
from verl_sweep.search.views.progress import StudyProgress, duration as _duration

if TYPE_CHECKING:
    import optuna

    from verl_sweep.objectives.probe import Probe
    from verl_sweep.objectives.utilisation import Finding
    from verl_sweep.search.database.records import Role, StageResult
    from verl_sweep.search.spec.study_file import StageSettings

#: the longest line the console prints (a trial line, a wrapped note)
WIDTH = 120
#: how many finished trials between two study progress lines without a terminal
PLAIN_PROGRESS_EVERY = 10


#: short names of verl's keys, by the key's last name (others: ``short_name``'s rules)
_SHORT_NAMES = {
    "ppo_mini_batch_size": "mini_batch", "lr": "lr", "kl_loss_coef": "kl", "kl_coef": "kl",
    "max_num_batched_tokens": "tokens", "gpu_memory_utilization": "mem", "tensor_model_parallel_size": "tp",
    "ulysses_sequence_parallel_size": "sp", "ppo_micro_batch_size_per_gpu": "micro",
    "ppo_max_token_len_per_gpu": "max_tokens", "log_prob_micro_batch_size_per_gpu": "lp_micro",
    "log_prob_max_token_len_per_gpu": "lp_tokens", "log_prob_use_dynamic_bsz": "lp_dyn",
    "use_dynamic_bsz": "dyn_bsz", "enable_gradient_checkpointing": "ckpt", "enable_activation_offload": "offload",
    "forward_prefetch": "prefetch", "use_remove_padding": "rmpad", "free_cache_engine": "free_cache",
    "enforce_eager": "eager", "max_num_seqs": "seqs", "use_kl_loss": "use_kl", "strategy": "layout",
    "entropy_coeff": "entropy", "clip_ratio": "clip", "n": "n", "temperature": "temp",
}
_AFFIXES = re.compile(r"^(ppo_|enable_|use_)|(_per_gpu|_size|_coef|_coeff)$")


def short_name(key: str, keys: Iterable[str] = ()) -> str:
    """A short name for the dotted ``key``: its last name, shortened (``ppo_mini_batch_size``
    → ``mini_batch``), made unique among ``keys`` by as many of the names
    before it (the actor's and the reference model's sequence parallel sizes: ``actor.sp``,
    ``ref.sp``)."""
    def base(k: str) -> str:
        last = k.rsplit(".", 1)[-1]
        return _SHORT_NAMES.get(last) or _AFFIXES.sub("", last) or last

    name = base(key)
    others = [k for k in keys if k != key and base(k) == name]
    parts = key.split(".")[:-1]
    for n in range(len(parts) + 1):
        head = parts[len(parts) - n:]
        if not any(o.split(".")[:-1][-n:] == head if n else True for o in others):
            return ".".join([*head, name])
    return key


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def changed_params(overrides: Mapping[str, Any], base: Mapping[str, Any] | None, *, width: int) -> str:
    """``overrides`` that differ from the incumbent's config ``base``, short names, at most
    ``width`` characters (``+N more`` for those left out); "incumbent's config" when none differs."""
    changed = {k: v for k, v in overrides.items() if base is None or base.get(k) != v}
    if not changed:
        return "= incumbent"
    # Keys the incumbent sets first (a change of its value), then settings it leaves to verl.
    order = sorted(changed, key=lambda k: (base is not None and k not in base, short_name(k, changed)))
    items = [f"{short_name(k, changed)}={_value(changed[k])}" for k in order]
    text = ""
    for n, item in enumerate(items):
        more = len(items) - n - 1
        candidate = f"{text} {item}".strip()
        tail = f" +{more} more" if more else ""
        if len(candidate) + len(tail) > width:
            return f"{text} +{len(items) - n} more".strip()
        text = candidate
    return text


def cut(text: str, width: int) -> str:
    """``text`` on one line, at most ``width`` characters: cut at a word boundary with an
    ellipsis, never in the middle of a word."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    head = text[: width - 1]
    if " " in head:
        head = head[: head.rindex(" ")]
    return head.rstrip(" ,;:.") + "…"


class Console(StudyListener):
    """What the driver shows. On a terminal (``live``): the study's progress line, per stage
    a bar of trials done against the budget with the best η so far and an ETA from the median
    probe time, and one bar per running probe with its step and current reward; finished
    trials print one line each above the bars. Otherwise plain lines only, with the study's
    progress line at each stage's start and end and every ``PLAIN_PROGRESS_EVERY`` trials.
    ``progress``: what the study had done before this process (a resume counts on from it)."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None, quiet: bool = False,
                 progress: StudyProgress | None = None) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.quiet = quiet
        self.progress = progress
        self.rich = RichConsole(file=self.stream, force_terminal=self.live, highlight=False,
                                soft_wrap=not self.live)
        self._progress: Progress | None = None
        self._task: Any = None
        self._study_task: Any = None
        self._budget = 0
        self._stage = ""
        self._base: dict[str, Any] | None = None
        self._running: dict[int, Any] = {}  # trial number -> its probe's progress task (or None)
        self._started_at: dict[int, float] = {}
        self._durations: list[float] = []
        self._done = 0
        self._reruns = 0
        self._max_parallel = 1
        self._best: tuple[int, float] | None = None
        self._finished_here = 0

    # -- lines ---------------------------------------------------------------------------------
    def line(self, text: str) -> None:
        """One line, or (longer than ``WIDTH``) its words wrapped under its indent."""
        if self.quiet:
            return
        if len(text) > WIDTH:
            indent = text[: len(text) - len(text.lstrip())]
            text = "\n".join(textwrap.wrap(text, WIDTH, subsequent_indent=indent + "    ",
                                           break_long_words=False, break_on_hyphens=False))
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            self.rich.print(text, markup=False, highlight=False)

    def note(self, text: str) -> None:
        self.line(f"[verl-sweep] {text}")

    def progress_text(self) -> str | None:
        """The study's progress line (None without ``progress``)."""
        if self.progress is None:
            return None
        current = self._stage if self._stage in self.progress.stages and not self.progress.stages[self._stage].finished \
            else None
        return self.progress.text(current, self.study_eta_s())

    def study_eta_s(self) -> float | None:
        """Seconds until every planned probe ran, at the median probe time of this process's
        probes and the most seen running at once (None before the first finished here)."""
        if not self._durations or self.progress is None:
            return None
        left = max(0, self.progress.planned - self.progress.probes)
        return statistics.median(self._durations) * math.ceil(left / max(1, self._max_parallel))

    def _show_progress(self) -> None:
        text = self.progress_text()
        if text is not None:
            self.line(text)

    # -- stages --------------------------------------------------------------------------------
    def stage_started(self, index: int, stage: "StageSettings", base: dict[str, Any], explain: list[str],
                      budget: int) -> None:
        self.line(f"== stage {index + 1} {stage.name} ({stage.space}): up to {budget} trials")
        for text in explain:
            self.line(f"   {text}")
        self._budget = budget
        self._stage = stage.name
        self._base = dict(base)
        self._running.clear()
        self._started_at.clear()
        self._done = self._reruns = 0
        counted = self.progress.stages.get(stage.name) if self.progress is not None else None
        if counted is not None:  # a resumed stage goes on from the trials it has
            counted.budget = budget
            self._done, self._reruns = counted.done, counted.reruns
        self._max_parallel = 1
        self._best = None
        if not self.live:
            self._show_progress()
        if self.live and not self.quiet:
            self._progress = Progress(
                # fixed, unwrapped columns: a long status is cut, never the names and bars
                TextColumn("{task.description}", table_column=Column(no_wrap=True)),
                BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[status]}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
                console=self.rich, transient=True, refresh_per_second=4,
            )
            self._progress.start()
            if self.progress is not None:
                self._study_task = self._progress.add_task(f"study {self.progress.study}", total=1, status="")
            self._task = self._progress.add_task(f"stage {stage.name}", total=budget, status="")
            self._refresh_stage()

    def stage_skipped(self, name: str, result: "StageResult") -> None:
        self.line(f"== stage {name}: already finished ({result.summary})")

    def stage_finished(self, name: str, result: "StageResult") -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.progress is not None and name in self.progress.stages:
            self.progress.stages[name].finished = True
        self.line(f"== stage {name} done: {result.summary}")
        self._show_progress()

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
        if self._progress is None:
            return
        self._progress.update(self._task, completed=min(self._done, self._budget), status=self._stage_status())
        if self._study_task is not None and self.progress is not None:
            text = self.progress_text() or ""
            self._progress.update(self._study_task, total=max(1, self.progress.planned),
                                  completed=min(self.progress.probes, self.progress.planned),
                                  status=text.split(": ", 1)[-1])

    # -- trials --------------------------------------------------------------------------------
    def _base_of(self, stage: str) -> dict[str, Any] | None:
        return self._base if stage == self._stage else None

    def trial_started(self, stage: str, number: int, role: "Role", overrides: dict[str, Any]) -> None:
        self._started_at[number] = time.monotonic()
        task = None
        changes = changed_params(overrides, self._base_of(stage), width=60)
        if self._progress is not None:
            task = self._progress.add_task(f"  trial {number} ({role})", total=None, status=changes)
        self._running[number] = task
        self._max_parallel = max(self._max_parallel, len(self._running))
        if not self.live:
            head = f"[{stage}] trial {number} started ({role}): "
            self.line(head + changed_params(overrides, self._base_of(stage), width=WIDTH - len(head)))

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
        log_path: str = "",
    ) -> None:
        """``requeued``: the trial's assignment was queued again (it runs later, and counts then);
        ``log_path``: the probe's log, named on a failure (its output is never shown here)."""
        task = self._running.pop(number, None)
        if self._progress is not None and task is not None:
            self._progress.remove_task(task)
        started = self._started_at.pop(number, None)
        if started is not None and state != "failed":
            self._durations.append(time.monotonic() - started)
        from verl_sweep.search.database.records import Role

        stage = study.study_name.split(".", 1)[-1]
        counted = self.progress.stage_of(study.study_name) if self.progress is not None else None
        here = stage == self._stage or self.progress is None  # the stage bar's, or (run ahead) not
        if role == Role.RERUN:
            if here:
                self._reruns += 1
            if counted is not None:
                counted.reruns += 1
        elif not requeued:  # a trial queued again runs later and counts then
            if here:
                self._done += 1
            if counted is not None:
                counted.done += 1
        self._finished_here += 1
        best = None
        if not self.quiet:  # one read of the study, for text someone sees
            best, gpu_s = _best_and_gpu(study)
            if counted is not None:
                counted.gpu_s = gpu_s
        head = f"[{stage}] trial {number} {role}"
        if eta is not None:
            if best is not None and here:
                self._best = best
            ci = f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
            text = f"{head} η {eta:.3f}{ci}"
            mark = " · best so far" if best is not None and best[0] == number else ""
            changes = changed_params(overrides, self._base_of(stage), width=WIDTH - len(text) - len(mark) - 2)
            self.line(f"{text}  {changes}{mark}")
        elif state == "complete" and not reason:  # a run with no η (the train mode's continuation)
            self.line(f"{head} complete")
        else:
            text = f"{head} {state}: "
            self.line(text + cut(reason or "no reason recorded", WIDTH - len(text)))
            if state == "failed" and log_path:
                self.line(f"    log: {_relative(log_path)}")
        if not self.live and self._finished_here % PLAIN_PROGRESS_EVERY == 0:
            self._show_progress()
        self._refresh_stage()


def _relative(path: str) -> str:
    """``path`` from the working directory when it is below it (shorter to read and copy)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def _best_and_gpu(study: "optuna.Study") -> tuple[tuple[int, float] | None, float]:
    """The best candidate or re-run so far (number, η), and the GPU-seconds the stage's probes
    held: one read of the study."""
    from optuna.trial import TrialState

    from verl_sweep.search.database.records import Role, records

    trials = records(study.get_trials(deepcopy=False))
    gpu_s = sum(float(t.probe.get("gpu_time_s") or 0.0) for t in trials)
    # Candidates and their re-runs: an incumbent run's η is against the runs before it (1.022
    # for the second of two), which says nothing about what beats the incumbent.
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None and t.role is not Role.INCUMBENT]
    if not done:
        return None, gpu_s
    best = max(done, key=lambda t: t.value)  # type: ignore[arg-type,return-value]
    return (best.number, float(best.value)), gpu_s  # type: ignore[arg-type]


def print_status_table(data: dict[str, Any], *, trials: bool = False) -> None:
    """``verl-sweep status``: the stages as a table that fits 80 columns, each stage's decision,
    in train mode the chain (``verl_sweep.search.views.train.chain_lines``), and the top trials
    of each stage (``trials``: every trial instead), in one screen."""
    from rich import box
    from rich.console import Console as RichConsole
    from rich.table import Table

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
            _gpu_hours_cell(stage),
            f"{stage.get('gpu_hours_saved', 0.0):.1f}",
            _winner_cell(winner),
            eta,
        )
    console.print(table)
    say = lambda text: console.print(text, markup=False, soft_wrap=True)  # noqa: E731
    if data.get("overall") or data.get("cost"):  # the final config against the user's baseline, its payback
        from verl_sweep.search.views.status import cost_lines, overall_line

        for line in (overall_line(data), *cost_lines(data)):  # wrapped at a space: no number cut from its unit
            glued = re.sub(r"(\d) R\b", "\\1\0R", line)
            say("\n".join(textwrap.wrap(glued, width=max(40, console.width), subsequent_indent="  ")).replace("\0", " "))
    # Each stage's decision, and what did not complete: one line each.
    for stage in data["stages"]:
        lost = ("not completed: " + ", ".join(f"{n} {r}" for r, n in sorted(stage["reasons"].items()))
                if stage.get("reasons") else "")
        decision = f"{stage['name']}: {stage['winner']['summary']}" if stage.get("winner") else ""
        if decision and lost and len(decision) + len(lost) + 3 <= WIDTH:
            decision, lost = f"{decision} · {lost}", ""
        if decision:  # whole: its reason is the end of the sentence (the terminal wraps it)
            say(decision)
        for text in (lost and f"  {stage['name']}: {lost}", stage.get("ended_early") and f"  {stage['ended_early']}"):
            if text:
                say(cut(text, WIDTH))
    if data.get("train"):  # train mode: the chain each learning stage carried on, the continuation, the model
        from verl_sweep.search.views.train import chain_lines

        for text in chain_lines(data):  # whole: a checkpoint's path is copied from here
            say(text)
    if trials:
        _print_trials(data, say)
        return
    top = [(stage, row) for stage in data["stages"] for row in _top_trials(stage, TOP_TRIALS)]
    if top:
        say(f"top trials (η against each stage's incumbent; up to {TOP_TRIALS} a stage):")
    for stage, row in top:
        text = f"  {stage['name']} trial {row['number']} {row['role']} η {row['eta']:.3f}"
        low, high = row.get("eta_interval") or (row["eta"], row["eta"])
        text += f" [{low:.3f}, {high:.3f}]"
        base = (stage.get("incumbent") or {}).get("config")
        say(f"{text}  {changed_params(row.get('params') or {}, base, width=WIDTH - len(text) - 2)}")
    n = sum(len(stage.get("trials", [])) for stage in data["stages"])
    say(f"{n} trials in all: `verl-sweep status {data['study']} --trials` lists each.")


def _gpu_hours_cell(stage: dict[str, Any]) -> str:
    """A stage's GPU-hours, and under them the same in R (one full run of the baseline) once known."""
    from verl_sweep.search.views.status import r_text

    text = f"{stage.get('gpu_hours', 0.0):.1f}"
    return text if stage.get("cost_r") is None else f"{text}\n{r_text(stage['cost_r'])}"


#: the best trials a stage shows in ``status`` without ``--trials``
TOP_TRIALS = 2


def _top_trials(stage: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The stage's ``n`` configs with the highest η (a candidate's or one of its re-runs')."""
    from verl_sweep.search.database.records import Role

    done = [r for r in stage.get("trials", []) if r["state"] == "complete" and r.get("eta") is not None
            and r["role"] != Role.INCUMBENT.value]
    top: list[dict[str, Any]] = []
    for row in sorted(done, key=lambda r: -r["eta"]):  # a candidate and its re-runs: one line
        if len(top) < n and all(row.get("params") != shown.get("params") for shown in top):
            top.append(row)
    return top


def _print_trials(data: dict[str, Any], say: Any) -> None:
    """``status --trials``: one line per trial, whatever the width (lines a user can grep), and
    each GPU finding once per stage."""
    from verl_sweep.objectives.utilisation import findings

    for stage in data["stages"]:
        base = (stage.get("incumbent") or {}).get("config")
        by_finding: dict[tuple[str, str], list[int]] = {}
        rows = [r for r in stage.get("trials", []) if r["state"] not in ("waiting", "skipped")]
        if rows:
            say(f"{stage['name']}:")
        for row in rows:
            found = findings(row.get("gpu") or {})
            say("  " + _trial_line(row, found, base))
            for finding in found:
                by_finding.setdefault((finding.name, finding.advice), []).append(row["number"])
        # Once per stage, not on every trial line: on a big stage the same advice repeated.
        for (what, advice), numbers in by_finding.items():
            say(f"  GPU: {what} in trial{'s' * (len(numbers) > 1)} {', '.join(map(str, numbers))}"
                + (f": {advice}" if advice else ""))


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


def _trial_line(row: dict[str, Any], found: list[Finding], base: dict[str, Any] | None = None) -> str:
    """One trial, with what differs from the incumbent's config ``base``; ``found``: its GPU
    findings (their advice is printed once per stage)."""
    text = f"trial {row['number']} {row['role']} {row['state']}"
    if row.get("eta") is not None:
        low, high = row.get("eta_interval") or (row["eta"], row["eta"])
        text += f" η {row['eta']:.3f} [{low:.3f}, {high:.3f}]"
    text += f" ({changed_params(row.get('params') or {}, base, width=10_000)})"
    if row.get("carried_from"):
        text += f", the run of {row['carried_from']} carried over"
    if row["state"] in ("pruned", "fail", "stopped") and row.get("reason"):
        text += f": {row['reason']}"
    if row.get("owner"):
        text += f", on {row['owner']}"
    gpu = row.get("gpu")
    if gpu:
        text += (f" | GPU util {gpu.get('mean_util_pct')}%, idle {100 * (gpu.get('idle_fraction') or 0):.0f}%, "
                 f"peak {gpu.get('peak_mem_gb')} GB"
                 + (": " + "; ".join(f"{f.name} ({f.measured})" for f in found) if found else ""))
    return text
