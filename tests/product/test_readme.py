"""The README's examples run as written: every bash block it shows is run here, or by the test
named beside it (the install block by tests/product/test_install.py, which resolves each line)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import REPO

README = (REPO / "README.md").read_text()


def _block_after(heading: str) -> list[str]:
    section = README.split(heading, 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block after {heading!r}"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def _sections_with_bash_blocks() -> list[str]:
    """Each ``## `` heading whose section shows a bash block."""
    sections = re.split(r"^(## .*)$", README, flags=re.M)
    return [sections[i] for i in range(1, len(sections), 2) if "```bash" in sections[i + 1]]


#: each README section with a bash block, and the test that runs it
EXERCISED = {
    "## Install into your verl environment": "tests/product/test_install.py::test_the_readmes_install_lines_change_nothing_installed",
    "## The two commands": "test_the_two_commands_are_documented (demo.sh runs the quickstart's commands; .ci/run runs scripts/test.sh)",
    "## Quickstart": "test_quickstart_runs_as_written",
    "## Train mode: the study is the run": "test_train_mode_runs_as_written",
    "## From your verl command": "test_from_your_verl_command_runs_as_written",
    "## On a cluster": "test_the_cluster_commands_parse (their behaviour: tests/product/test_workers.py on PostgreSQL)",
}


def test_every_bash_block_is_exercised() -> None:
    assert _sections_with_bash_blocks() == list(EXERCISED), "a README section with commands has no test: add it to EXERCISED"


def test_readme_is_short_and_undated() -> None:
    """Read in five minutes: no dated runs, no issue numbers, no device leases."""
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md must stay within 250 lines, but has {len(lines)}. Move detail to docs/."
    months = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
    for pattern in (rf"\b{months}[a-z]* \d{{1,2}}\b", r"\b20\d\d-\d\d-\d\d\b", r"\b[Ii]ssue \d+", r"#\d+\b", r"\blease\b"):
        found = re.findall(pattern, README)
        assert not found, f"README.md must hold no dated runs or history, but has {found}. Put it in CHANGELOG.md or docs/."


def test_the_two_commands_are_documented() -> None:
    commands = _block_after("## The two commands")
    assert commands == ["bash scripts/demo.sh"]
    assert "bash scripts/test.sh" in README
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci, ".ci/run must call the README's test command"
    # the demo is the quickstart's commands (test_quickstart_runs_as_written runs them)
    demo = [line for line in (REPO / "scripts" / "demo.sh").read_text().splitlines() if line.startswith(".venv/bin/verl-sweep ")]
    quickstart = [line.split("  #")[0].strip() for line in _block_after("## Quickstart")]
    assert demo and all(line in quickstart for line in demo), (demo, quickstart)
    # the inner loop: the fast tier, which scripts/test.sh runs too (pytest collects tests/ whole)
    assert "-m pytest -q -p no:cacheprovider -m fast" in README and '"fast or newest"' in (REPO / "scripts" / "test.sh").read_text()


#: the demo's stage budgets for the quickstart's `run`: every stage and the final check as the
#: demo has them, a few probes each (its 124 probes took ~140 s). `validate` checks the file as
#: shipped; the demo's own budgets run whole in tests/search/method/test_study_outcomes.py.
QUICKSTART_BUDGETS = {"systems": 8, "tokens": 4, "minibatch": 3, "kl": 3, "lr": 3, "polish": 4}
#: the simulator's pace for the quickstart's `run`: 3x the demo's, a 500-step probe ~1 s instead
#: of ~3 s (the commands and what they leave do not depend on it; a probe counts as hung only
#: after 10 real seconds without metrics)
QUICKSTART_TIME_SCALE = 60000


def _cut_demo_budgets(study: Path, time_scale: float | None = None) -> None:
    data = yaml.safe_load(study.read_text())
    assert [s["name"] for s in data["stages"]] == list(QUICKSTART_BUDGETS), "the demo's stages changed: update QUICKSTART_BUDGETS"
    for stage in data["stages"]:
        stage["budget"] = {"max_trials": QUICKSTART_BUDGETS[stage["name"]]}
    if time_scale is not None:
        assert data["launcher"]["kind"] == "sim", data["launcher"]
        data["launcher"]["options"]["time_scale"] = time_scale
    study.write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.mark.slow
