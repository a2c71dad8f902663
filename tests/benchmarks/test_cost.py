"""The benchmark's cost measures: R (one full run of the baseline, in GPU-hours), each run's cost
in R and break-even, the full-run horizon, the fast noise-free rate, and the table that shows
them (SIMULATED worlds; no study is run here)."""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path

import pytest

from support import REPO

from benchmarks import run as R

pytestmark = pytest.mark.fast

BLIND = REPO / "benchmarks" / "blind"


def _second_route_r(world: str, steps: int) -> float:
    """R by hand: the baseline's noise-free step times (the landscape's own loop) summed over
    ``steps``, plus the replay launcher's 120 s start-up, × its 8 GPUs a run."""
    from verl_sweep.launchers.simulator import load_landscape

    land = load_landscape(world)
    base = R.demo_spec(world).baseline_config()
    seconds = sum(land.step_time(base, t) for t in range(1, steps + 1))
    return (120.0 + seconds) * 8 / 3600.0


@pytest.mark.parametrize("world", ["default", "slow_start", "ppo_lam", str(BLIND / "blind_couple_down_ppo.yaml")])
def test_r_is_the_baselines_noise_free_seconds_times_gpus_plus_one_startup(world: str) -> None:
    from verl_sweep.launchers.simulator import load_landscape

    full = R.full_run(world, R.demo_spec(world))
    assert full["run_steps"] == R.true_steps(load_landscape(world)) == 2000
    assert full["run_n_gpus"] == 8 and full["run_startup_s"] == 120.0
    assert full["run_gpu_h"] == pytest.approx(_second_route_r(world, 2000), rel=1e-9)
    # a 7B world: a full run is hundreds of GPU-hours, a 500-step probe about a fifth of it
    assert 300.0 < full["run_gpu_h"] < 3000.0


def test_the_replay_launcher_counts_a_runs_gpu_hours_as_r_does(tmp_path: Path) -> None:
    """The study's GPU-hours (the launcher's slot accounting) hold the run's GPUs from its
    start, start-up included, to its last step: R counts a full run the same way."""
    from benchmarks import methods as M
    from verl_sweep.launchers.base import RunSpec
    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.verl_knowledge import merge, to_overrides

    config = merge(R.demo_spec("default").baseline_config(), {"trainer.total_training_steps": 4, "data.seed": 3})
    launcher = M.replay_launcher(tmp_path, "default")
    handle = launcher.start(RunSpec(run_id="r.full", overrides=tuple(to_overrides(config)), n_gpus=8))
    while not launcher.poll(handle).status.is_finished:
        launcher.wait(600.0)
    (usage,) = launcher.usage()
    launcher.close()
    steps = list(load_landscape("default").simulate(merge(config, {"trainer.n_gpus_per_node": 8})))
    assert usage.last_step == len(steps) == 4
    full = R.full_run("default", R.demo_spec("default"), steps=4)
    assert usage.gpu_s == pytest.approx((full["run_startup_s"] + sum(s.step_time_s for s in steps)) * full["run_n_gpus"],
                                        rel=1e-12)  # fmt: skip


def test_the_horizon_is_the_full_runs_length() -> None:
    from verl_sweep.launchers.simulator import load_landscape

    land = load_landscape("default")
    assert "benchmark" not in land.data and R.true_steps(land) == R.RUN_STEPS == 2000
    longer = dataclasses.replace(land, data={**land.data, "benchmark": {"true_steps": 3000}})
    assert R.true_steps(longer) == 3000
    assert R.true_steps(land, R.demo_spec("default")) == 2000  # not the probe's 500 steps


