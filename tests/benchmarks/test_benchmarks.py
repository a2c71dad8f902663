"""The benchmark command: --quick runs end to end and its table/JSON are sane; its measures
are computed right on hand-made traces."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from support import REPO

from benchmarks.run import acceptance, eta_at, format_table, gpu_h_ratio, hours_to_reach, median_interval, summarize
from support.cluster import require_pg
from verl_sweep.launchers.simulator import shipped_landscapes



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


def _run(landscape: str, method: str, rep: int, points: list[tuple[float, float]], gpu_h: float) -> dict:
    return {"landscape": landscape, "method": method, "rep": rep, "points": points, "gpu_h": gpu_h,
            "final_eta": points[-1][1], "pruned_saved_gpu_h": 0.0, "idle_fraction": 0.0}


def test_summary_on_a_landscape_whose_baseline_is_already_near_best() -> None:
    """The acceptance step divided by a peer's GPU-hours to 95% of the best, which
    are 0 when the baseline is already within 95% (ZeroDivisionError before results.json)."""
    best = {"flat": {"best_eta": 1.03}}
    results = []
    for rep in range(3):
        results.append(_run("flat", "verl-sweep", rep, [(0.0, 1.0)], 400.0))
        results.append(_run("flat", "random", rep, [(0.0, 1.0), (300.0, 1.01)], 400.0))
        results.append(_run("flat", "tpe", rep, [(0.0, 1.0), (200.0, 0.97)], 400.0))
    rows = summarize(results, best, {"flat": 400.0})
    by = {r["method"]: r for r in rows}
    assert by["verl-sweep"]["final_reached"] == 3 and by["verl-sweep"]["false_win_rate"] == 0.0
    assert by["tpe"]["false_win_rate"] == 1.0  # ended below the baseline
    assert by["verl-sweep"]["best_peer"] == "random"
    # random's median final η (1.01) is above the baseline: verl-sweep never reaches it.
    assert math.isinf(by["verl-sweep"]["ratio_to_best_peer"])
    assert "flat" in format_table(rows, {"flat": 400.0})
    assert acceptance(rows)[0].startswith("flat (report)")


def test_gpu_hour_ratio_at_zero_and_never() -> None:
    assert gpu_h_ratio(0.0, 0.0) == 1.0  # both already there at the baseline
    assert math.isinf(gpu_h_ratio(10.0, 0.0))
    assert gpu_h_ratio(10.0, math.inf) == 0.0
    assert math.isinf(gpu_h_ratio(math.inf, 5.0))
    assert gpu_h_ratio(50.0, 200.0) == 0.25


@pytest.mark.slow
def test_quick_benchmark_prints_table_and_writes_json(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VERL_SWEEP_BENCH_REFERENCES": str(tmp_path / "references")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--no-overhead", "--out", str(tmp_path), "--reps-for", "gp=1",
         "--reps-for", "optuna-gp=1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GPU-h to best peer" in proc.stdout and "SIMULATED" in proc.stdout
    from benchmarks.run import METHODS, installed

    methods = [m for m in METHODS if installed(m)]  # SMAC3 and DEHB only with the bench extra
    for method in methods:
        assert f"{'default':<21} {'tune':<7} {method}" in proc.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["reps"] == 2 and data["landscapes"] == ["default"] and data["methods"] == methods
    assert len(data["runs"]) == 2 * len(methods) - ("gp" in methods) - ("optuna-gp" in methods)  # --reps-for …=1
    assert data["reps_per_method"].get("gp", 1) == 1 and data["reps_per_method"].get("optuna-gp", 1) == 1
    spent = sorted(r["gpu_h"] for r in data["runs"] if r["method"] == "verl-sweep")
    for run in data["runs"]:  # the peers stop once verl-sweep's median GPU-hours are spent
        if run["method"] not in ("verl-sweep", "manual"):
            assert run["gpu_h"] >= data["budget_gpu_h"]["default"] * 0.999
            assert run["gpu_h"] <= data["budget_gpu_h"]["default"] + 400  # at most one probe past it
    assert data["budget_gpu_h"]["default"] == pytest.approx(sum(spent) / 2)
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
    assert list((tmp_path / "references").glob("best-default-*.json"))  # its reference, kept out of the repository
    assert any(line.startswith("default (tune): ≥95% in") for line in data["acceptance"])


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_overhead_fill_writes_trials_that_optuna_reads_and_samples_from(tmp_path: Path, backend: str) -> None:
    """The ask + tell benchmark fills its study in bulk, past Optuna's API: the trials must be
    the ones Optuna would have written (numbers in order, values, parameters), and the
    driver's TPE must ask and tell on them."""
    import optuna

    from benchmarks.overhead import _distributions, _fill, _sampler, _verl_sweep_study
    from verl_sweep.search.database.storage import open_storage

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


