"""One self-contained HTML report of a study (``verl-sweep report NAME -o report.html``).

Contract: ``write_report(storage, spec, output_path)`` reads the study's database (read-only)
and the probes' run directories and writes ONE HTML file that opens offline: plotly.js is
inlined once (with the first figure), nothing is fetched. Sections: a stage summary (in train
mode then the chain, the continuation and the model, in place of the final check), η of
every trial per stage with its interval, best η so far against simulated GPU-hours, reward
curves of each stage's incumbent and winner, parameter importance (or a note why not), prune
and failure reasons, GPU utilisation, and the exported YAML. Every piece of text is escaped.

The overall gain against the baseline (the final check) and its payback come first. The page
fits a 1,400 px screen: figures take their container's width (``responsive``), slice plots hold
a few parameters each, wide tables scroll inside their box, and per-trial tables are collapsed
(``<details>``).

After the plots are drawn, a script writes a marker into ``#report-check``
(``data-expected``, ``data-rendered``, ``data-errors``, ``data-scroll-width``,
``data-scroll-height``) so that a headless browser can check that every figure rendered
without a script error and that nothing overflows the window.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from verl_sweep.objectives.metrics import REWARD_KEY
from verl_sweep.objectives.sources import read_run
from verl_sweep.search.views import export
from verl_sweep.search.database.records import Role, TrialRecord, records, stage_study_name
from verl_sweep.search.views.status import cost_lines, overall_line, r_text, results_of, study_status, trial_gpu_summary
from verl_sweep.search.engine.final_check import BASELINE_TIME_RATIO
from verl_sweep.search.views.train import schedule as train_schedule, schedule_yaml as train_schedule_yaml
from verl_sweep.search.spec.study_file import StageSettings, StudySpec

if TYPE_CHECKING:
    import optuna
    import plotly.graph_objects as go

logger = logging.getLogger(__name__)

#: fewest complete trials (and varied parameters) before an importance estimate means anything
MIN_TRIALS_FOR_IMPORTANCE = 5
MIN_PARAMS_FOR_IMPORTANCE = 2
#: reward curves are thinned to at most this many points per run (keeps the file small)
MAX_CURVE_POINTS = 400

ROLE_COLOURS = {Role.INCUMBENT: "#636efa", Role.CANDIDATE: "#00cc96", Role.RERUN: "#ab63fa"}

_PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}" if abs(value) < 1e-3 or abs(value) >= 1e5 else f"{value:.{digits}f}"
    return str(value)


def _gb(value: Any) -> str:
    return "—" if not isinstance(value, (int, float)) else f"{value:.1f}"


def _params_text(overrides: dict[str, Any]) -> str:
    from verl_sweep.search.views.console import format_params

    return format_params(overrides)


class _Figures:
    """Turns plotly figures into HTML fragments: plotly.js inlined with the first one only."""

    def __init__(self) -> None:
        self.count = 0

    def render(self, fig: "go.Figure", *, height: int = 380) -> str:
        # No fixed width: the figure takes its container's (``responsive`` redraws it on resize).
        fig.update_layout(height=height, width=None, autosize=True, margin={"l": 60, "r": 20, "t": 50, "b": 50})
        fragment = fig.to_html(
            full_html=False,
            include_plotlyjs=self.count == 0,  # inline (no CDN) exactly once
            include_mathjax=False,
            div_id=f"plot-{self.count}",
            config=_PLOTLY_CONFIG,
        )
        self.count += 1
        return f'<div class="plot">{fragment}</div>'


@dataclasses.dataclass
class _StageData:
    stage: StageSettings
    status: dict[str, Any]
    study: "optuna.Study | None"
    trials: list[TrialRecord]


# -- data ---------------------------------------------------------------------------------------


def _load(storage: "optuna.storages.BaseStorage", spec: StudySpec, *,
          run_steps: int | None = None) -> tuple[dict[str, Any], list[_StageData]]:
    from verl_sweep.search.database.study_root import stored_study

    status = study_status(storage, spec, run_steps=run_steps)
    stages = []
    for stage, entry in zip(spec.stages, status["stages"]):
        study = stored_study(storage, stage_study_name(spec, stage))
        trials = [] if study is None else records(study.get_trials(deepcopy=False))
        stages.append(_StageData(stage, entry, study, trials))
    return status, stages


def _reward_curve(run_dir: str | None) -> tuple[list[int], list[float]]:
    if not run_dir:
        return [], []
    points = [(m.step, m.get(REWARD_KEY)) for m in read_run(run_dir)]
    points = [(s, r) for s, r in points if r is not None]
    stride = max(1, math.ceil(len(points) / MAX_CURVE_POINTS))
    thinned = points[::stride]
    if points and thinned[-1] != points[-1]:
        thinned.append(points[-1])
    return [s for s, _ in thinned], [float(r) for _, r in thinned]  # type: ignore[arg-type]


# -- figures ------------------------------------------------------------------------------------


def eta_figure(data: _StageData) -> "go.Figure | None":
    """η of every complete trial of a stage, with its interval, coloured by role."""
    import plotly.graph_objects as go

    rows = [r for r in data.status.get("trials", []) if r["state"] == "complete" and r.get("eta") is not None]
    if not rows:
        return None
    fig = go.Figure()
    for role in (Role.INCUMBENT, Role.CANDIDATE, Role.RERUN):
        mine = [r for r in rows if r["role"] == role]
        if not mine:
            continue
        eta = [float(r["eta"]) for r in mine]
        low = [float((r.get("eta_interval") or [v, v])[0]) for r, v in zip(mine, eta)]
        high = [float((r.get("eta_interval") or [v, v])[1]) for r, v in zip(mine, eta)]
        fig.add_trace(go.Scatter(
            x=[r["number"] for r in mine], y=eta, mode="markers", name=role.value,
            marker={"size": 10, "color": ROLE_COLOURS.get(role)},
            error_y={"type": "data", "symmetric": False,
                     "array": [h - v for h, v in zip(high, eta)],
                     "arrayminus": [v - lo for v, lo in zip(eta, low)]},
            text=[f"trial {r['number']} ({role}, seed {r.get('seed')}): {_params_text(r['params'])}" for r in mine],
            hovertemplate="%{text}<br>η %{y:.3f}<extra></extra>",
        ))
    tolerance = data.stage.stop.tolerance
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey", annotation_text="incumbent η = 1",
                  annotation_position="top left")
    fig.add_hline(y=1 + tolerance, line_dash="dash", line_color="#ef553b",
                  annotation_text=f"+{tolerance:.0%} to win", annotation_position="bottom right")
    fig.update_layout(title=f"{data.stage.name}: η per trial (90% interval)",
                      xaxis_title="trial", yaxis_title="η (rate ÷ incumbent rate)")
    return fig


def best_so_far_figure(stages: list[_StageData]) -> "go.Figure | None":
    """Best η so far in each stage against the study's cumulative simulated GPU-hours."""
    import plotly.graph_objects as go

    finished: list[tuple[datetime.datetime, str, TrialRecord]] = []
    for data in stages:
        for t in data.trials:
            if t.datetime_complete is not None:
                finished.append((t.datetime_complete, data.stage.name, t))
    if not finished:
        return None
    finished.sort(key=lambda item: (item[0], item[2].number))
    gpu_h = 0.0
    best: dict[str, float] = {}
    series: dict[str, tuple[list[float], list[float], list[str]]] = {}
    for _, stage, t in finished:
        gpu_h += float(t.probe.get("gpu_time_s") or 0.0) / 3600.0
        if t.state.name == "COMPLETE" and t.value is not None and t.role is not Role.RERUN:
            best[stage] = max(best.get(stage, 1.0), float(t.value))
        xs, ys, texts = series.setdefault(stage, ([], [], []))
        xs.append(gpu_h)
        ys.append(best.get(stage, 1.0))
        texts.append(f"{stage} trial {t.number} ({t.state.name.lower()})")
    fig = go.Figure()
    for stage, (xs, ys, texts) in series.items():
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=stage, line_shape="hv", text=texts,
                                 hovertemplate="%{text}<br>%{x:.2f} GPU-h, best η %{y:.3f}<extra></extra>"))
    fig.update_layout(title="best η so far against simulated GPU-hours (each stage against its own incumbent)",
                      xaxis_title="cumulative GPU-hours", yaxis_title="best η so far")
    return fig


