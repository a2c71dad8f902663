"""Does staged search reach a near-best config with less GPU time than the alternatives?

    python -m benchmarks.run [--landscape FILE ...] [--reps N] [--quick] [--jobs 2] [--out DIR]

Runs every method of :mod:`benchmarks.methods` on each landscape (default: the shipped ones)
× ``--reps`` repetitions (sampler and noise seeds differ per repetition) on the simulated-time
ReplayLauncher, scores every choice on the landscape's noise-free model (``true_rate``), and
prints one table; writes ``results.json`` and ``curves.html`` (best true η so far against
simulated GPU-hours, one line per method) to ``--out``. Then measures orchestration overhead
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
CACHE = REPO / "benchmarks" / ".cache"
#: bump when best_reachable's method changes (it is part of the cache key)
BEST_VERSION = 2
METHODS = ("verl-sweep", "manual", "random", "tpe")
JOINT_TRIALS = 36
QUICK_JOINT_TRIALS = 16


def demo_spec(landscape: str, *, quick: bool = False) -> Any:
    """The demo study (studies/demo.yaml) on the replay launcher, for ``landscape``."""
    import yaml

    from search.study_file import parse_study

    data = yaml.safe_load((REPO / "studies" / "demo.yaml").read_text())
    data["name"] = "bench"
    # The study file cannot name the replay launcher yet (kind is sim/local/ray); the
    # benchmark hands the driver a ReplayLauncher itself.
    data["launcher"] = {"kind": "sim", "max_concurrent": 2, "options": {"landscape": landscape}}
    if quick:  # smaller stage budgets: the test checks the machinery, not the figures
        for stage in data["stages"]:
            stage["budget"] = {"max_trials": 3}
            stage["confirm_top"] = 1
    return parse_study(data)


# -- the noise-free reference --------------------------------------------------------------------


def _true_eta(landscape: Any, config: dict[str, Any], baseline_rate: float, steps: int) -> float:
    rate = landscape.true_rate(config, steps)
    return rate / baseline_rate if math.isfinite(rate) else 0.0


def best_reachable(landscape_name: str, spec: Any, *, n_random: int = 300, seed: int = 0) -> dict[str, Any]:
    """Max true η over every config a method can choose: TPE on the noise-free model over the
    joint space (``n_random`` trials), coordinate passes on fine grids of the four method
    knobs, and the study's own stage chain run on the noise-free model (each stage's space
    on the chain's base, ``n_random`` points a stage). The chain's later spaces reach configs
    the joint space cannot: the token budget bound follows the tuned memory fraction and TP.
    Cached in benchmarks/.cache by the landscape file's and the study's content."""
    from launchers.simulator import load_landscape
    from spaces import limits as L
    from spaces.overrides import merge

    from benchmarks.methods import joint_space
    from spaces.stages import build_space

    landscape = load_landscape(landscape_name)
    key = hashlib.sha1(json.dumps([BEST_VERSION, landscape.data, spec.model_dump(mode="json"), n_random], sort_keys=True,
                                  default=str).encode()).hexdigest()[:16]  # fmt: skip
    cached = CACHE / f"best-{landscape.name}-{key}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    import optuna

    space = joint_space(spec)
    kinds = {part.kind: part for part in space.parts}
    mini, kl, tokens, lr = (kinds[k] for k in ("mini_batch", "kl", "token_budget", "lr"))
    base = spec.baseline_config()
    steps = spec.probe.steps
    base_rate = landscape.true_rate(base, steps)
    _, coef_key = L.kl_keys(spec.algorithm)

    # 1. TPE on the noise-free model over the whole joint space (systems layout included).
    def objective(trial: "optuna.trial.Trial") -> float:
        config = merge(base, space.suggest(trial, base))
        trial.set_user_attr("config", config)
        return _true_eta(landscape, config, base_rate, steps)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=40))
    study.enqueue_trial(space.incumbent_params(base) or {})
    study.optimize(objective, n_trials=n_random)
    best_config = dict(study.best_trial.user_attrs["config"])
    best = study.best_value
    # 2. Coordinate passes on fine grids of the four method knobs, the layout kept.
    grids = {
        L.MINI_BATCH: list(mini.choices),  # type: ignore[attr-defined]
        coef_key: [kl.bound.low * (kl.bound.high / kl.bound.low) ** (i / 31) for i in range(32)],  # type: ignore[attr-defined]
        L.TOKEN_BUDGET: sorted({int(tokens.bound.low + (tokens.bound.high - tokens.bound.low) * i / 31) for i in range(32)}),  # type: ignore[attr-defined]
        L.LR: [lr.bound.low * (lr.bound.high / lr.bound.low) ** (i / 31) for i in range(32)],  # type: ignore[attr-defined]
    }
    for _ in range(2):
        for key_, grid in grids.items():
            for option in grid:
                config = {**best_config, key_: option}
                v = _true_eta(landscape, config, base_rate, steps)
                if v > best:
                    best, best_config = v, config
    # 3. The stage chain on the noise-free model.
    chain = base
    for index, stage in enumerate(spec.stages):
        stage_space = build_space(stage.space, model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm,
                                  base=chain, options=stage.params, where=f"stages[{index}]", baseline=base)
        stage_study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed + index))
        stage_best, stage_config = _true_eta(landscape, chain, base_rate, steps), chain
        for _ in range(n_random):
            trial = stage_study.ask()
            config = merge(chain, stage_space.suggest(trial, chain))
            v = _true_eta(landscape, config, base_rate, steps)
            stage_study.tell(trial, v)
            if v > stage_best:
                stage_best, stage_config = v, config
        chain = stage_config
        if stage_best > best:
            best, best_config = stage_best, stage_config
    best_point = {k: v for k, v in best_config.items() if base.get(k) != v}
    result = {"landscape": landscape.name, "best_eta": best, "best_point": best_point, "baseline_rate": base_rate}
    CACHE.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(result, indent=2))
    return result


def reference(landscape_name: str, quick: bool) -> dict[str, Any]:
    """The landscape's best reachable η, for the summary."""
    return best_reachable(landscape_name, demo_spec(landscape_name), n_random=60 if quick else 400)


