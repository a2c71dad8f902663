"""The HTML report of a real (small, simulated) demo study: self-contained, every plot drawn in
headless Chromium without a script error, text escaped, the export and the reasons in it; and
the status figures the report shows (GPU-hours saved by pruning, reason counts)."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from support import REPO, cli
from support.shared_runs import shared_demo

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars",
    # no name resolves: a report that fetched anything (a CDN) would fail to plot
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--virtual-time-budget=10000",
]
MARKER = re.compile(r'<p id="report-check" data-expected="(\d+)" data-rendered="(\d+)" data-errors="([^"]*)"')


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_demo(tmp_path_factory)


@pytest.fixture(scope="module")
def report(demo_dir: Path) -> Path:
    result = cli("report", "demo", "-o", "out/report.html", cwd=demo_dir)
    assert result.returncode == 0, result.stderr
    assert "wrote out/report.html" in result.stdout
    return demo_dir / "out" / "report.html"


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium must be installed in CI (apt-get install chromium), but it was not found.")
        pytest.skip("chromium is not installed")
    return found


def _run_chromium(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )


def _marker(dom: str) -> tuple[int, int, list[str]]:
    found = MARKER.search(dom)
    assert found, "the page never wrote its render marker: " + dom[-2000:]
    return int(found.group(1)), int(found.group(2)), json.loads(html.unescape(found.group(3)))


@pytest.mark.slow  # the shared demo study takes ~40 s to run once
def test_report_is_one_self_contained_file(report: Path) -> None:
    from verl_sweep.search.views.report import figure_count

    text = report.read_text()
    assert text.count("* plotly.js v") == 1, "plotly.js must be inlined exactly once"
    assert not re.search(r"<script[^>]+src=", text), "no external script"
    assert not re.search(r"<link[^>]+href=", text), "no external stylesheet"
    assert "cdn.plot.ly/plotly" not in text.split("* plotly.js v")[0]
    assert report.stat().st_size < 8_000_000
    assert figure_count(text) == text.count('class="plot"')
    assert figure_count(text) >= 10


@pytest.mark.slow  # the shared demo study takes ~40 s to run once
def test_report_shows_every_stage_winner_curve_and_the_export(report: Path, demo_dir: Path) -> None:
    import optuna

    text = report.read_text()
    storage = f"sqlite:///{demo_dir}/demo.db"
    stages = json.loads(cli("status", "demo", "--json", cwd=demo_dir).stdout)["stages"]
    n_importance = 0
    for stage in stages:
        assert f"<h2>Stage {stage['name']} (" in text
        assert f"{stage['name']}: η per trial" in text
        result = stage["winner"]
        assert html.escape(result["summary"]) in text  # the decision in words (its kind, "won on balance", is not shown)
        if result["winner_trial"] is not None:
            assert f"winner (trial {result['winner_trial']}," in text
        study = optuna.load_study(study_name=stage["study"], storage=storage)
        for t in study.get_trials(deepcopy=False):
            if t.user_attrs.get("role") == "incumbent" and t.state.name == "COMPLETE":
                assert f"incumbent (trial {t.number}, seed {t.user_attrs['seed']})" in text
        n_importance += f"{stage['name']}: parameter importance" in text
    assert n_importance >= 1, "the systems stage has enough trials and parameters for an importance plot"
    exported = cli("export", "demo", cwd=demo_dir)
    assert exported.returncode == 0, exported.stderr
    pre = re.search(r"<pre>(.*?)</pre>", text, re.S)
    assert pre and html.unescape(pre.group(1)) == exported.stdout


@pytest.mark.slow  # the shared demo study takes ~40 s to run once
def test_every_plot_renders_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    from verl_sweep.search.views.report import figure_count

    result = _run_chromium(report, tmp_path / "profile", "--dump-dom")
    expected, rendered, errors = _marker(result.stdout)
    assert expected == figure_count(report.read_text())
    assert rendered == expected, f"{rendered} of {expected} plots rendered"
    assert errors == []

    shot = tmp_path / "report.png"
    _run_chromium(report, tmp_path / "profile2", "--window-size=1280,4000", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 50_000
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1280, 4000)
        colours = image.convert("RGB").getcolors(maxcolors=1_000_000)
    assert colours is not None and len(colours) > 100, "a drawn page has many colours, a blank one few"


@pytest.mark.slow  # the shared demo study takes ~40 s to run once
def test_the_render_check_catches_a_broken_page(report: Path, tmp_path: Path) -> None:
    """Negative control: without plotly.js no plot renders and the error is recorded."""
    text = report.read_text()
    start = text.index("* plotly.js v")
    script_start = text.rindex("<script", 0, start)
    broken = text[:script_start] + text[text.index("</script>", start) + len("</script>"):]
    page = tmp_path / "broken.html"
    page.write_text(broken)
    expected, rendered, errors = _marker(_run_chromium(page, tmp_path / "profile", "--dump-dom").stdout)
    assert rendered == 0 < expected
    assert any("Plotly" in e for e in errors), errors


def _add_trials(db: Path) -> None:
    """A pruned and a failed trial in stage lr, with text that must be escaped."""
    import optuna
    from optuna.trial import TrialState, create_trial

    study = optuna.load_study(study_name="demo.lr", storage=f"sqlite:///{db}")
    study.add_trial(create_trial(state=TrialState.PRUNED, user_attrs={
        "role": "candidate", "seed": 11, "overrides": {"actor_rollout_ref.actor.optim.lr": 3e-6},
        "reason": "pruned at step 100: rate <below> & others",
        "probe": {"state": "pruned", "last_step": 100, "gpu_time_s": 8 * 1100.0, "startup_s": 100.0},
    }))
    study.add_trial(create_trial(state=TrialState.FAIL, user_attrs={
        "role": "candidate", "seed": 12, "overrides": {"actor_rollout_ref.actor.optim.lr": 4e-6},
        "reason": "oom: <script>alert('x')</script>", "failure_kind": "oom",
        "probe": {"state": "failed", "last_step": 3, "gpu_time_s": 80.0},
    }))


@pytest.mark.slow  # the shared demo study takes ~40 s to run once
def test_reasons_are_counted_escaped_and_pruning_savings_estimated(demo_dir: Path, tmp_path: Path) -> None:
    shutil.copy(demo_dir / "demo.db", tmp_path / "demo.db")
    before = json.loads(cli("status", "demo", "--json", "--storage", f"sqlite:///{tmp_path}/demo.db",
                            cwd=tmp_path).stdout)
    _add_trials(tmp_path / "demo.db")
    after = json.loads(cli("status", "demo", "--json", "--storage", f"sqlite:///{tmp_path}/demo.db",
                           cwd=tmp_path).stdout)
    lr_before = next(s for s in before["stages"] if s["name"] == "lr")
    lr = next(s for s in after["stages"] if s["name"] == "lr")
    assert lr["reasons"].get("pruned", 0) == lr_before["reasons"].get("pruned", 0) + 1
    assert lr["reasons"].get("oom", 0) == lr_before["reasons"].get("oom", 0) + 1
    # a full probe's length is the longest complete one; the pruned trial ran 100 steps at
    # (1100 s − 100 s start-up) / 100 steps = 10 s a step on 8 GPUs
    full = max(r["last_step"] for r in lr["trials"] if r["state"] == "complete")
    expected_h = (full - 100) * 10.0 * 8 / 3600
    assert lr["gpu_hours_saved"] == pytest.approx(lr_before["gpu_hours_saved"] + expected_h, abs=1e-3)

    result = cli("report", "demo", "-o", "r.html", "--storage", f"sqlite:///{tmp_path}/demo.db", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "r.html").read_text()
    assert "<script>alert(" not in text
    assert "oom: &lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    assert "pruned at step 100: rate &lt;below&gt; &amp; others" in text
    rows = re.findall(r"<tr><td>lr</td><td>(\d+)</td><td>(pruned|fail)</td>", text)
    assert len(rows) == sum(1 for r in lr["trials"] if r["state"] in ("pruned", "fail"))


@pytest.mark.slow  # the shared demo study takes ~40 s to run once
def test_report_of_a_study_with_no_finished_stage(demo_dir: Path, tmp_path: Path) -> None:
    """Stages not started yet: notes instead of plots, no export, still a valid page."""
    shutil.copy(demo_dir / "demo.db", tmp_path / "demo.db")
    with sqlite3.connect(tmp_path / "demo.db") as db:
        db.execute("DELETE FROM study_user_attributes WHERE key = 'result'")
    from verl_sweep.search.engine.driver import load_spec
    from verl_sweep.search.views.report import build_report, figure_count
    from verl_sweep.search.database.storage import open_storage

    storage = open_storage(f"sqlite:///{tmp_path}/demo.db", create=False)
    text = build_report(storage, load_spec(storage, "demo"))
    assert "No stage has finished yet; nothing to export." in text
    assert text.count("* plotly.js v") == 1
    assert figure_count(text) >= 1


def _synthetic_study(tmp_path: Path) -> tuple[Any, Any]:
    """A one-stage study written straight into SQLite: two incumbents and six candidates over
    two parameters, each with a run directory holding metrics and GPU samples."""
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState, create_trial

    from verl_sweep.objectives.metrics import write_lines
    from verl_sweep.search.engine.driver import save_spec
    from verl_sweep.search.database.storage import open_storage
    from verl_sweep.search.spec.study_file import load_study

    spec = load_study(REPO / "studies" / "demo.yaml")
    storage = open_storage(f"sqlite:///{tmp_path}/synthetic.db")
    save_spec(storage, spec)
    stage = spec.stages[0].name
    study = optuna.create_study(study_name=f"{spec.name}.{stage}", storage=storage, direction="maximize")
    dists = {"a": FloatDistribution(0.0, 1.0), "b": FloatDistribution(0.0, 1.0)}
    for number in range(8):
        role = "incumbent" if number < 2 else "candidate"
        a, b = (0.5, 0.5) if role == "incumbent" else (number / 10, 1 - number / 10)
        eta = 1.0 + (a - 0.5) * 0.4 + (b - 0.5) * 0.01
        run_dir = tmp_path / "runs" / f"t{number}"
        run_dir.mkdir(parents=True)
        write_lines(run_dir / "metrics.jsonl", [
            {"step": s, "data": {"critic/score/mean": 0.3 + eta * s / 1000, "timing_s/step": 10.0}}
            for s in range(1, 101)])
        # half the samples busy (80%), half idle (5%): mean 42.5%, idle fraction 0.5
        (run_dir / "gpu_samples.jsonl").write_text("".join(
            json.dumps({"t": float(i), "gpus": [{"index": 0, "util": 80.0 if i % 2 else 5.0,
                                                 "mem_used_mb": 1024.0 * (10 + i), "mem_total_mb": 81920.0}]}) + "\n"
            for i in range(10)))
        study.add_trial(create_trial(
            state=TrialState.COMPLETE, value=eta, params={"a": a, "b": b}, distributions=dists,
            user_attrs={"role": role, "seed": 11 + number, "overrides": {"x.a": a, "x.b": b},
                        "eta": eta, "eta_interval": [eta - 0.05, eta + 0.05], "run_dir": str(run_dir),
                        "probe": {"state": "complete", "last_step": 100, "gpu_time_s": 8 * 1000.0}},
        ))
    study.set_user_attr("base_config", spec.baseline_config())
    study.set_user_attr("result", {
        "stage": stage, "winner_trial": 7, "eta": 1.08, "eta_low": 1.03, "eta_high": 1.13,
        "decision": "trial 7 beat the incumbent <with> & margin", "config": spec.baseline_config(),
        "overrides": {"x.a": 0.7, "x.b": 0.3},
    })
    return storage, spec


def test_report_of_a_synthetic_study_has_importance_curves_and_gpu_table(tmp_path: Path) -> None:
    """Fast (no study run): importance with two varied parameters, winner and incumbent reward
    curves, the GPU table from the run directories' samples, later stages noted as not started."""
    from verl_sweep.search.views.report import build_report, figure_count

    storage, spec = _synthetic_study(tmp_path)
    text = build_report(storage, spec)
    stage = spec.stages[0].name
    assert f"{stage}: parameter importance (η)" in text
    assert "winner (trial 7, seed 18)" in text
    assert "incumbent (trial 0, seed 11)" in text and "incumbent (trial 1, seed 12)" in text
    assert "trial 7 beat the incumbent &lt;with&gt; &amp; margin" in text
    # overview, η, reward, slice, importance
    assert figure_count(text) == 5 == text.count('class="plot"')
    gpu_rows = re.findall(rf"<tr><td>{stage}</td><td>(\d)</td><td>\w+</td><td>[^<]*</td><td>([\d.]+)%</td>"
                          r"<td>([\d.]+)%</td><td>([\d.]+)</td>", text)
    assert len(gpu_rows) == 8
    assert all((util, idle, peak) == ("42.5", "50.0", "19.0") for _, util, idle, peak in gpu_rows)
    for later in spec.stages[1:]:
        assert f"<h2>Stage {later.name} (" in text
    assert text.count("* plotly.js v") == 1