@pytest.mark.slow  # ~5-9 s a landscape: the reference's coordinate passes on the noise-free model
@pytest.mark.parametrize("landscape", shipped_landscapes())
def test_every_peer_space_holds_the_best_reachable_config(landscape: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peers' joint space must contain the best config the stage chain can
    reach (KL on or off, the chain's token-budget bound, its layouts), in Optuna's form (random,
    TPE, GP, BOHB-style) and in ConfigSpace's (SMAC3, DEHB), mapping back to the same config."""
    import optuna

    from benchmarks import run as R
    from benchmarks.joint import FairJointSpace
    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.verl_knowledge import merge

    monkeypatch.setattr(R, "CACHE", tmp_path)
    monkeypatch.setattr(R, "SHIPPED", tmp_path)  # computed here, never a kept reference
    spec = R.demo_spec(landscape)
    best = R.best_reachable(landscape, spec, n_random=25)
    space = FairJointSpace(spec)
    base = spec.baseline_config()
    land = load_landscape(landscape)
    for point in (best["best_point"], best["chain_point"], {}):
        config = merge(base, point)
        values = space.params_for(config)
        assert values is not None, point
        rebuilt = merge(base, space.to_config(values))
        steps = R.true_steps(land, spec)
        assert land.true_rate(rebuilt, steps) == pytest.approx(land.true_rate(config, steps), rel=1e-12, nan_ok=True)
        # Optuna: the same values are a point of the distributions the peers sample from.
        trial = optuna.trial.FixedTrial(values)
        assert space.to_config(space.suggest_values(trial)) == space.to_config(values)
        # ConfigSpace (SMAC3, DEHB): a valid configuration that maps back to the same values.
        cs_mod = pytest.importorskip("ConfigSpace")
        cs = space.config_space()
        configuration = cs_mod.Configuration(cs, values=space.to_config_space_values(values))
        _same_config(space.to_config(space.from_config_space(dict(configuration))), space.to_config(values))


def _same_config(a: dict, b: dict) -> None:
    """Equal, floats to 1e-6 (ConfigSpace keeps floats to a fixed precision)."""
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], float):
            assert a[key] == pytest.approx(b[key], rel=1e-6), key
        else:
            assert a[key] == b[key], key


def test_joint_space_turns_kl_off_and_reaches_the_chains_token_bound() -> None:
    from benchmarks.joint import FairJointSpace
    from benchmarks.run import demo_spec
    from verl_sweep import verl_knowledge as L

    space = FairJointSpace(demo_spec("default"))
    assert space.by_name["use_kl"].choices == (False, True)
    assert space.to_config({**space.params_for(demo_spec("default").baseline_config()), "use_kl": False})[L.USE_KL_LOSS] is False
    # The chain's token stage at memory fraction 0.9 reaches 100,000; the baseline's 0.6 only 83,000.
    assert space.by_name["token_budget"].high == 100_000


def test_the_gp_peer_suggests_what_optunas_gp_sampler_suggests() -> None:
    """The GP peer drops only the torch device context around Optuna's GPSampler: the same
    seed must give the same suggestions, on a mixed space like the peers' joint space."""
    import optuna

    from benchmarks.peers import cpu_gp_sampler

    def suggestions(sampler: optuna.samplers.BaseSampler) -> list[dict]:
        study = optuna.create_study(direction="maximize", sampler=sampler)
        for _ in range(12):
            trial = study.ask()
            x = trial.suggest_float("lr", 5e-7, 5e-6, log=True)
            k = trial.suggest_categorical("kl", [False, True])
            n = trial.suggest_int("mini_batch", 96, 160, step=8)
            study.tell(trial, -((math.log(x) + 13.5) ** 2) - abs(n - 130) / 10 + 0.3 * k)
        return [t.params for t in study.trials]

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    ours = suggestions(cpu_gp_sampler(seed=3, n_startup_trials=4))
    assert ours == suggestions(optuna.samplers.GPSampler(seed=3, n_startup_trials=4))
    assert len({json.dumps(p, sort_keys=True) for p in ours}) > 4  # the GP itself suggested


