"""Does staged search reach a near-best config with less GPU time than the alternatives?

    python -m benchmarks.run [--landscape FILE ...] [--split all|tune,report|heldout|blind] [--methods a,b] [--reps-for gp=1]
                             [--reps N] [--quick] [--jobs 2] [--out DIR]

Runs verl-sweep, the manual procedure (:mod:`benchmarks.methods`) and the HPO peers
(:mod:`benchmarks.peers`: random, TPE, GP, BOHB-style, SMAC3, DEHB) on each landscape
(default: every shipped one, the tune split first) × ``--reps`` repetitions (sampler and
noise seeds differ per repetition) on the simulated-time ReplayLauncher. The peers get the
GPU-hours verl-sweep spent (its median on that landscape). Every choice is scored on the
landscape's noise-free model (``true_rate``) over the full run's length (:func:`true_steps`),
and every run's GPU-hours also in R, one full run of the baseline (:func:`full_run`), with
the full runs after which the study pays for itself; prints one table; writes ``results.json`` and
``curves.html`` (the true η of each method's choice against simulated GPU-hours) to ``--out``. Then measures orchestration overhead
(real processes and real databases, see :mod:`benchmarks.overhead`) unless ``--no-overhead``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: the study file the benchmark runs in place of studies/demo.yaml (``--study``)
STUDY_ENV = "VERL_SWEEP_BENCH_STUDY"
#: the best-reachable references, computed once per landscape and method version, are written
#: here: outside the repository ($VERL_SWEEP_BENCH_REFERENCES, else $XDG_CACHE_HOME or
#: ~/.cache, under verl-sweep/bench-references), so that a run never leaves files to commit
CACHE = Path(os.environ.get("VERL_SWEEP_BENCH_REFERENCES")
             or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "verl-sweep" / "bench-references")
#: the references of the shipped worlds as computed when they were published: read, never written
SHIPPED = REPO / "benchmarks" / "references"
#: bump when best_reachable's method changes (it is part of the cache key); 4: judged at the
#: full run's length (RUN_STEPS, not the probe's 500 steps), R (``full_run``) kept in it
BEST_VERSION = 4
#: TPE trials (and random points a stage of the chain) of a world's reference (--quick: 60)
REFERENCE_N_RANDOM = 400
#: a full run's length in steps, where a landscape names none (``benchmark.true_steps``):
#: every method's choice is judged over it, and R is its baseline's GPU-hours
RUN_STEPS = 2000
METHODS = ("verl-sweep", "manual", "random", "tpe", "gp", "bohb", "smac", "dehb", "priorband", "asha", "st-bohb",
           "optuna-gp")
#: the peers (benchmarks/peers.py; benchmarks/prior_peers.py: those that also get the
#: baseline as their prior or first point): the best of them is what verl-sweep is measured against
PEERS = ("random", "tpe", "gp", "bohb", "smac", "dehb", "priorband", "asha", "st-bohb", "optuna-gp")
#: the peers whose runs take many times the others' CPU time (GP fits over a growing trial
#: set): one run a landscape by default, the other peers two, so that the timed benchmark with
#: every peer stays under 25 minutes on two cores (docs/method.md, Evidence)
SLOW_PEERS = ("gp", "optuna-gp")
PEER_REPS = 2
#: the landscapes verl-sweep's defaults (spaces/stages.py, studies/demo.yaml) were tuned on:
#: every landscape whose figures a default was changed for (benchmarks/blind's files among them,
#: no longer blind; docs/method.md, Evidence, names the rule each led to); every other shipped
#: landscape is in the report split: no default was changed while looking at its figures.
TUNE_SPLIT = ("batch_lr", "coupled3", "default", "kl_edge", "couple_down", "kl_floor_noisy", "flat_optimal",
              "blind_kl_off", "blind_low_lr", "blind_ppo_fast", "blind_couple_up_far", "blind_noise_by_config",
              "blind_noise_by_mini")
#: landscapes written blind in the session that used the report split's figures to change the
#: method (the slow-start probes, paired η): no run was made on them before the
#: benchmark that reports them
HELDOUT_SPLIT = ("heldout_coupled_noisy", "heldout_mb_edge", "heldout_oom_kl", "heldout_slow_ppo")


#: landscapes written blind later (benchmarks/blind, not shipped: run with --landscape FILE),
#: after the method was changed for the held-out split's failures
BLIND_DIR = REPO / "benchmarks" / "blind"


def split_of(landscape: str) -> str:
    """A landscape's split, by its name or the stem of its file."""
    name = Path(landscape).stem if landscape.endswith(".yaml") else landscape
    if name in TUNE_SPLIT:
        return "tune"
    if name in HELDOUT_SPLIT:
        return "heldout"
    return "blind" if (BLIND_DIR / f"{name}.yaml").is_file() else "report"


def split_landscapes(split: str) -> list[str]:
    """The landscapes of ``split``: ``all`` (every shipped one), or comma-separated splits
    (``tune,report``: the shipped landscapes of the timed benchmark; ``blind``: the files of
    benchmarks/blind no default was changed for; ``retired``: those some default was, now in
    the tune split)."""
    from verl_sweep.launchers.simulator import shipped_landscapes

    shipped = shipped_landscapes()
    shipped_splits = ("tune", "report", "heldout")
    by_split = {name: [n for n in shipped if split_of(n) == name] for name in shipped_splits}
    unshipped = [str(path) for path in sorted(BLIND_DIR.glob("*.yaml"))]
    # benchmarks/blind's worlds whose misses changed the method: tune worlds now, not shipped
    by_split["retired"] = [path for path in unshipped if split_of(path) == "tune"]
    by_split["blind"] = [path for path in unshipped if split_of(path) == "blind"]
    splits = list(shipped_splits) if split == "all" else split.split(",")
    if unknown := [s for s in splits if s not in by_split]:
        raise ValueError(f"--split must be all or some of {', '.join(by_split)}, comma-separated, but got "
                         f"{', '.join(map(repr, unknown))}")
    return [n for name in splits for n in by_split[name]]


