"""The README's examples run as written: the quickstart block, line by line, in a scratch copy."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

README = (REPO / "README.md").read_text()


def _block_after(heading: str) -> list[str]:
    section = README.split(heading, 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block after {heading!r}"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_the_two_commands_are_documented() -> None:
    commands = _block_after("## The two commands")
    assert commands == ["bash scripts/demo.sh"]
    assert "bash scripts/test.sh" in README
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci, ".ci/run must call the README's test command"
    # the inner loop: the fast tier, which scripts/test.sh runs too (pytest collects tests/ whole)
    assert "-m pytest -q -p no:cacheprovider tests/unit" in README and (REPO / "tests" / "unit").is_dir()


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
        result = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True,
                                timeout=600, env=env)
        assert result.returncode == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
    best = (tmp_path / "out" / "best.yaml").read_text()
    assert "defaults:" in best and "ppo_trainer" in best


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
