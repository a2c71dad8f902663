"""Probes in the user's own tracker. A small demo-like study on the simulator, whose baseline
logs to ``[console, wandb, tensorboard]`` (W&B offline, no network), leaves one W&B run and one
TensorBoard run per probe: W&B group = the study, job type = the stage, name = the run id,
config = verl's config (the trial's parameters at their places) and ``verl_sweep.params``,
summary = the trial's η, interval and state; TensorBoard ``<root>/<study>/<stage>/<run id>``
with verl's scalars, ``verl_sweep/eta`` and the parameters as hparams. Read back with wandb's
own reader (``wandb leet inspect --json``) and tensorboard's ``EventMultiplexer``; the W&B API
key given to the study is in no file it leaves."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest

from support import REPO, cli, demo_data, write_study
from verl_sweep.launchers.base import RunSpec
from verl_sweep.launchers.run_dir import RunDir, probe_pins
from verl_sweep.launchers.trackers import ProbeTracking
from verl_sweep.search.database.records import TrialRecord
from verl_sweep.search.views.trackers import tracker_lines

STUDY, STAGES, PROJECT = "trk", ("kl", "lr"), "my-project"
API_KEY = "wk-sentinel-7c1e0d9b5a3f" + "0" * 18  # a W&B key's length; never to be written anywhere


def _study() -> dict[str, Any]:
    data = demo_data()
    data["name"] = STUDY
    data["probe"] = {"steps": 30, "incumbent_repeats": 1}
    data["baseline"]["trainer.logger"] = ["console", "wandb", "tensorboard"]
    data["baseline"]["trainer.project_name"] = PROJECT
    data["stages"] = [{"name": name, "space": name, "budget": {"max_trials": 2}, "confirm_top": 0,
                       "pruner": {"name": "none"}} for name in STAGES]
    data.pop("stop_when_flat", None)
    return data


def _probes(db: Path) -> dict[str, dict[str, Any]]:
    """Each probe the study ran (trials carried from a stage before ran none): by run id."""
    probes = {}
    for stage in STAGES:
        study = optuna.load_study(study_name=f"{STUDY}.{stage}", storage=f"sqlite:///{db}")
        for record in (TrialRecord.of(t) for t in study.trials):
            if record.run_dir is None or record.carried_from is not None:
                continue
            argv = RunDir(Path(record.run_dir)).read_spec()["argv"]
            names = ProbeTracking.of_argv(argv)
            assert names is not None
            probes[record.run_id] = {"stage": stage, "record": record, "wandb_id": names.wandb_id}
    return probes


def _wandb_runs(wandb_dir: Path) -> dict[str, dict[str, Any]]:
    """The offline runs under ``wandb_dir`` by W&B run id, each run directory's records merged
    in the order they were written (a run opened again adds a directory with the same id)."""
    runs: dict[str, dict[str, Any]] = {}
    for directory in sorted(wandb_dir.glob("offline-run-*")):  # named by start time
        out = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json", str(directory)],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        run: dict[str, Any] | None = None
        for line in out.splitlines():
            record = json.loads(line)
            kind = record["type"]
            if kind == "run":
                body = record["run"]
                run = runs.setdefault(body["run_id"], {"dirs": 0, "config": {}, "summary": {}, "args": []})
                run["dirs"] += 1
                for key in ("run_group", "job_type", "display_name", "project"):
                    run.setdefault(key, body.get(key))
                _merge(run["config"], body.get("config", {}).get("update", {}))
            elif run is not None and kind == "config":
                _merge(run["config"], record["config"].get("update", {}))
            elif run is not None and kind == "summary":
                run["summary"].update(record["summary"].get("update", {}))
            elif run is not None and kind == "environment":
                run["args"] += record["environment"].get("args", [])
    return runs


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _at(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def test_a_study_leaves_one_run_per_probe_in_wandb_and_tensorboard(tmp_path: Path) -> None:
    path = write_study(tmp_path, _study(), "trk.yaml")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_API_KEY": API_KEY,
           "TENSORBOARD_DIR": str(tmp_path / "tb")}
    result = cli("run", str(path), cwd=tmp_path, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "dropping override 'trainer.logger" not in output  # the baseline's loggers are kept, not dropped
    assert "tracker did not take" not in output

    probes = _probes(tmp_path / "trk.db")
    assert {p["stage"] for p in probes.values()} == set(STAGES)

    # W&B: one run per probe, named and grouped as the study's, with its config and outcome.
    runs = _wandb_runs(tmp_path / "wandb")
    assert set(runs) == {p["wandb_id"] for p in probes.values()}
    for run_id, probe in probes.items():
        record, run = probe["record"], runs[probe["wandb_id"]]
        assert (run["run_group"], run["job_type"], run["display_name"], run["project"]) == \
            (STUDY, probe["stage"], run_id, PROJECT)
        assert run["dirs"] == 2  # the probe's, and the study's outcome added to it
        for key, value in record.overrides.items():  # verl's config holds the trial's parameters
            assert _at(run["config"], key.lstrip("+")) == pytest.approx(value)
        assert run["config"]["verl_sweep"]["params"] == pytest.approx(record.overrides)
        assert run["summary"]["training/global_step"] >= 1  # verl's steps, logged by the probe
        summary = run["summary"]
        assert summary["verl_sweep/state"] == "complete" and summary["verl_sweep/role"] == str(record.role)
        assert summary["verl_sweep/eta"] == pytest.approx(record.eta)
        if record.eta_interval is not None and all(map(math.isfinite, record.eta_interval)):
            assert (summary["verl_sweep/eta_low"], summary["verl_sweep/eta_high"]) == pytest.approx(record.eta_interval)
        else:  # an interval not known yet (one run) is left out
            assert "verl_sweep/eta_low" not in summary
        assert str(path) not in run["args"]  # the study's command line (it may hold a password) is not recorded

    # TensorBoard: <root>/<study>/<stage>/<run id>, verl's scalars, the outcome, the parameters.
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import metadata

    multiplexer = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "tb"))
    multiplexer.Reload()
    assert set(multiplexer.Runs()) == {f"{STUDY}/{p['stage']}/{run_id}" for run_id, p in probes.items()}
    for run_id, probe in probes.items():
        record = probe["record"]
        events = multiplexer.GetAccumulator(f"{STUDY}/{probe['stage']}/{run_id}")
        assert "training/global_step" in events.Tags()["scalars"]
        assert events.Scalars("verl_sweep/eta")[-1].value == pytest.approx(record.eta, rel=1e-6)
        content = events.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
        hparams = metadata.parse_session_start_info_plugin_data(content).hparams
        assert hparams["verl_sweep.state"].string_value == "complete"
        for key, value in record.overrides.items():
            held = hparams[key]
            assert (held.bool_value if isinstance(value, bool) else held.number_value) == pytest.approx(value)

    # The API key the study was given is in no file it left.
    leaked = [str(p) for p in tmp_path.rglob("*") if p.is_file() and API_KEY.encode() in p.read_bytes()]
    assert leaked == []


def test_a_baseline_without_trackers_keeps_verls_loggers_to_the_run_directory(tmp_path: Path) -> None:
    spec = RunSpec("s.lr.t0001", ("trainer.project_name=p",), metadata={"study": "s", "stage": "lr", "trial": "1"})
    pins = probe_pins(spec, RunDir(tmp_path))
    assert "trainer.logger=[console,file]" in pins
    assert not [p for p in pins if "WANDB_" in p]
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR={tmp_path / 'tensorboard'}" in pins


def test_a_baseline_with_trackers_names_the_probe_for_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)  # verl's default root: tensorboard_log/<project>
    spec = RunSpec("s.lr.t0001", ("trainer.logger=['console','wandb','tensorboard','swanlab']", "trainer.project_name=p"),
                   metadata={"study": "s", "stage": "lr", "trial": "1"})
    env_pin = "+ray_kwargs.ray_init.runtime_env.env_vars."
    first, again = probe_pins(spec, RunDir(tmp_path)), probe_pins(spec, RunDir(tmp_path))
    assert "trainer.logger=[console,file,wandb,tensorboard,swanlab]" in first
    assert {f"{env_pin}WANDB_RUN_GROUP=s", f"{env_pin}WANDB_JOB_TYPE=lr"} <= set(first)
    assert f"{env_pin}TENSORBOARD_DIR={Path('tensorboard_log/p/s/lr/s.lr.t0001').absolute()}" in first
    ids = [p for p in (*first, *again) if p.startswith(f"{env_pin}WANDB_RUN_ID=s.lr.t0001-")]
    assert len(set(ids)) == 2  # a W&B run of its own each start: a study run again is not a resume
    names = ProbeTracking.of_argv([*spec.overrides, "trainer.experiment_name=s.lr.t0001", *first])
    assert names is not None and (names.group, names.job_type, names.name, names.project) == ("s", "lr", "s.lr.t0001", "p")
    assert names.user_loggers == ("wandb", "tensorboard", "swanlab")


def test_validate_says_where_the_probes_show_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    lines = tracker_lines("s", {"trainer.logger": ["console", "wandb", "tensorboard"], "trainer.project_name": "p"})
    assert lines == [
        "note: each probe is a W&B run in project p: group s, job type = its stage, name s.<stage>.t<trial>",
        f"note: each probe's TensorBoard events: {Path('tensorboard_log/p/s/<stage>/s.<stage>.t<trial>').absolute()}",
    ]
    assert tracker_lines("s", {"trainer.logger": "['console','file']"}) == []
    assert tracker_lines("s", {}) == []  # verl's default loggers are not turned on: only the ones asked for


def test_probe_trackers_false_keeps_the_probes_out_of_the_users_trackers(tmp_path: Path) -> None:
    from verl_sweep.launchers.trackers import NO_TRACKERS
    from verl_sweep.search.spec.study_file import StudySpec

    data = _study()
    data["probe"]["trackers"] = False
    assert StudySpec.model_validate(data).probe.trackers is False
    spec = RunSpec("s.lr.t0001", ("trainer.logger=[console,wandb,tensorboard]",),
                   metadata={"study": "s", "stage": "lr", "trial": "1", **NO_TRACKERS})
    pins = probe_pins(spec, RunDir(tmp_path))
    assert "trainer.logger=[console,file]" in pins and not [p for p in pins if "WANDB_" in p]
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR={tmp_path / 'tensorboard'}" in pins


#: verl 0.9.1's own trackers (``verl.utils.tracking.Tracking``), or the simulated verl's, made in an
#: actor whose environment holds the probe's ``runtime_env.env_vars`` pins, logging one step
_VERL = ("import os, sys, json; from verl.utils.tracking import Tracking; a = json.loads(sys.argv[1]); "
         "os.environ.update(a['env']); t = Tracking(project_name=a['project'], experiment_name=a['name'], "
         "default_backend=['console', 'wandb', 'tensorboard'], config={'trainer': {}}); "
         "t.log({'training/global_step': 1}, step=1); t.finish()")
_SIMULATED = ("import os, sys, json; from verl_sweep.launchers.simulator.tracking import Tracking; a = json.loads(sys.argv[1]); "
              "t = Tracking(a['config']); t.log({'training/global_step': 1}, 1); t.finish()")


@pytest.mark.verl
def test_verl_itself_names_a_probe_as_the_simulator_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("verl.utils.tracking")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))  # the user's root: <root>/<study>/<stage>/<run id>
    from verl_sweep.launchers.simulator.config import parse_overrides
    from verl_sweep.launchers.trackers import ENV_OVERRIDE

    spec = RunSpec("s.lr.t0001", ("trainer.logger=[console,wandb,tensorboard]", "trainer.project_name=p"),
                   metadata={"study": "s", "stage": "lr", "trial": "1"})
    argv = [*spec.overrides, *probe_pins(spec, RunDir(tmp_path / "run"))]
    pinned_env = {p.partition("=")[0][len(ENV_OVERRIDE):]: p.partition("=")[2] for p in argv if p.startswith(ENV_OVERRIDE)}
    wandb_ids, tensorboard_dirs = {}, {}
    for who, code, args in (("verl", _VERL, {"env": pinned_env, "project": "p", "name": spec.run_id}),
                            ("simulated", _SIMULATED, {"config": parse_overrides(argv)})):
        env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / who), "PYTHONPATH": str(REPO)}
        (tmp_path / who).mkdir()
        before = set(Path(pinned_env["TENSORBOARD_DIR"]).glob("events.*"))
        subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, cwd=tmp_path / who, check=True,
                       capture_output=True, timeout=120)
        [run] = _wandb_runs(tmp_path / who / "wandb").items()
        wandb_ids[who] = (run[0], *(run[1][k] for k in ("run_group", "job_type", "display_name", "project")))
        tensorboard_dirs[who] = {p.parent for p in set(Path(pinned_env["TENSORBOARD_DIR"]).glob("events.*")) - before}
    assert wandb_ids["verl"] == wandb_ids["simulated"] == (pinned_env["WANDB_RUN_ID"], "s", "lr", "s.lr.t0001", "p")
    assert tensorboard_dirs["verl"] == tensorboard_dirs["simulated"] == {tmp_path / "tb/s/lr/s.lr.t0001"}


def test_a_tracker_that_fails_is_warned_about_once_and_then_left_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_sweep.search.database.records import Role, set_attrs, started_attrs
    from verl_sweep.search.views.trackers import TrackerListener

    (tmp_path / "tb").write_text("a file where the TensorBoard root should be")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    study = optuna.create_study()
    listener = TrackerListener()
    for number in range(2):
        run_id = f"s.lr.t{number:04d}"
        spec = RunSpec(run_id, ("trainer.logger=[console,tensorboard]",), metadata={"study": "s", "stage": "lr"})
        files = RunDir.make(tmp_path / "runs", run_id)
        files.write_spec(spec, {"argv": [*spec.overrides, *probe_pins(spec, files)]})
        trial = study.ask()
        set_attrs(trial, started_attrs(role=Role.CANDIDATE, seed=1, overrides={}, run_id=run_id, run_dir=str(files.path)))
        study.tell(trial, 1.0)
        with caplog.at_level("WARNING", logger="verl_sweep.search.views.trackers"):
            listener.trial_finished(study, number, Role.CANDIDATE, {}, eta=1.0)
    warned = [r.getMessage() for r in caplog.records if r.name == "verl_sweep.search.views.trackers"]
    assert len(warned) == 1 and warned[0].startswith("tensorboard did not take trial 0's outcome (NotADirectoryError")