def reward_figure(data: _StageData) -> "go.Figure | None":
    """Reward curves of the stage's incumbent runs and of its winner (with its re-runs); the
    best candidate stands in, dashed, when the incumbent was kept."""
    import plotly.graph_objects as go

    result = data.status.get("winner") or {}
    winner = result.get("winner_trial")
    complete = [t for t in data.trials if t.state.name == "COMPLETE"]
    picks: list[tuple[str, TrialRecord, dict[str, Any]]] = []
    for t in complete:
        if t.role is Role.INCUMBENT:
            picks.append((f"incumbent (trial {t.number}, seed {t.seed})", t,
                          {"color": ROLE_COLOURS[Role.INCUMBENT]}))
    focus = winner
    label = "winner"
    if focus is None:
        focus = _best_candidate(complete)
        label = "best candidate, not adopted"
    for t in complete:
        if t.number == focus or (focus is not None and t.rerun_of == focus):
            role = "re-run" if t.role is Role.RERUN else label
            style = {"color": "#ef553b"} if winner is not None else {"color": "#ef553b", "dash": "dash"}
            picks.append((f"{role} (trial {t.number}, seed {t.seed})", t, style))
    fig = go.Figure()
    for name, t, style in picks:
        steps, rewards = _reward_curve(t.run_dir)
        if steps:
            fig.add_trace(go.Scatter(x=steps, y=rewards, mode="lines", name=name, line=style))
    if not fig.data:
        return None
    fig.update_layout(title=f"{data.stage.name}: reward ({REWARD_KEY}) against step",
                      xaxis_title="step", yaxis_title=REWARD_KEY)
    return fig