def test_the_fast_rate_equals_the_landscapes_own() -> None:
    """20 random configs of the joint space (and the baseline) on three worlds, at the probe's
    and the full run's length: the same rate to 1e-9 (NaN where the landscape's is NaN)."""
    import optuna

    from benchmarks.joint import FairJointSpace
    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.verl_knowledge import merge

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    compared = 0
    for world in ("default", "slow_start", str(BLIND / "blind_couple_down_ppo.yaml")):
        spec, land = R.demo_spec(world), load_landscape(world)
        space, base = FairJointSpace(spec), spec.baseline_config()
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=7))
        configs = [base, *(merge(base, space.to_config(space.suggest_values(study.ask()))) for _ in range(20))]
        for steps in (500, 2000):
            for config in configs:
                old, new = land.true_rate(config, steps), R.true_rate(land, config, steps)
                assert math.isnan(old) == math.isnan(new), (world, config)
                if not math.isnan(old):
                    assert new == pytest.approx(old, rel=1e-9, abs=0), (world, steps, config)
                    compared += 1
    assert compared > 60  # most random configs run


def test_break_even_is_never_at_or_below_the_baselines_eta() -> None:
    assert R.break_even_runs(100.0, 50.0, 1.0) is None
    assert R.break_even_runs(100.0, 50.0, 0.7) is None
    assert R.break_even_runs(100.0, 50.0, 0.0) is None
    assert R.break_even_runs(100.0, 50.0, 2.0) == pytest.approx(4.0)  # each run saves 25 GPU-h
    runs = [{"landscape": "w", "gpu_h": 100.0, "final_eta": eta} for eta in (0.9, 2.0)]
    R.add_cost(runs, {"w": 50.0})
    assert [r["cost_r"] for r in runs] == [2.0, 2.0]
    assert runs[0]["break_even_runs"] is None and runs[1]["break_even_runs"] == pytest.approx(4.0)


def _run(method: str, rep: int, eta: float, gpu_h: float) -> dict:
    return {"landscape": "flat", "method": method, "rep": rep, "points": [(0.0, 1.0), (gpu_h, eta)], "gpu_h": gpu_h,
            "final_eta": eta, "pruned_saved_gpu_h": 0.0, "idle_fraction": 0.0}  # fmt: skip


def _rows(cost_gpu_h: float, manual_eta: float = 0.95) -> list[dict]:
    results = [_run("verl-sweep", rep, 2.0, cost_gpu_h) for rep in range(10)]
    results += [_run("manual", rep, manual_eta, 300.0) for rep in range(3)]
    R.add_cost(results, {"flat": 400.0})
    return R.summarize(results, {"flat": {"best_eta": 2.0, "run_gpu_h": 400.0, "true_steps": 2000}}, {"flat": 400.0})


def test_the_table_shows_cost_in_r_and_break_even() -> None:
    rows = _rows(600.0)
    table = R.format_table(rows, {"flat": 400.0})
    head = table.splitlines()[0]
    assert head.rstrip().endswith("cost R break-even")
    by = {line.split()[2]: line for line in table.splitlines()[2:4]}
    # verl-sweep: 600 GPU-h = 1.50 R; η 2 saves 200 GPU-h a run: 3.0 runs. manual: η < 1, never.
    assert by["verl-sweep"].split()[-2:] == ["1.50", "3.0"]
    assert by["manual"].split()[-2:] == ["0.75", "never"]
    assert "flat: 400 GPU-h, 2,000 steps" in table


def test_the_acceptance_line_counts_the_cost_and_a_summary_line_follows() -> None:
    cheap, dear = R.acceptance(_rows(600.0)), R.acceptance(_rows(900.0))
    assert "cost 1.50 R (≤2)" in cheap[0] and "cost 2.25 R (≤2)" in dear[0]
    assert "FAIL" in dear[0]
    # with no peer in the run the GPU-h ratio fails either way: the cost alone must not pass it
    assert cheap[0].endswith("FAIL") and "GPU-h ÷ None" in cheap[0]
    assert cheap[-1] == "verl-sweep over 1 world: median cost 1.50 R, median break-even 3.0 runs"


