"""MetricsFollower against the reference reader, on growing, torn, truncated and console streams."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

from verl_sweep.objectives.sources import ConsoleSource, FileLoggerSource
from verl_sweep.objectives.metrics import (
    MetricsFollower,
    StepMetrics,
    parse_console_line,
    parse_json_line,
    read_all,
    write_lines,
)

pytestmark = pytest.mark.fast

DATA = REPO / "tests" / "data"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for step in range(1, n + 1):
        out.append(
            {
                "step": step,
                "data": {
                    "critic/score/mean": 0.2 + 0.001 * step + rng.gauss(0, 0.02),
                    "timing_s/step": 3.0 + rng.random(),
                    "actor/grad_norm": float("nan") if step == 7 else rng.random(),
                },
            }
        )
    return out


def _jsonl_bytes(records: list[dict]) -> bytes:
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"jsonl-{os.getpid()}-{random.random()}"
    write_lines(tmp, records)
    data = tmp.read_bytes()
    tmp.unlink()
    return data


def test_growing_file_torn_lines_matches_reference(tmp_path: Path) -> None:
    payload = _jsonl_bytes(_records(60))
    path = tmp_path / "metrics.jsonl"
    clock = FakeClock()
    follower = MetricsFollower([FileLoggerSource(path)], clock=clock)
    assert follower.read_new() == []  # file does not exist yet
    rng = random.Random(1)
    written = 0
    seen: list[StepMetrics] = []
    with path.open("wb", buffering=0) as handle:
        while written < len(payload):
            size = rng.randint(1, 300)  # chunks cut lines anywhere
            handle.write(payload[written : written + size])
            written += size
            clock.now += 1
            seen.extend(follower.read_new())
            # Never a record from a torn line: everything read so far is the reference.
            assert follower.series == read_all(path)
    assert [r.step for r in seen] == list(range(1, 61))
    assert follower.series == read_all(path)
    assert follower.last_step == 60
    assert follower.series[6].get("actor/grad_norm") is None  # NaN written as null
    assert follower.restarts == 0 and follower.n_garbage == 0


def test_partial_last_line_is_held_back(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1, "data": {"a": 1.0}}\n{"step": 2, "data": {"a"')
    follower = MetricsFollower([FileLoggerSource(path)])
    assert [r.step for r in follower.read_new()] == [1]
    with path.open("ab") as handle:
        handle.write(b': 2.0}}\n')
    assert [(r.step, r.get("a")) for r in follower.read_new()] == [(2, 2.0)]


def test_truncated_file_restarts_series(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    write_lines(path, _records(30, seed=1))
    follower = MetricsFollower([FileLoggerSource(path)])
    assert len(follower.read_new()) == 30
    # verl re-opens the file "wb" on restart: shorter content → start over.
    path.write_bytes(b"")
    write_lines(path, _records(5, seed=2))
    new = follower.read_new()
    assert [r.step for r in new] == [1, 2, 3, 4, 5]
    assert follower.restarts == 1
    assert follower.series == read_all(path)


def test_rewritten_file_longer_than_offset_is_noticed(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    write_lines(path, _records(3, seed=1))
    follower = MetricsFollower([FileLoggerSource(path)])
    follower.read_new()
    path.write_bytes(b"")
    write_lines(path, _records(40, seed=9))  # grew past the old offset before we looked
    follower.read_new()
    assert follower.restarts == 1
    assert follower.series == read_all(path)


def test_garbage_lines_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(
        b'{"step": 1, "data": {"a": 1.0}}\n'
        b"not json at all\n"
        b'{"step": "x", "data": {}}\n'
        b"[1, 2]\n"
        b"\n"
        b'{"step": 2, "data": {"a": NaN, "b": "text", "c": [1, 2], "d": true}}\n'
    )
    follower = MetricsFollower([FileLoggerSource(path)])
    follower.read_new()
    assert follower.n_garbage == 3
    assert follower.series == read_all(path)
    assert follower.series[1].data == {"a": None, "d": 1.0}


def test_step_zero_is_validation_and_last_write_wins(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    write_lines(
        path,
        [
            {"step": 0, "data": {"val-core/acc": 0.3}},
            {"step": 1, "data": {"a": 1.0, "b": 5.0}},
            {"step": 1, "data": {"a": 2.0}},
        ],
    )
    follower = MetricsFollower([FileLoggerSource(path)])
    follower.read_new()
    assert follower.validation is not None and follower.validation.get("val-core/acc") == 0.3
    assert [(r.step, dict(r.data)) for r in follower.series] == [(1, {"a": 2.0, "b": 5.0})]
    assert read_all(path, include_validation=True)[0].step == 0


def test_last_update_time_follows_new_steps(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    clock = FakeClock()
    follower = MetricsFollower([FileLoggerSource(path)], clock=clock)
    assert follower.last_update_time == 1000.0
    clock.now = 1010.0
    write_lines(path, _records(2))
    follower.read_new()
    assert follower.last_update_time == 1010.0
    clock.now = 1100.0
    follower.read_new()  # nothing new
    assert follower.idle_s() == pytest.approx(90.0)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "(TaskRunnerV1 pid=123) step:12 - critic/score/mean:np.float64(0.41) - "
            "timing_s/step:3.2 - perf/total_num_tokens:np.int64(51200)",
            (12, {"critic/score/mean": 0.41, "timing_s/step": 3.2, "perf/total_num_tokens": 51200.0}),
        ),
        (
            "\x1b[36m(TaskRunner pid=9)\x1b[0m step:3 - a:nan - b:inf - c:tensor(0.5, device='cuda:0')"
            " - d:-1e-3 - e:np.float32(nan) [repeated 2x across cluster]",
            (3, {"a": None, "b": None, "c": 0.5, "d": -0.001, "e": None}),
        ),
        ("step:7 - x:1", (7, {"x": 1.0})),
        ("INFO: training step:5 started", None),
        ("Epoch 1/30 step:5", None),
        ("random garbage", None),
    ],
)
def test_console_line_parsing(line: str, expected: tuple[int, dict] | None) -> None:
    record = parse_console_line(line)
    if expected is None:
        assert record is None
    else:
        assert record is not None
        assert (record.step, dict(record.data)) == expected


def test_console_fallback_when_file_never_appears(tmp_path: Path) -> None:
    console = DATA / "console_grpo.log"
    follower = MetricsFollower([FileLoggerSource(tmp_path / "missing.jsonl"), ConsoleSource(console)])
    follower.read_new()
    assert follower.source == "console"
    reference = read_all(DATA / "metrics_grpo.jsonl")
    got = follower.series
    assert [r.step for r in got] == [r.step for r in reference]
    for a, b in zip(got, reference):
        for key in ("critic/score/mean", "timing_s/step", "actor/grad_norm"):
            va, vb = a.get(key), b.get(key)
            assert (va is None and vb is None) or math.isclose(va, vb, rel_tol=1e-9)  # type: ignore[arg-type]


def test_file_takes_over_from_console(tmp_path: Path) -> None:
    console = tmp_path / "stdout.log"
    console.write_text("(TaskRunnerV1 pid=1) step:1 - critic/score/mean:0.1 - timing_s/step:2.0\n")
    metrics = tmp_path / "m.jsonl"
    follower = MetricsFollower([FileLoggerSource(metrics), ConsoleSource(console)])
    follower.read_new()
    assert follower.source == "console" and follower.last_step == 1
    write_lines(metrics, _records(3))
    follower.read_new()
    assert follower.source == "file"
    assert follower.series == read_all(metrics)


def test_recorded_stream_matches_reference(tmp_path: Path) -> None:
    # Replay the recorded verl stream byte-by-byte in uneven chunks.
    payload = (DATA / "metrics_grpo.jsonl").read_bytes()
    path = tmp_path / "replay.jsonl"
    follower = MetricsFollower([FileLoggerSource(path)])
    rng = random.Random(7)
    pos = 0
    with path.open("wb", buffering=0) as handle:
        while pos < len(payload):
            step = rng.randint(1, 4000)
            handle.write(payload[pos : pos + step])
            pos += step
            follower.read_new()
    assert follower.series == read_all(DATA / "metrics_grpo.jsonl")
    assert len(follower.series) > 100


def test_parse_json_line_rejects_bad_records() -> None:
    assert parse_json_line(b'{"step": -1, "data": {}}') is None
    assert parse_json_line(b'{"step": true, "data": {}}') is None
    assert parse_json_line(b'{"step": 1}') is None
    assert parse_json_line(b"\xff\xfe") is None


@pytest.mark.verl
def test_verl_file_logger_round_trip(tmp_path: Path) -> None:
    """verl's own FileLogger (orjson, numpy scalars, NaN) writes what we read."""
    pytest.importorskip("orjson")
    path = tmp_path / "verl.jsonl"
    script = f"""
import importlib.util, sys, types
import numpy as np
# Load verl/utils/tracking.py alone: importing the verl package pulls torch/ray (~5 s).
spec = importlib.util.find_spec("verl")
root = spec.submodule_search_locations[0]
mod_spec = importlib.util.spec_from_file_location("verl_tracking", root + "/utils/tracking.py")
try:
    mod = importlib.util.module_from_spec(mod_spec); mod_spec.loader.exec_module(mod)
    FileLogger = mod.FileLogger
except Exception:
    from verl.utils.tracking import FileLogger
log = FileLogger("proj", "exp")
for step in range(0, 6):
    log.log({{"critic/score/mean": np.float64(0.1 * step), "timing_s/step": 2.5,
             "perf/total_num_tokens": np.int64(1000 + step),
             "actor/grad_norm": float("nan") if step == 3 else np.float32(0.5)}}, step)
log.finish()
"""
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(path)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, capture_output=True)
    follower = MetricsFollower([FileLoggerSource(path)])
    follower.read_new()
    assert follower.validation is not None
    assert [r.step for r in follower.series] == [1, 2, 3, 4, 5]
    assert follower.series[1].get("critic/score/mean") == pytest.approx(0.2)
    assert follower.series[2].get("actor/grad_norm") is None
    assert follower.series[4].get("perf/total_num_tokens") == 1005.0
    assert follower.n_garbage == 0
