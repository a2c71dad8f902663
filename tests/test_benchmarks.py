"""The benchmark command: --quick runs end to end and its table/JSON are sane; its measures
are computed right on hand-made traces."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run import eta_at, hours_to_reach, median_interval
from cluster import require_pg

REPO = Path(__file__).resolve().parents[1]


def test_hours_to_reach_and_eta_at_budget_read_the_trace() -> None:
    points = [(0.0, 1.0), (100.0, 1.2), (250.0, 1.5)]
    assert hours_to_reach(points, 1.1) == 100.0
    assert hours_to_reach(points, 1.5) == 250.0
    assert hours_to_reach(points, 1.6) == math.inf
    assert eta_at(points, 99.0) == 1.0
    assert eta_at(points, 260.0) == 1.5


def test_median_interval_with_never_reached() -> None:
    assert median_interval([1.0, 2.0, 3.0]) == (2.0, 1.5, 2.5)
    med, low, high = median_interval([1.0, 2.0, math.inf])
    assert med == 2.0 and low == 1.5 and math.isinf(high)
    assert math.isinf(median_interval([1.0, math.inf, math.inf])[0])


@pytest.mark.slow
def test_quick_benchmark_prints_table_and_writes_json(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--no-overhead", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GPU-h to 95% best" in proc.stdout
    for method in ("verl-sweep", "manual", "random", "tpe"):
        assert f"default    {method}" in proc.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["reps"] == 2 and data["landscapes"] == ["default"]
    assert len(data["runs"]) == 2 * 4
    best = data["best"]["default"]["best_eta"]
    assert best > 1.0  # the baseline is not the optimum of the default landscape
    for run in data["runs"]:
        etas = [eta for _, eta in run["points"]]
        hours = [h for h, _ in run["points"]]
        assert etas[0] == pytest.approx(1.0)  # every method starts from the baseline
        assert hours == sorted(hours) and run["gpu_h"] >= hours[-1] > 0 or len(hours) == 1
        assert max(etas) <= best * 1.0 + 1e-9 or run["method"] == "manual"  # manual may leave the bounds
        assert 0.0 <= run["idle_fraction"] < 1.0
        assert run["pruned_saved_gpu_h"] >= 0.0
    for row in data["rows"]:
        assert 0.0 <= row["false_win_rate"] <= 1.0
    assert (tmp_path / "curves.html").stat().st_size > 1000
    assert any(line.startswith("default: verl-sweep/random") for line in data["acceptance"])


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_overhead_fill_writes_trials_that_optuna_reads_and_samples_from(tmp_path: Path, backend: str) -> None:
    """The ask + tell benchmark fills its study in bulk, past Optuna's API: the trials must be
    the ones Optuna would have written (numbers in order, values, parameters), and the
    driver's TPE must ask and tell on them."""
    import optuna

    from benchmarks.overhead import _distributions, _fill, _sampler, _verl_sweep_study
    from search.storage import open_storage

    url = f"sqlite:///{tmp_path}/fill.db" if backend == "sqlite" else require_pg()
    storage = open_storage(url)
    _, stage = _verl_sweep_study(storage, 0)
    _fill(storage, stage, 150, seed=1)
    _fill(storage, stage, 150, seed=2)  # numbering goes on from the trials already there

    study = optuna.load_study(study_name=stage.study_name, storage=storage, sampler=_sampler("tpe"))
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(300))
    assert all(t.state == optuna.trial.TrialState.COMPLETE and t.value is not None for t in trials)
    assert len({t.params["lr"] for t in trials}) == 300  # two seeds, not one repeated
    trial = study.ask(_distributions())
    study.tell(trial, 1.0)
    assert trial.number == 300 and study.trials[-1].state == optuna.trial.TrialState.COMPLETE
