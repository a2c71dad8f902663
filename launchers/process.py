"""Start a probe as its own process tree, find it again, and kill all of it.

Contract:
- ``spawn`` starts an argv list (never a shell) as the leader of a new session (so its
  process group is its own), with stdout/stderr going to files, and records
  ``process.json`` (pid, create_time, pgid, argv, marker) in the run directory so a later
  driver can find the tree again.
- ``kill_tree`` stops everything the probe started: the recorded process, its descendants
  (walked before anything is killed, because Ray workers re-parent or leave the group once
  their parent dies), its process group, and any process whose command line or environment
  carries the run's marker. SIGTERM first, SIGKILL after a grace period.
- ``find_marked`` walks the process table for a marker; tests use it to prove nothing is left.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import psutil

from verl_sweep.launchers.base import LauncherError

logger = logging.getLogger(__name__)

PROCESS_FILE = "process.json"
# Every probe process and every process it starts inherits this variable; it is how a tree
# that left its process group (Ray's raylet and workers) is still found.
MARKER_ENV = "VERL_SWEEP_RUN_DIR"


@dataclasses.dataclass(frozen=True)
class ProcessRecord:
    """What ``process.json`` holds: enough to find (and not mistake) the probe's leader."""

    pid: int
    create_time: float
    pgid: int
    argv: tuple[str, ...]
    markers: tuple[str, ...]

    def to_json(self) -> str:
        payload = dataclasses.asdict(self)
        payload["argv"] = list(self.argv)
        payload["markers"] = list(self.markers)
        return json.dumps(payload, indent=2)

    @classmethod
    def from_json(cls, text: str) -> ProcessRecord:
        data = json.loads(text)
        return cls(
            pid=int(data["pid"]),
            create_time=float(data["create_time"]),
            pgid=int(data["pgid"]),
            argv=tuple(data["argv"]),
            markers=tuple(data.get("markers", ())),
        )


def spawn(
    argv: Sequence[str],
    *,
    run_dir: Path,
    env: Mapping[str, str],
    stdout_path: Path,
    stderr_path: Path,
    markers: Sequence[str] = (),
    cwd: Path | None = None,
) -> tuple[subprocess.Popen[bytes], ProcessRecord]:
    """Start ``argv`` in a new session; write ``process.json``. Raises LauncherError if it cannot start."""
    if not argv:
        raise LauncherError("command must be a non-empty argv list, but got []. Pass the program and its arguments.")
    full_env = dict(env)
    full_env[MARKER_ENV] = str(run_dir)
    with open(stdout_path, "ab") as out, open(stderr_path, "ab") as err:
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=full_env,
                cwd=str(cwd) if cwd is not None else None,
                start_new_session=True,  # own session and group: killpg reaches the whole tree
                close_fds=True,
            )
        except OSError as e:
            raise LauncherError(
                f"the probe command must be executable, but starting {argv[0]!r} failed: {e}. "
                "Check the launcher's command."
            ) from e
    try:
        create_time = psutil.Process(popen.pid).create_time()
    except psutil.Error:
        create_time = 0.0  # exited already; the exit code is still in popen
    record = ProcessRecord(
        pid=popen.pid,
        create_time=create_time,
        pgid=popen.pid,
        argv=tuple(argv),
        markers=(str(run_dir), *markers),
    )
    write_record(run_dir, record)
    _CHILDREN[popen.pid] = popen
    return popen, record


# Popen objects by pid, kept at module level so a launcher object that is thrown away does not
# let the garbage collector reap the child and lose its exit code (a re-attaching launcher in
# the same process still reads it).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def child_popen(pid: int) -> subprocess.Popen[bytes] | None:
    """The Popen of a probe this process started, if any."""
    return _CHILDREN.get(pid)


def forget_child(pid: int) -> None:
    _CHILDREN.pop(pid, None)


def write_record(run_dir: Path, record: ProcessRecord) -> None:
    tmp = run_dir / (PROCESS_FILE + ".tmp")
    tmp.write_text(record.to_json())
    os.replace(tmp, run_dir / PROCESS_FILE)  # atomic: a reader never sees half a record


def read_record(run_dir: Path) -> ProcessRecord | None:
    path = run_dir / PROCESS_FILE
    try:
        return ProcessRecord.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, KeyError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return None