def test_a_hyperband_peer_repeats_itself_with_the_same_seed() -> None:
    """BOHB's pruner picks each trial's bracket from a hash of the study name: with Optuna's
    default (a fresh UUID) the same seed gave 19-23 probes and final η 1.88-1.95 here."""
    from benchmarks.run import run_one

    first, again = (run_one(("default", "bohb", 0, True, 1500.0)) for _ in range(2))
    assert first["n_probes"] > 10  # enough trials for brackets and pruning to matter
    assert (again["points"], again["gpu_h"], again["n_probes"]) == (first["points"], first["gpu_h"], first["n_probes"])


def _peer_on_default_world(method: str, tmp_path: Path, *, budget_gpu_h: float) -> tuple[Any, Any, Any]:
    """One run of a peer on the `default` world's quick study, on the replay launcher:
    (spec, launcher, trace). A peer of the bench extra that is missing skips (in CI, fails)."""
    from benchmarks import methods as M
    from benchmarks.peer_run import run_peer
    from benchmarks.run import installed, rep_spec

    if not installed(method):
        pytest.skip(f"{method} comes with the bench extra (bash scripts/setup.sh --bench)")
    spec = rep_spec("default", 0, quick=True)
    launcher = M.replay_launcher(tmp_path, "default")
    trace = run_peer(spec, launcher, method, budget_gpu_h=budget_gpu_h, seed=1000)
    launcher.close()
    return spec, launcher, trace


@pytest.mark.parametrize("method", ["random", "tpe", "gp", "bohb", "smac", "dehb"])
def test_each_peer_searches_on_a_shipped_world_until_the_budget(method: str, tmp_path: Path) -> None:
    """A smoke run of each peer of benchmarks/peers.py (SMAC3 and DEHB are the bench extra's:
    in CI a missing one fails, see tests/support/strict_skips.py): a handful of probes on the
    `default` world, configs of its own choosing, its incumbent one it ran, stopped at the
    budget. The prior peers' run is the test below."""
    from benchmarks.peers import PEERS
    from verl_sweep.verl_knowledge import to_overrides

    assert method in PEERS
    _, _, trace = _peer_on_default_world(method, tmp_path, budget_gpu_h=800.0)

    def without_seed(overrides: list[str]) -> tuple[str, ...]:
        return tuple(sorted(o for o in overrides if not o.startswith("data.seed=")))

    probed = {without_seed(json.loads(p.read_text())["overrides"]) for p in tmp_path.rglob("spec.json")}
    assert trace.n_probes >= 5 and len(probed) >= 3, (trace.n_probes, probed)  # the peer proposed, not one config
    assert 800.0 <= trace.gpu_h < 1000.0  # it stopped once the budget was spent
    chosen = [without_seed(to_overrides(config)) for _, config in trace.points[1:]]
    assert chosen and set(chosen) <= probed  # its incumbent, read back from the peer, is a config it ran


@pytest.mark.parametrize("method", ["priorband", "asha", "st-bohb", "optuna-gp"])
def test_the_prior_peers_start_from_the_study_baseline_and_spend_the_budget(method: str, tmp_path: Path) -> None:
    """PriorBand, Syne Tune and the joint Optuna study get verl-sweep's head start: their first
    probe is the study's baseline, run to full length; they stop at the GPU-hour budget."""
    from verl_sweep.verl_knowledge import parse_overrides

    spec, launcher, trace = _peer_on_default_world(method, tmp_path, budget_gpu_h=400.0)
    specs = sorted(tmp_path.rglob("spec.json"), key=lambda p: json.loads(p.read_text())["run_id"])
    first = parse_overrides(json.loads(specs[0].read_text())["overrides"])
    base = spec.baseline_config()
    assert all(first[k] == v for k, v in base.items() if k != "data.seed"), first
    usage = {u.run_id: u for u in launcher.usage()}
    assert usage[f"{method}.p0001"].last_step >= spec.probe.steps  # full length
    assert 400.0 <= trace.gpu_h < 600.0 and trace.n_probes >= 3  # a probe started before the budget ends


