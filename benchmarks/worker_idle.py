"""How idle are workers at stage boundaries, where one waits for the others? (SIMULATED)

N processes share one study through one database: one ``verl-sweep run`` and N-1
``verl-sweep worker``, each with the simulator launcher and one probe slot. Every probe is a
real simulator process on a compressed clock (``--time-scale`` simulated seconds per real
second). Afterwards the trials in the database (start, end, owner pid) give each worker's busy
time (a trial of its own RUNNING) and idle time (none RUNNING).

What counts as worker time: from the worker's first probe start to the study's end (the last
probe's end), or to the worker's exit if it left earlier (a worker leaves once the last stage
has nothing left for it but other processes' confirmations, handing its GPUs back). Process
start-up (imports, joining the study) comes before and is printed on its own; the stage
decision and exit come after the last probe and are not counted.
Idle time is "at a stage boundary" while the stage has started its last budgeted probe and
the next stage (or, for the last stage, the end of the study) has not started yet — the stage
is waiting for its last probes; all other idle time (hand-off between probes, joining a new
stage) is "elsewhere".

Usage: python -m benchmarks.worker_idle [--workers 8] [--storage URL]
This machine may have few cores: 8 drivers plus their simulator processes compete for them.
The default time scale keeps a probe at about half a minute of real time, so the seconds a
starved process loses to start-up and polling stay small against it, and the figure reflects
the drivers' scheduling more than the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import yaml

REPO = Path(__file__).resolve().parent.parent
STAGES = (("minibatch", "mini_batch"), ("kl", "kl"), ("lr", "lr"))


@dataclass(frozen=True)
class Span:
    """One probe: a trial that ran (has a run id), in its owner's process."""

    pid: int
    stage: int
    number: int
    role: str
    start: float
    end: float
    state: str


def _ts(value: datetime.datetime) -> float:
    # Optuna stores naive local datetimes; .timestamp() reads them as local, like time.time().
    return value.timestamp()


