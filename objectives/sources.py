"""Where a run's per-step metrics are read from: the sources behind ``MetricSource``.

- ``FileLoggerSource``: verl's file logger (``metrics.jsonl``), one JSON line per step; the
  file is opened "wb" at start, so a restarted run truncates it.
- ``TensorBoardSource``: verl's tensorboard logger (``tensorboard/``), one scalar event per
  key and step, written by ``torch.utils.tensorboard.SummaryWriter`` (flushed in batches, so a
  step may arrive in parts: the newest step is held back until a later one appears or the
  run ends); a restarted run starts a new events file.
- ``ConsoleSource``: verl's console logger (``stdout.log``), ``step:N - key:value`` lines among
  everything else a run prints.

``run_sources`` lists a run's sources, most trusted first; ``read_run`` reads a finished run
whole through the same list (status, the report). A new source is one class here and its
place in that list.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable

from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.objectives.metrics import (
    Batch,
    MetricSource,
    MetricsFollower,
    StepMetrics,
    merge_step,
    ordered_steps,
    parse_console_line,
    parse_json_line,
)

logger = logging.getLogger(__name__)

# How many bytes of the first line we remember to notice a file that was rewritten from the
# start (verl re-opens it "wb" on restart) even when it has already grown past our offset.
_FIRST_LINE_PROBE = 4096


class _LineTail:
    """Incremental reader of complete lines from a growing file; notices rewrites."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.pending = b""
        self.first_line: bytes | None = None

    def reset(self) -> None:
        self.offset, self.pending, self.first_line = 0, b"", None

    def rewritten(self) -> bool:
        """True when the file shrank or its first line is no longer what we read."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return self.offset > 0  # deleted after we read from it
        if size < self.offset:
            return True
        if self.first_line is not None:
            with self.path.open("rb") as handle:
                return handle.read(len(self.first_line)) != self.first_line
        return False

    def read_lines(self) -> list[bytes]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        buffer = self.pending + chunk
        cut = buffer.rfind(b"\n") + 1
        # A torn last line (the writer is mid-write) waits for its newline.
        complete, self.pending = buffer[:cut], buffer[cut:]
        lines = complete.splitlines()
        if self.first_line is None and lines:
            # Before the first newline everything read is still pending from offset 0, so
            # the first complete line we see is the file's first line.
            self.first_line = lines[0][:_FIRST_LINE_PROBE]
        return lines


class _LinesSource(MetricSource):
    """A growing text file of one record per line (others skipped, counted or not)."""

    #: a line that is not a record is garbage (a file of records only), not other output
    counts_garbage = True

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._tail = _LineTail(self.path)

    def _parse(self, line: bytes) -> StepMetrics | None:
        raise NotImplementedError

    def read_new(self, *, final: bool = False) -> Batch:
        restarted = self._tail.rewritten()
        if restarted:
            self._tail.reset()
        records: list[StepMetrics] = []
        garbage = 0
        for line in self._tail.read_lines():
            if not line.strip():
                continue
            record = self._parse(line)
            if record is None:
                if self.counts_garbage:
                    garbage += 1
                    logger.debug("skipped a malformed metrics line: %.120r", line)
                continue
            records.append(record)
        return Batch(records, restarted=restarted, n_garbage=garbage)


class FileLoggerSource(_LinesSource):
    """verl's file logger: ``{"step": N, "data": {...}}`` per line."""

    name = "file"

    def present(self) -> bool:
        return self.path.exists() or self._tail.offset > 0

    def _parse(self, line: bytes) -> StepMetrics | None:
        return parse_json_line(line)


class ConsoleSource(_LinesSource):
    """verl's console logger's lines in the run's stdout (which holds much else besides)."""

    name = "console"
    counts_garbage = False

    def present(self) -> bool:
        return self.path.exists()

    def _parse(self, line: bytes) -> StepMetrics | None:
        return parse_console_line(line.decode("utf-8", errors="replace"))


class TensorBoardSource(MetricSource):
    """verl's tensorboard logger: the scalar events of the newest events file in ``directory``
    (a restarted run writes a new one). The ``tensorboard`` package reads them; it is imported
    when there is something to read."""

    name = "tensorboard"

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self._file: Path | None = None
        self._loader: Any = None
        self._pending: dict[int, dict[str, float | None]] = {}

    def _newest(self) -> Path | None:
        files = sorted(self.directory.glob("events.out.tfevents.*")) if self.directory.is_dir() else []
        return files[-1] if files else None

    def present(self) -> bool:
        return self._newest() is not None

    def read_new(self, *, final: bool = False) -> Batch:
        newest = self._newest()
        if newest is None:
            return Batch([])
        restarted = self._file is not None and newest != self._file
        if newest != self._file:
            from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

            self._file, self._loader, self._pending = newest, EventFileLoader(str(newest)), {}
        for event in self._loader.Load():
            for value in event.summary.value:
                number = _scalar(value)
                if number is not None:
                    merge_step(self._pending, StepMetrics(int(event.step), {value.tag: number[0]}))
        # A step's keys may arrive in several flushes: the newest step waits for a later one.
        done = sorted(self._pending) if final else sorted(self._pending)[:-1]
        records = ordered_steps({step: self._pending.pop(step) for step in done})
        return Batch(records, restarted=restarted)


def _scalar(value: Any) -> tuple[float | None] | None:
    """A summary value's number, as (finite float or None for NaN/inf,); None when it is no
    scalar. SummaryWriter writes ``simple_value`` or, in newer releases, a 0-d tensor."""
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        number = float(value.simple_value)
    elif kind == "tensor":
        from tensorboard.util import tensor_util

        array = tensor_util.make_ndarray(value.tensor)
        if array.size != 1 or array.dtype.kind not in "fiub":
            return None
        number = float(array.reshape(()))
    else:
        return None
    return (number if math.isfinite(number) else None,)


#: a run's sources, most trusted first: what verl wrote for a reader, then its console
SOURCES: tuple[Callable[[RunDir, Path], MetricSource], ...] = (
    lambda files, metrics: FileLoggerSource(metrics),
    lambda files, metrics: TensorBoardSource(metrics.parent / "tensorboard"),
    lambda files, metrics: ConsoleSource(files.stdout),
)


def run_sources(run_dir: Path, *, metrics_path: Path | None = None) -> list[MetricSource]:
    """The metric sources of a run (``verl_sweep.launchers.run_dir``), most trusted first; its metrics
    (and tensorboard events) may be elsewhere (``metrics_path``: a Ray job's shared storage)."""
    files = RunDir(Path(run_dir))
    return [make(files, metrics_path or files.metrics) for make in SOURCES]


def read_run(run_dir: Path | str) -> list[StepMetrics]:
    """A finished run's training steps from its most trusted source with something to read
    (ordered, one record per step, step 0 left out); [] when it has none."""
    follower = MetricsFollower(run_sources(Path(run_dir)))
    follower.read_new(final=True)
    return follower.series
