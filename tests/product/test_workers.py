"""Many workers on one real PostgreSQL study; faults: SIGKILL, SIGTERM, a database restart."""

from __future__ import annotations

import collections
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.cluster import (all_trials, processes_mentioning, require_pg, require_pg_restart, start_cli, stop_all, tiny_study,
                     unpooled_storage, wait_for_root)
from support import cli

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _check_study(url: str, name: str, budgets: dict[str, int]) -> dict[str, int]:
    """Every stage of the chain: no run twice, nothing left queued or running, the budget
    exact. Stages run ahead from a leader that lost were moved aside (``<stage>~lost<id>``):
    nothing may be left queued or running there either, and their runs count as wasted."""
    from optuna.trial import TrialState

    trials = all_trials(url, name)
    chain = {f"{name}.{stage}" for stage in budgets}
    assert chain <= set(trials), sorted(trials)
    known = chain | {f"{name}.final"}  # the final check, the driver's alone
    assert all(n in known or n.split("~lost")[0] in chain for n in trials), sorted(trials)
    run_ids = [t.user_attrs["run_id"] for ts in trials.values() for t in ts
               if "run_id" in t.user_attrs and "carried_from" not in t.user_attrs]  # a copy keeps its source's id
    assert len(run_ids) == len(set(run_ids)), "a run id was used twice"
    # Incumbent runs on seeds beyond the incumbent's own (carried from the stage before, or
    # run to pair a leader's) are outside the budget.
    import optuna

    from verl_sweep.search.database.records import SPEC_ATTR

    with unpooled_storage(url) as opened:
        spec = optuna.load_study(study_name=name, storage=opened).user_attrs[SPEC_ATTR]
    own = spec["seeds"][: spec["probe"]["incumbent_repeats"]]
    counts: collections.Counter[str] = collections.Counter()
    for study_name, stage_trials in trials.items():
        assert not [t.number for t in stage_trials if t.state in (TrialState.RUNNING, TrialState.WAITING)], study_name
        if study_name not in chain:
            counts["wasted (run ahead, leader lost)"] += sum("run_id" in t.user_attrs for t in stage_trials)
            continue
        stage = study_name.split(".")[-1]
        requeued = {n for t in stage_trials for n in t.system_attrs.get("retry_history", [])}
        counted = [t for t in stage_trials if t.number not in requeued
                   and t.user_attrs.get("role") not in ("rerun", "skipped")
                   and not (t.user_attrs.get("role") == "incumbent" and t.user_attrs.get("seed") not in own)]
        assert len(counted) == budgets[stage], f"{study_name}: {len(counted)} counted trials, budget {budgets[stage]}"
        for t in stage_trials:
            counts[t.state.name.lower()] += 1
            if t.number in requeued:
                counts["requeued"] += 1
            if t.user_attrs.get("role") == "skipped":
                counts["skipped"] += 1
    return dict(counts)


def _ran_ahead(url: str, name: str, first: str, second: str) -> int:
    """Probes of stage ``second`` (kept or moved aside) that started before stage ``first``'s
    last probe ended."""
    trials = all_trials(url, name)
    end = max(t.datetime_complete for t in trials[f"{name}.{first}"] if t.datetime_complete)
    return sum(1 for n, ts in trials.items() if n.split("~lost")[0] == f"{name}.{second}"
               for t in ts if "run_id" in t.user_attrs and t.datetime_start < end)