def _best_candidate(complete: list[TrialRecord]) -> int | None:
    """The candidate the driver judged best: like its decision, confirmed candidates (those with
    re-runs) rank by their mean η over all their runs, the others by their one run."""
    runs: dict[int, list[float]] = {}
    for t in complete:
        if t.value is None:
            continue
        if t.role is Role.CANDIDATE:
            runs.setdefault(t.number, []).insert(0, float(t.value))
        elif t.role is Role.RERUN and t.rerun_of is not None:
            runs.setdefault(t.rerun_of, []).append(float(t.value))
    candidates = {n: v for n, v in runs.items()
                  if any(t.number == n and t.role is Role.CANDIDATE for t in complete)}
    confirmed = {n: v for n, v in candidates.items() if len(v) > 1} or candidates
    if not confirmed:
        return None
    return max(confirmed, key=lambda n: sum(confirmed[n]) / len(confirmed[n]))


def _varied_params(trials: Iterable[TrialRecord]) -> list[str]:
    values: dict[str, set[str]] = {}
    for t in trials:
        for k, v in t.params.items():
            values.setdefault(k, set()).add(repr(v))
    return sorted(k for k, seen in values.items() if len(seen) > 1)


def importance_figure(data: _StageData) -> tuple["go.Figure | None", str]:
    """Optuna's parameter importance for the stage, or None and a note saying why not."""
    import optuna

    complete = [t for t in data.trials if t.state.name == "COMPLETE" and t.value is not None]
    varied = _varied_params(complete)
    if len(complete) < MIN_TRIALS_FOR_IMPORTANCE:
        return None, (f"{len(complete)} complete trials: importance needs at least "
                      f"{MIN_TRIALS_FOR_IMPORTANCE}.")
    if len(varied) < MIN_PARAMS_FOR_IMPORTANCE:
        what = f"only {varied[0]} varied" if varied else "no parameter varied"
        return None, f"{what}: importance is trivial with fewer than {MIN_PARAMS_FOR_IMPORTANCE} parameters."
    assert data.study is not None
    try:
        fig = optuna.visualization.plot_param_importances(data.study, params=varied, target_name="η")
    except Exception as e:  # noqa: BLE001 - Optuna refuses some trial sets; the report says so
        logger.warning("importance of %s failed: %s", data.stage.name, e)
        return None, f"Optuna could not compute the importance: {e}"
    fig.update_layout(title=f"{data.stage.name}: parameter importance (η)")
    return fig, ""