def test_status_counts_trials_given_back_unstarted_as_skipped_not_failed(tmp_path: Path) -> None:
    import optuna
    from optuna.trial import TrialState, create_trial

    from verl_sweep.search.views.status import study_status

    storage, spec = _synthetic_study(tmp_path)
    study = optuna.load_study(study_name=f"{spec.name}.{spec.stages[0].name}", storage=storage)
    study.add_trial(create_trial(state=TrialState.FAIL, user_attrs={
        "role": "skipped", "reason": "over budget: other workers filled the stage first"}))
    stage = study_status(storage, spec)["stages"][0]
    assert stage["counts"] == {"complete": 8, "skipped": 1}
    assert not stage["reasons"]


def _score(rate: float) -> dict[str, Any]:
    return {"rate": rate, "gain": rate * 100, "train_time_s": 100.0, "n_steps": 100,
            "ci_low": rate * 0.95, "ci_high": rate * 1.05, "rate_se": rate * 0.02}


def test_status_puts_a_requeue_reason_on_the_trial_requeued_and_rates_incumbents_against_all_runs(
    tmp_path: Path,
) -> None:
    """Found by a walkthrough: after Ctrl-C the reason showed on the copy that later ran fine,
    and an incumbent run's η depended on which run finished first."""
    import optuna
    from optuna.trial import TrialState, create_trial

    from verl_sweep.search.views.status import study_status

    storage, spec = _synthetic_study(tmp_path)
    stage = spec.stages[1]
    study = optuna.create_study(study_name=f"{spec.name}.{stage.name}", storage=storage, direction="maximize")
    study.set_user_attr("base_config", spec.baseline_config())
    # incumbent runs told in this order: the first one's stored η is against itself only (1.0)
    for number, (rate, stored_eta) in enumerate([(1.1, 1.0), (1.0, 1.0 / 1.05)]):
        study.add_trial(create_trial(state=TrialState.COMPLETE, value=stored_eta, user_attrs={
            "role": "incumbent", "seed": 11 + number, "eta": stored_eta, "score": _score(rate)}))
    study.add_trial(create_trial(state=TrialState.FAIL, user_attrs={"role": "candidate", "seed": 11}))
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=1.0, system_attrs={"retry_history": [2]},
                                 user_attrs={"role": "candidate", "seed": 11, "eta": 1.0,
                                             "requeued_because": "its driver stopped (KeyboardInterrupt)"}))
    rows = {r["number"]: r for r in study_status(storage, spec)["stages"][1]["trials"]}
    assert rows[0]["eta"] == pytest.approx(1.1 / 1.05) and rows[1]["eta"] == pytest.approx(1.0 / 1.05)
    assert rows[2]["reason"] == "requeued: its driver stopped (KeyboardInterrupt)" and rows[2]["requeued"]
    assert rows[3]["reason"] is None and rows[3]["eta"] == 1.0
    assert study_status(storage, spec)["stages"][1]["reasons"] == {"requeued": 1}


