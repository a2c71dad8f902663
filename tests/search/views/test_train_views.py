"""What ``status``, ``report`` and ``export`` say of a train-mode study: the chain (each learning
stage's branch step, the checkpoint it branched from, the steps its runs trained, the checkpoint
its choice left), the continuation and the model's checkpoint; the cost with the continuation's
GPU time, against one full run of the baseline; and the schedule the export writes beside the
config. One small study runs once on the replay launcher (the simulator's model, in-process);
every figure is checked against what the runs and the stored trials say, read here directly."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from typer.testing import CliRunner

from benchmarks import methods as M
from benchmarks.run import demo_spec
from verl_sweep.search.commands.cli import app
from verl_sweep.search.database.records import StageResult, StageStudyAttrs, records, stage_study_name
from verl_sweep.search.database.study_root import save_spec
from verl_sweep.search.engine.continuation import continuation_study_name, stored_model
from verl_sweep.search.engine.driver import StudyRunner
from verl_sweep.search.views.console import Console
from verl_sweep.spaces import build_space

pytestmark = pytest.mark.fast

BRANCH = 100
RUN_STEPS = 1755  # the default world's run: 15 epochs of 117 steps
STAGES = ("kl", "lr")


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The study run to its end: two learning stages of 100-step branches, then the continuation."""
    tmp = tmp_path_factory.mktemp("train_views")
    spec = demo_spec("default")
    data = spec.model_dump(mode="json")
    data.update(run_steps=RUN_STEPS, train={"branch_steps": BRANCH}, stop_when_flat=0, final_check=False,
                stages=[{"name": name, "space": name, "budget": {"max_trials": 3}, "confirm_top": 0} for name in STAGES])
    spec = type(spec).model_validate(data)
    url = f"sqlite:///{tmp}/train.db"
    storage = optuna.storages.RDBStorage(url)
    save_spec(storage, spec)
    launcher = M.replay_launcher(tmp / "runs", "default")
    try:
        StudyRunner(spec, storage, launcher, console=Console(quiet=True), build_space=build_space,
                    poll_interval_s=M.POLL_S).run()
    finally:
        launcher.close()
    return {"spec": spec, "storage": storage, "url": url, "dir": tmp}


def _stage(s: dict[str, Any], name: str) -> tuple[StageStudyAttrs, list[Any]]:
    study = optuna.load_study(study_name=f"{s['spec'].name}.{name}", storage=s["storage"])
    return StageStudyAttrs.of(study.user_attrs), records(study.get_trials(deepcopy=False))


def _all_gpu_s(s: dict[str, Any]) -> float:
    """Every run's GPU-seconds as stored: the stages' trials and the continuation's attempts."""
    spec, storage = s["spec"], s["storage"]
    names = [stage_study_name(spec, stage) for stage in spec.stages] + [continuation_study_name(spec)]
    return sum(float(t.user_attrs.get("probe", {}).get("gpu_time_s") or 0.0)
               for name in names for t in optuna.load_study(study_name=name, storage=storage).get_trials())