#: a slice plot shows at most this many parameters side by side (the systems stage varies ~17)
SLICE_PARAMS_PER_FIGURE = 4


def slice_figures(data: _StageData) -> list["go.Figure"]:
    """Optuna's slice plots: η against each varied parameter, ``SLICE_PARAMS_PER_FIGURE`` to a
    figure, so that each panel keeps a readable width on a 1,400 px screen."""
    import optuna

    complete = [t for t in data.trials if t.state.name == "COMPLETE" and t.value is not None]
    varied = _varied_params(complete)
    if len(complete) < 2 or not varied or data.study is None:
        return []
    figures: list[go.Figure] = []
    chunks = [varied[i:i + SLICE_PARAMS_PER_FIGURE] for i in range(0, len(varied), SLICE_PARAMS_PER_FIGURE)]
    for n, chunk in enumerate(chunks, 1):
        try:
            fig = optuna.visualization.plot_slice(data.study, params=chunk, target_name="η")
        except Exception as e:  # noqa: BLE001
            logger.warning("slice plot of %s failed: %s", data.stage.name, e)
            return figures
        part = f" ({n} of {len(chunks)})" if len(chunks) > 1 else ""
        fig.update_layout(title=f"{data.stage.name}: η against the stage's parameters{part}", width=None)
        figures.append(fig)
    return figures


# -- tables -------------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[Any]], *, css: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return (f'<div class="table"><table class="{_e(css)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody>'
            '</table></div>')


def _collapsed(summary: str, content: str) -> str:
    """A per-trial table, closed until clicked: one line of the page instead of thousands of px."""
    return f"<details><summary>{_e(summary)}</summary>{content}</details>"


def _summary_table(status: dict[str, Any]) -> str:
    rows = []
    for s in status["stages"]:
        winner = s.get("winner") or {}
        counts = " ".join(f"{n} {k}" for k, n in sorted((s.get("counts") or {}).items())) or "—"
        eta = (f"{winner['eta']:.3f} [{winner['eta_low']:.3f}, {winner['eta_high']:.3f}]" if winner else "—")
        in_r = "—" if s.get("cost_r") is None else r_text(s["cost_r"])
        rows.append([s["name"], s["space"], s["state"], counts, s.get("gpu_hours", 0.0), in_r,
                     s.get("gpu_hours_saved", 0.0), eta, winner.get("summary", "—")])
    return _table(["stage", "space", "state", "trials", "GPU-h", "in R (full runs)", "GPU-h saved by pruning", "η [90%]",
                   "decision"], rows)


def _reasons_table(status: dict[str, Any]) -> str:
    rows = []
    for s in status["stages"]:
        for r in s.get("trials", []):
            if r["state"] in ("pruned", "fail"):
                rows.append([s["name"], r["number"], r["state"], r["role"], _params_text(r["params"]),
                             r.get("last_step"), r.get("failure_kind") or "—", r.get("reason") or "—",
                             "yes" if r.get("requeued") else "no"])
    if not rows:
        return "<p class=\"note\">No trial was pruned or failed.</p>"
    counts = []
    for s in status["stages"]:
        for reason, n in sorted((s.get("reasons") or {}).items()):
            counts.append([s["name"], reason or "—", n])
    return (_table(["stage", "reason", "trials"], counts)
            + _collapsed(f"every pruned or failed trial ({len(rows)})",
                         _table(["stage", "trial", "state", "role", "parameters", "last step", "failure kind", "reason",
                                 "queued again"], rows)))