def installed(method: str) -> bool:
    """SMAC3, DEHB, NePS and Syne Tune come with the bench extra; every other method needs only ours."""
    import importlib.util

    module = {"smac": "smac", "dehb": "dehb", "priorband": "neps", "asha": "syne_tune", "st-bohb": "syne_tune"}.get(method)
    return module is None or importlib.util.find_spec(module) is not None


#: the model the simulator's landscapes were calibrated on (docs/method.md §1's 7B, hidden 4096)
BENCHMARK_MODEL = {"hidden_size": 4096, "num_attention_heads": 32, "n_params_b": 7.0}


def demo_spec(landscape: str, *, quick: bool = False) -> Any:
    """The demo study (studies/demo.yaml, or the file in ``$VERL_SWEEP_BENCH_STUDY``: set by
    ``--study``, read here so that the spawned workers see it too) on the replay launcher, for
    ``landscape``.

    A landscape may change the study through its ``study`` section: ``algorithm: ppo`` turns
    it into PPO with GAE (the critic follows; a ``lam`` stage goes before the polish stage,
    as in the default PPO stages)."""
    import yaml

    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.search.spec.study_file import Algorithm, default_stages, parse_study

    data = yaml.safe_load(Path(os.environ.get(STUDY_ENV) or REPO / "studies" / "demo.yaml").read_text())
    data["name"] = "bench"
    # The landscapes were calibrated on a Llama-7B-shaped model (hidden 4096, 32 heads, the
    # method's hidden ÷ 8 token rule): the benchmark keeps it, so that its figures stay
    # comparable across runs; the demo study itself has Qwen2.5-7B's real shape.
    data["model"] = {**BENCHMARK_MODEL, "max_prompt_length": data["model"]["max_prompt_length"],
                     "max_response_length": data["model"]["max_response_length"]}
    # The study file cannot name the replay launcher yet (kind is sim/local/ray); the
    # benchmark hands the driver a ReplayLauncher itself.
    data["launcher"] = {"kind": "sim", "max_concurrent": 2, "options": {"landscape": landscape}}
    # The benchmark compares searches: the final check (the chosen config against the baseline,
    # on fresh seeds) changes no choice and has no counterpart in the peers; its cost is in
    # the study's plan and status (four 500-step probes in the demo).
    data["final_check"] = False
    study = dict(load_landscape(landscape).data.get("study", {}) or {})
    if study.get("algorithm") == "ppo":
        data["algorithm"] = "ppo"
        data["baseline"] = {**data["baseline"], **dict(study.get("baseline", {}) or {})}
        polish = next(i for i, stage in enumerate(data["stages"]) if stage["space"] == "polish")
        lam = next(stage for stage in default_stages(Algorithm.PPO) if stage.space == "lam")
        data["stages"].insert(polish, lam.model_dump(mode="json", exclude_defaults=True))
    if quick:  # smaller stage budgets: the test checks the machinery, not the figures
        for stage in data["stages"]:
            stage["budget"] = {"max_trials": 3}
            stage["confirm_top"] = 1
    return parse_study(data)


def rep_spec(landscape: str, rep: int, *, quick: bool = False) -> Any:
    """The demo study of repetition ``rep``: a different noise stream per repetition (seeds
    shift by 100 × rep) and its own sampler seed."""
    spec = demo_spec(landscape, quick=quick)
    data = spec.model_dump(mode="json")
    data["seeds"] = [s + 100 * rep for s in data["seeds"]]
    for stage in data["stages"]:
        stage["sampler"] = {**stage.get("sampler", {}), "seed": 1000 + rep}
    return type(spec).model_validate(data)


def true_steps(landscape: Any, spec: Any = None) -> int:
    """The horizon every method's choice is judged at: the full run's length, the landscape's
    ``benchmark.true_steps`` where it names one, else :data:`RUN_STEPS` (not the probe's 500
    steps: a study chooses the config of a whole run). ``spec`` is not read (kept for callers)."""
    return int((landscape.data.get("benchmark", {}) or {}).get("true_steps", RUN_STEPS))


# -- the noise-free model, fast ------------------------------------------------------------------


def true_rate(landscape: Any, config: dict[str, Any], steps: int) -> float:
    """``landscape.true_rate(config, steps)``, the same values (to ~1e-14 relative; the sums
    are summed in another order) without its per-step loop: see :func:`steps_seconds`."""
    exp = landscape.expected(config)
    if exp.failure is not None or (exp.diverge_step is not None and exp.diverge_step <= steps):
        return math.nan
    seconds = steps_seconds(landscape, config, steps, exp)
    return (exp.reward(steps) - exp.r0) / seconds


def steps_seconds(landscape: Any, config: dict[str, Any], steps: int, exp: Any = None) -> float:
    """Σ ``landscape.step_time(config, t)`` over t = 1 … ``steps`` (noise-free seconds, start-up
    excluded: the denominator of ``true_rate``). A step's seconds are affine in its progress
    (every phase's work grows linearly with the response length, itself affine in the progress
    clipped to [0, 1]), so the sum is steps · T(0) + (T(1) − T(0)) · Σ progress_t, with the
    progress of every step at once in numpy. Where the step time is not affine (checked at two
    inner points on the landscape's own phases), the landscape's own loop."""
    import numpy as np

    exp = exp or landscape.expected(config)
    phases_at = landscape._step_phases(config)  # the phases true_rate's step_time sums

    def seconds_at(progress: float) -> float:
        return sum(phases_at(progress)[0].values())

    t0, t1 = seconds_at(0.0), seconds_at(1.0)
    slope = t1 - t0
    if not all(math.isclose(seconds_at(p), t0 + slope * p, rel_tol=1e-12, abs_tol=1e-12 * abs(t0))
               for p in (0.3, 0.75)):  # fmt: skip
        return sum(landscape.step_time(config, t, exp, phases_at=phases_at) for t in range(1, steps + 1))
    t = np.arange(1, steps + 1, dtype=float)
    reward = exp.r0 + (exp.ceiling - exp.r0) / (1.0 + (exp.t_mid / t) ** exp.steepness)  # exp.reward(t)
    progress = np.clip((reward - exp.r0) / max(1e-9, exp.ceiling - exp.r0), 0.0, 1.0)
    return steps * t0 + slope * float(progress.sum())