def write_study(work: Path, name: str, storage: str, *, time_scale: float, probe_steps: int,
                max_trials: int, confirm_top: int) -> Path:
    data = yaml.safe_load((REPO / "studies" / "demo.yaml").read_text())
    data.update(name=name, storage=storage)
    data["launcher"] = {"kind": "sim", "max_concurrent": 1, "options": {"time_scale": time_scale}}
    data["probe"] = {"steps": probe_steps, "incumbent_repeats": 2}
    data["stages"] = [{"name": n, "space": k, "budget": {"max_trials": max_trials}, "confirm_top": confirm_top}
                      for n, k in STAGES]
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_processes(work: Path, study_file: Path, name: str, storage: str, n_workers: int,
                  timeout_s: float) -> dict[int, tuple[float, float, int | None, Path]]:
    """Start the driver, then the workers; returns pid → (start time, exit time, exit code,
    log file). A worker leaves when the last stage has nothing left for it."""
    cmd = [sys.executable, "-m", "verl_sweep.search.commands.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs: list[tuple[subprocess.Popen[bytes], float, Path]] = []

    def start(args: list[str], log: Path) -> None:
        with log.open("wb") as out:
            procs.append((subprocess.Popen([*cmd, *args], cwd=work, stdout=out, stderr=subprocess.STDOUT, env=env),
                          time.time(), log))

    start(["run", str(study_file)], work / "driver.log")
    time.sleep(3)  # the driver creates the study; workers join it by name
    for i in range(1, n_workers):
        start(["worker", name, "--storage", storage], work / f"worker{i}.log")
    deadline = time.monotonic() + timeout_s
    ended: dict[int, float] = {}
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for p, _, _ in procs:
            if p.pid not in ended and p.poll() is not None:
                ended[p.pid] = time.time()
        time.sleep(0.2)
    result = {}
    for p, started, log in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        result[p.pid] = (started, ended.get(p.pid, time.time()), p.returncode if p.pid in ended else None, log)
    return result


def read_spans(name: str, storage: str) -> tuple[list[Span], dict[str, int]]:
    """Every probe of the study, those of stages run ahead from a leader that lost included
    (studies renamed ``<stage>~lost<id>``: busy, but wasted; role "wasted")."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spans, counts = [], {"skipped": 0, "extra reruns": 0, "required reruns": 0}
    names = optuna.get_all_study_names(storage)
    for index, (stage, _) in enumerate(STAGES):
        for study_name in [f"{name}.{stage}"] + sorted(n for n in names if n.startswith(f"{name}.{stage}~lost")):
            lost = study_name != f"{name}.{stage}"
            study = optuna.load_study(study_name=study_name, storage=storage)
            for t in study.get_trials(deepcopy=False):
                role = t.user_attrs.get("role", "?")
                if role == "skipped":
                    counts["skipped"] += 1
                if ("run_id" not in t.user_attrs or t.datetime_start is None or t.datetime_complete is None
                        or "carried_from" in t.user_attrs):
                    continue  # never ran a probe (skipped, released before start, or a copy of an earlier run)
                if role == "rerun" and not lost:
                    counts["extra reruns" if t.user_attrs.get("extra") else "required reruns"] += 1
                pid = int((t.user_attrs.get("owner") or {}).get("pid", -1))
                spans.append(Span(pid, index, t.number, "wasted" if lost else role, _ts(t.datetime_start),
                                  _ts(t.datetime_complete), t.state.name))
    return spans, counts


def boundary_windows(spans: list[Span], n_stages: int, study_end: float) -> list[tuple[float, float]]:
    """Per stage: from the start of its last budgeted probe (no candidate or incumbent
    starts after it) to the first probe of the next stage (the study end for the last)."""
    windows = []
    for k in range(n_stages):
        budgeted = [s.start for s in spans if s.stage == k and s.role not in ("rerun", "wasted")]
        nxt = [s.start for s in spans if s.stage == k + 1 and s.role != "wasted"]
        if budgeted:
            windows.append((max(budgeted), min(nxt) if nxt else study_end))
    return windows


def overlap(a: float, b: float, windows: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in windows)


def measure(spans: list[Span], windows: list[tuple[float, float]], study_end: float,
            exits: dict[int, float]) -> list[dict[str, float]]:
    """Per worker: busy and idle seconds from its first probe to the study end, or to its
    exit if it left earlier (a worker leaves when the last stage has nothing left for it)."""
    rows = []
    for pid in sorted({s.pid for s in spans}):
        mine = sorted((s for s in spans if s.pid == pid), key=lambda s: s.start)
        first = mine[0].start
        end = min(study_end, max(exits.get(pid, study_end), mine[-1].end))
        busy, at_boundary, cursor = 0.0, 0.0, first
        for s in mine:  # union of the worker's probe intervals; the gaps are its idle time
            if s.start > cursor:
                at_boundary += overlap(cursor, s.start, windows)
            if s.end > cursor:
                busy += s.end - max(s.start, cursor)
                cursor = s.end
        if end > cursor:
            at_boundary += overlap(cursor, end, windows)
        life = end - first
        rows.append({"pid": pid, "probes": len(mine), "first": first, "life": life, "busy": busy,
                     "idle": life - busy, "boundary": at_boundary})
    return rows


def _idle_in(spans: list[Span], row: dict[str, float], lo: float, hi: float) -> float:
    """A worker's idle seconds within [lo, hi] (inside its counted lifetime)."""
    lo = max(lo, row["first"])
    hi = min(hi, row["first"] + row["life"])
    if hi <= lo:
        return 0.0
    return (hi - lo) - overlap(lo, hi, [(s.start, s.end) for s in _union(s for s in spans if s.pid == row["pid"])])


def _union(spans: "Iterable[Span]") -> list[Span]:
    merged: list[Span] = []
    for s in sorted(spans, key=lambda s: s.start):
        if merged and s.start <= merged[-1].end:
            last = merged[-1]
            merged[-1] = Span(last.pid, last.stage, last.number, last.role, last.start, max(last.end, s.end), last.state)
        else:
            merged.append(s)
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8, help="processes on the study, the driver included")
    parser.add_argument("--storage", default=os.environ.get("VERL_SWEEP_TEST_PG_URL"),
                        help="PostgreSQL URL (default: $VERL_SWEEP_TEST_PG_URL)")
    parser.add_argument("--time-scale", type=float, default=1000.0, help="simulated seconds per real second")
    parser.add_argument("--probe-steps", type=int, default=200)
    parser.add_argument("--max-trials", type=int, default=10, help="budget of each of the 3 stages")
    parser.add_argument("--confirm-top", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the processes are stopped")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="worker-idle-"))
    name = f"idle{uuid.uuid4().hex[:8]}"
    storage = args.storage or f"sqlite:///{work}/{name}.db"
    study_file = write_study(work, name, storage, time_scale=args.time_scale, probe_steps=args.probe_steps,
                             max_trials=args.max_trials, confirm_top=args.confirm_top)
    if storage.startswith("sqlite"):
        parser.error("workers need PostgreSQL (`verl-sweep worker` refuses SQLite): pass --storage postgresql://…")
    began = time.time()
    procs = run_processes(work, study_file, name, storage, args.workers, args.timeout)
    wall = time.time() - began
    failed = {pid: (rc, log) for pid, (_, _, rc, log) in procs.items() if rc != 0}
    for pid, (rc, log) in failed.items():
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print(f"process {pid} exited with {rc}; the end of {log}:", *("  " + line for line in tail), sep="\n")

    spans, counts = read_spans(name, storage)
    if not spans:
        print("no probe ran")
        return 1
    study_start = min(s.start for s in spans)
    study_end = max(s.end for s in spans)
    windows = boundary_windows(spans, len(STAGES), study_end)
    rows = measure(spans, windows, study_end, {pid: ended for pid, (_, ended, _, _) in procs.items()})
    mean_probe = sum(s.end - s.start for s in spans) / len(spans)
    kind = storage.split(":", 1)[0]

    print(f"SIMULATED: {args.workers} worker processes (1 run + {args.workers - 1} worker), 1 probe slot each, "
          f"{kind}, {len(STAGES)} stages × {args.max_trials} trials, confirm_top {args.confirm_top}")
    print(f"simulator time scale {args.time_scale:g}× ({args.probe_steps}-step probes: {mean_probe:.1f} s real "
          f"on average, pruned ones included); study {study_end - study_start:.0f} s, whole run {wall:.0f} s, "
          f"{os.cpu_count()} CPU cores")
    print(f"{len(spans)} probes ({counts['required reruns']} required and {counts['extra reruns']} extra "
          f"re-runs on fresh seeds), {counts['skipped']} trials skipped without a probe")
    ahead = [s for s in spans if s.stage > 0 and s.start < max(p.end for p in spans if p.stage == s.stage - 1)]
    wasted = [s for s in spans if s.role == "wasted"]
    print(f"{len(ahead)} probes started ahead, before the stage before them had ended; {len(wasted)} of them "
          f"wasted (their leader lost): {sum(s.end - s.start for s in wasted):.0f} worker-s")
    print()
    print("worker    probes   busy s   idle s   idle %   at boundary s   start-up s   left s before the end")
    for r in rows:
        started, ended = next(((s, e) for pid, (s, e, _, _) in procs.items() if pid == r["pid"]), (None, None))
        startup = f"{r['first'] - started:10.1f}" if started is not None else "         ?"
        left = f"{max(0.0, study_end - ended):8.1f}" if ended is not None else "       ?"
        print(f"{r['pid']:<9} {r['probes']:>6}  {r['busy']:7.1f}  {r['idle']:7.1f}  {100 * r['idle'] / r['life']:6.1f}"
              f"   {r['boundary']:13.1f}   {startup}   {left}")
    life = sum(r["life"] for r in rows)
    idle = sum(r["idle"] for r in rows)
    boundary = sum(r["boundary"] for r in rows)
    print()
    print(f"idle fraction of worker time: {100 * idle / life:.1f}% "
          f"(at stage boundaries {100 * boundary / life:.1f}%, elsewhere {100 * (idle - boundary) / life:.1f}%)")
    from optuna import load_study

    print("per stage: boundary window (s from the study start), idle worker-s in it, decision")
    for (stage, _), (lo, hi) in zip(STAGES, windows):
        stage_idle = sum(_idle_in(spans, r, lo, hi) for r in rows)
        result = load_study(study_name=f"{name}.{stage}", storage=storage).user_attrs.get("result") or {}
        print(f"  {stage:<10} {lo - study_start:4.0f}-{hi - study_start:4.0f} s  {stage_idle:6.1f} worker-s  "
              f"{result.get('decision', 'no result')}")
    print(f"(logs and database in {work})")
    missing = {r["pid"] for r in rows} ^ set(procs)
    if missing:
        print(f"note: processes without probes or probes without a known process: {sorted(missing)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
