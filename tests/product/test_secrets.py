"""No password is ever stored, printed or passed on. A study runs with a
storage URL that holds a password in the study file and in $VERL_SWEEP_STORAGE; every output,
every stored attribute, every file of the run directories and every probe's environment is
then searched for the password."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

from support import cli, write_study
from test_bad_input import _tiny

#: a password with an unencoded '@' (it was masked only up to the first one)
MARKER = "pw-7Qx9@marker"
SECRET_URL = f"postgresql://sweeper:{MARKER}@127.0.0.1:1/sweep"

# The real simulator, after writing the environment it was given into its run directory.
DUMP_ENV_THEN_SIMULATE = (
    "import json, os, runpy, sys; "
    "run_dir = os.path.dirname(os.environ['VERL_SIM_GPU_SAMPLES_PATH']); "
    "open(os.path.join(run_dir, 'env.json'), 'w').write(json.dumps(dict(os.environ))); "
    "runpy.run_module('verl_sweep.launchers.simulator', run_name='__main__', alter_sys=True)"
)


def _dump(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        return "\n".join(conn.iterdump())


def test_no_password_in_any_output_stored_attribute_run_directory_or_probe_environment(tmp_path: Path) -> None:
    data = _tiny()
    data["storage"] = SECRET_URL  # the file's storage; --storage below wins, but the file's is stored
    data["launcher"]["options"]["command"] = [sys.executable, "-c", DUMP_ENV_THEN_SIMULATE]
    path = write_study(tmp_path, data, "tiny.yaml")
    url = f"sqlite:///{tmp_path / 'tiny.db'}"
    env = {"VERL_SWEEP_STORAGE": SECRET_URL}

    outputs = []
    for args in (["validate", str(path)], ["run", str(path), "--storage", url], ["status", "tiny", "--storage", url],
                 ["status", "tiny", "--storage", url, "--json"],
                 *(["export", "tiny", "--storage", url, "--format", f] for f in ("yaml", "overrides", "command", "json")),
                 ["report", "tiny", "--storage", url, "-o", str(tmp_path / "report.html")],
                 ["status", "tiny"],  # through $VERL_SWEEP_STORAGE: unreachable, and said so masked
                 ["status", "tiny", "--storage", SECRET_URL]):
        result = cli(*args, cwd=tmp_path, env=env)
        outputs.append((args, result.returncode, result.stdout + result.stderr))
    codes = {" ".join(args[:2]): code for args, code, _ in outputs}
    assert codes["run " + str(path)] == 0, outputs[1][2][-2000:]
    assert codes["status tiny"] == 2  # the unreachable server, told in one masked line
    for args, _, text in outputs:
        assert MARKER not in text and "7Qx9" not in text, (args, text[-1000:])
    assert "postgresql://sweeper:***@127.0.0.1:1/sweep" in outputs[-1][2]

    stored = _dump(tmp_path / "tiny.db")
    assert "7Qx9" not in stored
    assert "postgresql://sweeper:***@127.0.0.1:1/sweep" in stored  # the stored definition keeps the URL, masked

    run_files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    environments = [p for p in run_files if p.name == "env.json"]
    assert environments, "the probes ran and wrote their environment"
    for probe_env in environments:
        assert "VERL_SWEEP_STORAGE" not in json.loads(probe_env.read_text())
    for file in [*run_files, tmp_path / "report.html"]:
        assert b"7Qx9" not in file.read_bytes(), file


def test_masking_covers_the_whole_password() -> None:
    from verl_sweep.search.database.storage import mask_url

    assert mask_url("postgresql://u:p@ss/w:rd@db:5432/x") == "postgresql://u:***@db:5432/x"
    assert mask_url("postgresql://me@corp:secret@db/x") == "postgresql://me@corp:***@db/x"
    assert mask_url("postgresql+psycopg://u:s@db/x?sslmode=require") == "postgresql+psycopg://u:***@db/x?sslmode=require"
    assert mask_url("postgresql://u@db/x") == "postgresql://u@db/x"
    assert mask_url("sqlite:////tmp/a@b.db") == "sqlite:////tmp/a@b.db"


def test_every_launcher_strips_the_storage_variable_from_probes() -> None:
    """The one place every launcher builds a probe's environment from."""
    from verl_sweep.launchers.base import PRIVATE_ENV, probe_environment

    assert "VERL_SWEEP_STORAGE" in PRIVATE_ENV
    env = probe_environment({"VERL_SWEEP_STORAGE": SECRET_URL, "PATH": "/bin"}, {"A": "1"}, {"VERL_SWEEP_STORAGE": "x"})
    assert env == {"PATH": "/bin", "A": "1"}
