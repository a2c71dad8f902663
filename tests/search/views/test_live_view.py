"""The live view: a small demo study run by the real CLI under a pseudo-terminal shows stage
headers, progress bars with each probe's step and reward, and one line per finished trial.

The same run's database is shared with test_report.py, test_optuna_tools.py and
test_end_to_end.py (``support.shared_runs.shared_demo``): one study run for the four files.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support import demo_data
from support.shared_runs import plain, shared_demo


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_demo(tmp_path_factory)


@pytest.mark.slow  # runs the shared demo study (~40 s)
def test_live_view_shows_stage_progress_and_trials(demo_dir: Path) -> None:
    raw = (demo_dir / "transcript.bin").read_bytes()
    text = plain(raw)
    # a terminal got the live view: cursor control from the progress display, not plain lines
    assert b"\x1b[" in raw
    assert "started (" not in text, "per-trial 'started' lines are for non-terminals only"
    stages = [s["name"] for s in demo_data()["stages"]]
    for index, name in enumerate(stages):
        assert f"== stage {index + 1} {name} (" in text
        assert f"== stage {name} done: " in text
    # the stage bar: trials done against the budget, the best η so far
    assert re.search(r"stage \w+ .*\d+/\d+", text), text[-3000:]
    assert re.search(r"best η \d\.\d{3} \(trial \d+\)", text)
    # the probe bars: each running probe's step and reward
    probe_lines = re.findall(r"trial \d+ \((?:incumbent|candidate|rerun)\).*step (\d+) · reward (\S+)", text)
    assert probe_lines, text[-3000:]
    assert any(int(step) > 0 for step, _ in probe_lines)
    assert any(re.fullmatch(r"\d\.\d{3}", reward) for _, reward in probe_lines)
    # one line per finished trial, with η and its interval (or the reason)
    finished = re.findall(r"\[(\w+)\] trial (\d+) (\w+) η (\d+\.\d+) \[(\d+\.\d+), (\d+\.\d+)\]", text)
    assert {stage for stage, *_ in finished} == {*stages, "final"}  # the final check's runs too
    for _, _, _, eta, low, high in finished:
        assert float(low) <= float(eta) <= float(high)
    assert "ETA " in text


@pytest.mark.slow
def test_every_trial_of_the_database_has_its_line(demo_dir: Path) -> None:
    import optuna

    text = plain((demo_dir / "transcript.bin").read_bytes())
    storage = f"sqlite:///{demo_dir}/demo.db"
    for stage in demo_data()["stages"]:
        study = optuna.load_study(study_name=f"demo.{stage['name']}", storage=storage)
        for trial in study.get_trials(deepcopy=False):
            if trial.state.is_finished():
                pattern = rf"\[{stage['name']}\] trial {trial.number} \w+ (η|pruned|failed)"
                assert re.search(pattern, text), f"no line for trial {trial.number} of {stage['name']}"


def test_plain_lines_without_a_terminal(tmp_path: Path) -> None:
    """The Console's non-terminal mode: no escape codes, 'started' and 'finished' lines."""
    import io

    import optuna

    from verl_sweep.search.views.console import Console

    out = io.StringIO()
    console = Console(out)
    assert not console.live
    study = optuna.create_study(direction="maximize", study_name="demo.lr")
    trial = study.ask()
    study.tell(trial, 1.2)
    console.trial_started("lr", 0, "candidate", {"actor_rollout_ref.actor.optim.lr": 2e-6})
    console.trial_finished(study, 0, "candidate", {"actor_rollout_ref.actor.optim.lr": 2e-6}, eta=1.2,
                           interval=(1.1, 1.3))
    text = out.getvalue()
    assert "\x1b[" not in text
    assert "[lr] trial 0 started (candidate): lr=2e-06" in text
    assert "[lr] trial 0 candidate η 1.200 [1.100, 1.300]  lr=2e-06 · best so far" in text
    incumbent = study.ask()
    incumbent.set_user_attr("role", "incumbent")
    study.tell(incumbent, 1.5)  # an incumbent run is never "the best"
    console.trial_finished(study, 1, "incumbent", {}, eta=1.5, interval=(1.4, 1.6))
    assert out.getvalue().endswith("[lr] trial 1 incumbent η 1.500 [1.400, 1.600]  = incumbent\n"), out.getvalue()[-300:]



def test_parameter_names_are_as_short_as_tells_them_apart() -> None:
    from verl_sweep.search.views.console import format_params

    assert format_params({}) == "baseline"
    assert format_params({"actor_rollout_ref.actor.optim.lr": 1e-6, "data.seed": 3}) == "lr=1e-06, seed=3"
    # the actor's and the reference model's sequence parallel sizes are both in the systems stage
    assert format_params({
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 4,
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size": 2,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 4,
    }) == "actor.ulysses_sequence_parallel_size=4, ref.ulysses_sequence_parallel_size=2, tensor_model_parallel_size=4"
