"""Optuna's own tools keep working on a verl-sweep database: ``optuna-dashboard`` serves the
studies and trials (η as the value, its interval and the reasons as user attributes), and the
``optuna`` CLI lists studies and trials and finds the best trial."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from support import demo_data
from support.shared_runs import shared_demo

# all but the first test reuse it, but the shared demo study takes ~40 s to run once
pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_demo(tmp_path_factory)


@pytest.fixture(scope="module")
def storage_url(demo_dir: Path) -> str:
    return f"sqlite:///{demo_dir}/demo.db"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def dashboard(storage_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("dashboard") / "dashboard.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "optuna-dashboard"), storage_url, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                _get(f"{base}/api/meta")
                break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"optuna-dashboard did not start: {log.read_text()[-2000:]}")
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _optuna(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "optuna"), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_dashboard_lists_every_stage_study(dashboard: str) -> None:
    names = {s["study_name"] for s in _get(f"{dashboard}/api/studies")["study_summaries"]}
    expected = {"demo"} | {f"demo.{s['name']}" for s in demo_data()["stages"]}
    assert expected <= names


def test_dashboard_shows_eta_interval_and_reasons(dashboard: str, storage_url: str) -> None:
    import optuna

    summaries = {s["study_name"]: s for s in _get(f"{dashboard}/api/studies")["study_summaries"]}
    n_checked = 0
    for stage in demo_data()["stages"]:
        name = f"demo.{stage['name']}"
        detail = _get(f"{dashboard}/api/studies/{summaries[name]['study_id']}")
        study = optuna.load_study(study_name=name, storage=storage_url)
        ours = {t.number: t for t in study.get_trials(deepcopy=False)}
        assert {t["number"] for t in detail["trials"]} == set(ours)
        for served in detail["trials"]:
            trial = ours[served["number"]]
            attrs = {a["key"]: a["value"] for a in served["user_attrs"]}
            assert served["state"].upper() == trial.state.name
            assert attrs["role"] == trial.user_attrs["role"]
            if trial.state.name == "COMPLETE":
                # the value is η; its interval and the scoring details are user attributes
                assert served["values"] == [pytest.approx(trial.value)]
                assert float(attrs["eta"]) == pytest.approx(trial.value)
                low, high = json.loads(attrs["eta_interval"])
                assert low <= trial.value <= high
                assert json.loads(attrs["probe"])["state"] == "complete"
                n_checked += 1
            elif trial.state.name in ("PRUNED", "FAIL"):
                assert attrs["reason"] == trial.user_attrs["reason"]
        best = max((t for t in ours.values() if t.state.name == "COMPLETE"), key=lambda t: t.value)
        assert detail["best_trials"][0]["number"] == best.number
    assert n_checked > 0


def test_dashboard_param_importances_of_the_systems_stage(dashboard: str) -> None:
    summaries = {s["study_name"]: s for s in _get(f"{dashboard}/api/studies")["study_summaries"]}
    data = _get(f"{dashboard}/api/studies/{summaries['demo.systems']['study_id']}/param_importances")
    importances = data["param_importances"][0]
    assert importances and all(0.0 <= p["importance"] <= 1.0 for p in importances)


def test_optuna_cli_studies_trials_and_best_trial(storage_url: str) -> None:
    import optuna

    studies = _optuna("studies", "--storage", storage_url, "-f", "json")
    assert studies.returncode == 0, studies.stderr
    rows = {row["name"]: row for row in json.loads(studies.stdout)}
    for stage in demo_data()["stages"]:
        study = optuna.load_study(study_name=f"demo.{stage['name']}", storage=storage_url)
        assert rows[f"demo.{stage['name']}"]["n_trials"] == len(study.trials)

    trials = _optuna("trials", "--study-name", "demo.lr", "--storage", storage_url, "-f", "json")
    assert trials.returncode == 0, trials.stderr
    listed = json.loads(trials.stdout)
    lr = optuna.load_study(study_name="demo.lr", storage=storage_url)
    assert sorted(t["number"] for t in listed) == [t.number for t in lr.trials]

    best = _optuna("best-trial", "--study-name", "demo.lr", "--storage", storage_url, "-f", "yaml")
    assert best.returncode == 0, best.stderr
    parsed = yaml.safe_load(best.stdout)
    assert parsed["number"] == lr.best_trial.number
    # the value is labelled with the study's metric name, as the dashboard shows it
    assert parsed["value"] == {"eta": pytest.approx(lr.best_value)}
    assert parsed["user_attrs"]["eta"] == pytest.approx(lr.best_value)