def test_the_cost_decides_a_world_that_passes_everything_else() -> None:
    rows = _rows(600.0)
    vs = next(r for r in rows if r["method"] == "verl-sweep")
    vs["ratio_to_best_peer"], vs["best_peer"] = 0.3, "tpe"
    assert R.acceptance(rows)[0].endswith("→ PASS")
    vs["cost_r"] = (2.01, 2.01, 2.01)
    assert R.acceptance(rows)[0].endswith("→ FAIL")


def test_the_summary_gives_the_report_and_blind_median_when_both_are_there() -> None:
    rows = []
    for world, split, cost, runs in (("a", "report", 1.0, 2.0), ("b", "blind", 2.0, math.inf), ("c", "tune", 3.0, 5.0)):
        rows.append({"landscape": world, "split": split, "method": "verl-sweep", "cost_r": (cost, cost, cost),
                     "break_even": (runs, runs, runs)})  # fmt: skip
    line = R.cost_summary(rows)
    assert line.startswith("verl-sweep over 3 worlds: median cost 2.00 R, median break-even 5.0 runs")
    assert "report+blind (2 worlds): median cost 1.50 R, median break-even never (goal ≤ 1.5 R: met)" in line
    assert R.cost_summary([{**r, "cost_r": None} for r in rows]) is None


def test_an_older_results_json_still_renders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A results.json from before R: no cost fields in its runs, no R in its references. R is
    recomputed for a world that can still be found; a world that cannot has blank columns."""
    runs = []
    for world in ("default", "gone_world"):
        for rep in range(2):
            runs.append({"landscape": world, "method": "verl-sweep", "rep": rep, "points": [[0.0, 1.0], [2000.0, 2.0]],
                         "gpu_h": 2000.0, "final_eta": 2.0, "pruned_saved_gpu_h": 0.0, "idle_fraction": 0.0})  # fmt: skip
    old = {"runs": runs, "best": {w: {"best_eta": 2.1, "true_steps": 500} for w in ("default", "gone_world")},
           "budget_gpu_h": {"default": 2000.0, "gone_world": 2000.0}}  # fmt: skip
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert R.main(["--from-results", str(path), "--out", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    expected_r = _second_route_r("default", 2000)
    line = next(line for line in out.splitlines() if line.startswith("default "))
    assert line.split()[-2:] == [f"{2000.0 / expected_r:.2f}", f"{2000.0 / (expected_r * 0.5):.1f}"]
    gone = next(line for line in out.splitlines() if line.startswith("gone_world "))
    assert gone.rstrip().endswith("2,000")  # GPU-h spent, then the two blank columns
    assert "gone_world: unknown, 500 steps" in out and "cost unknown R (≤2) → FAIL" in out
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert again["run_gpu_h"]["default"] == pytest.approx(expected_r, rel=1e-9) and again["run_gpu_h"]["gone_world"] is None


def test_every_shipped_and_blind_world_has_a_kept_reference_with_r() -> None:
    """benchmarks/references holds the current reference (this BEST_VERSION's key) of every
    shipped world and every benchmarks/blind world, with R, judged at the full run's length;
    no stale one is left."""
    from verl_sweep.launchers.simulator import load_landscape, shipped_landscapes

    worlds = [*shipped_landscapes(), *(str(p) for p in sorted(BLIND.glob("*.yaml")))]
    kept = set((REPO / "benchmarks" / "references").glob("best-*.json"))
    with tempfile.TemporaryDirectory() as empty:
        for world in worlds:
            land = load_landscape(world)
            name = R.reference_path(world, R.demo_spec(world), n_random=R.REFERENCE_N_RANDOM, cache=Path(empty)).name
            path = REPO / "benchmarks" / "references" / name
            assert path in kept, f"{land.name}: no kept reference {name}"
            kept.discard(path)
            data = json.loads(path.read_text())
            assert data["true_steps"] == data["run_steps"] == R.true_steps(land) and data["run_gpu_h"] > 0, land.name
    assert not kept, f"stale references: {sorted(p.name for p in kept)}"
