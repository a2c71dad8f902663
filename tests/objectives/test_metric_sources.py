"""The metric sources behind ``MetricSource``: verl's tensorboard events, written by verl's own
tensorboard logger (``verl.utils.tracking``) and read back with the ``tensorboard`` package,
followed like the file logger's lines; a run directory read through its most trusted source."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from verl_sweep.objectives.metrics import MetricsFollower, read_all, write_lines
from verl_sweep.objectives.sources import ConsoleSource, FileLoggerSource, TensorBoardSource, read_run, run_sources

pytestmark = pytest.mark.verl


def _records(n: int, *, offset: float = 0.0) -> list[dict]:
    return [{"step": s, "data": {"critic/score/mean": offset + 0.01 * s, "timing_s/step": 10.0 + s % 3,
                                 "perf/throughput": 1000.0 + s, "actor/grad_norm": math.nan if s == 4 else 0.5}}
            for s in range(1, n + 1)]


def _verl_logger(directory: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """verl 0.9.1's tensorboard logger, writing where a probe's pins point it ($TENSORBOARD_DIR)."""
    tracking = pytest.importorskip("verl.utils.tracking")
    monkeypatch.setenv("TENSORBOARD_DIR", str(directory))
    return tracking._TensorboardAdapter("verl-sweep", "probe")


def test_tensorboard_events_are_followed_as_verl_writes_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = tmp_path / "tensorboard"
    writer = _verl_logger(events, monkeypatch)
    follower = MetricsFollower([TensorBoardSource(events)])
    assert follower.read_new() == []  # nothing flushed yet
    for record in _records(5):
        writer.log(record["data"], record["step"])
    writer.writer.flush()
    first = follower.read_new()
    assert [r.step for r in first] == [1, 2, 3, 4]  # step 5 may still be in parts: held back
    assert follower.source == "tensorboard" and follower.last_step == 4
    for record in _records(8)[5:]:
        writer.log(record["data"], record["step"])
    writer.finish()
    assert [r.step for r in follower.read_new()] == [5, 6, 7]
    assert [r.step for r in follower.read_new(final=True)] == [8]  # the run ended: its last step is whole
    series = follower.series
    assert series[3].get("actor/grad_norm") is None  # NaN, as verl's file logger writes null
    assert series[0].get("critic/score/mean") == pytest.approx(0.01, rel=1e-6)  # float32 in the events
    assert series[-1].data.keys() == {"critic/score/mean", "timing_s/step", "perf/throughput", "actor/grad_norm"}


def test_a_restarted_run_writes_a_new_events_file_and_the_series_starts_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = tmp_path / "tensorboard"
    first = _verl_logger(events, monkeypatch)
    for record in _records(6):
        first.log(record["data"], record["step"])
    first.finish()
    follower = MetricsFollower([TensorBoardSource(events)])
    assert follower.read_new(final=True)[-1].step == 6
    import time

    time.sleep(1.1)  # events files are named by the second they were opened in
    second = _verl_logger(events, monkeypatch)
    for record in _records(3, offset=0.5):
        second.log(record["data"], record["step"])
    second.finish()
    assert [r.step for r in follower.read_new(final=True)] == [1, 2, 3]
    assert follower.restarts == 1 and follower.last_step == 3


def test_a_run_is_read_through_its_most_trusted_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    writer = _verl_logger(run / "tensorboard", monkeypatch)
    for record in _records(12):
        writer.log(record["data"], record["step"])
    writer.finish()
    (run / "stdout.log").write_text("(TaskRunner pid=1) step:1 - critic/score/mean:0.3\n")
    from_events = read_run(run)
    assert [m.step for m in from_events] == list(range(1, 13))  # the events before the console
    write_lines(run / "metrics.jsonl", _records(12))
    from_file = read_run(run)
    assert from_file == read_all(run / "metrics.jsonl")  # the file logger before both
    for a, b in zip(from_events, from_file):
        assert a.data.keys() == b.data.keys()
        assert all(a.get(k) == pytest.approx(b.get(k), rel=1e-6) for k in a.data if b.get(k) is not None)
    assert [type(s) for s in run_sources(run)] == [FileLoggerSource, TensorBoardSource, ConsoleSource]
