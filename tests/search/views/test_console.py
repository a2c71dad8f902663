"""What a person sees, through the real CLI on the simulator: a study's log in short lines with
each pinned-override warning once, ``status`` in one screen, and the rough edges at the ends of
a run: Ctrl-C and SIGTERM stop alike and say how to resume, ``resume`` counts on with the
launcher the study ran with, one driver per SQLite file, a finished study in a read-only file,
passwords masked whatever they hold."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from support import REPO, cli, demo_data, write_study

#: the longest line the demo's log may hold, and a finished trial's line
MAX_LOG_LINE, MAX_TRIAL_LINE = 160, 120
#: verl settings every script sets, which a probe pins (each is warned about once a study)
PINNED = {"trainer.save_freq": 20, "trainer.resume_mode": "auto"}
TRIAL_LINE = re.compile(r"^\[(\w+)\] trial (\d+) (incumbent|candidate|rerun) (η|pruned|failed)")


def small_demo(directory: Path, *, systems: int = 10, others: int = 3, time_scale: float = 2000,
               kind: str = "sim", stages: int = 6) -> Path:
    """The demo with small budgets, faster probes, and two settings the probes pin."""
    data: dict[str, Any] = demo_data()
    data["stages"] = data["stages"][:stages]
    for stage in data["stages"]:
        stage["budget"] = {"max_trials": systems if stage["space"] == "systems" else others}
        stage.pop("stop", None)
    data["baseline"].update(PINNED)
    data["final_check"] = False  # the console's lines are the subject (tests/search/engine/test_final_check.py has the check)
    if kind == "sim":
        data["launcher"]["options"]["time_scale"] = time_scale
    else:
        data["launcher"] = {"kind": kind, "max_concurrent": 2}
    return write_study(directory, data, "demo.yaml")


def start(args: list[str], cwd: Path, log: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    out, err = cwd / f"{log}.out", cwd / f"{log}.err"
    # unbuffered: wait_for must see each line when printed, not when the study ends
    proc = subprocess.Popen([sys.executable, "-m", "verl_sweep.search.commands.cli", *args], cwd=cwd,
                            stdout=out.open("wb"), stderr=err.open("wb"),
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, out, err


def wait_for(path: Path, pattern: str, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if re.search(pattern, path.read_text(errors="replace"), re.MULTILINE):
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {pattern!r}: {path.read_text()[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {pattern!r} in {timeout_s} s: {path.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def finished() -> Iterator[Path]:
    """A finished small demo, in a folder another user may read (pytest's own is private)."""
    directory = Path(tempfile.mkdtemp(prefix="vs-console-demo-"))
    directory.chmod(0o755)
    # 3x the demo's pace (learning probes ~1 s, not ~3 s): the log's lines do not depend on it
    small_demo(directory, time_scale=60000)
    result = cli("run", "demo.yaml", cwd=directory, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (directory / "run.out").write_text(result.stdout)
    (directory / "run.err").write_text(result.stderr)
    yield directory
    shutil.rmtree(directory)


@pytest.mark.slow  # a small demo study (~45 s)
def test_the_demo_log_has_short_lines_and_each_warning_once(finished: Path) -> None:
    out, err = (finished / "run.out").read_text(), (finished / "run.err").read_text()
    lines = out.splitlines() + err.splitlines()
    assert max(map(len, lines)) <= MAX_LOG_LINE, max(lines, key=len)
    trials = [line for line in out.splitlines() if TRIAL_LINE.match(line)]
    assert len(trials) >= 25 and max(map(len, trials)) <= MAX_TRIAL_LINE, max(trials, key=len)
    assert not any(line.lstrip().startswith("|") for line in lines), "a probe's output was echoed"
    for key, value in PINNED.items():  # once a study, not once a probe
        assert err.count(f"dropping override '{key}={value}' from every probe") == 1, err
    assert re.search(r"^study demo: stage 1/6 systems · probes 0/25 · GPU-h 0\.0 SIMULATED$", out, re.MULTILINE)
    assert re.search(r"^study demo: 6/6 stages done · probes \d+/\d+ · GPU-h [\d,.]+ of ~[\d,]+ \(estimate\) "
                     r"SIMULATED", out, re.MULTILINE), out[-2000:]
    # The end: the study's cost in GPU-hours and in R (a run of the baseline, its length unknown here).
    assert re.search(r"^SIMULATED cost: [\d,.]+ GPU-h = [\d.]+ R \(R: a 2,000-step run of the baseline, [\d,.]+ GPU-h; "
                     r"2,000 steps assumed; `status --run-steps N` gives yours\)\n"
                     r"SIMULATED payback: no saving to show: the final check is skipped\n", out, re.MULTILINE), out[-2000:]
    for failed in re.findall(r"^\[\w+\] trial \d+ \w+ failed: .*\n(.*)$", out, re.MULTILINE):
        assert re.fullmatch(r"    log: runs/demo/demo\.\w+\.t\d{4}/stderr\.log", failed), failed


@pytest.mark.slow
def test_status_fits_one_screen_and_lists_every_trial_on_request(finished: Path) -> None:
    data = json.loads(cli("status", "demo", "--json", cwd=finished).stdout)
    assert {"study", "algorithm", "stages"} <= set(data)
    screen = cli("status", "demo", cwd=finished, env={"COLUMNS": "80"})
    assert screen.returncode == 0, screen.stderr
    assert len(screen.stdout.splitlines()) <= 50, screen.stdout
    for stage in data["stages"]:
        assert f"{stage['name']}: {stage['winner']['summary']}" in screen.stdout
    # speed probes end once their tokens/s settles: by design, not a run shorter than its probes
    assert not any(stage.get("ended_early") for stage in data["stages"]), data["stages"]
    every = cli("status", "demo", "--trials", cwd=finished).stdout
    for stage in data["stages"]:
        for row in stage["trials"]:
            if row["state"] not in ("waiting", "skipped"):
                assert re.search(rf"^  trial {row['number']} {row['role']} {row['state']}\b", every, re.MULTILINE)


@pytest.mark.slow
def test_sigterm_and_ctrl_c_stop_alike_and_resume_counts_on(tmp_path: Path) -> None:
    # a second stage of 6: the resumed study must still be running when its Ctrl-C lands
    # (with 3 it could finish first)
    small_demo(tmp_path, stages=2, others=6)
    run, out, err = start(["run", "demo.yaml"], tmp_path, "run")
    wait_for(out, r"^\[systems\] trial 4 ", run)
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=180) == 130
    assert err.read_text().splitlines()[-1] == ("stopped (SIGTERM); running trials were queued again. "
                                                "Continue with `verl-sweep resume demo`.")
    done = sum(bool(TRIAL_LINE.match(line)) for line in out.read_text().splitlines())
    resumed, out, err = start(["resume", "demo"], tmp_path, "resume")
    wait_for(out, r"^\[systems\] trial \d+ started", resumed)  # a probe is running
    resumed.send_signal(signal.SIGINT)
    assert resumed.wait(timeout=180) == 130
    assert err.read_text().splitlines()[-1] == ("stopped (Ctrl-C); running trials were queued again. "
                                                "Continue with `verl-sweep resume demo`.")
    # the study's progress counts what the database holds, not from 0
    counted = re.search(r"^study demo: stage 1/2 systems · probes (\d+)/", out.read_text(), re.MULTILINE)
    assert counted and int(counted[1]) >= done - 2 > 0, out.read_text()[:3000]
    status = json.loads(cli("status", "demo", "--json", cwd=tmp_path).stdout)
    rows = status["stages"][0]["trials"]
    stopped = [row for row in rows if (row["reason"] or "").startswith("its driver stopped")]
    assert len(stopped) >= 2 and all(row["state"] == "stopped" for row in stopped), rows
    assert re.search(r"\d+ stopped", cli("status", "demo", cwd=tmp_path).stdout)


@pytest.mark.slow
def test_a_second_driver_on_one_sqlite_file_is_refused(tmp_path: Path) -> None:
    small_demo(tmp_path, stages=1, time_scale=20)  # probes that outlast the second driver's checks
    run, out, _ = start(["run", "demo.yaml"], tmp_path, "run")
    try:
        wait_for(out, r"^\[systems\] trial 1 started", run)
        for second in (["run", "demo.yaml"], ["resume", "demo"]):
            refused = cli(*second, cwd=tmp_path)
            assert refused.returncode == 2, refused.stdout + refused.stderr
            assert re.fullmatch(rf"error: one driver per SQLite study database, but {tmp_path}/demo\.db is driven by "
                                rf"pid {run.pid} already\. Wait for it \(or stop it\); several workers need "
                                r"PostgreSQL \(README: on a cluster\)\.\n", refused.stderr), refused.stderr
    finally:
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=180)