def true_eta_of(landscape: Any, config: dict[str, Any], baseline_rate: float, steps: int) -> float:
    rate = true_rate(landscape, config, steps)
    return rate / baseline_rate if math.isfinite(rate) else 0.0


# -- R: one full run of the baseline -------------------------------------------------------------


def full_run(landscape_name: str, spec: Any, steps: int | None = None) -> dict[str, Any]:
    """R: the noise-free GPU-hours of one full run of the study's baseline, ``steps`` long
    (default :func:`true_steps`), counted as the study's own GPU-hours are: the benchmark's
    replay launcher (``benchmarks.methods.replay_launcher``) holds ``gpus_per_probe`` GPUs a
    run from its start to its last step, its start-up included (the launcher's ``startup_s``,
    else the landscape's); a full run pays one start-up. The steps' seconds are
    ``true_rate``'s (noise-free; the trainer's GPU count pinned as the launcher pins it)."""
    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.verl_knowledge import merge

    from benchmarks import methods as M

    landscape = load_landscape(landscape_name)
    steps = true_steps(landscape) if steps is None else steps
    with tempfile.TemporaryDirectory(prefix="vs-bench-r-") as tmp:
        launcher = M.replay_launcher(Path(tmp), landscape_name)
        n_gpus, startup = launcher.gpus_per_probe, launcher.startup_s
        launcher.close()
    config = merge(spec.baseline_config(), {"trainer.n_gpus_per_node": n_gpus})
    exp = landscape.expected(config)
    startup = exp.startup_s if startup is None else float(startup)
    seconds = steps_seconds(landscape, config, steps, exp)
    return {"run_gpu_h": (startup + seconds) * n_gpus / 3600.0, "run_steps": steps, "run_startup_s": startup,
            "run_n_gpus": n_gpus, "run_step_seconds": seconds}  # fmt: skip


def run_gpu_h_of(name: str, entry: dict[str, Any]) -> float | None:
    """A world's R: its reference's, else computed now (:func:`full_run`) where the world is a
    shipped landscape or a file of benchmarks/blind; None where it is neither."""
    if entry.get("run_gpu_h"):
        return float(entry["run_gpu_h"])
    from verl_sweep.launchers.simulator import LandscapeError, shipped_landscapes

    path = str(BLIND_DIR / f"{name}.yaml") if (BLIND_DIR / f"{name}.yaml").is_file() else name
    if path == name and name not in shipped_landscapes():
        return None
    try:
        return float(full_run(path, demo_spec(path))["run_gpu_h"])
    except (LandscapeError, OSError, ValueError):
        return None


def break_even_runs(gpu_h: float, run_gpu_h: float, final_eta: float) -> float | None:
    """Full runs of the chosen config after which the study has paid for itself: each saves
    R · (1 − 1/η) GPU-hours (the same reward gain in 1/η of the time). None (never) at η ≤ 1."""
    if not math.isfinite(final_eta) or final_eta <= 1.0:
        return None
    return gpu_h / (run_gpu_h * (1.0 - 1.0 / final_eta))


def add_cost(results: list[dict[str, Any]], run_gpu_h: dict[str, float | None]) -> None:
    """Give each run's record ``cost_r`` (its GPU-hours ÷ R) and ``break_even_runs``, where
    its world's R is known and the record has none yet."""
    for r in results:
        big_r = run_gpu_h.get(r["landscape"])
        if big_r and "cost_r" not in r:
            r["cost_r"] = r["gpu_h"] / big_r
            r["break_even_runs"] = break_even_runs(r["gpu_h"], big_r, r["final_eta"])


def reference_path(landscape_name: str, spec: Any, *, n_random: int, cache: Path | None = None) -> Path:
    """Where :func:`best_reachable` keeps a reference: ``best-<world>-<key>.json`` in ``cache``
    (default ``CACHE``; the kept ones in ``SHIPPED`` have the same name), the key a hash of
    ``BEST_VERSION``, the landscape file's content, the study's part that decides what is
    reachable, and ``n_random``."""
    from verl_sweep.launchers.simulator import load_landscape

    landscape = load_landscape(landscape_name)
    key = hashlib.sha1(json.dumps([BEST_VERSION, landscape.data, _study_for_key(spec), n_random], sort_keys=True,
                                  default=str).encode()).hexdigest()[:16]  # fmt: skip
    return (CACHE if cache is None else cache) / f"best-{landscape.name}-{key}.json"


