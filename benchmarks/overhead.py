"""Orchestration overhead, in real seconds on real components.

- hand-off: median time from a probe ending (its last metrics line at step N) to the next
  probe starting on the freed slot (its spec.json written), with the staged driver and real
  simulator processes (SimLauncher);
- ask + tell latency of the driver's samplers on a study already holding 1,000 and 10,000
  trials, on SQLite and on PostgreSQL (``$VERL_SWEEP_TEST_PG_URL`` or the local server), with
  verl-sweep's storage and, side by side, Optuna's own RDBStorage;
- ``verl-sweep status`` wall time (a subprocess, as a user runs it) on a 10,000-trial study.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOCAL_PG = "postgresql://sweep:sweep-test@127.0.0.1:5432/sweep"


def measure_handoff(*, n_trials: int = 8) -> dict[str, Any]:
    """Real probes through the driver: slot hand-off times from the run directories."""
    import yaml

    from verl_sweep.launchers.sim import SimLauncher
    from verl_sweep.search.views.console import Console
    from verl_sweep.search.engine.driver import StudyRunner
    from verl_sweep.search.database.storage import open_storage
    from verl_sweep.search.spec.study_file import parse_study
    from verl_sweep.spaces import build_space

    data = yaml.safe_load((REPO / "studies" / "demo.yaml").read_text())
    data.update(name="handoff", probe={**data["probe"], "steps": 40})
    data["stages"] = [{"name": "minibatch", "space": "mini_batch", "budget": {"max_trials": n_trials}, "confirm_top": 0}]
    spec = parse_study(data)
    with tempfile.TemporaryDirectory(prefix="vs-handoff-") as tmp:
        storage = open_storage(f"sqlite:///{tmp}/handoff.db")
        launcher = SimLauncher(Path(tmp) / "runs", max_concurrent=2, time_scale=40000.0)
        runner = StudyRunner(spec, storage, launcher, console=Console(quiet=True), build_space=build_space)
        started = time.perf_counter()
        runner.run()
        wall = time.perf_counter() - started
        runs = []
        for spec_path in sorted((Path(tmp) / "runs").glob("*/spec.json")):
            info = json.loads(spec_path.read_text())
            metrics = spec_path.with_name("metrics.jsonl")
            end = metrics.stat().st_mtime if metrics.exists() else spec_path.stat().st_mtime
            runs.append((int(info.get("slot", 0)), spec_path.stat().st_mtime, end))
    gaps = []
    for slot in {r[0] for r in runs}:
        mine = sorted((r for r in runs if r[0] == slot), key=lambda r: r[1])
        gaps += [nxt[1] - cur[2] for cur, nxt in zip(mine, mine[1:]) if nxt[1] >= cur[2]]
    return {"n_probes": len(runs), "n_handoffs": len(gaps), "median_s": statistics.median(gaps) if gaps else None,
            "max_s": max(gaps) if gaps else None, "study_wall_s": wall}  # fmt: skip


def _distributions() -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    return {
        "mini_batch": CategoricalDistribution([384, 400, 416, 432, 448, 464, 480, 496, 512, 528, 544, 560, 576, 592, 608, 624, 640]),
        "kl_coef": FloatDistribution(0.0005, 0.01, log=True),
        "token_budget": IntDistribution(2048, 114688),
        "lr": FloatDistribution(5e-7, 5e-6, log=True),
    }


def _fill(storage: Any, study: Any, n: int, seed: int = 0) -> float:
    """Add ``n`` finished trials to ``study`` in one transaction; seconds it took.

    Written with Optuna's own table definitions in bulk: ``add_trials`` makes one transaction
    of tens of statements per trial: minutes for 10,000 (docs/method.md, Evidence). The trials are read back through Optuna and checked, so the study
    is one Optuna itself would have written."""
    import datetime

    import numpy as np
    import sqlalchemy as sa
    from optuna.distributions import distribution_to_json
    from optuna.storages._rdb import models
    from optuna.trial import TrialState

    rng = np.random.default_rng(seed)
    dists = _distributions()
    rows = []
    for _ in range(n):
        params = {
            "mini_batch": int(rng.choice(dists["mini_batch"].choices)),
            "kl_coef": float(np.exp(rng.uniform(np.log(0.0005), np.log(0.01)))),
            "token_budget": int(rng.integers(2048, 114688)),
            "lr": float(np.exp(rng.uniform(np.log(5e-7), np.log(5e-6)))),
        }
        rows.append((params, float(rng.normal(1.0, 0.05))))
    as_json = {name: distribution_to_json(d) for name, d in dists.items()}
    trials_table = models.TrialModel.__table__
    now = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)  # Optuna stores naive UTC
    started = time.perf_counter()
    with storage.engine.begin() as conn:
        first = conn.execute(sa.select(sa.func.count()).select_from(trials_table)
                             .where(trials_table.c.study_id == study._study_id)).scalar_one()  # fmt: skip
        conn.execute(sa.insert(trials_table), [
            {"number": first + i, "study_id": study._study_id, "state": TrialState.COMPLETE,
             "datetime_start": now, "datetime_complete": now} for i in range(n)])  # fmt: skip
        ids = dict(conn.execute(sa.select(trials_table.c.number, trials_table.c.trial_id)
                                .where(trials_table.c.study_id == study._study_id, trials_table.c.number >= first)).all())  # fmt: skip
        conn.execute(sa.insert(models.TrialParamModel.__table__), [
            {"trial_id": ids[first + i], "param_name": name, "distribution_json": as_json[name],
             "param_value": dists[name].to_internal_repr(value)}
            for i, (params, _) in enumerate(rows) for name, value in params.items()])  # fmt: skip
        conn.execute(sa.insert(models.TrialValueModel.__table__), [
            {"trial_id": ids[first + i], "objective": 0, "value": value,
             "value_type": models.TrialValueModel.TrialValueType.FINITE} for i, (_, value) in enumerate(rows)])  # fmt: skip
        conn.execute(sa.insert(models.TrialUserAttributeModel.__table__), [
            {"trial_id": ids[first + i], "key": "role", "value_json": json.dumps("candidate")} for i in range(n)])
    elapsed = time.perf_counter() - started
    stored = study.get_trials(deepcopy=False)[first:]
    if [(t.params, t.value, t.user_attrs) for t in stored] != [(p, v, {"role": "candidate"}) for p, v in rows]:
        raise RuntimeError("the trials written in bulk do not read back as written")
    return elapsed


def _verl_sweep_study(storage: Any, n: int) -> tuple[str, Any]:
    """A verl-sweep study (root + first stage) whose stage holds ``n`` finished trials."""
    import optuna
    import yaml

    from verl_sweep.search.engine.driver import save_spec
    from verl_sweep.search.spec.study_file import parse_study

    data = yaml.safe_load((REPO / "studies" / "demo.yaml").read_text())
    name = f"benchoverhead{uuid.uuid4().hex[:8]}"
    data["name"] = name
    spec = parse_study(data)
    save_spec(storage, spec)
    stage = optuna.create_study(study_name=f"{name}.{spec.stages[0].name}", storage=storage, direction="maximize")
    stage.set_user_attr("base_config", spec.baseline_config())
    return name, stage


def _optuna_storage(storage: Any) -> Any:
    """A second handle on the same database, with the same pooled engine, but Optuna's own
    RDBStorage instead of verl-sweep's ``SweepStorage``: the before/after of its fast paths."""
    from optuna.storages import RDBStorage

    plain = RDBStorage.__new__(RDBStorage)
    plain.__setstate__(storage.__getstate__())  # what unpickling does: a new engine from engine_kwargs
    return plain