def test_the_polish_follows_a_coupling_in_the_other_direction() -> None:
    """On a world where a smaller mini-batch tolerates a larger lr, the polish stage moves the
    mini-batch down and lr up from the chain's winner (the old polish assumed the other way and
    kept the one-knob answer, 0 of 4 runs within 95% of the best)."""
    from benchmarks import methods as M
    from benchmarks.run import rep_spec
    from verl_sweep import verl_knowledge as L
    from verl_sweep.launchers.simulator import load_landscape

    # A study for 500-step runs: over 2,000 steps this coupling's optimum moves (the one-knob
    # chain wins there), and the study, judging probes for the run, rightly keeps the chain's.
    spec = rep_spec("couple_down", 1).model_copy(update={"run_steps": 500})
    with tempfile.TemporaryDirectory(prefix="vs-polish-") as tmp:
        launcher = M.replay_launcher(Path(tmp), "couple_down")
        trace = M.StageTrace(launcher)
        M.run_staged(spec, launcher, trace=trace)
        launcher.close()
    (_, chain), (_, final) = trace.stage_ends[-2], trace.stage_ends[-1]
    # The polish's win in true η over the run the study tunes for.
    world, steps = load_landscape("couple_down"), spec.probe.steps
    assert world.eta(final, spec.baseline_config(), steps) > world.eta(chain, spec.baseline_config(), steps) * 1.05
    assert final[L.MINI_BATCH] < 512 and final[L.LR] > 2e-6


@pytest.fixture(scope="module")
def default_study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """One verl-sweep study on the `default` world (replay launcher): its spec and storage."""
    from benchmarks import methods as M
    from benchmarks.run import rep_spec
    from verl_sweep.search.database.optuna_forks import storage_class
    from verl_sweep.search.views.console import Console
    from verl_sweep.search.engine.driver import StudyRunner

    tmp_path = tmp_path_factory.mktemp("default-study")
    spec = rep_spec("default", 0, quick=False)
    launcher = M.replay_launcher(tmp_path, "default")
    storage = storage_class()(f"sqlite:///{tmp_path}/s.db", heartbeat_interval=60, grace_period=120)
    StudyRunner(spec, storage, launcher, console=Console(quiet=True), poll_interval_s=M.POLL_S).run()
    launcher.close()
    return spec, storage


def test_the_polish_runs_its_own_points_and_no_sampler_draws(default_study: tuple[Any, Any]) -> None:
    """The polish is a pattern search: its starting points, its follow-up rounds and their
    re-runs, then it ends; the sampler's own draws in its three-knob space read poorly and cost
    ~half its GPU-hours (default world: 606 → 144 GPU-h, the same choice)."""
    import optuna

    from verl_sweep.search.database.records import Role, records
    from verl_sweep.search.method.policy import StagePolicy
    from verl_sweep.search.method.stage import Stage

    spec, storage = default_study
    polish = optuna.load_study(study_name=f"{spec.name}.polish", storage=storage)
    trials = records(polish.get_trials(deepcopy=False))
    origins = [t.assignment.origin for t in trials if t.role is Role.CANDIDATE]
    assert origins and all(o in ("start", "follow-up") or str(o).startswith("leader of") for o in origins), origins
    policy = StagePolicy(Stage.of(spec, len(spec.stages) - 1))
    # its pattern (2 incumbent runs, 2 first-pass points, the follow-ups its budget leaves) fits its budget
    assert policy.counted(trials) <= spec.stages[-1].budget.max_trials