def best_reachable(landscape_name: str, spec: Any, *, n_random: int = 300, seed: int = 0) -> dict[str, Any]:
    """Max true η over every config a method can choose: TPE on the noise-free model over the
    peers' joint space (``n_random`` trials, which holds every config the chain can reach),
    coordinate passes on fine grids of each numeric knob, and the study's own stage chain
    run on the noise-free model (each stage's space on the chain's base, ``n_random`` points
    a stage). Judged at :func:`true_steps` (the full run's length); with R, the GPU-hours of
    one full run of the baseline (:func:`full_run`). Cached in ``CACHE`` (or read from the shipped
    ``SHIPPED``) by the landscape file's and the study's content."""
    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.verl_knowledge import merge

    from benchmarks.joint import FairJointSpace
    from verl_sweep.spaces.registry import build_space

    landscape = load_landscape(landscape_name)
    cached = reference_path(landscape_name, spec, n_random=n_random)
    for known in (cached, SHIPPED / cached.name):
        if known.is_file():
            return json.loads(known.read_text())
    import optuna

    space = FairJointSpace(spec)
    base = spec.baseline_config()
    steps = true_steps(landscape)
    base_rate = true_rate(landscape, base, steps)

    # 1. TPE on the noise-free model over the whole joint space.
    def objective(trial: "optuna.trial.Trial") -> float:
        return true_eta_of(landscape, merge(base, space.suggest(trial, base)), base_rate, steps)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=40, multivariate=True))  # fmt: skip
    study.enqueue_trial(space.params_for(base) or {})
    study.optimize(objective, n_trials=n_random)
    best_values = dict(study.best_trial.params)
    best = study.best_value
    # 2. Coordinate passes on fine grids of every knob, the rest kept.
    for _ in range(2):
        for p in space.params:
            if p.kind == "cat":
                grid = list(p.choices)
            elif p.log:
                grid = [p.low * (p.high / p.low) ** (i / 31) for i in range(32)]
            else:
                grid = [p.low + (p.high - p.low) * i / 31 for i in range(32)]
            if p.kind != "cat":  # exactly inside the bounds (the log grid's ends are not)
                grid = [min(p.high, max(p.low, g)) for g in grid]
            if p.kind == "int":
                grid = sorted({int(p.low) + int(round((g - p.low) / p.step)) * p.step for g in grid})
            for option in grid:
                values = {**best_values, p.name: option}
                v = true_eta_of(landscape, merge(base, space.to_config(values)), base_rate, steps)
                if v > best:
                    best, best_values = v, values
    best_config = merge(base, space.to_config(best_values))
    # 3. The stage chain on the noise-free model.
    chain = base
    for index, stage in enumerate(spec.stages):
        stage_space = build_space(stage.space, model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm,
                                  base=chain, options=stage.params, where=f"stages[{index}]", baseline=base)
        stage_study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed + index))
        stage_best, stage_config = true_eta_of(landscape, chain, base_rate, steps), chain
        for _ in range(n_random):
            trial = stage_study.ask()
            config = merge(chain, stage_space.suggest(trial, chain))
            v = true_eta_of(landscape, config, base_rate, steps)
            stage_study.tell(trial, v)
            if v > stage_best:
                stage_best, stage_config = v, config
        chain = stage_config
        if stage_best > best:
            best, best_config = stage_best, stage_config
    best_point = {k: v for k, v in best_config.items() if base.get(k) != v}
    result = {"landscape": landscape.name, "best_eta": best, "best_point": best_point, "baseline_rate": base_rate,
              "chain_point": {k: v for k, v in chain.items() if base.get(k) != v}, "true_steps": steps,
              **full_run(landscape_name, spec, steps)}  # fmt: skip
    CACHE.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(result, indent=2))
    return result


#: study fields added after the kept references were computed: at these values they change
#: neither a world nor the joint space, so a reference's key leaves them out and stays valid
NEUTRAL_STUDY_FIELDS = {("model", "num_hidden_layers"): None,
                        ("model", "num_key_value_heads"): None, ("model", "intermediate_size"): None,
                        ("model", "vocab_size"): None}


def _study_for_key(spec: Any) -> dict[str, Any]:
    """What of the study the best reachable η depends on: each stage's space and options only
    (its budget, stop rule, sampler and pruner decide how a method searches, not what it can
    reach), no probe or launcher settings (how a method measures, and where: a world named by
    its file's path would key on the checkout's location, nor the run's length it measures for),
    and no field added later at its neutral value."""
    data = spec.model_dump(mode="json")
    # run_steps sets how a method measures (its probes' horizon); the benchmark judges every
    # choice at the world's own horizon (``true_steps``)
    del data["probe"], data["launcher"], data["run_steps"]
    data.pop("train", None)  # train mode branches its runs: how a method measures, not what it reaches
    for (section, name), neutral in NEUTRAL_STUDY_FIELDS.items():
        if name in data.get(section, {}) and data[section][name] == neutral:
            del data[section][name]
    data["stages"] = [{"space": stage["space"], "params": stage["params"]} for stage in data["stages"]]
    return data


def reference(landscape_name: str, quick: bool) -> dict[str, Any]:
    """The landscape's best reachable η, for the summary."""
    return best_reachable(landscape_name, demo_spec(landscape_name), n_random=60 if quick else REFERENCE_N_RANDOM)


# -- one (landscape, method, repetition) ---------------------------------------------------------


def run_one(task: tuple[str, str, int, bool, float]) -> dict[str, Any]:
    """Run one method once; returns its trace scored on the noise-free model. ``budget_gpu_h``
    (the last item) is the peers' GPU-hour budget (verl-sweep and manual stop by themselves)."""
    landscape_name, method, rep, quick, budget_gpu_h = task
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from verl_sweep.launchers.simulator import load_landscape

    from benchmarks import methods as M
    from benchmarks.peer_run import run_peer

    spec = rep_spec(landscape_name, rep, quick=quick)
    landscape = load_landscape(landscape_name)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vs-bench-") as tmp:
        launcher = M.replay_launcher(Path(tmp), landscape_name)
        if method == "verl-sweep":
            trace = M.run_staged(spec, launcher)
        elif method == "manual":
            trace = M.run_manual(spec, launcher, seed=5000 + 100 * rep)
        else:
            trace = run_peer(spec, launcher, method, budget_gpu_h=budget_gpu_h, seed=1000 + rep)
        launcher.close()
    steps = true_steps(landscape)
    base_rate = true_rate(landscape, spec.baseline_config(), steps)
    keys = [json.dumps(config, sort_keys=True, default=str) for _, config in trace.points]
    true_eta: dict[str, float] = {}  # a choice held over many points is judged once
    for key, (_, config) in zip(keys, trace.points):
        if key not in true_eta:
            true_eta[key] = true_eta_of(landscape, config, base_rate, steps)
    points = [(gpu_h, true_eta[key]) for key, (gpu_h, _) in zip(keys, trace.points)]
    return {
        "landscape": landscape_name, "method": method, "rep": rep,
        "points": points, "gpu_h": trace.gpu_h, "n_probes": trace.n_probes,
        "pruned_saved_gpu_h": trace.pruned_saved_gpu_h, "idle_fraction": trace.idle_fraction,
        "final_eta": points[-1][1], "final_config": trace.points[-1][1], "seconds": time.perf_counter() - started,
    }  # fmt: skip


