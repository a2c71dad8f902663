"""Follow a verl run's per-step metrics while it runs.

verl (``trainer.logger=[console,file]``) appends one JSON line per step,
``{"step": N, "data": {...}}``, to ``$VERL_FILE_LOGGER_PATH``; the file is opened "wb" at
start (so a restarted run truncates it) and NaN/inf are written as ``null``. The console
logger prints the same numbers as ``step:N - key:value - ...`` lines on stdout, which we
parse when the metrics file never appears (logger without ``file``, or storage the
orchestrator cannot read).

Contract of the values: every value in ``StepMetrics.data`` is a finite float or ``None``
(``None`` = NaN/inf, as in verl's file). Non-numeric values (strings, lists) are dropped.

Step 0 is the validation before training (``trainer.val_before_train``); it is kept apart in
``MetricsFollower.validation`` and never enters ``series``, because it has no training time
and would distort every rate computed over the series.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

logger = logging.getLogger(__name__)

Clock = Callable[[], float]

# -- verl's metric keys (0.9.1), named here once -------------------------------------------
#: the raw task score (``critic/rewards/*`` is after the in-reward KL)
REWARD_KEY = "critic/score/mean"
#: a training step's time (validation and start-up excluded)
STEP_TIME_KEY = "timing_s/step"
TOKENS_KEY = "perf/total_num_tokens"
THROUGHPUT_KEY = "perf/throughput"
GRAD_KEY = "actor/grad_norm"
KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty")
#: the in-reward KL penalty's coefficient at a step (the adaptive controller's value before it moves)
REWARD_KL_COEF_KEY = "actor/reward_kl_penalty_coeff"
LOSS_KEYS = ("actor/pg_loss", "critic/vf_loss")


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """The metrics verl logged for one training step (values finite or None)."""

    step: int
    data: Mapping[str, float | None]

    def get(self, key: str) -> float | None:
        """The value of ``key``, or None when it is missing or non-finite."""
        return self.data.get(key)


def _to_float(value: Any) -> float | None | type[_Skip]:
    """JSON value → finite float, None (null/NaN/inf) or ``_Skip`` (not a number)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        number = float(value)
        return number if math.isfinite(number) else None
    return _Skip


class _Skip:
    """Marker for values that are not numbers (dropped from ``data``)."""