def find_process(record: ProcessRecord) -> psutil.Process | None:
    """The recorded leader if it still runs (same pid AND create time: pids are reused)."""
    try:
        proc = psutil.Process(record.pid)
        if abs(proc.create_time() - record.create_time) > 0.5:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (psutil.Error, ValueError):  # ValueError: a placeholder record with pid <= 0
        return None


def is_alive(record: ProcessRecord) -> bool:
    return find_process(record) is not None


def _carries_marker(proc: psutil.Process, markers: Iterable[str]) -> bool:
    markers = [m for m in markers if m]
    if not markers:
        return False
    try:
        cmdline = " ".join(proc.cmdline())
        if any(m in cmdline for m in markers):
            return True
        env_value = proc.environ().get(MARKER_ENV, "")
        return any(env_value == m for m in markers)
    except psutil.Error:
        return False  # gone, a zombie, or another user's process


def find_marked(markers: Sequence[str], *, pgid: int | None = None) -> list[psutil.Process]:
    """Every live process (not this one) in group ``pgid`` or carrying one of ``markers``."""
    me = os.getpid()
    found: list[psutil.Process] = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if pgid is not None and os.getpgid(proc.pid) == pgid:
                found.append(proc)
                continue
        except (psutil.Error, OSError):
            continue
        if _carries_marker(proc, markers):
            found.append(proc)
    return found


def _collect(record: ProcessRecord) -> dict[int, psutil.Process]:
    procs: dict[int, psutil.Process] = {}
    leader = find_process(record)
    if leader is not None:
        procs[leader.pid] = leader
        try:
            for child in leader.children(recursive=True):
                procs[child.pid] = child
        except psutil.Error:
            pass
    # The group id is trusted only while its leader lives: after that the pid (= pgid) may
    # belong to someone else, and only the marker identifies our processes.
    pgid = record.pgid if leader is not None else None
    for proc in find_marked(record.markers, pgid=pgid):
        procs.setdefault(proc.pid, proc)
    return procs


def _killpg(record: ProcessRecord, sig: int) -> None:
    if find_process(record) is None:
        return  # see _collect: a dead leader's group id is not ours any more
    try:
        os.killpg(record.pgid, sig)
    except OSError:
        pass  # group already empty


def _signal_all(procs: Iterable[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


def kill_tree(record: ProcessRecord, *, grace_s: float = 5.0) -> int:
    """Stop the recorded probe and all it started; returns how many processes were signalled.

    Walks the tree first (children die with their parent and re-parent otherwise), freezes
    nothing, sends SIGTERM, waits ``grace_s``, then SIGKILLs whatever (old or newly spawned)
    is still there. Reaps the leader if this process started it.
    """
    procs = _collect(record)
    _signal_all(procs.values(), signal.SIGTERM)
    _killpg(record, signal.SIGTERM)
    _gone, alive = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    # A second walk: processes started during the grace period, or that ignored SIGTERM.
    late = {p.pid: p for p in alive}
    late.update(_collect(record))
    if late:
        logger.debug("SIGKILL %d process(es) of %s", len(late), record.markers[:1])
        _killpg(record, signal.SIGKILL)
        _signal_all(late.values(), signal.SIGKILL)
        psutil.wait_procs(list(late.values()), timeout=5.0)
    popen = _CHILDREN.get(record.pid)
    if popen is not None:
        try:
            popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            logger.warning("probe leader %d did not exit after SIGKILL", record.pid)
    return len(procs) + len(late)


def exit_code(record: ProcessRecord) -> tuple[bool, int | None]:
    """(finished, exit code) of the recorded leader.

    The exit code is known only for a probe this process started (from ``wait``); a probe
    started by an earlier driver reports (True, None) once it is gone.
    """
    popen = _CHILDREN.get(record.pid)
    if popen is not None:
        code = popen.poll()
        return (code is not None, code)
    if find_process(record) is not None:
        return (False, None)
    # Not our child: reap it if it happens to be a zombie of ours, else its code is lost.
    try:
        pid, status = os.waitpid(record.pid, os.WNOHANG)
        if pid == record.pid:
            return (True, os.waitstatus_to_exitcode(status))
    except ChildProcessError:
        pass
    return (True, None)


def wait_gone(record: ProcessRecord, *, timeout_s: float) -> bool:
    """Wait until the leader has exited; True if it did within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        finished, _ = exit_code(record)
        if finished:
            return True
        time.sleep(0.05)
    return False