def _sampler(name: str) -> Any:
    import optuna

    from verl_sweep.search.method.sampler import build_sampler
    from verl_sweep.search.spec.study_file import StageSettings

    if name.startswith("tpe"):  # as the driver builds it: a stage's default, or multivariate (systems)
        stage = StageSettings.model_validate({"name": "x", "space": "lr", "budget": {"max_trials": 10},
                                              "sampler": {"seed": 0, "multivariate": name == "tpe-mv"}})  # fmt: skip
        return build_sampler(stage, 0)
    return optuna.samplers.RandomSampler(seed=0)


def _time_ask_tell(studies: dict[str, Any], n_cycles: int) -> dict[str, list[float]]:
    """``n_cycles`` ask + tell on each study, interleaved so that a busy machine slows all alike."""
    dists = _distributions()
    times: dict[str, list[float]] = {key: [] for key in studies}
    for i in range(n_cycles):
        for key, study in studies.items():
            t0 = time.perf_counter()
            trial = study.ask(dists)
            study.tell(trial, 1.0 + 0.001 * i)
            times[key].append(time.perf_counter() - t0)
    return times


def measure_backend(url: str, cycles: dict[int, int], *, status_at: int | None = None,
                    compare_optuna: bool = False, in_memory: bool = False) -> dict[str, Any]:  # fmt: skip
    """Per size in ``cycles`` (trials: ask + tell cycles): fill a verl-sweep stage study with
    that many trials (``_fill``), time that many ask + tell with TPE as the driver builds it
    and with random; at ``status_at`` trials also time ``verl-sweep status`` on it (a
    subprocess, as users run it). ``compare_optuna``: also time Optuna's own RDBStorage on the
    same pool, interleaved with verl-sweep's (``sweep``). ``in_memory``: also time the same
    trials in Optuna's in-memory storage, which is the sampler's own cost with no database."""
    import optuna

    from verl_sweep.search.database.storage import open_storage

    storage = open_storage(url)
    backend = url.split(":")[0].split("+")[0]
    handles = {"sweep": storage}
    if compare_optuna:
        handles["optuna"] = _optuna_storage(storage)
    rows: list[dict[str, Any]] = []
    status: list[dict[str, Any]] = []
    name, stage = _verl_sweep_study(storage, 0)
    filled = 0
    for size, n_cycles in cycles.items():
        fill_s = _fill(storage, stage, size - filled, seed=size)
        filled = size
        memory = None
        if in_memory:
            memory = optuna.create_study(direction="maximize")
            memory.add_trials(stage.get_trials(deepcopy=False))
        for sampler_name in ("tpe", "tpe-mv", "random"):
            studies = {key: optuna.load_study(study_name=stage.study_name, storage=handle, sampler=_sampler(sampler_name))
                       for key, handle in handles.items()}  # fmt: skip
            if memory is not None:
                memory.sampler = _sampler(sampler_name)
                studies["memory"] = memory
            times = _time_ask_tell(studies, n_cycles)
            filled += n_cycles * len(handles)
            for key, ts in times.items():
                label = "in-memory" if key == "memory" else backend
                engine = "" if key == "memory" or len(handles) == 1 else key
                rows.append({"backend": label, "engine": engine, "trials": size, "sampler": sampler_name,
                             "median_ms": 1000 * statistics.median(ts), "max_ms": 1000 * max(ts), "fill_s": fill_s})  # fmt: skip
        if status_at is not None and size == status_at:
            started = time.perf_counter()
            proc = subprocess.run([str(Path(sys.executable).with_name("verl-sweep")), "status", name, "--storage", url],
                                  capture_output=True, text=True, timeout=600)  # fmt: skip
            status.append({"backend": backend, "trials": filled, "wall_s": time.perf_counter() - started,
                           "exit_code": proc.returncode,
                           "error": proc.stderr.strip().splitlines()[-1] if proc.returncode and proc.stderr.strip() else ""})  # fmt: skip
    return {"ask_tell": rows, "status": status}