def _gpu_table(stages: list[_StageData]) -> str:
    rows = []
    for data in stages:
        for t in data.trials:
            summary = trial_gpu_summary(t)
            if summary is None:
                continue
            idle = summary.get("idle_fraction")
            rows.append([data.stage.name, t.number, t.role.value, _params_text(t.overrides),
                         f"{summary['mean_util_pct']:.1f}%", "—" if idle is None else f"{idle:.1%}",
                         _gb(summary.get("peak_mem_gb")), _gb(summary.get("min_free_gb")), summary.get("n_samples"),
                         summary.get("diagnosis") or "—"])
    if not rows:
        return "<p class=\"note\">No GPU samples were recorded (no <code>gpu</code> attribute, no gpu_samples.jsonl).</p>"
    return _collapsed(f"GPU utilisation of every trial ({len(rows)})",
                      _table(["stage", "trial", "role", "parameters", "mean util", "idle (<10% util)",
                              "peak memory GB", "least free GB", "samples", "diagnosis"], rows))


def _train_section(status: dict[str, Any]) -> str:
    """Train mode's chain: each learning stage's branch (the step and checkpoint it started from,
    the steps its runs trained, its runs, the config it chose, the checkpoint it left), then the
    continuation and the model (``verl_sweep.search.views.train``)."""
    from verl_sweep.search.views.train import chain_lines

    train = status["train"]
    rows = []
    for link in train["chain"]:
        steps = "—" if link["steps"] is None else f"{link['steps'][0]:,}–{link['steps'][1]:,}"
        start = link["from"] or {}
        source = ("—" if not start else "from scratch" if not start.get("step_dir")
                  else f"step {start['step']:,}: {start['stage']} trial {start['trial']}, {start['step_dir']}")
        left = link.get("left") or {}
        winner = (status["stages"][link["index"]].get("winner") or {})
        rows.append([link["stage"], link["state"], steps, source, link["n_runs"], winner.get("summary") or "—",
                     "—" if not left.get("step_dir") else f"step {left['step']:,}: trial {left['trial']}, {left['step_dir']}"])
    c = train["continuation"]
    start = c.get("from") or {}
    model = c.get("model") or {}
    rows.append(["continuation", c["state"],
                 "—" if not start else f"{start['step'] + 1:,}–" + ("?" if c["to_step"] is None else f"{c['to_step']:,}"),
                 "—" if not start.get("step_dir") else
                 f"step {start['step']:,}: {start['stage']} trial {start['trial']}, {start['step_dir']}",
                 len(c["attempts"]), f"the chain's config trains to the run's end ({c['gpu_hours']:.2f} GPU-h)",
                 model.get("step_dir") or "the model: not trained yet"])
    lines = "".join(f"<p>{_e(line)}</p>" for line in chain_lines(status)[:1])
    model_text = (f"The model: step {model['step']:,}, <code>{_e(model['step_dir'])}</code>" if model
                  else "The model is not trained yet: <code>verl-sweep resume</code> trains it to the run's end.")
    return ("<h2>Train mode: the chain and the model</h2>" + lines
            + _table(["stage", "state", "steps its runs trained", "branched from", "runs (attempts)",
                      "decision (the config the chain went on with)", "the chain's checkpoint it left (the model)"], rows)
            + f"<p><b>{model_text}</b></p>")


def _final_check_label(row: dict[str, Any]) -> str:
    """Which config a final check's run is: the baseline (re-timed from its learning at the speed
    stages' layout, ``verl_sweep.search.engine.final_check``) or the final config (re-timed too where it
    is that same config, its run then the baseline's as well)."""
    ratio = row.get(BASELINE_TIME_RATIO)
    if row["role"] == Role.INCUMBENT:
        return "baseline" if ratio is None else f"baseline (its learning at the tuned layout, re-timed ×{ratio:.2f})"
    if ratio is None:
        return "final config"
    carried = f"the run of {row['carried_from']} carried over, " if row.get("carried_from") else ""
    return f"final config ({carried}re-timed ×{ratio:.2f}: the baseline's run too)"


