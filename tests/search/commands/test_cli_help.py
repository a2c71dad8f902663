"""Every command's --help reads as help texts do: no `{name}` placeholder left in it."""

from __future__ import annotations

import re

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from verl_sweep.search.commands.cli import app

pytestmark = pytest.mark.fast

COMMANDS = sorted(get_command(app).commands)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_shows_no_placeholder(command: str) -> None:
    result = CliRunner().invoke(app, [*command.split(), "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert not re.search(r"\{\w+\}", result.output), result.output


def test_usage_names_a_required_argument_in_capitals() -> None:
    result = CliRunner().invoke(app, ["status", "--help"], prog_name="verl-sweep", env={"COLUMNS": "80"})
    assert "Usage: verl-sweep status [OPTIONS] NAME" in result.output, result.output