@pytest.mark.slow
def test_resume_uses_the_launcher_the_study_ran_with(tmp_path: Path) -> None:
    """The file names the local launcher (this machine has no GPU for it); the study ran with
    ``--launcher sim``: the hint and ``resume`` keep to sim."""
    small_demo(tmp_path, stages=1, systems=4, kind="local")
    run, out, err = start(["run", "demo.yaml", "--launcher", "sim"], tmp_path, "run")
    wait_for(out, r"^\[systems\] trial 0 started", run)
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=180) == 130
    assert err.read_text().splitlines()[-1].endswith("Continue with `verl-sweep resume demo --launcher sim`.")
    resumed = cli("resume", "demo", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.startswith("resuming study demo (launcher sim)\n")


@pytest.mark.slow
def test_a_finished_study_in_a_read_only_file_is_reported_finished(finished: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="vs-read-only-"))  # outside pytest's private folder
    try:
        shutil.copy(finished / "demo.db", directory / "demo.db")
        shutil.copy(finished / "demo.yaml", directory / "demo.yaml")
        for path in (directory / "demo.db", directory / "demo.yaml"):
            path.chmod(0o444)
        directory.chmod(0o555)
        # root writes whatever the mode bits say: the commands then run as nobody
        as_reader = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []

        def verl_sweep(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*as_reader, sys.executable, "-m", "verl_sweep.search.commands.cli", *args], cwd=directory,
                                  capture_output=True, text=True, timeout=120,
                                  env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(directory)})

        for command in (["resume", "demo"], ["run", "demo.yaml"]):
            result = verl_sweep(*command)
            assert result.returncode == 0, result.stderr
            assert result.stdout.startswith(f"study demo is finished: nothing left to run (its database "
                                            f"sqlite:///{directory}/demo.db is read-only here).\n"), result.stdout
            assert "Export the winner: verl-sweep export demo" in result.stdout
        status = verl_sweep("status", "demo")
        assert status.returncode == 0 and "systems: " in status.stdout, status.stderr
        export = verl_sweep("export", "demo")
        assert export.returncode == 0 and "defaults:" in export.stdout, export.stderr
        assert not re.search(r"\d\.\d{5,}", export.stdout), "exported numbers are rounded"
    finally:
        directory.chmod(0o755)
        shutil.rmtree(directory)


@pytest.mark.parametrize("password", ["p@zzq@wxy", "kq:jv/wz@zz", "a/b:qq@zz"])
def test_a_password_is_masked_whatever_characters_it_holds(password: str) -> None:
    """A refused connection through SQLAlchemy and psycopg (no server on port 1)."""
    url = f"postgresql://sweeper:{password}@127.0.0.1:1/sweep"
    for command in (["status", "demo", "--storage", url], ["export", "demo", "--storage", url]):
        result = cli(*command, timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("error: cannot reach the study database postgresql://sweeper:***@127.0.0.1:1/sweep: ")
        assert "Connection refused" in result.stderr, result.stderr
        for piece in [password, *re.split(r"[@:/]", password)]:
            if len(piece) >= 2:
                assert piece not in result.stdout + result.stderr, (piece, result.stderr)
