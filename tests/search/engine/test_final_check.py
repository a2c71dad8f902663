"""The overall gain, measured: after the last stage the final config and the baseline run side
by side on fresh paired seeds (``<study>.final``); its η against the baseline is in ``status
--json``, the status lines, the export's header; it resumes like a stage; the cost and payback
of the study. Studies run on the replay launcher (the simulator's model, no processes)."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from support import cli, demo_data, kill_run_when
from support.shared_runs import shared_small, small_study
from verl_sweep.search.spec.errors import BadInputError
from verl_sweep.search.views.status import r_text


def status_json(directory: Path, name: str = "small", *extra: str) -> dict[str, Any]:
    result = cli("status", name, "--json", "--storage", f"sqlite:///{directory}/{name}.db", *extra, cwd=directory)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_small(tmp_path_factory)


def test_where_no_learning_stage_changed_the_config_its_runs_there_are_the_check_and_nothing_runs(finished: Path) -> None:
    """The small study's systems stage won and its mini-batch stage kept that config: the final
    config is the baseline's learning at the systems stage's layout. Its runs in the learning
    stage are then the final config's runs and, re-timed to the baseline's layout, the
    baseline's: the check carries them over and runs nothing (the gain is the layout's alone;
    a fresh seed would only measure the same learning again). The overall η and the price of a
    full run are the world's noise-free ones."""
    import optuna

    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.search.spec.study_file import load_study

    data = status_json(finished, "small", "--run-steps", "2000")
    overall = data["overall"]
    assert overall["state"] == "measured" and overall["simulated"] is True
    assert overall["n_pairs"] == 2
    assert overall["low"] <= overall["eta"] <= overall["high"]
    # The systems stage won on the simulator's landscape: the final config beats the baseline clearly.
    assert overall["low"] > 1.0
    product = 1.0
    for stage in data["stages"]:
        product *= stage["winner"]["eta"]
    assert overall["stage_product"] == pytest.approx(product, rel=1e-3)

    assert data["stages"][1]["winner"]["config"] == data["stages"][0]["winner"]["config"]  # (what this test is about)
    runs = data["final_check"]["trials"]
    learning = {r["seed"]: r for r in data["stages"][1]["trials"] if r["role"] == "incumbent" and r["state"] == "complete"}
    assert [r["role"] for r in runs] == ["candidate", "candidate"], runs
    assert all(r["state"] == "complete" and r["params"] == {} and r["baseline_time_ratio"] > 1.2 for r in runs), runs
    assert {r["seed"] for r in runs} <= set(learning) and all(r["carried_from"] for r in runs), runs
    assert data["final_check"]["gpu_hours"] == 0  # nothing ran
    said = (finished / "small.out").read_text()
    for r in runs:  # each carried run has its finished line, as a stage's carried runs do
        assert re.search(rf"\[final\] trial {r['number']} candidate η {r['eta']:.3f}", said), said[-3000:]

    spec = load_study(finished / "small.yaml")
    final = optuna.load_study(study_name="small.final", storage=f"sqlite:///{finished}/small.db")
    world = load_landscape("default")
    truth = world.eta(final.user_attrs["final_config"], spec.baseline_config(), steps=2000)
    assert overall["low"] <= truth <= overall["high"], (overall, truth)
    assert overall["eta"] == pytest.approx(truth, rel=0.03)
    step_s = sum(world.step_time(spec.baseline_config(), t) for t in range(1, 501)) / 500
    assert data["cost"]["baseline_step_s"] == pytest.approx(step_s, rel=0.03)
    print(f"SIMULATED overall η {overall['eta']:.3f} [{overall['low']:.3f}, {overall['high']:.3f}] (noise-free "
          f"{truth:.3f}), product of the stages' η {product:.3f}; a baseline step {data['cost']['baseline_step_s']:.1f} s "
          f"(noise-free {step_s:.1f} s)")


def test_before_the_final_check_a_full_run_is_priced_from_the_first_learning_stages_runs(finished: Path,
                                                                                         tmp_path: Path) -> None:
    """Mid-study (no final check yet), R comes from the first learning stage's incumbent runs:
    the baseline's learning over a probe's 500 steps at the systems stage's layout, each step
    re-timed to the baseline's own; not from the systems stage's speed probes, whose first
    few steps run before the responses lengthen."""
    import optuna

    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.search.spec.study_file import load_study

    shutil.copy(finished / "small.db", tmp_path / "small.db")  # the runs' directories stay where they are
    optuna.delete_study(study_name="small.final", storage=f"sqlite:///{tmp_path}/small.db")
    data = status_json(tmp_path)
    assert "final_check" not in data
    spec = load_study(finished / "small.yaml")
    world = load_landscape("default")
    step_s = sum(world.step_time(spec.baseline_config(), t) for t in range(1, 501)) / 500
    first_steps = sum(world.step_time(spec.baseline_config(), t) for t in range(1, 5)) / 4
    assert first_steps < 0.95 * step_s  # (what the speed probes would read: what this test is about)
    assert data["cost"]["baseline_step_s"] == pytest.approx(step_s, rel=0.03)