# -- measures -----------------------------------------------------------------------------------


def hours_to_reach(points: list[tuple[float, float]], target: float) -> float:
    """GPU-hours at which the chosen config's true η first reaches ``target`` (inf: never)."""
    for gpu_h, eta in points:
        if eta >= target:
            return gpu_h
    return math.inf


def eta_at(points: list[tuple[float, float]], budget_h: float) -> float:
    """True η of the config chosen when ``budget_h`` GPU-hours were spent."""
    chosen = points[0][1]
    for gpu_h, eta in points:
        if gpu_h <= budget_h:
            chosen = eta
    return chosen


def median_curve_hours(runs: list[list[tuple[float, float]]], target: float) -> float:
    """GPU-hours at which the median curve (the median over runs of the true η chosen by
    then, the plotted curve) first reaches ``target``; inf when it never does. A method's
    median curve ends at its median final η, so it reaches that by its last point."""
    hours = sorted({h for points in runs for h, _ in points})
    for h in hours:
        if statistics.median(eta_at(points, h) for points in runs) >= target - 1e-12:
            return h
    return math.inf


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """Median and the 25th-75th percentile range (inf allowed: 'never reached')."""
    ordered = sorted(values)
    n = len(ordered)

    def q(p: float) -> float:
        i = p * (n - 1)
        lo, hi = math.floor(i), math.ceil(i)
        if math.isinf(ordered[lo]) or math.isinf(ordered[hi]):
            return ordered[hi] if math.isinf(ordered[hi]) and i - lo > 0 else ordered[lo]
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (i - lo)

    return q(0.5), q(0.25), q(0.75)


def gpu_h_ratio(mine: float, theirs: float) -> float:
    """verl-sweep's GPU-hours ÷ a peer's to reach the same η. Both 0 (the baseline already
    reaches it): 1. Only the peer at 0: inf. Never reached (inf) on either side: inf / 0 —
    never reached by verl-sweep is inf, by the peer alone 0."""
    if math.isinf(mine):
        return math.inf
    if math.isinf(theirs):
        return 0.0
    if theirs == 0.0:
        return 1.0 if mine == 0.0 else math.inf
    return mine / theirs


def summarize(results: list[dict[str, Any]], best: dict[str, dict[str, Any]], budget_h: dict[str, float]) -> list[dict[str, Any]]:
    """One row per (landscape, method): the measures the acceptance table shows (see
    ``format_table``), plus the older ones (η at the budget, pruning, idle) in the JSON. The
    cost in R and the break-even come from the runs' records (:func:`add_cost`)."""
    rows = []
    for landscape in best:
        best_eta = best[landscape]["best_eta"]
        target = 0.95 * best_eta
        mine = [r for r in results if r["landscape"] == landscape]
        finals = {m: statistics.median(r["final_eta"] for r in mine if r["method"] == m)
                  for m in METHODS if any(r["method"] == m for r in mine)}  # fmt: skip
        peers = [m for m in PEERS if m in finals]
        best_peer = max(peers, key=lambda m: finals[m]) if peers else None
        peer_target = finals[best_peer] if best_peer else math.inf
        for method in METHODS:
            runs = [r for r in mine if r["method"] == method]
            if not runs:
                continue
            reach = [hours_to_reach(r["points"], target) for r in runs]
            at_budget = [eta_at(r["points"], budget_h[landscape]) for r in runs]
            rows.append({
                "landscape": landscape, "method": method, "reps": len(runs),
                "split": split_of(landscape),
                "best_eta": best_eta, "best_peer": best_peer, "best_peer_final_eta": peer_target,
                "hours_to_95": median_interval(reach),
                "reached": sum(1 for h in reach if math.isfinite(h)),
                "final_reached": sum(1 for r in runs if r["final_eta"] >= target),
                "final_fraction": median_interval([r["final_eta"] / best_eta for r in runs]),
                "hours_to_best_peer": median_curve_hours([r["points"] for r in runs], peer_target),
                "eta_at_budget": median_interval(at_budget),
                "final_eta": median_interval([r["final_eta"] for r in runs]),
                "false_win_rate": sum(1 for r in runs if r["final_eta"] < 1.0) / len(runs),
                "gpu_h_total": median_interval([r["gpu_h"] for r in runs]),
                "pruning_saved": statistics.median(
                    r["pruned_saved_gpu_h"] / max(1e-9, r["gpu_h"] + r["pruned_saved_gpu_h"]) for r in runs),
                "idle_fraction": statistics.median(r["idle_fraction"] for r in runs),
                # R and the cost in it (None where the world's R is unknown: an older results.json)
                "run_gpu_h": best[landscape].get("run_gpu_h"), "true_steps": best[landscape].get("true_steps"),
                "cost_r": median_interval([r["cost_r"] for r in runs]) if all("cost_r" in r for r in runs) else None,
                "break_even": (median_interval([math.inf if r["break_even_runs"] is None else r["break_even_runs"]
                                                for r in runs]) if all("cost_r" in r for r in runs) else None),
            })  # fmt: skip
        by = {r["method"]: r for r in rows if r["landscape"] == landscape}
        if "verl-sweep" in by and best_peer in by:
            by["verl-sweep"]["ratio_to_best_peer"] = gpu_h_ratio(
                by["verl-sweep"]["hours_to_best_peer"], by[best_peer]["hours_to_best_peer"])
    return rows


def _fmt_h(m: tuple[float, float, float]) -> str:
    f = lambda x: "never" if math.isinf(x) else f"{x:,.0f}"  # noqa: E731
    return f"{f(m[0])} [{f(m[1])}-{f(m[2])}]"


def _fmt_hours(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:,.0f}"


def _fmt_ratio(x: float | None) -> str:
    if x is None:
        return ""
    return "∞" if math.isinf(x) else f"{x:.2f}"