def test_sixteen_workers_share_one_postgres_study(tmp_path: Path) -> None:
    url = require_pg()
    study, name = tiny_study(tmp_path, budgets=(10, 10), storage=url)
    logs = tmp_path / "logs"
    logs.mkdir()
    first = start_cli("run", str(study), cwd=tmp_path, log=logs / "w00.log")
    procs = [first]
    try:
        wait_for_root(url, name)
        for i in range(1, 16):
            procs.append(start_cli("worker", name, "--storage", url, cwd=tmp_path, log=logs / f"w{i:02d}.log"))
        for i, p in enumerate(procs):
            assert p.wait(timeout=900) == 0, (logs / f"w{i:02d}.log").read_text()[-3000:]
    finally:
        stop_all(procs)
    text = "\n".join(f.read_text() for f in sorted(logs.iterdir()))
    for bad in ("database is locked", "too many clients", "OperationalError", "Traceback"):
        assert bad not in text, bad
    counts = _check_study(url, name, {"minibatch": 10, "lr": 10})
    ahead = _ran_ahead(url, name, "minibatch", "lr")
    left = text.count("worker left study")
    print(f"16 workers: trial states {counts}; {ahead} lr probes started before minibatch ended; "
          f"{left} workers left before the end")
    assert ahead > 0, "idle workers should run the next stage ahead at the boundary"
    # 16 workers on a 10-trial last stage: some have nothing left there and hand their GPUs back.
    assert left > 0 and "worker left study" not in (logs / "w00.log").read_text()  # `run` stays to report
    exported = cli("export", name, "--storage", url, "--format", "overrides", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=" in exported.stdout
    assert processes_mentioning(str(tmp_path)) == []


def _completed(url: str, name: str, seen: dict[int, float | None]) -> int:
    """Record every completed trial's value in ``seen`` (trial ids survive a stage moved aside);
    how many there are."""
    for trials in all_trials(url, name).values():
        for t in trials:
            if t.state.name == "COMPLETE":
                seen[t._trial_id] = t.value
    return len(seen)


def test_faults_kill_workers_and_restart_postgres(tmp_path: Path) -> None:
    url = require_pg()
    restart = require_pg_restart()
    # Probes 5x slower than tiny_study's (~5 s each), so that a fault strikes a worker mid-probe.
    # The faults strike at counts of completed trials, not at times, so the probes' length only
    # sets how long the study takes (at 1,000x, ~22 s a probe, it took 4 minutes). No final
    # check: every fault strikes before it, and the driver alone would run its six slow probes
    # one by one (test_final_check.py kills and resumes in it).
    study, name = tiny_study(tmp_path, budgets=(10, 10), storage=url, final_check=False,
                             launcher={"kind": "sim", "max_concurrent": 1, "options": {"time_scale": 4000}})
    logs = tmp_path / "logs"
    logs.mkdir()
    rng = random.Random(7)
    procs = [start_cli("run", str(study), cwd=tmp_path, log=logs / "w00.log")]
    wait_for_root(url, name)
    procs += [start_cli("worker", name, "--storage", url, cwd=tmp_path, log=logs / f"w{i:02d}.log") for i in range(1, 6)]
    born = {p.pid: time.monotonic() for p in procs}
    faults = collections.Counter()
    completed_seen: dict[int, float | None] = {}
    # Each fault strikes when the study has completed this many trials (about 33 in all), not
    # after a fixed time: a faster or slower machine still gets every fault mid-study.
    strike_at = (2, 5, 8, 11, 14, 17)
    try:
        for round_, at in enumerate(strike_at):
            while _completed(url, name, completed_seen) < at and any(p.poll() is None for p in procs):
                time.sleep(0.3)
            alive = [p for p in procs if p.poll() is None]
            if not alive:
                break
            victim = rng.choice(alive)
            if round_ == 2:
                subprocess.run(restart, shell=True, check=True, timeout=120)
                faults["postgres restart"] += 1
            elif round_ % 2 == 0:
                victim.send_signal(signal.SIGKILL)
                faults["SIGKILL"] += 1
            else:
                # Not in its first second: a process signalled while the interpreter itself
                # starts, before any of verl-sweep's code runs, cannot stop cleanly.
                time.sleep(max(0.0, born[victim.pid] + 1.5 - time.monotonic()))
                victim.send_signal(signal.SIGTERM)
                started = time.monotonic()
                code = victim.wait(timeout=30)
                assert code == 130, f"SIGTERM should stop a worker cleanly (exit 130), got {code}"
                faults["SIGTERM"] += 1
                faults["SIGTERM exit s"] = round(time.monotonic() - started, 1)
            procs.append(start_cli("worker", name, "--storage", url, cwd=tmp_path, log=logs / f"r{round_:02d}.log"))
            born[procs[-1].pid] = time.monotonic()
        for p in procs:
            if p.poll() is None:
                p.wait(timeout=900)
        final = cli("resume", name, "--storage", url, cwd=tmp_path, timeout=900)
        assert final.returncode == 0, final.stdout[-2000:] + final.stderr[-2000:]
    finally:
        stop_all(procs)
    assert faults["postgres restart"] == 1, f"the study ended before its faults ({dict(faults)})"
    counts = _check_study(url, name, {"minibatch": 10, "lr": 10})
    after = {t._trial_id: t.value for ts in all_trials(url, name).values() for t in ts}
    for key, value in completed_seen.items():
        assert after[key] == value, f"completed trial {key} changed or was lost"
    assert processes_mentioning(str(tmp_path)) == []
    print(f"faults {dict(faults)}; trial states {counts}; completed trials kept: {len(completed_seen)}")
