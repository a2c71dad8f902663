"""Studies run once per pytest session and read by test files of several folders (a lock file
keeps the pytest-xdist workers from running one twice): ``shared_demo``, the small demo run by
the real CLI under a pseudo-terminal (test_live_view.py, test_report.py, test_optuna_tools.py,
test_end_to_end.py); ``shared_small``, the small study with its final check on the replay
launcher (test_final_check.py, test_report_layout.py)."""

from __future__ import annotations

import copy
import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from support import cli, demo_data, session_dir, write_study


# -- the small demo, under a pseudo-terminal --

COLUMNS = 140
RUN_TIMEOUT_S = 240.0
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def small_demo(directory: Path) -> Path:
    """The demo study with smaller budgets and one confirmation re-run per stage. The systems
    stage keeps enough trials (and parameters) for a parameter-importance estimate."""
    data = demo_data()
    for stage in data["stages"]:
        stage["budget"] = {"max_trials": 6 if stage["space"] == "systems" else 4}
        stage["confirm_top"] = 1
    # 2x the demo's pace: a 500-step probe ~1.5 s, not ~3 s, still several frames of the live
    # view's probe bars (a probe counts as hung only after 10 real seconds without metrics)
    data["launcher"]["options"]["time_scale"] = 40000
    return write_study(directory, data, "demo.yaml")


def run_under_pty(argv: list[str], cwd: Path, *, timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, bytes]:
    """Run ``argv`` with its stdout/stderr on a new pseudo-terminal; returns (exit status,
    everything it wrote). Kills the child (by its pid) when it outlives ``timeout_s``."""
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(COLUMNS), "LINES": "40"}
    env.pop("NO_COLOR", None)
    pid, fd = pty.fork()
    if pid == 0:  # child: a terminal of known size, then the CLI
        try:
            fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 40, COLUMNS, 0, 0))
            os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if not ready:
                continue
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        else:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks)


def plain(transcript: bytes) -> str:
    """The transcript without escape sequences, split at carriage returns too."""
    return ANSI.sub(b"", transcript).replace(b"\r", b"\n").decode("utf-8", "replace")


def shared_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small demo, run once per pytest session under a pty (a lock file keeps concurrent
    fixtures, on any xdist worker, from running it twice); the directory holds demo.db, runs/
    and transcript.bin."""
    base = session_dir(tmp_path_factory) / "shared-small-demo"
    base.mkdir(exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = base / "exit_code"
        if not done.exists():
            small_demo(base)
            started = time.monotonic()
            code, transcript = run_under_pty([sys.executable, "-m", "verl_sweep.search.commands.cli", "run", "demo.yaml"], base)
            (base / "transcript.bin").write_bytes(transcript)
            (base / "elapsed_s").write_text(f"{time.monotonic() - started:.1f}")
            done.write_text(str(code))
    code = int(done.read_text())
    assert code == 0, plain((base / "transcript.bin").read_bytes())[-4000:]
    return base


# -- the small study with its final check --

def small_study(tmp_path: Path, name: str = "small", change: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """The demo cut to its systems stage (8 probes) and mini-batch stage (5), on the replay
    launcher, with a final check of 2 seeds: about a minute."""
    data = copy.deepcopy(demo_data())
    data["name"] = name
    # the modelled metrics only: what the scorer reads, less to write and parse
    data["launcher"] = {"kind": "replay", "max_concurrent": 2, "options": {"verl_record": False}}
    stages = {s["name"]: s for s in data["stages"]}
    stages["systems"]["budget"] = {"max_trials": 8}
    stages["minibatch"]["budget"] = {"max_trials": 5}
    data["stages"] = [stages["systems"], stages["minibatch"]]
    data["final_check"] = {"runs": 2}
    for stage in data["stages"]:
        # The same suggestions every time: the systems stage then varies 5 parameters, whose
        # slice plot (300 px a parameter) overflowed a 1,400 px report before it was split.
        stage["sampler"] = {"seed": 7}
    if change:
        change(data)
    return write_study(tmp_path, data, f"{name}.yaml")


def run_small(tmp_path: Path, name: str = "small", change: Callable[[dict[str, Any]], None] | None = None) -> Path:
    path = small_study(tmp_path, name, change)
    result = cli("run", str(path), cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (tmp_path / f"{name}.out").write_text(result.stdout + result.stderr)  # what the console said
    return tmp_path


def shared_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small study with its final check, run once per pytest session (a lock file keeps
    fixtures on any xdist worker from running it twice); its users only read it."""
    base = session_dir(tmp_path_factory) / "shared-final-small"
    base.mkdir(exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "finished").exists():
            run_small(base)
            (base / "finished").touch()
    return base
