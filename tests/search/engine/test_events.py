"""A study's events reach every listener (``verl_sweep.search.engine.events``): what a benchmark traces, and a
tracker would log, without subclassing the driver or the console."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from benchmarks import methods as M
from benchmarks.run import demo_spec
from verl_sweep.search.views.console import Console
from verl_sweep.search.engine.driver import StudyRunner
from verl_sweep.search.engine.events import StudyListener
from verl_sweep.search.database.study_root import save_spec

pytestmark = pytest.mark.fast


class _Recorder(StudyListener):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def stage_started(self, index: int, stage: Any, base: dict[str, Any], explain: list[str], budget: int) -> None:
        self.events.append(("started", (stage.name, base)))

    def trial_started(self, stage: str, number: int, role: Any, overrides: dict[str, Any]) -> None:
        self.events.append(("trial started", number))

    def trial_finished(self, study: Any, number: int, role: Any, overrides: dict[str, Any], **details: Any) -> None:
        self.events.append(("trial finished", (number, details["state"])))

    def stage_finished(self, name: str, result: Any) -> None:
        self.events.append(("finished", result.decision))


def test_every_listener_hears_the_stage_and_its_trials(tmp_path: Path) -> None:
    spec = demo_spec("default")
    data = spec.model_dump(mode="json")
    data["stop_when_flat"] = 0
    data["stages"] = [{"name": "lr", "space": "lr", "budget": {"max_trials": 3}, "confirm_top": 0}]
    spec = type(spec).model_validate(data)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/e.db")
    save_spec(storage, spec)
    launcher = M.replay_launcher(tmp_path / "runs", "default")
    first, second = _Recorder(), _Recorder()
    StudyRunner(spec, storage, launcher, console=Console(quiet=True), listeners=[first, second],
                poll_interval_s=M.POLL_S).run()
    assert first.events == second.events
    kinds = [kind for kind, _ in first.events]
    assert kinds[0] == "started" and first.events[0][1] == ("lr", spec.baseline_config()) and kinds[-1] == "finished"
    started = [n for kind, n in first.events if kind == "trial started"]
    finished = [payload[0] for kind, payload in first.events if kind == "trial finished"]
    assert len(started) == len(launcher.usage()) == 3 and sorted(finished) == sorted(started)
