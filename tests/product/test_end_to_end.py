"""The staged sweep end to end on the simulator: run, status, export, kill -9 and resume."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from support import cli, demo_data, kill_run_when, write_study
from support.shared_runs import shared_demo


#: stage budgets of the kill-and-resume study: every stage, a few probes each (the demo's own
#: budgets run in tests/search/method/test_study_outcomes.py; 80 layouts would add minutes and prove nothing more here)
BUDGETS = {"systems": 10, "tokens": 4, "minibatch": 4, "kl": 4, "lr": 4, "polish": 4}


def _fast_demo(tmp_path: Path, **launcher_options: Any) -> Path:
    data = demo_data()
    data["launcher"]["options"].update(launcher_options)
    # Short learning probes: the kill, the resume and the budgets do not depend on their length
    # (pruning still starts at half the probe). slow_start_factor 1: a 150-step probe ends before
    # the default world's reward bends, which would lengthen the later stages' probes 4x.
    data["probe"].update({"steps": 150, "slow_start_factor": 1})
    data["final_check"] = False  # tests/search/engine/test_final_check.py kills and resumes in it
    for stage in data["stages"]:
        stage["budget"] = {"max_trials": BUDGETS[stage["name"]]}
        stage.pop("stop", None)
    return write_study(tmp_path, data, "demo.yaml")


def _status(tmp_path: Path) -> dict[str, Any]:
    result = cli("status", "demo", "--json", "--storage", f"sqlite:///{tmp_path}/demo.db", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _counted(stage: dict[str, Any]) -> list[dict[str, Any]]:
    """The trials in a stage's budget (``policy.counted``): not re-runs, not failures queued
    again, and no incumbent run on a seed beyond the incumbent's own (carried from the stage
    before, or run to pair a leader's confirmations: how many of those a stage runs depends on
    timing)."""
    data = demo_data()
    own = data["seeds"][: data["probe"]["incumbent_repeats"]]
    return [t for t in stage["trials"] if not t["requeued"] and t["role"] != "rerun"
            and not (t["role"] == "incumbent" and t["seed"] not in own)]


def _leftover_processes(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def finished_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's small demo (every stage of the demo, a few probes each), run once for
    this file and those that share it (tests/support/shared_runs.py)."""
    return shared_demo(tmp_path_factory)


def _budgets(directory: Path) -> dict[str, int]:
    return {st["name"]: st["budget"]["max_trials"] for st in yaml.safe_load((directory / "demo.yaml").read_text())["stages"]}


def test_status_json_reports_every_stage(finished_demo: Path) -> None:
    status = _status(finished_demo)
    assert [s["name"] for s in status["stages"]] == ["systems", "tokens", "minibatch", "kl", "lr", "polish"]
    budgets = _budgets(finished_demo)
    stages = {st["name"]: st for st in yaml.safe_load((finished_demo / "demo.yaml").read_text())["stages"]}
    for stage in status["stages"]:
        assert stage["state"] == "finished"
        roles = [t["role"] for t in stage["trials"]]
        assert roles.count("incumbent") >= 2
        assert "candidate" in roles
        winner = stage["winner"]
        assert winner["eta"] > 0 and winner["eta_low"] <= winner["eta"] <= winner["eta_high"]
        assert stage["incumbent"]["config"]
        complete = [t for t in stage["trials"] if t["state"] == "complete"]
        assert complete and all(t["eta"] is not None for t in complete)
        assert len(_counted(stage)) <= budgets[stage["name"]]
        # confirmations: the top confirm_top candidates, each up to confirm_max_runs runs in all
        settings = stages[stage["name"]]
        most = settings.get("confirm_top", 3) * (settings.get("confirm_max_runs", 3) - 1)
        assert sum(t["role"] == "rerun" and not t["requeued"] for t in stage["trials"]) <= most
    # the chain: each stage's base is the previous stage's result
    for before, after in zip(status["stages"], status["stages"][1:]):
        assert after["incumbent"]["config"] == before["winner"]["config"]