def test_the_systems_stage_ends_with_a_local_search_inside_its_budget(default_study: tuple[Any, Any]) -> None:
    """Stage 0's sampler draws all but its last fifth (at most 16 trials); the rest are
    follow-ups around its leader, proposed once the draws before them ended; the stage stays
    inside its budget."""
    import optuna

    from verl_sweep.search.method.policy import structured_points
    from verl_sweep.search.database.records import Role, records

    spec, storage = default_study
    stage = spec.stages[0]
    assert stage.space == "systems"
    trials = records(optuna.load_study(study_name=f"{spec.name}.systems", storage=storage).get_trials(deepcopy=False))
    candidates = [t for t in trials if t.role is Role.CANDIDATE]
    follow_ups = [t for t in candidates if t.assignment.origin == "follow-up"]
    reserve = min(16, stage.budget.max_trials // 5)
    assert 0 < len(follow_ups) <= reserve
    first = min(t.number for t in follow_ups)
    assert all(t.number < first for t in candidates if t.assignment.origin != "follow-up")  # the draws came first
    assert sum(1 for t in trials if t.role is not Role.RERUN) <= stage.budget.max_trials
    ended, _ = structured_points([t for t in trials if t.number < first], every_candidate=True)
    leader = max(ended, key=lambda r: r[1])[0]
    for t in follow_ups[:4]:  # the first round: one knob (with the passes that fit) from the leader
        moved = {k for k in set(leader) | set(t.params) if leader.get(k) != t.params.get(k)}
        assert moved and len(moved - {k for k in moved if "_sp" in k or k == "log_prob_token_factor"}) <= 2, moved


def test_median_curve_reaches_the_median_final_by_its_end() -> None:
    from benchmarks.run import median_curve_hours

    runs = [[(0.0, 1.0), (100.0, 2.0)], [(0.0, 1.0), (50.0, 1.5), (300.0, 2.5)], [(0.0, 1.0), (200.0, 1.8)]]
    # median of the finals (2.0, 2.5, 1.8) is 2.0; the median curve is 1.5 at 100, 1.8 at 200, 2.0 at 300
    assert median_curve_hours(runs, 2.0) == 300.0
    assert median_curve_hours(runs, 1.5) == 100.0
    assert median_curve_hours(runs, 1.0) == 0.0
    assert math.isinf(median_curve_hours(runs, 2.1))


def test_every_shipped_landscape_builds_its_study_and_names_its_split() -> None:
    from benchmarks.run import TUNE_SPLIT, demo_spec
    from verl_sweep.launchers.simulator import load_landscape, shipped_landscapes

    names = shipped_landscapes()
    shipped_tune = set(TUNE_SPLIT) & set(names)  # the rest of the tune split are former blind worlds
    assert len(shipped_tune) >= 6 and len(set(names) - shipped_tune) >= 6
    for name in names:
        spec = demo_spec(name)
        land = load_landscape(name)
        assert land.data.get("description")
        rate = land.true_rate(spec.baseline_config(), spec.probe.steps)
        assert math.isfinite(rate) and rate > 0, name  # the study's baseline runs in every world
    assert demo_spec("ppo_lam").algorithm.value == "ppo"
    assert [s.space for s in demo_spec("ppo_lam").stages][-2:] == ["lam", "polish"]


def test_the_blind_worlds_build_their_study_and_are_not_shipped() -> None:
    from benchmarks.run import BLIND_DIR, TUNE_SPLIT, demo_spec, split_of
    from verl_sweep.launchers.simulator import load_landscape, shipped_landscapes

    paths = sorted(BLIND_DIR.glob("*.yaml"))
    assert len(paths) >= 3
    for path in paths:
        land = load_landscape(path)
        # a blind world whose misses changed the method is no longer blind: it moved to tune
        assert split_of(land.name) == ("tune" if land.name in TUNE_SPLIT else "blind"), land.name
        assert land.name not in shipped_landscapes()
        spec = demo_spec(str(path))
        rate = land.true_rate(spec.baseline_config(), spec.probe.steps)
        assert math.isfinite(rate) and rate > 0, path.name
    assert split_of("default") == "tune" and split_of("noisy_hetero") == "report"


def test_split_names_the_landscapes_of_each_split_and_refuses_others() -> None:
    from benchmarks.run import TUNE_SPLIT, split_landscapes, split_of

    issue = split_landscapes("tune,report")
    tune, retired = split_landscapes("tune"), split_landscapes("retired")
    assert issue[: len(tune)] == tune and {Path(n).stem for n in tune + retired} == set(TUNE_SPLIT)
    assert {split_of(n) for n in retired} == {"tune"} and all(n.endswith(".yaml") for n in retired)
    blind = split_landscapes("blind")
    assert blind and {split_of(n) for n in blind} == {"blind"} and not {Path(n).stem for n in blind} & set(TUNE_SPLIT)
    assert {split_of(n) for n in issue} == {"tune", "report"} and len(issue) >= 10
    everything = split_landscapes("all")
    assert set(issue) < set(everything) and {split_of(n) for n in everything} == {"tune", "report", "heldout"}
    assert all(n.endswith(".yaml") for n in split_landscapes("blind"))
    with pytest.raises(ValueError, match="'nope'"):
        split_landscapes("tune,nope")