def pg_url() -> str | None:
    """The PostgreSQL URL to use, or None when no server answers."""
    url = os.environ.get("VERL_SWEEP_TEST_PG_URL") or LOCAL_PG
    try:
        import sqlalchemy

        with sqlalchemy.create_engine(url).connect():
            return url
    except Exception:  # noqa: BLE001 - any failure means: no server to measure
        return None


def measure_all(*, quick: bool = False) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    result: dict[str, Any] = {"handoff": measure_handoff(n_trials=4 if quick else 8), "ask_tell": [], "status": []}
    # 30 cycles at 1,000 trials: the median of 10 moved by a quarter between runs minutes apart
    cycles = {200: 3} if quick else {1000: 30, 10000: 10}
    status_at = max(cycles)
    # tmpfs when there is one: SQLite's fsync per trial would otherwise dominate the filling.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vs-asktell-", dir=shm) as tmp:
        part = measure_backend(f"sqlite:///{tmp}/overhead.db", cycles, status_at=status_at, compare_optuna=not quick)
        result["ask_tell"] += part["ask_tell"]
        result["status"] += part["status"]
    url = None if quick else pg_url()
    if url is not None:
        part = measure_backend(url, cycles, status_at=status_at, compare_optuna=True)
        result["ask_tell"] += part["ask_tell"]
        result["status"] += part["status"]
    else:
        result["postgres"] = "skipped (--quick)" if quick else "no PostgreSQL server answered"
    return result