@pytest.mark.verl
def test_status_table_fits_80_columns_and_breaks_no_number(finished_demo: Path) -> None:
    """In a narrow terminal every η, interval and one-word winner in the table stays whole."""
    from verl_sweep.search.views.console import MAX_ONE_WORD_WINNER, format_params

    stages = _status(finished_demo)["stages"]
    result = cli("status", "demo", "--storage", f"sqlite:///{finished_demo}/demo.db", cwd=finished_demo,
                 env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    table = result.stdout.split(f"\n{stages[0]['name']}: ")[0]  # below it: one line per item
    assert max(map(len, table.splitlines())) <= 80, table
    for stage in stages:
        winner = stage["winner"]
        assert f"{winner['eta']:.3f}" in table and f"[{winner['eta_low']:.3f}, {winner['eta_high']:.3f}]" in table, table
        changes = format_params(winner["overrides"])
        if winner["winner_trial"] is None:
            continue
        if " " not in changes and len(changes) <= MAX_ONE_WORD_WINNER:  # e.g. lr=4.726e-06
            assert changes in table, table
        elif " " not in changes:  # ppo_mini_batch_size=408 would be cut: its trial instead
            assert f"trial {winner['winner_trial']} (1" in table, table


def test_export_composes_with_real_verl(finished_demo: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    result = cli("export", "demo", "--storage", f"sqlite:///{finished_demo}/demo.db", "-o", str(out / "best.yaml"),
                 cwd=finished_demo)
    assert result.returncode == 0, result.stderr
    text = (out / "best.yaml").read_text()
    assert text.startswith("# verl-sweep export of study 'demo'")
    final = _status(finished_demo)["stages"][-1]["winner"]["config"]
    code = f"""
import json, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
with initialize_config_dir(config_dir={str(out)!r}, version_base=None):
    cfg = compose(config_name="best")
print(json.dumps(OmegaConf.to_container(cfg, resolve=False)))
"""
    composed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert composed.returncode == 0, composed.stderr[-2000:]
    cfg = json.loads(composed.stdout.strip().splitlines()[-1])
    from verl_sweep.search.views.export import rounded

    for key, value in final.items():
        node: Any = cfg
        for part in key.lstrip("+").split("."):
            node = node[part]
        assert node == rounded(value), key  # floats to the digits verl needs
    # the full run's settings, not the probe's; and the method's checkpoint guard
    assert cfg["trainer"]["resume_mode"] == "auto"
    assert cfg["trainer"]["val_before_train"] is True
    assert cfg["trainer"]["max_actor_ckpt_to_keep"] == 3
    assert "ppo_trainer" not in json.dumps(cfg["trainer"])  # composed, not a raw defaults list


def test_export_overrides_format(finished_demo: Path) -> None:
    result = cli("export", "demo", "--storage", f"sqlite:///{finished_demo}/demo.db", "--format", "overrides",
                 cwd=finished_demo)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "actor_rollout_ref.rollout.name=vllm" in lines
    assert all("=" in line for line in lines)


def _has_study(db: Path, name: str) -> bool:
    """Whether the driver has created study ``name`` yet. Read-only: an RDBStorage opened here
    while the driver is still creating the schema would create the same tables
    ("table study_user_attributes already exists")."""
    if not db.exists():
        return False
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        try:
            return conn.execute("SELECT 1 FROM studies WHERE study_name = ?", (name,)).fetchone() is not None
        except sqlite3.OperationalError:  # no studies table yet, or the driver holds a lock
            return False


def _trials_db(db: Path) -> dict[str, list[dict[str, Any]]]:
    import optuna

    storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
    out: dict[str, list[dict[str, Any]]] = {}
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        out[summary.study_name] = [
            {"number": t.number, "state": t.state.name, "value": t.value, "run_id": t.user_attrs.get("run_id"),
             "params": t.params, "complete": str(t.datetime_complete)}
            for t in study.get_trials(deepcopy=False)
        ]
    return out


def test_sigkill_in_stage_2_then_resume(tmp_path: Path) -> None:
    study = _fast_demo(tmp_path, time_scale=10000)
    db = tmp_path / "demo.db"

    def stage_2_running() -> bool:
        if not _has_study(db, "demo.kl"):
            return False
        trials = _trials_db(db)["demo.kl"]
        return sum(t["state"] == "COMPLETE" for t in trials) >= 2 and any(t["state"] == "RUNNING" for t in trials)

    kill_run_when(study, stage_2_running, timeout_s=240, what="stage 2 never had a running trial")
    before = _trials_db(db)
    completed_before = {
        (name, t["number"]): t for name, trials in before.items() for t in trials if t["state"] == "COMPLETE"
    }
    assert any(name == "demo.kl" for name, _ in completed_before)

    result = cli("resume", "demo", "--storage", f"sqlite:///{db}", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # A trial the kill left RUNNING is closed and queued again, or, when its simulator run
    # outlived the driver (it may have finished in the meantime), followed again.
    left_running = sum(t["state"] == "RUNNING" for trials in before.values() for t in trials)
    assert left_running >= 1
    assert (f"closed {left_running} trial" in result.stdout
            or "re-attached to the runs of trial" in result.stdout), result.stdout

    after = _trials_db(db)
    status = _status(tmp_path)
    assert all(s["state"] == "finished" for s in status["stages"])
    # completed trials are kept exactly as they were, and none was run again
    for (name, number), trial in completed_before.items():
        assert after[name][number] == trial
    for name, trials in after.items():
        run_ids = [t["run_id"] for t in trials if t["run_id"]]
        assert len(run_ids) == len(set(run_ids)), f"a run id was used twice in {name}"
        assert not [t for t in trials if t["state"] in ("RUNNING", "WAITING")], name
    # budgets held: requeued failures do not count
    for stage in status["stages"]:
        assert len(_counted(stage)) <= BUDGETS[stage["name"]], stage["name"]
    # the dead driver's probes were killed; nothing of the study is left running
    assert _leftover_processes(str(tmp_path)) == []
