"""The cost in R, one full run of the user's baseline: ``status`` (text and ``--json``), the
report's header and ``validate``'s plan state the study's GPU-hours, and each stage's, as
multiples of R beside the payback. R's length is ``--run-steps``, else the baseline's own,
else 2,000 steps assumed (said so). Every R figure is checked against GPU-hours ÷ (steps ×
step time × GPUs / 3600), the step time taken from the probes the test stored (status) or
from the plan's own estimate (validate)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest

from support import demo_data, write_study

pytestmark = pytest.mark.fast

#: the baseline's probes as stored: seconds a step, GPUs, start-up seconds, steps
STEP_S, GPUS, STARTUP_S, STEPS = 120.0, 8, 60.0, 500
#: the final check's measured gain, and its interval
ETA, LOW, HIGH = 1.25, 1.2, 1.3


def _probe(last_step: int) -> dict[str, Any]:
    """A probe's record: ``last_step`` steps of STEP_S on GPUS GPUs after STARTUP_S."""
    return {"state": "complete", "last_step": last_step, "startup_s": STARTUP_S,
            "gpu_time_s": (last_step * STEP_S + STARTUP_S) * GPUS}


def _study(tmp_path: Path, change: Callable[[dict[str, Any]], None] | None = None, *,
           trials: bool = True) -> tuple[Any, Any, float]:
    """The demo study written straight into SQLite: the first stage with two baseline runs and
    a candidate pruned at step 200, the final check with two pairs and its measured η.
    Returns the storage, the spec and the GPU-hours stored (summed here, not by status)."""
    import optuna
    from optuna.trial import TrialState, create_trial

    from verl_sweep.search.database.storage import open_storage
    from verl_sweep.search.engine.driver import save_spec
    from verl_sweep.search.spec.study_file import load_study

    data = demo_data()
    if change is not None:
        change(data)
    spec = load_study(write_study(tmp_path, data, "demo.yaml"))
    storage = open_storage(f"sqlite:///{tmp_path}/cost.db")
    save_spec(storage, spec)
    if not trials:
        return storage, spec, 0.0
    gpu_s = 0.0
    stage = optuna.create_study(study_name=f"{spec.name}.{spec.stages[0].name}", storage=storage, direction="maximize")
    for number, (role, state, last) in enumerate([("incumbent", TrialState.COMPLETE, STEPS),
                                                  ("incumbent", TrialState.COMPLETE, STEPS),
                                                  ("candidate", TrialState.PRUNED, 200)]):
        probe = _probe(last)
        gpu_s += probe["gpu_time_s"]
        stage.add_trial(create_trial(state=state, value=1.0 if state == TrialState.COMPLETE else None,
                                     user_attrs={"role": role, "seed": 11 + number, "probe": probe}))
    final = optuna.create_study(study_name=f"{spec.name}.final", storage=storage, direction="maximize")
    for number, role in enumerate(["incumbent", "candidate", "incumbent", "candidate"]):
        probe = _probe(STEPS)
        gpu_s += probe["gpu_time_s"]
        final.add_trial(create_trial(state=TrialState.COMPLETE, value=1.0,
                                     user_attrs={"role": role, "seed": 20 + number // 2, "probe": probe}))
    final.set_user_attr("result", {"eta": ETA, "low": LOW, "high": HIGH, "n_pairs": 2})
    return storage, spec, gpu_s / 3600


def r_of(run_steps: int) -> float:
    """R by the second route: a full run's steps × the stored step time × GPUs, in hours."""
    return run_steps * STEP_S * GPUS / 3600


def test_status_gives_the_cost_and_each_stage_in_r_with_2000_steps_assumed(tmp_path: Path) -> None:
    from verl_sweep.search.views.status import cost_lines, r_text, study_status

    storage, spec, spent = _study(tmp_path)
    data = study_status(storage, spec)
    cost, r = data["cost"], r_of(2000)  # the demo's train files are not here: its length is unknown
    assert (cost["run_steps"], cost["run_steps_assumed"], cost["run_steps_from"]) == (2000, True, "2,000 steps assumed")
    assert cost["r_gpu_hours"] == pytest.approx(r, abs=0.01) == cost["full_run_gpu_hours"]
    assert cost["gpu_hours_spent"] == pytest.approx(spent, abs=0.01)
    assert cost["cost_r"] == pytest.approx(spent / r, rel=1e-3)
    first, final = data["stages"][0], data["final_check"]
    assert first["cost_r"] == pytest.approx(first["gpu_hours"] / r, rel=1e-3) and first["cost_r"] > 0
    assert final["cost_r"] == pytest.approx(final["gpu_hours"] / r, rel=1e-3)
    assert all(s["cost_r"] is None for s in data["stages"][1:])  # not started: no GPU-hours
    # The winner reaches the same reward η times sooner: it saves 1 - 1/η of R a run.
    saved = r * (1 - 1 / ETA)
    assert cost["saved_gpu_hours_per_run"] == pytest.approx(saved, abs=0.01)
    assert cost["break_even_runs"] == pytest.approx(spent / saved, abs=0.01)

    lines = cost_lines(data)
    print(*lines, sep="\n")
    assert lines[0] == (f"SIMULATED cost: {spent:,.1f} GPU-h = {r_text(spent / r)} (R: a 2,000-step run of the "
                        f"baseline, {r:,.1f} GPU-h; 2,000 steps assumed; give --run-steps N)")
    assert lines[1] == (f"SIMULATED payback: the winner saves {saved:,.1f} [{r * (1 - 1 / LOW):,.1f}, "
                        f"{r * (1 - 1 / HIGH):,.1f}] GPU-h a full run = {r_text(1 - 1 / ETA)}; "
                        f"break-even after {spent / saved:.1f} runs")
    assert max(map(len, lines)) <= 150


def test_run_steps_or_the_baselines_own_length_replace_the_assumed_2000(tmp_path: Path) -> None:
    from verl_sweep.search.views.status import cost_lines, study_status

    def own_length(data: dict[str, Any]) -> None:
        data["baseline"]["trainer.total_training_steps"] = 3000

    storage, spec, spent = _study(tmp_path, own_length)
    cost = study_status(storage, spec)["cost"]
    assert (cost["run_steps"], cost["run_steps_assumed"]) == (3000, False)
    assert cost["run_steps_from"] == "trainer.total_training_steps = 3,000"
    assert cost["cost_r"] == pytest.approx(spent / r_of(3000), rel=1e-3)
    given = study_status(storage, spec, run_steps=4000)
    assert (given["cost"]["run_steps"], given["cost"]["run_steps_from"]) == (4000, "--run-steps")
    assert given["cost"]["cost_r"] == pytest.approx(spent / r_of(4000), rel=1e-3)
    line = cost_lines(given)[0]
    assert "(R: a 4,000-step run of the baseline, " in line and "assumed" not in line


def test_before_the_baseline_ran_r_is_unknown_and_status_says_why(tmp_path: Path) -> None:
    from verl_sweep.search.views.status import cost_lines, study_status

    storage, spec, _ = _study(tmp_path, trials=False)
    data = study_status(storage, spec)
    assert data["cost"]["cost_r"] is None and data["cost"]["r_gpu_hours"] is None
    assert cost_lines(data) == ["SIMULATED cost: 0.0 GPU-h (R, a 2,000-step run of the baseline: its step time is not "
                                "measured yet; 2,000 steps assumed; give --run-steps N)"]


def test_the_status_table_and_the_report_show_r(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from verl_sweep.search.views.console import print_status_table
    from verl_sweep.search.views.report import build_report
    from verl_sweep.search.views.status import r_text, study_status

    storage, spec, _ = _study(tmp_path)
    data = study_status(storage, spec)
    monkeypatch.setenv("COLUMNS", "80")
    print_status_table(data)
    screen = capsys.readouterr().out
    first = data["stages"][0]
    assert re.search(rf"^ {first['name']} .* {first['gpu_hours']:.1f} .*\n.* {re.escape(r_text(first['cost_r']))} ",
                     screen, re.MULTILINE), screen
    assert "2,000 steps assumed; give --run-steps N" in screen
    assert not re.search(r"\d\n\s*R\b", screen), "a figure cut from its unit"
    report = build_report(storage, spec)
    assert f"= {r_text(data['cost']['cost_r'])} (R: a 2,000-step run of the baseline" in report
    assert f"<td>{r_text(first['cost_r'])}</td>" in report


def _plan(tmp_path: Path, change: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[str], Any]:
    from verl_sweep.search.spec.study_file import load_study
    from verl_sweep.search.views.plan import plan_lines

    data = demo_data()
    if change is not None:
        change(data)
    spec = load_study(write_study(tmp_path, data, "demo.yaml"))
    return plan_lines(spec, spec.baseline_config()), spec


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def test_the_plan_gives_each_stage_and_the_total_in_r_with_2000_steps_assumed(tmp_path: Path) -> None:
    from verl_sweep.search.views.plan import stage_plans, step_seconds

    lines, spec = _plan(tmp_path)
    print(*lines, sep="\n")
    step_s, _ = step_seconds(spec, spec.baseline_config())
    r = 2000 * step_s * spec.hardware.n_gpus / 3600  # R by the second route: the plan's step time
    assert lines[0] == (f"plan: R is one full run of the baseline: 2,000 steps assumed (set run_steps: learning "
                        f"probes are judged over the run), ~{r:,.0f} GPU-h at ~{step_s:.0f} s a step")
    stage_lines = [line for line in lines if re.match(r"plan: \w+ \(", line)]
    assert len(stage_lines) == len(stage_plans(spec)) + 1  # the final check too
    for line in stage_lines:
        found = re.search(r": ~([\d,]+)(?:-([\d,]+))? GPU-h = ([\d.]+)(?:-([\d.]+))? R$", line)
        assert found, line
        hours_low, hours_high, r_low, r_high = found.groups()
        assert _number(r_low) == pytest.approx(_number(hours_low) / r, abs=0.05 * _number(r_low) + 0.01), line
        assert _number(r_high or r_low) == pytest.approx(_number(hours_high or hours_low) / r,
                                                         abs=0.05 * _number(r_high or r_low) + 0.01), line
    total = next(line for line in lines if "ESTIMATE" in line)
    found = re.search(r"ESTIMATE ([\d,]+)-([\d,]+) GPU-hours = ([\d.]+)-([\d.]+) R at ~\d+ s a step "
                      r"\(R: 2,000 steps assumed\)$", total)
    assert found, total
    for hours, in_r in ((found[1], found[3]), (found[2], found[4])):
        assert _number(in_r) == pytest.approx(_number(hours) / r, rel=0.05)
    assert max(len(line) for line in lines) <= 170


def test_the_plan_takes_r_from_the_baselines_own_length(tmp_path: Path) -> None:
    def own_length(data: dict[str, Any]) -> None:
        data["baseline"]["trainer.total_training_steps"] = 4000

    lines, _ = _plan(tmp_path, own_length)
    assert lines[0].startswith("plan: R is one full run of the baseline: 4,000 steps (trainer.total_training_steps = "
                               "4,000), ~")
    assert "assumed" not in "\n".join(lines)
    assert next(line for line in lines if "ESTIMATE" in line).endswith("(R: 4,000 steps)")
    # Half the R of a 2,000-step run: each figure in R halves, the GPU-hours stay.
    assumed, _ = _plan(tmp_path)
    for line, before in zip(lines[1:], assumed[1:]):
        if "GPU-h = " in line:
            hours = re.findall(r"~([\d,-]+) GPU-h", line)
            assert hours == re.findall(r"~([\d,-]+) GPU-h", before)
            r_now = re.search(r"= ([\d.]+)(?:-[\d.]+)? R", line)
            r_before = re.search(r"= ([\d.]+)(?:-[\d.]+)? R", before)
            assert r_now and r_before
            assert float(r_now[1]) == pytest.approx(float(r_before[1]) / 2, rel=0.1, abs=0.01), (line, before)


@pytest.mark.parametrize("r, text", [(12.4, "12 R"), (6.66, "6.7 R"), (0.314, "0.31 R"), (0.0417, "0.042 R")])
def test_r_is_printed_with_two_figures_under_ten(r: float, text: str) -> None:
    from verl_sweep.search.views.status import r_text

    assert r_text(r) == text


def test_the_plan_prices_a_speed_probe_at_its_settled_length_only_where_it_settles(tmp_path: Path) -> None:
    """A speed probe ends once its tokens/s settles: the plan prices it at the warm-up and three
    scored steps, and at its whole length where the study turns the early end off."""
    settling, _ = _plan(tmp_path)
    systems = next(line for line in settling if line.startswith("plan: systems ("))
    assert "× ~4 steps (until tokens/s settles, ≤30)" in systems, systems

    def no_settle(data: dict[str, Any]) -> None:
        data["probe"] = {**data.get("probe", {}), "speed_settle_tolerance": 0.0}

    (tmp_path / "whole").mkdir()
    whole, _ = _plan(tmp_path / "whole", no_settle)
    systems_whole = next(line for line in whole if line.startswith("plan: systems ("))
    assert "× 30 steps" in systems_whole, systems_whole
    hours = [_number(re.search(r": ~([\d,]+)", line)[1]) for line in (systems, systems_whole)]
    assert hours[0] == pytest.approx(hours[1] * 4 / 30, rel=0.05)


def test_the_plan_says_what_gain_pays_the_study_back_within_three_runs(tmp_path: Path) -> None:
    from verl_sweep.search.views.plan import eta_to_pay_back

    for cost_r in (0.1, 0.9, 1.5, 2.9):
        eta = eta_to_pay_back(cost_r, 3)
        assert eta is not None and 3 * (1 - 1 / eta) == pytest.approx(cost_r)  # three runs' savings repay it
    assert eta_to_pay_back(3.0, 3) is None and eta_to_pay_back(9.9, 3) is None

    whole, _ = _plan(tmp_path)  # the demo: ~10 R, more than any gain repays in three runs
    assert any(re.fullmatch(r"plan: payback: at [\d.]+ R no gain pays the study back within 3 full runs "
                            r"\(each saves under 1 R\)", line) for line in whole), whole

    def speed_only(data: dict[str, Any]) -> None:
        data["stages"] = [stage for stage in data["stages"] if stage["space"] in ("systems", "token_budget")]
        data["final_check"] = False

    (tmp_path / "speed").mkdir()
    lines, _ = _plan(tmp_path / "speed", speed_only)
    total = next(line for line in lines if "ESTIMATE" in line)
    low_r = _number(re.search(r"= ([\d.]+)(?:-[\d.]+)? R at", total)[1])
    line = next(line for line in lines if line.startswith("plan: payback:"))
    found = re.fullmatch(r"plan: payback: within 3 full runs if the winner reaches η ≥ ([\d.]+) \(each run then saves "
                         r"≥ [\d.]+ R\)", line)
    assert found, line
    assert _number(found[1]) == pytest.approx(1 / (1 - low_r / 3), abs=0.01)