def _clean(data: Mapping[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    isfinite = math.isfinite
    for key, value in data.items():
        # A plain float (most values) is converted inline: a call per value was most of the cost.
        converted = (value if isfinite(value) else None) if type(value) is float else _to_float(value)
        if converted is not _Skip:
            out[str(key)] = converted  # type: ignore[assignment]
    return out


def parse_json_line(line: str | bytes) -> StepMetrics | None:
    """One line of verl's metrics file → StepMetrics; None when it is not a valid record."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    step, data = record.get("step"), record.get("data")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    if not isinstance(data, dict):
        return None
    return StepMetrics(step=step, data=_clean(data))


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Ray appends "[repeated 3x across cluster]" to de-duplicated log lines.
_RAY_REPEAT = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")
# "step:12" at the start of the payload, after an optional "(TaskRunner pid=1) " prefix.
_CONSOLE_STEP = re.compile(r"(?:^|[\s)])step:(\d+)(?= - |\s*$)")
# np.float64(0.41), np.int64(3), tensor(0.41, device='cuda:0'), 0.41, nan, -inf, True.
_WRAPPED = re.compile(r"^(?:np\.\w+|numpy\.\w+|tensor|torch\.tensor)\((.*)\)$")


def _parse_console_value(text: str) -> float | None | type[_Skip]:
    text = text.strip()
    wrapped = _WRAPPED.match(text)
    if wrapped:
        text = wrapped.group(1).split(",")[0].strip()  # drop ", device='cuda:0'", dtype=...
    lowered = text.lower()
    if lowered in ("true", "false"):
        return 1.0 if lowered == "true" else 0.0
    try:
        number = float(text)  # accepts "nan", "inf", "-inf", "1e-3"
    except ValueError:
        return _Skip
    return number if math.isfinite(number) else None


def parse_console_line(line: str) -> StepMetrics | None:
    """One stdout line of verl's console logger → StepMetrics; None for any other line."""
    line = _RAY_REPEAT.sub("", _ANSI.sub("", line)).rstrip("\r\n")
    match = _CONSOLE_STEP.search(line)
    if match is None:
        return None
    data: dict[str, float | None] = {}
    for part in line[match.end() :].split(" - "):
        key, sep, raw = part.partition(":")
        key = key.strip()
        if not sep or not key or " " in key:
            continue
        value = _parse_console_value(raw)
        if value is not _Skip:
            data[key] = value  # type: ignore[assignment]
    if not data:
        return None  # "step:3" alone (e.g. a progress message) carries no metrics
    return StepMetrics(step=int(match.group(1)), data=data)


def merge_step(series: dict[int, dict[str, float | None]], record: StepMetrics) -> None:
    """Add ``record`` to ``series`` (step -> values). Last write wins key by key: a later line
    for the same step overrides the values it has."""
    series.setdefault(record.step, {}).update(record.data)


def ordered_steps(series: Mapping[int, Mapping[str, float | None]]) -> list[StepMetrics]:
    """``series`` as records, ordered by step."""
    return [StepMetrics(step, dict(series[step])) for step in sorted(series)]


def read_all(path: Path | str, *, include_validation: bool = False) -> list[StepMetrics]:
    """Reference reader: the whole metrics file at once, same rules as ``MetricsFollower``.

    Ordered by step, one record per step (later lines override earlier ones key by key),
    garbage lines skipped, an unterminated last line ignored (it may still be written),
    step 0 dropped unless ``include_validation``. A missing file gives ``[]``.
    """
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    series: dict[int, dict[str, float | None]] = {}
    for line in complete.splitlines():
        record = parse_json_line(line) if line.strip() else None
        if record is not None and (record.step > 0 or include_validation):
            merge_step(series, record)
    return ordered_steps(series)


@dataclasses.dataclass(frozen=True)
class Batch:
    """What a source read since its last read."""

    #: records completed since, in the order read (step 0, the validation, included)
    records: list[StepMetrics]
    #: the source was rewritten from its start (a restarted run): what it gave before is void
    restarted: bool = False
    #: lines that should have been records but were not (a source whose other lines carry no
    #: metrics, such as the console, says 0)
    n_garbage: int = 0


class MetricSource(abc.ABC):
    """One place a run's per-step metrics can be read from, incrementally (``verl_sweep.objectives.sources``:
    verl's file logger, its tensorboard events, its console). ``MetricsFollower`` reads the
    most trusted source that has something to read."""

    #: names the source in logs and in ``MetricsFollower.source``
    name: str = ""

    @abc.abstractmethod
    def present(self) -> bool:
        """There is something to read (its file exists)."""

    @abc.abstractmethod
    def read_new(self, *, final: bool = False) -> Batch:
        """What was completed since the last call. ``final``: the run has ended, so whatever
        the source holds back as possibly incomplete is complete now. Never raises on
        malformed input."""


class MetricsFollower:
    """Reads a run's metrics incrementally while verl writes them.

    ``sources`` are the places to read them, most trusted first (``verl_sweep.objectives.sources.
    run_sources``): the first one that has something to read is followed; when a more
    trusted one appears later it takes over and the series read so far is discarded.
    Callers (the probe's polling loop) call ``read_new()`` every few seconds and use
    ``series`` for scoring and the health screen, ``last_update_time`` for hang detection.
    Never raises on malformed input: garbage lines are skipped and counted in ``n_garbage``.
    A rewritten source (a restarted run) clears the series and counts ``restarts``.
    """

    def __init__(self, sources: Sequence[MetricSource], *, clock: Clock = time.time) -> None:
        self.sources = list(sources)
        self.clock = clock
        self.restarts = 0
        self.n_garbage = 0
        self.validation: StepMetrics | None = None
        self.source: str | None = None  # the name of the source followed once something was read
        # Starts at construction so a run that never logs a step still looks idle.
        self.last_update_time: float = clock()
        self._current: MetricSource | None = None
        self._series: dict[int, dict[str, float | None]] = {}
        # ``series`` kept up to date as steps arrive (None: rebuilt on the next read): a probe
        # reads it several times a poll, and rebuilding thousands of steps each time was
        # most of a long probe's polling cost.
        self._ordered: list[StepMetrics] | None = None

    # -- reading --------------------------------------------------------------------------
    def read_new(self, *, final: bool = False) -> list[StepMetrics]:
        """Records completed since the last call (in the source's order; step 0 excluded).
        ``final``: the run has ended (see ``MetricSource.read_new``)."""
        current = next((source for source in self.sources if source.present()), None)
        if current is None:
            return []
        if current is not self._current:
            if self._current is not None:
                logger.info("%s appeared; switching from %s", current.name, self._current.name)
                self._clear()
            self._current, self.source = current, current.name
        batch = current.read_new(final=final)
        if batch.restarted:
            self.restarts += 1
            logger.warning("the run's %s was rewritten from the start (run restarted); the series starts over",
                           current.name)
            self._clear()
        self.n_garbage += batch.n_garbage
        new: list[StepMetrics] = []
        for record in batch.records:
            if record.step == 0:
                self.validation = record
                continue
            self._merge(record)
            new.append(record)
        if new:
            self.last_update_time = self.clock()
        return new

    def _clear(self) -> None:
        self._series.clear()
        self._ordered = None
        self.validation = None

    def _merge(self, record: StepMetrics) -> None:
        """Merge a record into the series; a new last step extends the ordered view, anything
        else (a step seen before, one out of order) has it rebuilt."""
        ordered, step = self._ordered, record.step
        new_last = step not in self._series and (not ordered or step > ordered[-1].step)
        merge_step(self._series, record)
        if ordered is not None and new_last:
            ordered.append(record)  # holds just what the series has for the step: no copy needed
        else:
            self._ordered = None

    # -- views ----------------------------------------------------------------------------
    @property
    def series(self) -> list[StepMetrics]:
        """All training steps so far, ordered, one per step (step 0 excluded)."""
        if self._ordered is None:
            self._ordered = ordered_steps(self._series)
        return list(self._ordered)

    @property
    def last_step(self) -> int:
        """The highest training step seen (0 when none)."""
        return max(self._series, default=0)

    def idle_s(self) -> float:
        """Seconds since a new step last arrived (or since construction)."""
        return self.clock() - self.last_update_time


def write_lines(path: Path | str, records: Iterable[Mapping[str, Any]]) -> None:
    """Append records as verl does (test helper and recorder); ``NaN`` → null."""

    def _null_nan(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value

    with open(path, "ab") as handle:
        for record in records:
            data = {k: _null_nan(v) for k, v in dict(record["data"]).items()}
            handle.write(json.dumps({"step": record["step"], "data": data}).encode() + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
