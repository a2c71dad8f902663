"""Bad input, all of it: each case exits 2 with one clear line, and the database is unchanged."""

from __future__ import annotations

import copy
import hashlib
import re
import sqlite3
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import cli, demo_data, write_study

Change = Callable[[dict[str, Any]], Any]


def _tiny() -> dict[str, Any]:
    data = demo_data()
    data["name"] = "tiny"
    data["probe"] = {"steps": 40, "incumbent_repeats": 1}
    data["stages"] = [{"name": "lr", "space": "lr", "budget": {"max_trials": 2}, "confirm_top": 0,
                       "pruner": {"name": "none"}}]
    return data


@pytest.fixture(scope="module")
def study_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bad")
    path = write_study(directory, _tiny(), "tiny.yaml")
    result = cli("run", str(path), cwd=directory)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return directory / "tiny.db"


def _fingerprint(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        return hashlib.sha256("\n".join(conn.iterdump()).encode()).hexdigest()


def _edit(change: Change) -> dict[str, Any]:
    data = copy.deepcopy(_tiny())
    change(data)
    return data


def _set(path: str, value: Any) -> Change:
    def change(data: dict[str, Any]) -> None:
        node = data
        parts = path.split("/")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return change


# (label, study change, expected message) — each checked with `validate` and with `run`
STUDY_CASES: list[tuple[str, Change, str]] = [
    ("budget wrong type", _set("stages/0/budget/max_trials", "ten"), r"stages\[0\]\.budget\.max_trials: must be an integer, but got 'ten'"),
    ("budget zero", _set("stages/0/budget/max_trials", 0), r"stages\[0\]\.budget\.max_trials: must be ≥ 1, but got 0"),
    ("budget huge", _set("stages/0/budget/max_trials", 10**30), r"stages\[0\]\.budget\.max_trials: must be ≤ 100000"),
    ("infinite wall clock", _set("stages/0/budget/max_wall_clock_s", float("inf")), r"max_wall_clock_s: must be a finite number"),
    ("NaN tolerance", _set("stages/0/stop", {"tolerance": float("nan")}), r"stages\[0\]\.stop\.tolerance: must be a finite number"),
    ("negative seed", _set("seeds", [-1, 2]), r"seeds: seeds must be in \[0, 2\^31\)"),
    ("duplicate seeds", _set("seeds", [3, 3]), r"seeds: seeds must be distinct"),
    ("empty seeds", _set("seeds", []), r"seeds: must not be empty"),
    ("unknown top key", _set("stagez", 1), r"stagez: is not a known field"),
    ("unknown stage key", _set("stages/0/budgte", 1), r"stages\[0\]\.budgte: is not a known field"),
    ("missing model", lambda d: d.pop("model"), r"model: is required"),
    ("missing hidden size", lambda d: d["model"].pop("hidden_size"), r"model: .*needs hidden_size"),
    ("config_json missing file", _set("model", {"config_json": "nope.json", "n_params_b": 7}), r"model\.config_json: .*nope\.json: no such model config\.json"),
    ("algorithm unknown", _set("algorithm", "dpo"), r"algorithm: must be 'grpo' or 'ppo'"),
    ("launcher kind unknown", _set("launcher", {"kind": "slurm"}), r"launcher\.kind: must be 'sim', 'local', 'ray' or 'replay'"),
    ("probe steps 1", _set("probe", {"steps": 1}), r"probe\.steps: must be ≥ 2"),
    ("name traversal", _set("name", "../../etc/passwd"), r"name: must be 1-64 letters"),
    ("name empty", _set("name", ""), r"name: must be 1-64 letters"),
    ("duplicate stage names", lambda d: d["stages"].append(copy.deepcopy(d["stages"][0])), r"stage names must be distinct"),
    ("override key with shell", lambda d: d["baseline"].update({"data.train_files; rm -rf /": 1}), r"baseline: .*override key must be a dotted config path"),
    ("override key with =", lambda d: d["baseline"].update({"a=b": 1}), r"override key must be a dotted config path"),
    ("override value newline", lambda d: d["baseline"].update({"trainer.project_name": "a\nb"}), r"string override must be one short line"),
    ("override value mapping", lambda d: d["baseline"].update({"trainer.project_name": {"a": 1}}), r"override value must be a scalar or a list"),
    ("override value NaN", lambda d: d["baseline"].update({"actor_rollout_ref.actor.optim.lr": float("nan")}), r"override value must be finite"),
    ("unknown space", _set("stages/0/space", "warp"), r"space must be one of"),
    ("lam on grpo", _set("stages/0/space", "lam"), r"λ|lam"),
    ("bound widened", _set("stages/0/params", {"high": 1e-4}), r"must be ≤ 5e-06 .*unsafe: true"),
    ("unknown space option", _set("stages/0/params", {"hgih": 1e-6}), r"hgih"),
    ("multivariate random", _set("stages/0/sampler", {"name": "random", "multivariate": True}),
     r"stages\[0\]\.sampler: multivariate applies to the tpe sampler only"),
    ("budget holds only the incumbent", _set("stages/0/budget/max_trials", 1),
     r"^error: tiny\.yaml: stages\[0\]\.budget\.max_trials: must be more than probe\.incumbent_repeats \(1\), but got 1"),
    # launcher options are checked before a database exists (a stored bad definition could not be fixed)
    ("launcher option misspelled", _set("launcher", {"kind": "sim", "options": {"time_scal": 5}}),
     r"launcher\.options: the sim launcher takes .*time_scale.*, but got 'time_scal'"),
    ("launcher option wrong type", _set("launcher", {"kind": "sim", "options": {"time_scale": "fast"}}),
     r"launcher\.options\.time_scale: must be a number, but got 'fast'"),
    ("landscape misspelled", _set("launcher", {"kind": "sim", "options": {"landscape": "defualt"}}),
     r"launcher\.options\.landscape: landscape must be a file or one of \[.*'default'.*\], but got 'defualt'"),
]

RAW_FILES: list[tuple[str, bytes, str]] = [
    ("python tag", b"name: !!python/object/apply:os.system ['touch /tmp/verl-sweep-pwned']\n", r"not valid YAML at line 1"),
    ("duplicate key", b"name: a\nname: b\n", r"duplicate key 'name'"),
    ("a list", b"- 1\n- 2\n", r"must be a YAML mapping, but got list"),
    ("empty", b"", r"must be a YAML mapping, but got NoneType"),
    ("not utf-8", b"name: \xff\xfe\n", r"a study file must be UTF-8 text, but byte 6 is not \(0xff\)"),
    ("broken yaml", b"name: [unclosed\n", r"not valid YAML"),
]


@pytest.mark.parametrize("label,change,message", STUDY_CASES, ids=[c[0] for c in STUDY_CASES])
def test_bad_study(tmp_path: Path, label: str, change: Change, message: str) -> None:
    path = write_study(tmp_path, _edit(change), "tiny.yaml")
    for command in ("validate", "run"):
        result = cli(command, str(path), cwd=tmp_path)
        assert result.returncode == 2, (command, result.stdout[-1000:], result.stderr[-1000:])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert re.search(message, lines[0]), lines[0]
        assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.db")), "bad input must create no database"


@pytest.mark.parametrize("label,content,message", RAW_FILES, ids=[c[0] for c in RAW_FILES])
def test_bad_file(tmp_path: Path, label: str, content: bytes, message: str) -> None:
    path = tmp_path / "study.yaml"
    path.write_bytes(content)
    result = cli("run", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert re.search(message, result.stderr), result.stderr
    assert not list(tmp_path.glob("*.db"))
    assert not Path("/tmp/verl-sweep-pwned").exists()


def _cli_cases(db: Path) -> list[tuple[str, list[str], str]]:
    url = f"sqlite:///{db}"
    return [
        ("unknown study", ["status", "nosuch", "--storage", url], r"no study named 'nosuch' in this database\. Studies here: tiny"),
        ("resume unknown study", ["resume", "nosuch", "--storage", url], r"no study named 'nosuch'"),
        ("export bad format", ["export", "tiny", "--storage", url, "--format", "toml"], r"--format must be one of yaml, overrides, command, json, but got 'toml'"),
        ("launcher bogus", ["resume", "tiny", "--storage", url, "--launcher", "slurm"], r"launcher kind must be one of local, ray, .*sim, but got 'slurm'"),
        ("storage not a url", ["status", "tiny", "--storage", "tiny.db"], r"--storage must be a database URL"),
        ("storage missing sqlite file", ["status", "tiny", "--storage", "sqlite:////nonexistent/x.db"], r"no study database at /nonexistent/x\.db"),
        ("storage unreachable server", ["status", "tiny", "--storage", "postgresql://u:secret@127.0.0.1:1/db"], r"cannot reach the study database postgresql://u:\*\*\*@127\.0\.0\.1:1/db"),
        ("no storage found", ["status", "nowhere"], r"no database found for study 'nowhere'"),
        ("a stage's study for the study", ["status", "tiny.lr", "--storage", url], r"'tiny\.lr' is the study of stage 'lr'; pass the study's name, 'tiny'"),
        ("worker on sqlite", ["worker", "tiny", "--storage", url], r"worker: needs a PostgreSQL storage, but the study is in SQLite"),
        ("worker before its study", ["worker", "later", "--storage", url], r"no study named 'later' .* Start `verl-sweep run` first, or give workers --wait SECONDS"),
        ("export to .yml", ["export", "tiny", "--storage", url, "-o", "best.yml"], r"Hydra finds a --config-name only in a \.yaml file; use -o best\.yaml"),
        ("sqlite url with three slashes", ["status", "tiny", "--storage", f"sqlite://{db}"], r"an absolute one needs four slashes: sqlite:////"),
    ]


def test_bad_cli_input_leaves_database_unchanged(study_db: Path, tmp_path: Path) -> None:
    before = _fingerprint(study_db)
    for label, args, message in _cli_cases(study_db):
        result = cli(*args, cwd=tmp_path)
        assert result.returncode == 2, (label, result.stdout[-500:], result.stderr[-1000:])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and re.search(message, lines[0]), (label, lines)
        assert "secret" not in result.stderr, "a password must never be printed"
        assert _fingerprint(study_db) == before, f"{label} changed the database"


def test_changed_definition_under_same_name_is_refused(study_db: Path) -> None:
    before = _fingerprint(study_db)
    data = _tiny()
    data["baseline"]["actor_rollout_ref.actor.optim.lr"] = 2e-6
    path = write_study(study_db.parent, data, "tiny-changed.yaml")
    result = cli("run", str(path), "--storage", f"sqlite:///{study_db}", cwd=study_db.parent)
    assert result.returncode == 2
    assert re.search(r"study 'tiny' already exists in this database with a different definition "
                     r"\(baseline\.actor_rollout_ref\.actor\.optim\.lr changed\)", result.stderr), result.stderr
    assert _fingerprint(study_db) == before


def test_run_takes_new_launcher_settings_but_not_a_new_landscape(tmp_path: Path) -> None:
    """More slots or another time scale after a stop: the same study goes on, and resume and
    workers get the new settings; another landscape would mix two experiments: refused."""
    from search.driver import load_spec
    from search.storage import open_storage

    path = write_study(tmp_path, _tiny(), "tiny.yaml")
    assert cli("run", str(path), cwd=tmp_path).returncode == 0
    data = _tiny()
    data["launcher"] = {**data.get("launcher", {}), "max_concurrent": 3,
                        "options": {**data.get("launcher", {}).get("options", {}), "time_scale": 50000}}
    result = cli("run", str(write_study(tmp_path, data, "tiny.yaml")), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-1000:]
    assert "study tiny: took launcher.max_concurrent, launcher.options.time_scale from the file" in result.stdout
    stored = load_spec(open_storage(f"sqlite:///{tmp_path}/tiny.db", create=False), "tiny")
    assert stored.launcher.max_concurrent == 3 and stored.launcher.options["time_scale"] == 50000

    before = _fingerprint(tmp_path / "tiny.db")
    data["launcher"]["options"]["landscape"] = "kl_edge"
    result = cli("run", str(write_study(tmp_path, data, "tiny.yaml")), cwd=tmp_path)
    assert result.returncode == 2
    assert re.search(r"different definition \(launcher\.options\.landscape changed\)", result.stderr), result.stderr
    assert _fingerprint(tmp_path / "tiny.db") == before


def test_a_baseline_every_run_of_which_fails_stops_the_study_and_names_the_cause(tmp_path: Path) -> None:
    """Not a finished study with the untested baseline as its winner: exit 1, the cause named.
    (A key verl does not know is refused by `run` before anything is stored, so here every
    probe fails the way verl fails on one: a probe command that prints verl's error.)"""
    import sys

    data = _tiny()
    fail = "import sys; print(\"Key 'no_such_knob' is not in struct\", file=sys.stderr); sys.exit(1)"
    data["launcher"]["options"]["command"] = [sys.executable, "-c", fail]
    path = write_study(tmp_path, data, "tiny.yaml")
    result = cli("run", str(path), cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-1000:] + result.stderr[-1000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.search(r"every run of the stage's incumbent failed \(config_error: Key "
                                          r"'no_such_knob' is not in struct\)", errors[0]), errors
    assert "finished" not in result.stdout
    export = cli("export", "tiny", cwd=tmp_path)
    assert export.returncode == 2 and "no finished stage" in export.stderr


def test_the_printed_next_step_works_from_another_directory(tmp_path: Path) -> None:
    path = write_study(tmp_path, _tiny(), "tiny.yaml")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = cli("run", str(path), cwd=elsewhere)
    assert result.returncode == 0, result.stderr[-2000:]
    hint = next(line for line in result.stdout.splitlines() if line.startswith("Export the winner: "))
    assert f"--storage sqlite:///{tmp_path / 'tiny.db'}" in hint, hint
    command = hint.removeprefix("Export the winner: verl-sweep ").split()
    exported = cli(*command, cwd=elsewhere)
    assert exported.returncode == 0 and (elsewhere / "best.yaml").exists(), exported.stderr


def test_a_worker_with_wait_joins_a_study_created_after_it_started(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    from search.driver import save_spec
    from search.storage import open_storage
    from search.study_file import parse_study

    url = f"sqlite:///{tmp_path}/later.db"
    storage = open_storage(url)
    worker = subprocess.Popen([sys.executable, "-m", "search.cli", "worker", "tiny", "--storage", url, "--wait", "60"],
                              stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    assert worker.poll() is None, worker.communicate()[1]  # still waiting for the study
    save_spec(storage, parse_study(_tiny()))
    _, err = worker.communicate(timeout=60)
    # It found the study: what stops it now is the next check (workers need PostgreSQL).
    assert worker.returncode == 2 and "needs a PostgreSQL storage" in err, err


def test_override_values_cannot_smuggle_keys_or_shell(tmp_path: Path) -> None:
    """Values are quoted for Hydra and passed as argv items: no extra key, no shell."""
    from spaces.overrides import parse_override, to_overrides

    hostile = "x,+trainer.evil=1; touch /tmp/verl-sweep-pwned2 $(id) `id`"
    [item] = to_overrides({"trainer.project_name": hostile})
    assert parse_override(item) == ("trainer.project_name", hostile)
    data = _tiny()
    data["baseline"]["trainer.project_name"] = hostile
    path = write_study(tmp_path, data, "tiny.yaml")
    result = cli("run", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not Path("/tmp/verl-sweep-pwned2").exists()
    spec = (tmp_path / "runs" / "tiny" / "tiny.lr.t0000" / "spec.json").read_text()
    assert "trainer.evil" not in spec.replace("'" + hostile.replace("'", "\\'") + "'", "")


def test_validate_unsafe_study_one_line_per_problem(tmp_path: Path) -> None:
    data = demo_data()
    data["baseline"]["actor_rollout_ref.actor.optim.lr"] = 1e-4          # baseline outside the safe range
    data["baseline"]["actor_rollout_ref.rollout.max_num_batched_tokens"] = 500_000  # above the memory bound
    data["stages"] = [
        {"name": "kl", "space": "kl", "params": {"high": 0.05}, "budget": {"max_trials": 3}},  # widened, no unsafe
        {"name": "lam", "space": "lam", "budget": {"max_trials": 3}},                          # λ on GRPO
    ]
    path = write_study(tmp_path, data, "unsafe.yaml")
    result = cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 4, errors
    for pattern in (r"optim\.lr: must be within the safe bound", r"max_num_batched_tokens: must be ≤ the memory bound",
                    r"stages\[0\]\.high: must be ≤ 0\.01 .*unsafe: true", r"stages\[1\]: λ only matters with GAE"):
        assert any(re.search(pattern, line) for line in errors), pattern
    assert not list(tmp_path.glob("*.db"))


def test_a_mistyped_study_name_gets_the_closest_names_not_a_wall_of_them() -> None:
    from search.driver import _known_studies_hint

    assert _known_studies_hint("x", []) == " This database has no studies."
    assert _known_studies_hint("tinny", ["demo", "tiny"]) == " Did you mean 'tiny'? Studies here: demo, tiny."
    many = [f"sweep{i:03d}" for i in range(480)]
    hint = _known_studies_hint("sweep1000", many)
    assert hint.startswith(" Did you mean 'sweep100'") and "480 studies here, e.g. sweep000," in hint
    assert len(hint) < 300


def test_the_budget_of_a_finished_stage_cannot_change(study_db: Path) -> None:
    before = _fingerprint(study_db)
    data = _tiny()
    data["stages"][0]["budget"]["max_trials"] = 4
    path = write_study(study_db.parent, data, "tiny-more.yaml")
    result = cli("run", str(path), "--storage", f"sqlite:///{study_db}", cwd=study_db.parent)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and re.search(r"study 'tiny': the budget of a finished stage cannot change \(changed: lr;",
                                         lines[0]), lines
    assert _fingerprint(study_db) == before


def test_the_budget_of_a_stage_not_finished_is_taken_from_the_file(tmp_path: Path) -> None:
    """Stopped before a stage finished (here: before any ran), the study goes on with the new
    budget: the stage runs as many trials as the file now says."""
    import optuna

    from search.driver import save_spec
    from search.storage import open_storage
    from search.study_file import parse_study

    save_spec(open_storage(f"sqlite:///{tmp_path}/tiny.db"), parse_study(_tiny()))
    data = _tiny()
    data["stages"][0]["budget"]["max_trials"] = 3
    result = cli("run", str(write_study(tmp_path, data, "tiny.yaml")), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-1000:]
    assert "study tiny: took stages[0].budget.max_trials from the file" in result.stdout
    trials = optuna.load_study(study_name="tiny.lr", storage=f"sqlite:///{tmp_path}/tiny.db").trials
    assert len(trials) == 3, [(t.number, t.state.name) for t in trials]