def _fmt_cost(m: tuple[float, float, float] | None) -> str:
    return "" if m is None else f"{m[0]:.2f}"


def _fmt_runs(m: tuple[float, float, float] | None) -> str:
    if m is None:
        return ""
    return "never" if math.isinf(m[0]) else f"{m[0]:.1f}"


def format_table(rows: list[dict[str, Any]], budget_h: dict[str, float]) -> str:
    """The acceptance table: per landscape and method, the runs whose final choice reaches 95%
    of the best reachable η, the median final η as a fraction of it, false wins (final η below
    the baseline's), the GPU-hours at which the method's median curve reaches the best peer's
    median final η and verl-sweep's ÷ that peer's, the GPU-hours spent (median), the cost in R
    (GPU-hours ÷ one full run of the baseline, median) and the break-even (full runs of the
    choice that pay the study back, median; ``never`` at η ≤ 1; both blank where R is unknown)."""
    head = (f"{'landscape':<21} {'split':<7} {'method':<11} {'≥95% best':>9} {'final/best':>10} {'false win':>9} "
            f"{'GPU-h to best peer':>18} {'÷ peer':>6} {'GPU-h spent':>11} {'cost R':>6} {'break-even':>10}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['landscape']:<21} {r['split']:<7} {r['method']:<11} {r['final_reached']:>6}/{r['reps']:<2} "
            f"{r['final_fraction'][0]:>10.3f} {r['false_win_rate']:>9.0%} {_fmt_hours(r['hours_to_best_peer']):>18} "
            f"{_fmt_ratio(r.get('ratio_to_best_peer')):>6} {r['gpu_h_total'][0]:>11,.0f} "
            f"{_fmt_cost(r.get('cost_r')):>6} {_fmt_runs(r.get('break_even')):>10}"
        )
    lines.append("")
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        seen.setdefault(r["landscape"], r)
    lines.append("best reachable η (noise-free, vs the study baseline), best peer (highest median final η) and "
                 "the peers' GPU-hour budget: " + "; ".join(
                     f"{k}: {v['best_eta']:.3f}, {v['best_peer']}, {budget_h.get(k, 0):,.0f} GPU-h" for k, v in seen.items()))  # fmt: skip
    lines.append("")
    lines.append("R (noise-free GPU-hours of one full run of the baseline; every η judged over the run's steps): " + "; ".join(
        f"{k}: " + (f"{v['run_gpu_h']:,.0f} GPU-h" if v.get("run_gpu_h") else "unknown")
        + (f", {v['true_steps']:,} steps" if v.get("true_steps") else "") for k, v in seen.items()))  # fmt: skip
    return "\n".join(lines)


#: the acceptance line's bar on verl-sweep's median cost in R a world, and the summary's goal
#: on the median over the report and blind worlds
COST_BAR_R, COST_GOAL_R = 2.0, 1.5


def acceptance(rows: list[dict[str, Any]]) -> list[str]:
    """The benchmark's acceptance criteria, measured: one line per landscape (its cost in R
    counts: a cost unknown fails), then one summary line (:func:`cost_summary`)."""
    out = []
    for landscape in dict.fromkeys(r["landscape"] for r in rows):
        by = {r["method"]: r for r in rows if r["landscape"] == landscape}
        vs = by.get("verl-sweep")
        if vs is None:
            continue
        peers = [by[m] for m in PEERS if m in by]
        at_least_peers = all(vs["final_eta"][0] >= p["final_eta"][0] for p in peers)
        ratio = vs.get("ratio_to_best_peer")
        ok_reach = vs["final_reached"] >= math.ceil(0.9 * vs["reps"]) and vs["false_win_rate"] == 0.0
        ok_ratio = ratio is not None and ratio <= 0.5
        cost = vs.get("cost_r")
        ok_cost = cost is not None and cost[0] <= COST_BAR_R
        ok = ok_reach and at_least_peers and ok_ratio and ok_cost
        out.append(
            f"{landscape} ({vs['split']}): ≥95% in {vs['final_reached']}/{vs['reps']} (≥9/10), false wins "
            f"{vs['false_win_rate']:.0%} (0), median final η ≥ every peer's: {'yes' if at_least_peers else 'no'}, "
            f"GPU-h ÷ {vs['best_peer']} {_fmt_ratio(ratio)} (≤0.5), "
            f"cost {_fmt_cost(cost) or 'unknown'} R (≤{COST_BAR_R:g}) → {'PASS' if ok else 'FAIL'}"
        )
    summary = cost_summary(rows)
    return out + ([summary] if summary else [])


def cost_summary(rows: list[dict[str, Any]], method: str = "verl-sweep") -> str | None:
    """One line: the median over the run's worlds of ``method``'s median cost in R and of its
    median break-even (and over the report and blind worlds, where the run has both splits;
    goal ≤ 1.5 R). None where no world's cost is known."""
    mine = [r for r in rows if r["method"] == method and r.get("cost_r") is not None]
    if not mine:
        return None

    def medians(subset: list[dict[str, Any]]) -> str:
        cost = statistics.median(r["cost_r"][0] for r in subset)
        runs = median_interval([r["break_even"][0] for r in subset])[0]
        return (f"median cost {cost:.2f} R, median break-even "
                f"{'never' if math.isinf(runs) else f'{runs:.1f} runs'}")  # fmt: skip

    line = f"{method} over {len(mine)} world{'s' if len(mine) > 1 else ''}: {medians(mine)}"
    splits = {r["split"] for r in mine}
    if {"report", "blind"} <= splits:
        chosen = [r for r in mine if r["split"] in ("report", "blind")]
        cost = statistics.median(r["cost_r"][0] for r in chosen)
        line += (f"; report+blind ({len(chosen)} worlds): {medians(chosen)} "
                 f"(goal ≤ {COST_GOAL_R:g} R: {'met' if cost <= COST_GOAL_R else 'not met'})")
    return line