def test_an_export_of_an_unfinished_study_says_so_in_the_file(tmp_path: Path) -> None:
    from verl_sweep.search.views import export
    from verl_sweep.search.views.status import finished_results

    storage, spec = _synthetic_study(tmp_path)  # only the first stage has a result
    results = finished_results(storage, spec)
    text = export.render(spec, results, results[-1].config, "yaml")
    later = ", ".join(s.name for s in spec.stages[1:])
    assert f"# PARTIAL: 1 of {len(spec.stages)} stages finished; not tuned yet: {later}\n" in text
    assert json.loads(export.render(spec, results, results[-1].config, "json"))["finished"] is False


def test_status_names_the_process_of_a_running_trial_and_whether_it_is_gone(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    import optuna
    from optuna.trial import TrialState, create_trial

    from verl_sweep.search.views.status import study_status

    storage, spec = _synthetic_study(tmp_path)
    study = optuna.load_study(study_name=f"{spec.name}.{spec.stages[0].name}", storage=storage)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    for pid in (os.getpid(), gone.pid):
        study.add_trial(create_trial(state=TrialState.RUNNING, user_attrs={
            "role": "candidate", "owner": {"host": host, "pid": pid, "started": 0.0}}))
    rows = study_status(storage, spec)["stages"][0]["trials"]
    alive, dead = rows[-2:]
    assert alive["owner"] == f"{host} pid {os.getpid()}"
    assert dead["owner"] == f"{host} pid {gone.pid} (gone: `resume` or a worker queues it again)"


@pytest.mark.slow  # the shared demo study
def test_status_text_gives_each_gpu_finding_once_per_stage(demo_dir: Path) -> None:
    from verl_sweep.objectives.utilisation import findings

    text = cli("status", "demo", "--trials", cwd=demo_dir).stdout  # every trial, with its GPU findings
    stages = json.loads(cli("status", "demo", "--json", cwd=demo_dir).stdout)["stages"]
    seen = 0
    for stage in stages:
        expected: dict[str, list[int]] = {}
        for row in stage["trials"]:
            if row["state"] in ("waiting", "skipped") or not row.get("gpu"):
                continue
            assert f"trial {row['number']} " in text
            for finding in findings(row["gpu"]):
                expected.setdefault(finding.name, []).append(row["number"])
                assert f"{finding.name} ({finding.measured})" in text  # on the trial's own line
                if finding.advice:
                    assert text.count(finding.advice) <= len({s["name"] for s in stages}), text
        for name, numbers in expected.items():
            seen += 1
            assert f"GPU: {name} in trial{'s' * (len(numbers) > 1)} {', '.join(map(str, numbers))}" in text, text
    assert seen, "the demo's probes should show at least one GPU finding"


@pytest.mark.slow  # the shared demo study
def test_status_table_names_a_long_winner_by_its_trial(demo_dir: Path) -> None:
    from verl_sweep.search.views.console import MAX_ONE_WORD_WINNER, format_params

    text = cli("status", "demo", cwd=demo_dir, env={"COLUMNS": "200"}).stdout
    stages = json.loads(cli("status", "demo", "--json", cwd=demo_dir).stdout)["stages"]
    table = text[: text.index(f"\n{stages[0]['name']}: ")]  # below it: one line per item
    for stage in stages:
        winner = stage["winner"]
        if winner["winner_trial"] is None:
            continue
        changes = format_params(winner["overrides"])
        # whole when it fits: up to 40 characters that may wrap, or one short word
        # (ppo_mini_batch_size=424 would be cut in 80 columns)
        whole = len(changes) <= 40 and (" " in changes or len(changes) <= MAX_ONE_WORD_WINNER)
        n = len(winner["overrides"])
        cell = changes if whole else f"trial {winner['winner_trial']} ({n} change{'s' * (n > 1)})"
        assert cell in table, table