def test_the_baselines_runs_are_its_learning_at_the_speed_stages_layout_retimed_to_its_own(tmp_path: Path) -> None:
    """A study whose lr stage wins (the baseline's lr 1e-7): the final check's baseline runs are
    the baseline's learning at the systems stage's layout (the lr stage's incumbent), each step
    re-timed by the phase ratios of the two layouts' paired speed probes. The overall η and the
    price of a full run are the baseline's own, read off the world's noise-free model, at a
    fraction of its runs' cost."""
    import optuna

    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.search.spec.study_file import load_study

    def lr_wins(data: dict[str, Any]) -> None:
        data["stages"] = [data["stages"][0], {"name": "lr", "space": "lr", "budget": {"max_trials": 4},
                                              "confirm_top": 1, "sampler": {"seed": 7}}]
        data["baseline"]["actor_rollout_ref.actor.optim.lr"] = 1e-7

    path = small_study(tmp_path, "lrwin", lr_wins)
    result = cli("run", str(path), cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    spec = load_study(path)
    storage = f"sqlite:///{tmp_path}/lrwin.db"
    final = optuna.load_study(study_name="lrwin.final", storage=storage)
    lr_stage = optuna.load_study(study_name="lrwin.lr", storage=storage)
    reference, baseline = final.user_attrs["baseline_config"], spec.baseline_config()
    assert reference == lr_stage.user_attrs["base_config"] != baseline
    assert final.user_attrs["final_config"] != reference  # the lr stage won
    ratios = final.user_attrs["retime"]
    assert ratios["pairs"] >= 2 and ratios["step"] > 1.2, ratios

    data = status_json(tmp_path, "lrwin", "--run-steps", "2000")
    rows = data["final_check"]["trials"]
    incumbents = [r for r in rows if r["role"] == "incumbent"]
    assert len(incumbents) == 2 and all(r["params"] == {} and r["baseline_time_ratio"] > 1.2 for r in incumbents)
    for row in rows:
        if row["role"] == "candidate":  # the final config's differences from the reference
            assert row["params"] and {**reference, **row["params"]} == final.user_attrs["final_config"]
    world = load_landscape("default")
    overall = data["overall"]
    truth = world.eta(final.user_attrs["final_config"], baseline, steps=2000)
    assert overall["low"] <= truth <= overall["high"], (overall, truth)
    assert overall["eta"] == pytest.approx(truth, rel=0.02)
    # R: the baseline's seconds a step over the final check's 500 steps, noise-free
    step_s = sum(world.step_time(baseline, t) for t in range(1, 501)) / 500
    assert data["cost"]["baseline_step_s"] == pytest.approx(step_s, rel=0.03)
    # The runs cost their layout's time, not the baseline's.
    run_s = [r["gpu_time_s"] / 8 - r["startup_s"] for r in incumbents]
    assert max(run_s) < 500 * step_s / 1.2
    print(f"SIMULATED overall η {overall['eta']:.3f} [{overall['low']:.3f}, {overall['high']:.3f}], noise-free "
          f"{truth:.3f}; a baseline step {data['cost']['baseline_step_s']:.1f} s (noise-free {step_s:.1f} s)")


def test_status_prints_the_overall_gain_and_the_payback_of_a_full_run(finished: Path) -> None:
    data = status_json(finished, "small", "--run-steps", "2000")
    cost, overall = data["cost"], data["overall"]
    stage_h = sum(s["gpu_hours"] for s in data["stages"]) + data["final_check"]["gpu_hours"]
    assert cost["gpu_hours_spent"] == pytest.approx(stage_h, abs=0.01)
    assert cost["run_steps"] == 2000 and cost["baseline_step_s"] > 0
    full = cost["full_run_gpu_hours"]
    assert full == pytest.approx(2000 * cost["baseline_step_s"] * 8 / 3600, rel=1e-3)
    # The winner reaches the same reward η times sooner: it saves 1 - 1/η of a full run.
    assert cost["saved_gpu_hours_per_run"] == pytest.approx(full * (1 - 1 / overall["eta"]), rel=1e-2)
    assert cost["break_even_runs"] == pytest.approx(cost["gpu_hours_spent"] / cost["saved_gpu_hours_per_run"], rel=1e-2)

    text = cli("status", "small", "--run-steps", "2000", "--storage", f"sqlite:///{finished}/small.db", cwd=finished)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.replace("\n  ", " ").splitlines()  # each line whole, as wrapped to the terminal
    gain = next(line for line in lines if "overall gain" in line)
    assert gain.startswith("SIMULATED overall gain against your baseline: η ") and "2 paired seeds" in gain
    spent = next(line for line in lines if line.startswith("SIMULATED cost: "))
    payback = next(line for line in lines if line.startswith("SIMULATED payback: "))
    assert f"= {r_text(cost['cost_r'])} (R: a 2,000-step run of the baseline, {full:,.1f} GPU-h)" in spent
    assert cost["cost_r"] == pytest.approx(cost["gpu_hours_spent"] / full, rel=1e-3)
    assert "break-even after" in payback
    assert len(gain) <= 160 and len(spent) <= 150 and len(payback) <= 150
    print(gain, spent, payback, sep="\n")
    # Without a run length (the demo's baseline gives none that can be read), 2,000 steps are
    # assumed, and it says what to give.
    plain = status_json(finished)
    assert (plain["cost"]["run_steps"], plain["cost"]["run_steps_assumed"]) == (2000, True)
    assert plain["cost"]["cost_r"] == cost["cost_r"]
    assert "2,000 steps assumed; give --run-steps N" in cli("status", "small", "--storage",
                                                            f"sqlite:///{finished}/small.db", cwd=finished).stdout


def test_the_export_header_starts_with_the_overall_gain(finished: Path) -> None:
    result = cli("export", "small", "--storage", f"sqlite:///{finished}/small.db", cwd=finished)
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[:2]
    assert header[1].startswith("# SIMULATED overall gain against your baseline: η "), header
    as_json = cli("export", "small", "--format", "json", "--storage", f"sqlite:///{finished}/small.db", cwd=finished)
    assert json.loads(as_json.stdout)["overall"]["n_pairs"] == 2


def test_final_check_false_skips_it_and_the_plan_says_so(tmp_path: Path) -> None:
    def off(data: dict[str, Any]) -> None:
        data["final_check"] = False
        data["stages"] = data["stages"][1:]  # the mini-batch stage alone
        data["baseline"]["trainer.total_training_steps"] = 4000  # the full run's length, for the payback

    path = small_study(tmp_path, "off", off)
    plan = cli("validate", str(path), cwd=tmp_path)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "no final check (final_check: false)" in plan.stdout
    result = cli("run", str(path), cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = status_json(tmp_path, "off")
    assert data["overall"]["state"] == "skipped" and "final_check: false" in data["overall"]["note"]
    assert "final_check" not in data
    cost = data["cost"]
    assert cost["run_steps"] == 4000 and cost["run_steps_from"] == "trainer.total_training_steps = 4,000"
    assert cost["full_run_gpu_hours"] > 0 and "saved_gpu_hours_per_run" not in cost
    text = cli("status", "off", "--storage", f"sqlite:///{tmp_path}/off.db", cwd=tmp_path).stdout
    assert "no saving to show: the final check is skipped" in text
    with sqlite3.connect(tmp_path / "off.db") as db:
        assert not db.execute("select 1 from studies where study_name = 'off.final'").fetchall()


def test_the_plan_counts_the_final_check_probes(tmp_path: Path) -> None:
    path = small_study(tmp_path)
    result = cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "final (final config against the baseline) 4 probes × 500 steps" in result.stdout
    # 8 + 1 confirmation (systems), 5 + 3 (minibatch), 4 (final)
    assert "plan: up to 17 probes" in result.stdout and "ESTIMATE" in result.stdout
    assert re.search(r"ESTIMATE [\d,]+-[\d,]+ GPU-hours = [\d.]+-[\d.]+ R at ~\d+ s a step \(R: 2,000 steps assumed\)",
                     result.stdout), result.stdout[-2000:]


def test_a_speed_only_study_runs_and_its_final_check_compares_throughput(tmp_path: Path) -> None:
    """What init writes for a run too short for learning probes (15 steps): the systems stage
    alone on 5-step speed probes. It runs; its final check measures the throughput gain on
    speed probes (a learning probe would not fit the run), and status and export say so."""
    def speed_only(data: dict[str, Any]) -> None:
        data["stages"] = data["stages"][:1]
        data["stages"][0]["budget"] = {"max_trials": 4}
        data["baseline"]["trainer.total_training_steps"] = 15
        data["probe"] = {"speed_steps": 5}

    path = small_study(tmp_path, "speed", speed_only)
    from verl_sweep.search.views.plan import closing_plan
    from verl_sweep.search.spec.study_file import load_study

    plan = closing_plan(load_study(path))
    assert plan is not None and (plan.space, plan.probes, plan.steps) == (
        "final config against the baseline, on throughput", 4, 5)
    result = cli("run", str(path), cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = (result.stdout + result.stderr).replace("\n    ", " ")  # the console's lines, unwrapped
    assert "(5-step speed probes, on throughput: the study has no learning stage)" in said
    assert "overall gain (final check on throughput, 2 paired seeds)" in said
    data = status_json(tmp_path, "speed")
    overall = data["overall"]
    assert overall["metric"] == "throughput" and overall["state"] == "measured", overall
    assert all(r["state"] == "complete" for r in data["final_check"]["trials"])
    text = cli("status", "speed", "--storage", f"sqlite:///{tmp_path}/speed.db", cwd=tmp_path).stdout.replace("\n  ", " ")
    assert "overall gain against your baseline: η " in text and "(final check on throughput, 2 paired seeds" in text
    exported = cli("export", "speed", "--storage", f"sqlite:///{tmp_path}/speed.db", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "(final check on throughput" in exported.stdout.splitlines()[1]


def test_the_final_check_is_skipped_when_the_final_config_is_the_baseline() -> None:
    from verl_sweep.search.engine.final_check import skip_reason
    from verl_sweep.search.spec.study_file import StudySpec

    spec = StudySpec.model_validate({k: v for k, v in demo_data().items() if k != "stages"})
    assert skip_reason(spec, spec.baseline_config()) == "the final config is the baseline (no stage found a better one)"
    assert skip_reason(spec, {**spec.baseline_config(), "actor_rollout_ref.actor.optim.lr": 3e-6}) is None


def test_study_file_final_check_field() -> None:
    from verl_sweep.search.spec.study_file import StudySpec, parse_study

    base = {k: v for k, v in demo_data().items() if k != "stages"}
    assert StudySpec.model_validate({**base, "final_check": False}).final_check.runs == 0
    assert StudySpec.model_validate({**base, "final_check": {"runs": 5}}).final_check.runs == 5
    assert StudySpec.model_validate(base).final_check.runs == 2
    stage = {"name": "final", "space": "lr", "budget": {"max_trials": 5}}
    with pytest.raises(BadInputError, match=r"stage names must not be 'final', but got it at stages\[0\]"):
        parse_study({**base, "stages": [stage]})


def _final_trials(db: Path, name: str) -> list[tuple[int, str]]:
    try:
        with sqlite3.connect(db) as conn:
            return conn.execute("select t.number, t.state from trials t join studies s using (study_id) "
                                "where s.study_name = ?", (f"{name}.final",)).fetchall()
    except sqlite3.OperationalError:  # no tables yet, or locked by the driver's write
        return []


def test_sigkill_in_the_final_check_then_resume(tmp_path: Path) -> None:
    """A check of 3 seeds where the learning stage ran the final config on 2: it runs the final
    config on 3 fresh seeds (re-timed, the baseline's runs too); killed mid-way, resumed."""
    def three_runs(data: dict[str, Any]) -> None:
        data["final_check"] = {"runs": 3}

    path = small_study(tmp_path, "killed", three_runs)
    db = tmp_path / "killed.db"
    kill_run_when(path, lambda: db.exists() and any(state == "RUNNING" for _, state in _final_trials(db, "killed")),
                  timeout_s=300, what="the final check never had a running trial", poll_s=0.1)
    before = dict(_final_trials(db, "killed"))
    assert "RUNNING" in before.values()

    result = cli("resume", "killed", "--storage", f"sqlite:///{db}", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "overall gain (final check, 3 paired seeds)" in result.stdout
    after = dict(_final_trials(db, "killed"))
    for number, state in before.items():
        if state == "COMPLETE":
            assert after[number] == "COMPLETE"  # kept, not run again
    data = status_json(tmp_path, "killed")
    assert data["overall"]["state"] == "measured" and data["overall"]["n_pairs"] == 3
    complete = [r for r in data["final_check"]["trials"] if r["state"] == "complete"]
    assert len(complete) == 3 and not any(r["carried_from"] for r in complete)  # the final config on each seed, once
    assert not [r for r in data["final_check"]["trials"] if r["state"] in ("running", "waiting")]