def write_plot(results: list[dict[str, Any]], path: Path) -> None:
    """Median best-true-η-so-far (as a fraction of the best reachable) against GPU-hours, one
    line per method, one panel per landscape; plotly HTML (matplotlib is not installed here)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    landscapes = list(dict.fromkeys(r["landscape"] for r in results))
    n_cols = min(3, len(landscapes))
    n_rows = math.ceil(len(landscapes) / n_cols)
    titles = [f"{name} ({split_of(name)})" for name in landscapes]
    fig = make_subplots(rows=n_rows, cols=n_cols, subplot_titles=titles)
    colors = {"verl-sweep": "#1f77b4", "manual": "#7f7f7f", "random": "#ff7f0e", "tpe": "#2ca02c", "gp": "#9467bd",
              "bohb": "#8c564b", "smac": "#e377c2", "dehb": "#17becf", "priorband": "#d62728", "asha": "#bcbd22",
              "st-bohb": "#aec7e8", "optuna-gp": "#ffbb78"}  # fmt: skip
    for i, landscape in enumerate(landscapes):
        row, col = i // n_cols + 1, i % n_cols + 1
        runs = [r for r in results if r["landscape"] == landscape]
        horizon = max(r["gpu_h"] for r in runs)
        grid = [horizon * i / 100 for i in range(101)]
        for method in METHODS:
            mine = [r for r in runs if r["method"] == method]
            if not mine:
                continue
            curve = [statistics.median(_best_so_far(r["points"], h) for r in mine) for h in grid]
            fig.add_trace(go.Scatter(x=grid, y=curve, name=method, legendgroup=method, showlegend=i == 0,
                                     line={"color": colors.get(method)}), row=row, col=col)  # fmt: skip
    fig.update_xaxes(title_text="simulated GPU-hours")
    fig.update_yaxes(title_text="true η chosen (median, SIMULATED)", col=1)
    fig.update_layout(height=320 * n_rows, title_text="SIMULATED: true η of the current choice against GPU-hours spent")
    fig.write_html(str(path), include_plotlyjs="cdn")


def _best_so_far(points: list[tuple[float, float]], budget_h: float) -> float:
    """The true η of the choice held at ``budget_h`` (the name is historical: a method's
    choice can get worse, e.g. a peer's incumbent re-scored on more seeds)."""
    return eta_at(points, budget_h)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--landscape", action="append", help="landscape name or YAML file (repeatable)")
    parser.add_argument("--split", default="all", metavar="SPLIT[,SPLIT]",
                        help="the shipped landscapes of some splits (tune, report, heldout; default all: every "
                             "shipped one; the timed benchmark is tune,report), blind: the unshipped worlds of "
                             "benchmarks/blind, or retired: those of them that changed the method (tune worlds "
                             "now); ignored with --landscape")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of {','.join(METHODS)} (default: every one installed)")
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions per landscape of verl-sweep and manual (default 10; 2 with --quick); "
                             f"each peer runs at most {PEER_REPS}, {' and '.join(SLOW_PEERS)} once")
    parser.add_argument("--reps-for", action="append", default=[], metavar="METHOD=N",
                        help="another number of repetitions for one method, e.g. priorband=10 (repeatable)")
    parser.add_argument("--budget", type=float, default=3000.0,
                        help="the peers' GPU-hour budget when verl-sweep is not run (else: its median spend)")
    parser.add_argument("--budget-from", type=Path, default=None, metavar="RESULTS_JSON",
                        help="without verl-sweep in the run: the peers' budget per landscape from an earlier "
                             "run's results.json (verl-sweep's median spend there)")
    parser.add_argument("--study", type=Path, default=None, metavar="YAML",
                        help="a study file in place of studies/demo.yaml (its stages, probe and pruner settings; "
                             "model, launcher and final check stay the benchmark's)")
    parser.add_argument("--quick", action="store_true", help="1 landscape, 2 reps, small budgets (for tests)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--no-overhead", action="store_true", help="skip the orchestration-overhead measures")
    parser.add_argument("--from-results", type=Path, default=None,
                        help="re-summarise a results.json (no runs): table, verdict, plot to --out")
    args = parser.parse_args(argv)
    if args.study is not None:
        os.environ[STUDY_ENV] = str(args.study.resolve())
    if args.from_results:
        return _resummarize(args.from_results, args.out)
    from verl_sweep.launchers.simulator import load_landscape

    asked = args.methods.split(",") if args.methods else [m for m in METHODS if installed(m)]
    unknown = sorted(set(asked) - set(METHODS))
    if unknown:
        parser.error(f"--methods must name some of {', '.join(METHODS)}, but got {', '.join(unknown)}")
    missing = [m for m in asked if not installed(m)]
    if missing:
        parser.error(f"--methods {', '.join(missing)} need the bench extra: bash scripts/setup.sh --bench")
    methods = [m for m in METHODS if m in asked]
    if not args.methods and len(methods) < len(METHODS):
        print(f"not run (install the bench extra: bash scripts/setup.sh --bench): "
              f"{', '.join(m for m in METHODS if m not in methods)}")
    if args.landscape:
        landscapes = args.landscape
    elif args.quick:
        landscapes = ["default"]
    else:
        try:
            landscapes = split_landscapes(args.split)
        except ValueError as e:
            parser.error(str(e))
    reps = args.reps or (2 if args.quick else 10)
    reps_of = {m: reps if m not in PEERS else min(reps, 1 if m in SLOW_PEERS else PEER_REPS) for m in methods}
    for item in args.reps_for:
        name, _, n = item.partition("=")
        if name not in METHODS or not n.isdigit() or int(n) < 1:
            parser.error(f"--reps-for must be METHOD=N with a method of {', '.join(METHODS)} and N >= 1, but got {item!r}")
        reps_of[name] = int(n)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    names = {name: load_landscape(name).name for name in landscapes}
    references = [(name, args.quick) for name in landscapes]
    first = [m for m in methods if m not in PEERS]
    peers = [m for m in methods if m in PEERS]

    earlier = json.loads(args.budget_from.read_text())["budget_gpu_h"] if args.budget_from else {}

    def tasks_of(group: list[str], budget: dict[str, float]) -> list[tuple[str, str, int, bool, float]]:
        return [(name, m, rep, args.quick, budget.get(name, args.budget))
                for name in landscapes for rep in range(max(reps_of[m] for m in group) if group else 0)
                for m in group if rep < reps_of[m]]  # fmt: skip

    def budgets(done: list[dict[str, Any]]) -> dict[str, float]:
        # The peers' budget per landscape: the median GPU-hours verl-sweep spent in total.
        out = {}
        for name in landscapes:
            spent = [r["gpu_h"] for r in done if r["landscape"] == name and r["method"] == "verl-sweep"]
            if spent:
                out[name] = statistics.median(spent)
            elif names[name] in earlier:
                out[name] = float(earlier[names[name]])
        return out

    if args.jobs > 1:
        # One BLAS thread per pool process: the pool already keeps every core busy, and
        # OpenBLAS's own threads on top of it slow a run (the curve fits' matrix products; same
        # results either way; docs/method.md, Evidence). Spawned processes take this from the environment.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        # Likewise torch's OpenMP threads (the GP peer's fits): two GP runs side by side run
        # faster with one thread each, with the same suggestions.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # glibc hands each fresh array over 128 KiB (a curve fit's (grid, steps) temporaries)
        # new pages from mmap and zeroes them; keeping them on the heap is faster.
        os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=268435456:"
                                                "glibc.malloc.trim_threshold=536870912")
        # The references are only needed for the summary: they share the pool with the runs.
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            pending = pool.starmap_async(reference, references, chunksize=1)
            results = _progress(pool.imap(run_one, tasks_of(first, {}), chunksize=1), len(tasks_of(first, {})))
            peer_budget = budgets(results)
            # Longest first, so that no long run is left alone on one core at the end: GP's
            # fits grow with its trials, and every peer's trials with its GPU-hour budget.
            peer_tasks = sorted(tasks_of(peers, peer_budget), key=lambda task: (task[1] != "gp", -task[4]))
            results += _progress(pool.imap(run_one, peer_tasks, chunksize=1), len(peer_tasks))
            best = {names[name]: b for name, b in zip(landscapes, pending.get())}
    else:
        best = {names[name]: reference(name, quick) for name, quick in references}
        results = _progress(map(run_one, tasks_of(first, {})), len(tasks_of(first, {})))
        peer_budget = budgets(results)
        results += _progress(map(run_one, tasks_of(peers, peer_budget)), len(tasks_of(peers, peer_budget)))
    for r in results:
        r["landscape"] = names[r["landscape"]]
    run_gpu_h = {name: run_gpu_h_of(name, entry) for name, entry in best.items()}
    add_cost(results, run_gpu_h)
    budget_h = {names[name]: peer_budget.get(name, args.budget) for name in landscapes}
    rows = summarize(results, best, budget_h)
    table = format_table(rows, budget_h)
    verdict = acceptance(rows)
    search_s = time.perf_counter() - started
    print("SIMULATED figures (ReplayLauncher, virtual time):")
    print(table)
    print()
    print("\n".join(verdict))
    print(f"\nsearch part: {search_s:.0f} s")
    overhead: dict[str, Any] = {}
    if not args.no_overhead:
        from benchmarks import overhead as O

        overhead = O.measure_all(quick=args.quick)
        print()
        print(O.format_overhead(overhead))
    payload = {
        "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"), "landscapes": list(best), "reps": reps, "methods": methods,
        "reps_per_method": reps_of,
        "split": {name: split_of(name) for name in best},
        "best": best, "budget_gpu_h": budget_h, "run_gpu_h": run_gpu_h, "rows": rows, "acceptance": verdict, "runs": results,
        "overhead": overhead, "search_seconds": search_s, "total_seconds": time.perf_counter() - started,
    }  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(payload, indent=1, default=_json_default))
    try:
        write_plot(results, args.out / "curves.html")
    except ImportError:
        logging.getLogger(__name__).warning("plotly is not installed: no plot written")
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'curves.html'} in {time.perf_counter() - started:.0f} s")
    return 0