def test_quickstart_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "studies").mkdir()
    shutil.copy(REPO / "studies" / "demo.yaml", tmp_path / "studies" / "demo.yaml")
    for name in (".venv", "scripts", "pyproject.toml"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    for line in _block_after("## Quickstart"):
        if line.startswith("bash scripts/setup.sh"):
            continue  # the suite already runs inside the environment it sets up
        if line.startswith(".venv/bin/verl-sweep run "):
            # after `validate` read it as shipped
            _cut_demo_budgets(tmp_path / "studies" / "demo.yaml", QUICKSTART_TIME_SCALE)
        result = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True,
                                timeout=600, env=env)
        assert result.returncode == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
    best = (tmp_path / "out" / "best.yaml").read_text()
    assert "defaults:" in best and "ppo_trainer" in best
    # "Then train with the winner": main_ppo's --config-path/--config-name, composed by verl's Hydra as
    # main_ppo composes it before it trains (training itself needs GPUs; the H200 device run did it)
    (train,) = _block_after("Then train with the winner")
    args = shlex.split(train)
    assert args[:3] == ["python", "-m", "verl.trainer.main_ppo"], train
    config_path, config_name = args[args.index("--config-path") + 1], args[args.index("--config-name") + 1]
    code = ("from hydra import compose, initialize_config_dir\n"
            f"with initialize_config_dir(config_dir={str(tmp_path / config_path)!r}, version_base=None):\n"
            f"    cfg = compose(config_name={config_name!r})\n"
            "print(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)")
    composed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert composed.returncode == 0 and composed.stdout.strip().isdigit(), composed.stderr[-2000:]


@pytest.mark.slow
def test_train_mode_runs_as_written(tmp_path: Path) -> None:
    """The train-mode block: run, status and export of studies/demo-train.yaml (its stage budgets
    cut as the quickstart's): the export writes the config and the schedule beside it, whose
    model is the checkpoint the continuation left at the run's end."""
    (tmp_path / "studies").mkdir()
    shutil.copy(REPO / "studies" / "demo-train.yaml", tmp_path / "studies" / "demo-train.yaml")
    _cut_demo_budgets(tmp_path / "studies" / "demo-train.yaml")
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    commands = _block_after("## Train mode: the study is the run")
    assert len(commands) == 3 and all(c.startswith(".venv/bin/verl-sweep ") for c in commands)
    for line in commands:
        result = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
    schedule = yaml.safe_load((tmp_path / "out" / "best.schedule.yaml").read_text())
    assert schedule["trained"] and Path(schedule["model"]).is_dir(), schedule
    assert schedule["model_step"] == schedule["run_steps"] and "defaults:" in (tmp_path / "out" / "best.yaml").read_text()


def test_from_your_verl_command_runs_as_written(tmp_path: Path) -> None:
    """The "From your verl command" block: init from one of verl's own scripts and from a
    command line (the model's config.json from a local Hugging Face cache), then validate."""
    hub = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "0"
    hub.mkdir(parents=True)
    shutil.copy(REPO / "tests" / "data" / "model-configs" / "Qwen--Qwen3-8B.json", hub / "config.json")
    for name in (".venv", "tests"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    commands = _block_after("## From your verl command")
    assert len(commands) == 3 and all(c.startswith(".venv/bin/verl-sweep ") for c in commands)
    for line in commands:
        result = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
        assert re.search(r"ESTIMATE [\d,]+-[\d,]+ GPU-hours", result.stdout), result.stdout[-2000:]
    assert (tmp_path / "studies" / "qwen3-8b.yaml").is_file() and (tmp_path / "studies" / "mine.yaml").is_file()


def test_the_cluster_commands_parse() -> None:
    """The "On a cluster" block: the storage URL is one verl-sweep accepts, and each command's
    arguments parse with the real CLI (running them needs a PostgreSQL server and GPUs:
    tests/product/test_workers.py runs `run` and `worker` on one study in PostgreSQL)."""
    from typer.main import get_command

    from verl_sweep.search.commands.cli import app
    from verl_sweep.search.database.storage import check_url

    commands = get_command(app).commands  # type: ignore[attr-defined]
    lines = _block_after("## On a cluster")
    assert [line.split()[0] for line in lines] == ["export", "verl-sweep", "verl-sweep"], lines
    variable, url = lines[0].removeprefix("export ").split("=", 1)
    assert variable == "VERL_SWEEP_STORAGE" and check_url(url), url
    for line in lines[1:]:
        name, *args = shlex.split(line)[1:]
        commands[name].make_context(name, args)  # raises on an unknown option or a missing argument