def format_overhead(data: dict[str, Any]) -> str:
    lines = ["orchestration overhead (real seconds)"]
    h = data.get("handoff")  # absent with --ask-tell-only
    if h is not None:
        lines.append(f"  probe-to-probe hand-off on a freed slot: median {h['median_s']:.3f} s, max {h['max_s']:.3f} s "
                     f"({h['n_handoffs']} hand-offs, SimLauncher, real processes)" if h["median_s"] is not None
                     else "  hand-off: none measured")  # fmt: skip
    for row in data["ask_tell"]:
        backend = f"{row['backend']} ({row['engine']})" if row.get("engine") else row["backend"]
        lines.append(f"  ask+tell {backend:<21} {row['trials']:>6} trials {row['sampler']:<6}: median "
                     f"{row['median_ms']:.1f} ms (max {row['max_ms']:.1f} ms; filling took {row['fill_s']:.1f} s)")  # fmt: skip
    for row in data["status"]:
        extra = f" — exit {row['exit_code']}: {row['error']}" if row["exit_code"] else ""
        lines.append(f"  verl-sweep status {row['backend']:<10} {row['trials']:>6} trials: {row['wall_s']:.2f} s{extra}")
    if "postgres" in data:
        lines.append(f"  PostgreSQL: {data['postgres']}")
    return "\n".join(lines)


def measure_ask_tell(*, n_trials: int = 1000, n_cycles: int = 30, postgres: bool = True) -> dict[str, Any]:
    """Only the ask + tell latency at ``n_trials``: SQLite and PostgreSQL, each with verl-sweep's
    and Optuna's storage interleaved, and the in-memory storage (the sampler alone); no hand-off, no status."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    result: dict[str, Any] = {"ask_tell": [], "status": []}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vs-asktell-", dir=shm) as tmp:
        result["ask_tell"] += measure_backend(f"sqlite:///{tmp}/overhead.db", {n_trials: n_cycles},
                                              compare_optuna=True, in_memory=True)["ask_tell"]  # fmt: skip
    url = pg_url() if postgres else None
    if url is not None:
        result["ask_tell"] += measure_backend(url, {n_trials: n_cycles}, compare_optuna=True)["ask_tell"]
    else:
        result["postgres"] = "skipped (--no-postgres)" if not postgres else "no PostgreSQL server answered"
    return result


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.overhead --ask-tell-only``: the ask + tell measure alone (about a
    minute); without the flag, everything that ``benchmarks.run`` measures."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ask-tell-only", action="store_true", help="only ask + tell latency at --trials")
    parser.add_argument("--trials", type=int, default=1000, help="trials in the study (--ask-tell-only)")
    parser.add_argument("--cycles", type=int, default=30, help="ask + tell cycles per sampler and engine")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    parser.add_argument("--quick", action="store_true", help="small sizes, no PostgreSQL (full measure)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    if args.ask_tell_only:
        data = measure_ask_tell(n_trials=args.trials, n_cycles=args.cycles, postgres=not args.no_postgres)
    else:
        data = measure_all(quick=args.quick)
    print(format_overhead(data))
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