def _final_check_section(status: dict[str, Any]) -> str:
    """The final check's runs: the baseline and the final config on each fresh seed."""
    entry = status.get("final_check")
    head = "<h2>Final check: the final config against the baseline</h2>"
    if entry is None:
        return head + f'<p class="note">{_e(overall_line(status))}</p>'
    rows = [[r["number"], _final_check_label(r), r["seed"], r["state"],
             "—" if r.get("eta") is None else f"{r['eta']:.3f} [{r['eta_interval'][0]:.3f}, {r['eta_interval'][1]:.3f}]",
             r.get("gpu_time_s") and r["gpu_time_s"] / 3600.0, r.get("reason") or "—"] for r in entry["trials"]]
    in_r = "" if entry.get("cost_r") is None else f" = {r_text(entry['cost_r'])}"
    return head + _collapsed(f"its {len(rows)} runs ({entry['gpu_hours']:.2f} GPU-hours{in_r})",
                             _table(["trial", "config", "seed", "state", "η [90%] against the baseline", "GPU-h",
                                     "reason"], rows))


# -- page ---------------------------------------------------------------------------------------

_CSS = """
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;padding:0 24px;color:#222;
max-width:1400px}
.plot{width:100%;max-width:100%}.plot .js-plotly-plot,.plot .plotly-graph-div{width:100%!important}
.table{max-width:100%;overflow-x:auto}td{overflow-wrap:break-word}
details{margin:8px 0 16px}summary{cursor:pointer;color:navy}
.overall{border:2px solid seagreen;border-radius:6px;padding:10px 16px;background:#f3fbf6;font-size:1.1em}
.overall p{margin:4px 0}
h1{font-size:1.6em}h2{margin-top:2em;border-bottom:1px solid #ddd}h3{margin-top:1.4em}
table{border-collapse:collapse;margin:8px 0 16px;font-size:.9em}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}.note{color:#555;font-style:italic}
pre{background:#f7f7f7;border:1px solid #ddd;padding:10px;overflow:auto;font-size:.85em;white-space:pre-wrap;
overflow-wrap:anywhere}
#report-check{color:#888;font-size:.8em}
"""

_ERROR_HOOK = """<script>
window.__reportErrors = [];
window.addEventListener('error', function (e) { window.__reportErrors.push(String(e.message || e)); });
(function () { var original = console.error; console.error = function () {
  window.__reportErrors.push(Array.prototype.map.call(arguments, String).join(' '));
  return original.apply(console, arguments); }; })();
</script>"""

_CHECK_SCRIPT = """<script>
(function () {
  var expected = %d, started = Date.now();
  function rendered() {
    var n = 0;
    document.querySelectorAll('.js-plotly-plot').forEach(function (p) { if (p.querySelector('.main-svg')) n++; });
    return n;
  }
  function check() {
    var n = rendered();
    if (n < expected && Date.now() - started < 8000) { setTimeout(check, 100); return; }
    var marker = document.getElementById('report-check');
    marker.setAttribute('data-rendered', String(n));
    marker.setAttribute('data-errors', JSON.stringify(window.__reportErrors || []));
    marker.setAttribute('data-scroll-width', String(document.documentElement.scrollWidth));
    marker.setAttribute('data-scroll-height', String(document.documentElement.scrollHeight));
    marker.textContent = 'rendered ' + n + ' of ' + expected + ' plots';
  }
  if (document.readyState === 'complete') check(); else window.addEventListener('load', check);
})();
</script>"""