def _resummarize(path: Path, out: Path) -> int:
    """The table, verdict and plot of a finished run, recomputed from its results.json."""
    payload = json.loads(path.read_text())
    results, best, budget_h = payload["runs"], payload["best"], payload["budget_gpu_h"]
    for r in results:
        r["points"] = [tuple(p) for p in r["points"]]
    # An older file has no R and no cost: R recomputed where the world can still be found
    # (at today's full-run length; its η stay those of its own horizon, the table's last line)
    run_gpu_h = payload.get("run_gpu_h") or {}
    for name, entry in best.items():
        run_gpu_h[name] = run_gpu_h.get(name) or run_gpu_h_of(name, entry)
        if run_gpu_h[name] is not None:
            entry.setdefault("run_gpu_h", run_gpu_h[name])
    add_cost(results, run_gpu_h)
    payload["run_gpu_h"] = run_gpu_h
    rows = summarize(results, best, budget_h)
    payload["rows"], payload["acceptance"] = rows, acceptance(rows)
    print("SIMULATED figures (ReplayLauncher, virtual time), from", path)
    print(format_table(rows, budget_h))
    print()
    print("\n".join(payload["acceptance"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=_json_default))
    write_plot(results, out / "curves.html")
    return 0


def _progress(runs: Any, total: int) -> list[dict[str, Any]]:
    """Collect the runs, one line on stderr each (landscape, method, repetition, seconds)."""
    out = []
    for r in runs:
        out.append(r)
        print(f"[{len(out)}/{total}] {r['landscape']} {r['method']} rep {r['rep']}: final η {r['final_eta']:.3f}, "
              f"{r['gpu_h']:,.0f} GPU-h, {r['seconds']:.1f} s", file=sys.stderr, flush=True)
    return out


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)  # type: ignore[arg-type]
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