# -- one (landscape, method, repetition) ---------------------------------------------------------


def run_one(task: tuple[str, str, int, bool]) -> dict[str, Any]:
    """Run one method once; returns its trace scored on the noise-free model."""
    landscape_name, method, rep, quick = task
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from launchers.simulator import load_landscape

    from benchmarks import methods as M

    spec = demo_spec(landscape_name, quick=quick)
    # A different noise stream per repetition: seeds shift by 100 × rep.
    data = spec.model_dump(mode="json")
    data["seeds"] = [s + 100 * rep for s in data["seeds"]]
    for stage in data["stages"]:
        stage["sampler"] = {**stage.get("sampler", {}), "seed": 1000 + rep}
    spec = type(spec).model_validate(data)
    landscape = load_landscape(landscape_name)
    n_joint = QUICK_JOINT_TRIALS if quick else JOINT_TRIALS
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vs-bench-") as tmp:
        launcher = M.replay_launcher(Path(tmp), landscape_name)
        if method == "verl-sweep":
            trace = M.run_staged(spec, launcher)
        elif method == "manual":
            trace = M.run_manual(spec, launcher, seed=5000 + 100 * rep)
        else:
            trace = M.run_joint(spec, launcher, method, n_trials=n_joint, seed=1000 + rep)
        launcher.close()
    base_rate = landscape.true_rate(spec.baseline_config(), spec.probe.steps)
    points = [(gpu_h, _true_eta(landscape, config, base_rate, spec.probe.steps)) for gpu_h, config in trace.points]
    return {
        "landscape": landscape_name, "method": method, "rep": rep,
        "points": points, "gpu_h": trace.gpu_h, "n_probes": trace.n_probes,
        "pruned_saved_gpu_h": trace.pruned_saved_gpu_h, "idle_fraction": trace.idle_fraction,
        "final_eta": points[-1][1], "seconds": time.perf_counter() - started,
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


def summarize(results: list[dict[str, Any]], best: dict[str, dict[str, Any]], budget_h: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for landscape in best:
        target = 0.95 * best[landscape]["best_eta"]
        for method in METHODS:
            runs = [r for r in results if r["landscape"] == landscape and r["method"] == method]
            if not runs:
                continue
            reach = [hours_to_reach(r["points"], target) for r in runs]
            at_budget = [eta_at(r["points"], budget_h[landscape]) for r in runs]
            rows.append({
                "landscape": landscape, "method": method, "reps": len(runs),
                "best_eta": best[landscape]["best_eta"],
                "hours_to_95": median_interval(reach),
                "reached": sum(1 for h in reach if math.isfinite(h)),
                "eta_at_budget": median_interval(at_budget),
                "final_eta": median_interval([r["final_eta"] for r in runs]),
                "false_win_rate": sum(1 for r in runs if r["final_eta"] < 1.0) / len(runs),
                "gpu_h_total": median_interval([r["gpu_h"] for r in runs]),
                "pruning_saved": statistics.median(
                    r["pruned_saved_gpu_h"] / (r["gpu_h"] + r["pruned_saved_gpu_h"]) for r in runs),
                "idle_fraction": statistics.median(r["idle_fraction"] for r in runs),
            })  # fmt: skip
    return rows


def _fmt_h(m: tuple[float, float, float]) -> str:
    f = lambda x: "never" if math.isinf(x) else f"{x:,.0f}"  # noqa: E731
    return f"{f(m[0])} [{f(m[1])}-{f(m[2])}]"


def format_table(rows: list[dict[str, Any]], budget_h: dict[str, float]) -> str:
    head = (f"{'landscape':<10} {'method':<11} {'GPU-h to 95% best (IQR)':<28} {'reached':>8} "
            f"{'η@budget':>9} {'final η':>8} {'false win':>9} {'GPU-h total':>12} {'pruning saved':>13} {'idle':>6}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['landscape']:<10} {r['method']:<11} {_fmt_h(r['hours_to_95']):<28} "
            f"{r['reached']:>4}/{r['reps']:<3} {r['eta_at_budget'][0]:>9.3f} {r['final_eta'][0]:>8.3f} "
            f"{r['false_win_rate']:>9.0%} {r['gpu_h_total'][0]:>12,.0f} {r['pruning_saved']:>13.0%} {r['idle_fraction']:>6.0%}"
        )
    lines.append("")
    lines.append("best η (noise-free optimum of the joint space and of the stage chain, vs the study baseline) and fixed budgets: "
                 + "; ".join(f"{k}: {rows[[r['landscape'] for r in rows].index(k)]['best_eta']:.3f}, "
                             f"{v:,.0f} GPU-h" for k, v in budget_h.items()))  # fmt: skip
    return "\n".join(lines)


def acceptance(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 8's criteria, measured: one line per landscape."""
    out = []
    for landscape in sorted({r["landscape"] for r in rows}):
        by = {r["method"]: r for r in rows if r["landscape"] == landscape}
        vs = by.get("verl-sweep")
        if vs is None:
            continue

        def ratio(other: str) -> str:
            if other not in by:
                return "n/a"
            a, b = vs["hours_to_95"][0], by[other]["hours_to_95"][0]
            if math.isinf(a):
                return "∞ (verl-sweep never reached)"
            if math.isinf(b):
                return f"0 ({other} never reached)"
            return f"{a / b:.2f}"

        r_random, r_tpe = ratio("random"), ratio("tpe")
        ok = (_le(r_random, 0.5) and _le(r_tpe, 0.8) and vs["false_win_rate"] <= 0.10)
        out.append(f"{landscape}: verl-sweep/random {r_random} (≤0.5), verl-sweep/tpe {r_tpe} (≤0.8), "
                   f"false wins {vs['false_win_rate']:.0%} (≤10%) → {'PASS' if ok else 'FAIL'}")  # fmt: skip
    return out


def _le(text: str, limit: float) -> bool:
    try:
        return float(text.split()[0]) <= limit
    except ValueError:
        return False


def write_plot(results: list[dict[str, Any]], path: Path) -> None:
    """Median best-true-η-so-far against GPU-hours, one line per method, one panel per
    landscape; plotly HTML (matplotlib is not installed here)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    landscapes = sorted({r["landscape"] for r in results})
    fig = make_subplots(rows=1, cols=len(landscapes), subplot_titles=landscapes)
    colors = {"verl-sweep": "#1f77b4", "manual": "#7f7f7f", "random": "#ff7f0e", "tpe": "#2ca02c", "gp": "#9467bd"}
    for col, landscape in enumerate(landscapes, start=1):
        runs = [r for r in results if r["landscape"] == landscape]
        horizon = max(r["gpu_h"] for r in runs)
        grid = [horizon * i / 100 for i in range(101)]
        for method in METHODS:
            mine = [r for r in runs if r["method"] == method]
            if not mine:
                continue
            curve = [statistics.median(_best_so_far(r["points"], h) for r in mine) for h in grid]
            fig.add_trace(go.Scatter(x=grid, y=curve, name=method, legendgroup=method, showlegend=col == 1,
                                     line={"color": colors.get(method)}), row=1, col=col)  # fmt: skip
    fig.update_xaxes(title_text="simulated GPU-hours")
    fig.update_yaxes(title_text="true η of the best choice so far (median)", col=1)
    fig.write_html(str(path), include_plotlyjs="cdn")


def _best_so_far(points: list[tuple[float, float]], budget_h: float) -> float:
    return max(eta for gpu_h, eta in points if gpu_h <= budget_h)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--landscape", action="append", help="landscape name or YAML file (repeatable)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per landscape and method (default 10; 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="1 landscape, 2 reps, small budgets (for tests)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--no-overhead", action="store_true", help="skip the orchestration-overhead measures")
    args = parser.parse_args(argv)
    from launchers.simulator import load_landscape, shipped_landscapes

    landscapes = args.landscape or (["default"] if args.quick else shipped_landscapes())
    reps = args.reps or (2 if args.quick else 10)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    names = {name: load_landscape(name).name for name in landscapes}
    references = [(name, args.quick) for name in landscapes]
    tasks = [(name, method, rep, args.quick) for name in landscapes for rep in range(reps) for method in METHODS]
    if args.jobs > 1:
        # One BLAS thread per pool process: the pool already keeps every core busy, and
        # OpenBLAS's own threads on top of it made a run ~40% slower (the curve fits' matrix
        # products; same results either way). Spawned processes take this from the environment.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        # The references are only needed for the summary: they share the pool with the runs.
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            pending = pool.starmap_async(reference, references, chunksize=1)
            results = pool.map(run_one, tasks, chunksize=1)
            best = {names[name]: b for name, b in zip(landscapes, pending.get())}
    else:
        best = {names[name]: reference(name, quick) for name, quick in references}
        results = [run_one(t) for t in tasks]
    for r in results:
        r["landscape"] = names[r["landscape"]]
    # Fixed budget per landscape: the median GPU-hours verl-sweep spends in total.
    budget_h = {
        lname: statistics.median(r["gpu_h"] for r in results if r["landscape"] == lname and r["method"] == "verl-sweep")
        for lname in best
    }
    rows = summarize(results, best, budget_h)
    table = format_table(rows, budget_h)
    verdict = acceptance(rows)
    search_s = time.perf_counter() - started
    print(table)
    print()
    print("\n".join(verdict))
    overhead: dict[str, Any] = {}
    if not args.no_overhead:
        from benchmarks import overhead as O

        overhead = O.measure_all(quick=args.quick)
        print()
        print(O.format_overhead(overhead))
    payload = {
        "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"), "landscapes": list(best), "reps": reps,
        "best": best, "budget_gpu_h": budget_h, "rows": rows, "acceptance": verdict, "runs": results,
        "overhead": overhead, "search_seconds": search_s, "total_seconds": time.perf_counter() - started,
    }  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(payload, indent=1, default=_json_default))
    try:
        write_plot(results, args.out / "curves.html")
    except ImportError:
        logging.getLogger(__name__).warning("plotly is not installed: no plot written")
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'curves.html'} in {time.perf_counter() - started:.0f} s")
    return 0


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)  # type: ignore[arg-type]
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