def build_report(storage: "optuna.storages.BaseStorage", spec: StudySpec, *, run_steps: int | None = None) -> str:
    """The report's HTML text (see the module docstring); ``run_steps``: a full run's length
    for the payback (``verl_sweep.search.views.status.study_status``)."""
    status, stages = _load(storage, spec, run_steps=run_steps)
    figures = _Figures()
    parts: list[str] = []
    total_gpu_h = sum(s.get("gpu_hours", 0.0) for s in status["stages"])
    saved_gpu_h = sum(s.get("gpu_hours_saved", 0.0) for s in status["stages"])
    kind = "SIMULATED GPU-hours" if status["cost"]["simulated"] else "GPU-hours"
    train = status.get("train")
    continuation = "" if train is None else \
        f", {train['continuation']['gpu_hours']:.2f} by the continuation (train mode: it trains the model)"
    parts.append(f"<h1>verl-sweep study {_e(spec.name)} ({_e(status['algorithm'])})</h1>")
    # The answer first: the final config against the user's baseline, and what it pays back.
    costs = "".join(f"<p>{_e(line)}</p>" for line in cost_lines(status))
    parts.append(f'<div class="overall"><p><b>{_e(overall_line(status))}</b></p>{costs}</div>')
    parts.append(
        f"<p>{len(spec.stages)} stages, {spec.hardware.n_gpus} GPUs per run, probes of {spec.probe.steps} steps; "
        f"{total_gpu_h:.2f} {kind} used by the stages{continuation}, about {saved_gpu_h:.2f} saved by pruning. "
        f"Generated {_e(datetime.datetime.now().isoformat(timespec='seconds'))}.</p>"
    )
    parts.append("<h2>Stages</h2>" + _summary_table(status))
    if train is not None:
        parts.append(_train_section(status))

    overview = best_so_far_figure(stages)
    parts.append("<h2>Best η so far against GPU-hours</h2>")
    parts.append(figures.render(overview) if overview is not None else '<p class="note">No trial has finished yet.</p>')

    for data in stages:
        parts.append(f"<h2>Stage {_e(data.stage.name)} ({_e(data.stage.space)})</h2>")
        winner = data.status.get("winner")
        parts.append(f"<p>{_e(winner['summary'])}</p>" if winner else f"<p class=\"note\">{_e(data.status['state'])}</p>")
        if not data.trials:
            continue
        for fig in (eta_figure(data), reward_figure(data), *slice_figures(data)):
            if fig is not None:
                parts.append(figures.render(fig))
        importance, why_not = importance_figure(data)
        parts.append("<h3>Parameter importance</h3>")
        parts.append(figures.render(importance) if importance is not None else f'<p class="note">{_e(why_not)}</p>')

    if train is None:  # train mode runs none (the overall line says so)
        parts.append(_final_check_section(status))
    parts.append("<h2>Pruned and failed trials</h2>" + _reasons_table(status))
    parts.append("<h2>GPU utilisation</h2>" + _gpu_table(stages))

    results = results_of(status)
    parts.append("<h2>Exported config</h2>")
    if results:
        plan = None if train is None else train_schedule(status, results[-1].config)
        text = export.render(spec, results, results[-1].config, "yaml", overall=status["overall"], schedule=plan)
        parts.append(f"<p>As written by <code>verl-sweep export {_e(spec.name)} -o best.yaml</code>:</p>"
                     f"<pre>{_e(text)}</pre>")
        if plan is not None:
            parts.append("<p>and beside it, <code>best.schedule.yaml</code>: which config trained which steps, and "
                         f"the model:</p><pre>{_e(train_schedule_yaml(plan, config_file='best.yaml'))}</pre>")
    else:
        parts.append('<p class="note">No stage has finished yet; nothing to export.</p>')

    parts.append(f'<p id="report-check" data-expected="{figures.count}"></p>')
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>verl-sweep report: {_e(spec.name)}</title><style>{_CSS}</style>{_ERROR_HOOK}</head><body>\n"
        + "\n".join(parts)
        + (_CHECK_SCRIPT % figures.count)
        + "\n</body></html>\n"
    )


def write_report(storage: "optuna.storages.BaseStorage", spec: StudySpec, output_path: Path | str, *,
                 run_steps: int | None = None) -> Path:
    """Write the report to ``output_path`` (parents created); returns the path."""
    output = Path(output_path)
    text = build_report(storage, spec, run_steps=run_steps)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    logger.info("wrote report %s (%d bytes)", output, len(text))
    return output


def figure_count(report_html: str) -> int:
    """How many figures a report declares (its ``data-expected`` marker)."""
    marker = 'id="report-check" data-expected="'
    start = report_html.index(marker) + len(marker)
    return int(report_html[start: report_html.index('"', start)])


__all__ = ["build_report", "write_report", "figure_count", "REWARD_KEY"]