def _status_text(data: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> str:
    from verl_sweep.search.views.console import print_status_table

    print_status_table(data)
    return capsys.readouterr().out


def test_status_gives_each_branch_and_the_chain_it_carried_on(study: dict[str, Any]) -> None:
    from verl_sweep.search.views.status import study_status

    kl, _ = _stage(study, "kl")
    lr, _ = _stage(study, "lr")
    model, attempts = stored_model(study["storage"], study["spec"])
    assert kl.branch is not None and lr.branch is not None and model is not None
    train = study_status(study["storage"], study["spec"])["train"]
    first, second = train["chain"]
    assert (first["stage"], first["steps"], first["from"]["step"], first["from"]["step_dir"]) == ("kl", [1, BRANCH], 0, None)
    assert (second["steps"], second["from"]) == ([BRANCH + 1, 2 * BRANCH], {**vars(lr.branch)})
    assert first["left"] == second["from"] and Path(first["left"]["step_dir"]).is_dir()
    assert first["left"]["step_dir"].endswith(f"global_step_{BRANCH}")
    c = train["continuation"]
    assert second["left"] == c["from"] and c["from"]["step"] == 2 * BRANCH and c["from"]["stage"] == "lr"
    assert (c["state"], c["to_step"], c["model"]) == ("trained", RUN_STEPS, vars(model))
    assert [r["number"] for r in c["attempts"]] == [t.number for t in attempts]
    assert first["n_runs"] > 0 and second["n_runs"] > 0


def test_the_cost_counts_the_continuation_and_stands_against_one_full_run(study: dict[str, Any]) -> None:
    from verl_sweep.search.views.status import cost_lines, r_text, study_status

    data = study_status(study["storage"], study["spec"])
    cost = data["cost"]
    _, attempts = stored_model(study["storage"], study["spec"])
    trained_h = sum(float(t.probe["gpu_time_s"]) for t in attempts) / 3600
    assert trained_h > 0
    assert cost["gpu_hours_spent"] == pytest.approx(_all_gpu_s(study) / 3600, abs=0.01)
    assert cost["cost_r"] == pytest.approx(cost["gpu_hours_spent"] / cost["r_gpu_hours"], rel=1e-3)
    t = cost["train"]
    assert t["continuation_gpu_hours"] == pytest.approx(trained_h, abs=0.01)
    assert t["total_r"] == pytest.approx(t["tuning_r"] + t["continuation_r"], abs=1e-3) == cost["cost_r"]
    assert "break_even_runs" not in cost and "saved_gpu_hours_per_run" not in cost
    spent, total = cost_lines(data)
    assert f"= {r_text(cost['cost_r'])} (R: a {RUN_STEPS:,}-step run of the baseline" in spent
    assert total.startswith(("train mode: the study is the run: ", "SIMULATED train mode: the study is the run: "))
    assert "payback" not in total
    assert (f"{r_text(t['tuning_r'])} tuning + {r_text(t['continuation_r'])} the trained run = {r_text(t['total_r'])}, "
            "against 1 R for one full run of the baseline") in total
    assert (data["overall"]["state"], data["overall"]["note"]) == ("skipped", "train mode runs none, the study is the run")


def test_status_text_draws_the_chain_with_its_checkpoints_and_the_model(study: dict[str, Any],
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from verl_sweep.search.views.status import study_status

    data = study_status(study["storage"], study["spec"])
    text = _status_text(data, capsys)
    first, second = data["train"]["chain"]
    model = data["train"]["continuation"]["model"]
    assert f"  kl: steps 1-{BRANCH} from scratch, {first['n_runs']} runs; " in text
    assert (f"  lr: steps {BRANCH + 1}-{2 * BRANCH} from step {BRANCH} (kl trial {first['left']['trial']}'s checkpoint), "
            f"{second['n_runs']} runs; ") in text
    for link in (first, second):  # each checkpoint the chain went on from, whole
        assert f"the chain's checkpoint at step {link['left']['step']} (trial {link['left']['trial']}" in text
        assert link["left"]["step_dir"] in text
    assert f"  continuation: steps {2 * BRANCH + 1}-{RUN_STEPS:,} from step {2 * BRANCH} (lr trial" in text
    assert ": trained, 1 attempt, " in text
    assert f"  the model: step {RUN_STEPS:,}: {model['step_dir']}" in text
    assert "payback" not in text and "train mode: the study is the run:" in text


def test_the_report_shows_the_chain_the_model_and_the_schedule(study: dict[str, Any]) -> None:
    import html

    from verl_sweep.search.views.report import build_report

    page = html.unescape(build_report(study["storage"], study["spec"]))
    model, _ = stored_model(study["storage"], study["spec"])
    assert model is not None
    kl, _ = _stage(study, "kl")
    lr, _ = _stage(study, "lr")
    assert "Train mode: the chain and the model" in page and "Final check: the final config" not in page
    assert lr.branch is not None and lr.branch.step_dir in page and model.step_dir in page
    assert f"{BRANCH + 1}–{2 * BRANCH}" in page and f"{2 * BRANCH + 1}–{RUN_STEPS:,}" in page
    assert "best.schedule.yaml" in page and "changes_from_final" in page
    assert "train mode: the study is the run: " in page


def test_export_writes_the_config_as_before_and_the_schedule_beside_it(study: dict[str, Any]) -> None:
    out = study["dir"] / "out"
    result = CliRunner().invoke(app, ["export", study["spec"].name, "--storage", study["url"], "-o", str(out / "best.yaml")])
    assert result.exit_code == 0, result.output
    model, _ = stored_model(study["storage"], study["spec"])
    assert model is not None
    config = yaml.safe_load((out / "best.yaml").read_text())
    assert config["defaults"][-1] == "_self_" and config["hydra"] == {"searchpath": ["pkg://verl.trainer.config"]}
    assert set(config) >= {"actor_rollout_ref", "trainer"} and "schedule" not in config and "model" not in config
    assert f"# model: {model.step_dir}\n" in (out / "best.yaml").read_text()
    plan = yaml.safe_load((out / "best.schedule.yaml").read_text())
    steps = [s["steps"] for s in plan["schedule"]]
    assert steps == [[1, BRANCH], [BRANCH + 1, 2 * BRANCH], [2 * BRANCH + 1, RUN_STEPS]]
    assert [s["stage"] for s in plan["schedule"]] == [*STAGES, "train"]
    segments = plan["schedule"]
    assert segments[0]["from"] is None
    for before, after in zip(segments, segments[1:]):  # each segment goes on from the checkpoint the one before left
        assert after["from"] == before["checkpoint"] and Path(before["checkpoint"]).is_dir()
    assert segments[-1]["changes_from_final"] == {} and segments[-1]["checkpoint"] == model.step_dir
    assert (plan["model"], plan["model_step"], plan["trained"]) == (model.step_dir, model.step, True)
    assert f"wrote {out / 'best.schedule.yaml'}" in result.output

    as_json = CliRunner().invoke(app, ["export", study["spec"].name, "--storage", study["url"], "--format", "json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["train"] == plan


def test_a_chain_not_yet_trained_says_where_the_continuation_will_start(study: dict[str, Any], tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The stages done, the continuation not opened: its start is found as the driver finds it."""
    from verl_sweep.search.views import export
    from verl_sweep.search.views.status import cost_lines, study_status
    from verl_sweep.search.views.train import schedule, schedule_yaml

    shutil.copy(study["dir"] / "train.db", tmp_path / "train.db")
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/train.db")
    optuna.delete_study(study_name=continuation_study_name(study["spec"]), storage=storage)
    data = study_status(storage, study["spec"])
    c = data["train"]["continuation"]
    lr_left = data["train"]["chain"][1]["left"]
    assert c["state"] == "not started" and c["model"] is None and c["from"] == lr_left
    assert lr_left["step"] == 2 * BRANCH and Path(lr_left["step_dir"]).is_dir()
    assert data["cost"]["train"]["continuation_gpu_hours"] == 0
    assert "the trained run not started" in cost_lines(data)[1]
    text = _status_text(data, capsys)
    assert f"continuation: steps {2 * BRANCH + 1}-{RUN_STEPS:,} from step {2 * BRANCH} (lr trial" in text
    assert "  the model: not trained yet" in text
    final = data["stages"][-1]["winner"]["config"]
    plan = schedule(data, final)
    assert plan["trained"] is False and plan["model"] is None
    assert plan["schedule"][-1]["steps"] == [2 * BRANCH + 1, RUN_STEPS] and plan["schedule"][-1]["checkpoint"] is None
    assert "the model is not trained yet" in schedule_yaml(plan)
    results = [StageResult.of(s["winner"]) for s in data["stages"]]
    assert "# model: not trained yet" in export.render(study["spec"], results, final, "yaml", schedule=plan)


def test_a_run_without_eta_finishes_on_one_line() -> None:
    from verl_sweep.search.database.records import Role

    stream = io.StringIO()
    console = Console(stream, live=False)
    study = optuna.create_study(study_name="s.train")
    console.trial_finished(study, 0, Role.CANDIDATE, {}, state="complete")
    assert stream.getvalue() == "[train] trial 0 candidate complete\n"


def test_the_plan_prices_branches_and_the_continuation_not_a_final_check(study: dict[str, Any]) -> None:
    from verl_sweep.search.views.plan import plan_lines

    spec = study["spec"]
    lines = plan_lines(spec, spec.baseline_config())
    text = "\n".join(lines)
    # Each stage's incumbent branches anew from the chain: nothing carried over; the run's rest
    # after the two stages' branches is the continuation; no final check, no payback.
    assert "carried over" not in text and "plan: final" not in text and "payback" not in text, text
    assert any(line.startswith(f"plan: train (the chain's config to the run's end) 1 probe × {RUN_STEPS - 2 * BRANCH} steps")
               for line in lines), text
    assert "at most ~1.5 R all told (train.max_cost_r" in text, text
