"""Bad input, all of it: each case exits 2 with one clear line, and the database is unchanged."""

from __future__ import annotations

import copy
import hashlib
import os
import re
import sqlite3
from pathlib import Path
from typing import Any, Callable

import pytest

from support import cli, demo_data, write_study

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
    ("override value mapping where verl has a number", lambda d: d["baseline"].update({"actor_rollout_ref.actor.optim.lr": {"a": 1}}), r"optim\.lr=\{'a': 1\}: must be a number"),
    ("override value mapping where verl has a string", lambda d: d["baseline"].update({"actor_rollout_ref.model.path": {}}),
     r"model\.path: must be a single value \(verl's default is '.*'\), but got \{\}"),
    ("override mapping with a bad key", lambda d: d["baseline"].update({"+actor_rollout_ref.rollout.engine_kwargs.vllm": {"a$b": 1}}), r"a mapping's keys must be names"),
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


@pytest.mark.parametrize("change,message", [
    (_set("stages/0/space", "warp"), r"space must be one of"),
    (_set("baseline/actor_rollout_ref.actor.optim.lrr", 1e-6), r"verl has no key 'lrr'.*did you mean `lr`"),
], ids=["the study's own problem", "a key verl lacks"])
def test_a_refusal_before_verls_own_checks_imports_no_verl(tmp_path: Path, change: Change, message: str) -> None:
    """Which keys verl has is read from its config files with Hydra alone: a study refused
    before verl's validation runs answers without importing verl (torch and tensordict, ~5 s)."""
    import subprocess
    import sys

    path = write_study(tmp_path, _edit(change), "tiny.yaml")
    code = ("import sys\nfrom verl_sweep.search.commands.cli import main\n"
            f"sys.argv = ['verl-sweep', 'validate', {str(path)!r}]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    print('exit', e.code)\n"
            "print('verl imported:', 'verl' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "exit 2" in result.stdout, result.stdout + result.stderr[-2000:]
    assert re.search(message, result.stderr), result.stderr[-2000:]
    assert "verl imported: False" in result.stdout, result.stdout


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


def test_the_name_clash_is_found_before_verls_checks(study_db: Path) -> None:
    """One cause, one error, the cheap one first: a changed definition under a stored name is
    refused before verl's compose (which would otherwise take seconds and name a typo)."""
    data = _tiny()
    data["baseline"]["actor_rollout_ref.actor.ppo_mini_batch_sizee"] = 16  # what verl would refuse
    path = write_study(study_db.parent, data, "tiny-clash.yaml")
    result = cli("run", str(path), "--storage", f"sqlite:///{study_db}", cwd=study_db.parent)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "already exists in this database with a different definition" in lines[0], lines


def test_run_takes_new_launcher_settings_but_not_a_new_landscape(tmp_path: Path) -> None:
    """More slots or another time scale after a stop: the same study goes on, and resume and
    workers get the new settings; another landscape would mix two experiments: refused."""
    from verl_sweep.search.engine.driver import load_spec
    from verl_sweep.search.database.storage import open_storage

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

    from verl_sweep.search.engine.driver import save_spec
    from verl_sweep.search.database.storage import open_storage
    from verl_sweep.search.spec.study_file import parse_study

    url = f"sqlite:///{tmp_path}/later.db"
    storage = open_storage(url)
    worker = subprocess.Popen([sys.executable, "-m", "verl_sweep.search.commands.cli", "worker", "tiny", "--storage", url, "--wait", "60"],
                              stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    assert worker.poll() is None, worker.communicate()[1]  # still waiting for the study
    save_spec(storage, parse_study(_tiny()))
    _, err = worker.communicate(timeout=60)
    # It found the study: what stops it now is the next check (workers need PostgreSQL).
    assert worker.returncode == 2 and "needs a PostgreSQL storage" in err, err


def test_override_values_cannot_smuggle_keys_or_shell(tmp_path: Path) -> None:
    """Values are quoted for Hydra and passed as argv items: no extra key, no shell."""
    from verl_sweep.verl_knowledge.overrides import parse_override, to_overrides

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
    """A baseline outside the safe bounds is accepted with one warning line per value (the search
    spans the safe range and the baseline); what the stages would do wrong is an error each."""
    data = demo_data()
    data["baseline"]["actor_rollout_ref.actor.optim.lr"] = 1e-4          # baseline outside the safe range
    data["baseline"]["actor_rollout_ref.rollout.max_num_batched_tokens"] = 5_000_000  # above the memory bound
    data["stages"] = [
        {"name": "kl", "space": "kl", "params": {"high": 0.05}, "budget": {"max_trials": 3}},  # widened, no unsafe
        {"name": "lam", "space": "lam", "budget": {"max_trials": 3}},                          # λ on GRPO
    ]
    path = write_study(tmp_path, data, "unsafe.yaml")
    result = cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, errors
    for pattern in (r"stages\[0\]\.high: must be ≤ 0\.01 .*unsafe: true", r"stages\[1\]: λ only matters with GAE"):
        assert any(re.search(pattern, line) for line in errors), pattern
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: ")]
    assert any(re.search(r"optim\.lr=0\.0001 lies outside the safe bound .*the search spans the safe range and the "
                         r"baseline, \[5e-07, 0\.0001\]", line) for line in warnings), warnings
    assert any(re.search(r"max_num_batched_tokens=5,000,000 is above the memory bound", line) for line in warnings), warnings
    assert not list(tmp_path.glob("*.db"))


def test_a_baseline_outside_the_safe_bounds_is_searched_with_the_baseline(tmp_path: Path) -> None:
    data = demo_data()
    data["baseline"]["actor_rollout_ref.actor.optim.lr"] = 1e-5
    data["stages"] = [{"name": "lr", "space": "lr", "budget": {"max_trials": 4}}]
    path = write_study(tmp_path, data, "wide.yaml")
    result = cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"lr ∈ \[5e-07, 1e-05\] \(log\) — the method's lr range 5e-7 - 5e-6; widened to the base config's "
                     r"1e-05", result.stdout)


def test_a_mistyped_study_name_gets_the_closest_names_not_a_wall_of_them() -> None:
    from verl_sweep.search.database.study_root import _known_studies_hint

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

    from verl_sweep.search.engine.driver import save_spec
    from verl_sweep.search.database.storage import open_storage
    from verl_sweep.search.spec.study_file import parse_study

    save_spec(open_storage(f"sqlite:///{tmp_path}/tiny.db"), parse_study(_tiny()))
    data = _tiny()
    data["stages"][0]["budget"]["max_trials"] = 3
    result = cli("run", str(write_study(tmp_path, data, "tiny.yaml")), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-1000:]
    assert "study tiny: took stages[0].budget.max_trials from the file" in result.stdout
    trials = optuna.load_study(study_name="tiny.lr", storage=f"sqlite:///{tmp_path}/tiny.db").trials
    assert len(trials) == 3, [(t.number, t.state.name) for t in trials]


# -- every bad input, hostile file and broken environment ----------------------------------------
# Each case: exit 2, exactly one line on stderr, no traceback, and no database created (or the
# database it names unchanged). The classes follow the issue: files that are not what they
# seem (1), numbers and types (2), what verl would refuse (3), storage (4), output paths and
# environment (5), secrets (6), flags against the file (7), values verl would interpret (8).


def _one_line(result: Any, message: str, *, code: int = 2) -> str:
    assert result.returncode == code, (result.returncode, result.stdout[-800:], result.stderr[-1500:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in result.stderr
    assert re.search(message, lines[0]), lines[0]
    return lines[0]


def _needs_verl() -> None:
    from verl_sweep.verl_knowledge import verl_check

    if not verl_check.verl_available():
        pytest.skip("needs verl")


NUMBER_CASES: list[tuple[str, Change, str]] = [
    # class 2: YAML types its values; `true` is no integer, .inf no time scale
    ("bool concurrency", _set("launcher/max_concurrent", True), r"launcher\.max_concurrent: must be an integer, but got True"),
    ("bool seed", _set("seeds", [True, 2]), r"seeds\[0\]: must be an integer, but got True"),
    ("bool repeats", _set("probe/incumbent_repeats", True), r"probe\.incumbent_repeats: must be an integer, but got True"),
    ("float trials", _set("stages/0/budget/max_trials", 2.5), r"max_trials: must be an integer, but got 2\.5"),
    ("non-numeric lr", lambda d: d["baseline"].update({"actor_rollout_ref.actor.optim.lr": "abc"}),
     r"baseline: actor_rollout_ref\.actor\.optim\.lr='abc': must be a number"),
    ("wrong-kind micro-batch", lambda d: d["baseline"].update({"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": []}),
     r"baseline: actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu=\[\]: must be an integer"),
    ("string GPUs", _set("hardware/gpus_per_node", "8"), r"hardware\.gpus_per_node: must be an integer, but got '8'"),
    ("bool memory", _set("hardware/gpu_memory_gb", True), r"hardware\.gpu_memory_gb: must be a number, but got True"),
    ("infinite time scale", lambda d: d["launcher"]["options"].update(time_scale=float("inf")),
     r"launcher\.options: time_scale: must be a finite number, but got inf"),
    ("NaN deep in a space option", _set("stages/0/params", {"choices": [1e-6, float("nan")]}), r"stages\[0\]\.params: choices: must be a finite number"),
    ("huge time scale", lambda d: d["launcher"]["options"].update(time_scale=10**400), r"time_scale: must fit in 64 bits"),
    ("huge space bound", _set("stages/0/params", {"high": 10**400}), r"stages\[0\]\.params: high: must fit in 64 bits"),
    ("mini-batch 2^62", lambda d: (d["baseline"].update({"actor_rollout_ref.actor.ppo_mini_batch_size": 2**62,
                                                          "data.train_batch_size": 2**62}),
                                   d["stages"][0].update(space="mini_batch")),
     r"ppo_mini_batch_size must be ≤ 1,048,576, but got 4611686018427387904"),
    ("warm-up as long as the probe", _set("probe", {"steps": 40, "warmup_steps": 40, "incumbent_repeats": 1}),
     r"probe\.warmup_steps: must be < probe\.steps \(40\), but got 40"),
    ("speed warm-up too long", _set("probe", {"steps": 40, "speed_steps": 5, "speed_warmup_steps": 9, "incumbent_repeats": 1}),
     r"probe\.speed_warmup_steps: must be < probe\.speed_steps \(5\)"),
    ("stage probes inside the warm-up", lambda d: (d["probe"].update(warmup_steps=20), d["stages"][0].update(probe_steps=10)),
     r"stages\[0\]\.probe_steps: a probe of stage \w+ must score at least 10 steps after its warm-up \(20\), "
     r"but 10 steps leave 0"),
    ("probes too short to score", _set("probe", {"steps": 8, "warmup_steps": 1, "incumbent_repeats": 1}),
     r"probe\.steps: a probe of stage \w+ must score at least 10 steps after its warm-up \(1\), but 8 steps leave 7\. "
     r"Raise it to at least 11"),
    # class 7: an option the kind does not take is named with the ones it does take
    ("option of another kind", lambda d: d["launcher"]["options"].update(gpu_ids=[0, 1]),
     r"launcher\.options: the sim launcher takes .*landscape.*time_scale, but got 'gpu_ids'"),
    ("option of the wrong type", lambda d: d["launcher"]["options"].update(gpus_per_probe=True),
     r"launcher\.options\.gpus_per_probe: must be an integer, but got True"),
    ("ray without address", _set("launcher", {"kind": "ray", "max_concurrent": 1}),
     r"launcher\.options: the ray launcher needs address"),
    # class 8: an interpolation would be resolved by verl's OmegaConf, not by the simulator
    ("interpolation", lambda d: d["baseline"].update({"trainer.project_name": "${oc.env:HOME}"}),
     r"baseline: trainer\.project_name: string override must not contain '\$\{' .*Write the value itself"),
    # class 4/6: the file's storage is checked before anything is created, the password never shown
    ("postgres scheme", _set("storage", "postgres://u:hunter2@db/x"), r"must start with postgresql://, but got 'postgres://u:\*\*\*@db/x'"),
    ("http storage", _set("storage", "http://db.example/x"), r"must start with sqlite:/// or postgresql://"),
    ("in-memory storage", _set("storage", "sqlite://"), r"is in memory: nothing could resume the study"),
    ("relative sqlite with two slashes", _set("storage", "sqlite://tiny.db"), r"has a host after sqlite://"),
    ("password in a sqlite url", _set("storage", "sqlite://u:hunter2@/tiny.db"), r"has a user or password after sqlite://"),
]


@pytest.mark.parametrize("label,change,message", NUMBER_CASES, ids=[c[0] for c in NUMBER_CASES])
def test_bad_values_are_refused_by_validate_and_run(tmp_path: Path, label: str, change: Change, message: str) -> None:
    path = write_study(tmp_path, _edit(change), "tiny.yaml")
    for command in ("validate", "run"):
        line = _one_line(cli(command, str(path), cwd=tmp_path), message)
        assert "hunter2" not in line
    assert not list(tmp_path.rglob("*.db")) and not (tmp_path / "runs").exists()


VERL_CASES: list[tuple[str, Change, str]] = [
    # class 3: what verl refuses is refused by run before it stores anything, as by validate
    ("typo'd key", lambda d: d["baseline"].update({"actor_rollout_ref.actor.ppo_mini_batch_sizee": 256}),
     r"baseline: verl rejects the config: actor_rollout_ref\.actor\.ppo_mini_batch_sizee: verl has no key "
     r"'ppo_mini_batch_sizee' under actor_rollout_ref\.actor; did you mean `ppo_mini_batch_size`\?"),
    ("+key on a key verl has", lambda d: d["baseline"].update({"+actor_rollout_ref.actor.ppo_epochs": 2}),
     r"\+actor_rollout_ref\.actor\.ppo_epochs: the \+ adds a key, but verl already has"),
    ("a YAML 1e-6 where verl has a boolean", lambda d: d["baseline"].update({"actor_rollout_ref.actor.use_kl_loss": "1e-6"}),
     r"use_kl_loss=1e-06: must be true or false"),
    # (lr, use_kl_loss and the other keys verl-sweep's own rules compute with are checked
    # before verl: see NUMBER_CASES; verl's defaults give every other key its kind)
    ("non-numeric clip ratio", lambda d: d["baseline"].update({"actor_rollout_ref.actor.clip_ratio": "abc"}),
     r"baseline: verl rejects the config: actor_rollout_ref\.actor\.clip_ratio: must be a number \(verl's default is 0\.2\), but got 'abc'"),
    ("string where verl has a boolean", lambda d: d["baseline"].update({"actor_rollout_ref.actor.use_torch_compile": "yes"}),
     r"actor_rollout_ref\.actor\.use_torch_compile: must be true or false \(verl's default is True\), but got 'yes'"),
]


@pytest.mark.parametrize("label,change,message", VERL_CASES, ids=[c[0] for c in VERL_CASES])
def test_what_verl_refuses_is_never_stored(tmp_path: Path, label: str, change: Change, message: str) -> None:
    _needs_verl()
    path = write_study(tmp_path, _edit(change), "tiny.yaml")
    for command in ("validate", "run"):
        _one_line(cli(command, str(path), cwd=tmp_path), message)
    assert not list(tmp_path.rglob("*.db")) and not (tmp_path / "runs").exists()


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(8))

#: (label, writes the hostile study file and returns its path, message); class 1
HOSTILE_FILES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("FIFO", lambda d: _fifo(d / "study.yaml"), r"a study file must be a regular file, but it is a FIFO"),
    ("/dev/zero", lambda d: Path("/dev/zero"), r"/dev/zero: a study file must be a regular file, but it is a character device"),
    ("directory", lambda d: d, r"a study file must be a regular file, but it is a directory"),
    ("over 1 MB", lambda d: _write(d / "study.yaml", b"#" * 1_000_001), r"a study file must be at most 1,000,000 bytes"),
    ("nested 5000 deep", lambda d: _write(d / "study.yaml", b"name: " + b"[" * 5000 + b"]" * 5000),
     r"must be plain YAML, but it is nested (more than 32 levels|too) deep"),
    ("nested 40 deep", lambda d: _write(d / "study.yaml", b"baseline: {a.b: " + b"[" * 40 + b"]" * 40 + b"}"),
     r"must be plain YAML, but it is nested more than 32 levels deep"),
    ("alias bomb", lambda d: _write(d / "study.yaml", BILLION_LAUGHS.encode()), r"expands to more than 200,000 values"),
    ("alias inside itself", lambda d: _write(d / "study.yaml", b"name: &x [*x]\n"), r"an alias refers to a value that contains it"),
    ("binary", lambda d: _write(d / "study.yaml", bytes(range(256)) * 4), r"(must be UTF-8 text|not valid YAML)"),
    ("control characters", lambda d: _write(d / "study.yaml", b"name: a\x00b\n"), r"not valid YAML"),
    ("unhashable key", lambda d: _write(d / "study.yaml", b"? [1]\n: x\n"), r"not valid YAML.*unhashable"),
    ("impossible date", lambda d: _write(d / "study.yaml", b"name: 2026-13-45\n"), r"not valid YAML: month must be in 1\.\.12"),
]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("label,make,message", HOSTILE_FILES, ids=[c[0] for c in HOSTILE_FILES])
def test_hostile_study_files(tmp_path: Path, label: str, make: Callable[[Path], Path], message: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    path = make(work)
    for command in ("validate", "run"):
        _one_line(cli(command, str(path), cwd=work, timeout=60), message)
    assert not list(work.rglob("*.db")) and not (work / "runs").exists()


def _study_with(directory: Path, change: Change) -> Path:
    return write_study(directory, _edit(change), "tiny.yaml")


def _model_json(directory: Path, content: bytes) -> Change:
    (directory / "config.json").write_bytes(content)
    return _set("model", {"config_json": "config.json", "n_params_b": 7})


def _landscape(directory: Path, content: bytes | None) -> Change:
    path = directory / "world.yaml"
    if content is None:
        _fifo(path)
    else:
        path.write_bytes(content)
    return lambda d: d["launcher"]["options"].update(landscape=str(path))


#: files a study names: model.config_json (class 1-2) and a simulator landscape (class 1)
NAMED_FILES: list[tuple[str, Callable[[Path], Change], str]] = [
    ("config.json is /dev/zero", lambda d: _set("model", {"config_json": "/dev/zero", "n_params_b": 7}),
     r"model\.config_json: /dev/zero: a model config\.json must be a regular file, but it is a character device"),
    ("config.json is a FIFO", lambda d: (_fifo(d / "config.json"), _set("model", {"config_json": "config.json", "n_params_b": 7}))[1],
     r"model\.config_json: .*config\.json: a model config\.json must be a regular file, but it is a FIFO"),
    ("config.json hidden size a string", lambda d: _model_json(d, b'{"hidden_size": "abc", "num_attention_heads": 32}'),
     r"model\.hidden_size: must be an integer, but got 'abc' \(read from model\.config_json\)"),
    ("config.json hidden size a fraction", lambda d: _model_json(d, b'{"hidden_size": 4096.5, "num_attention_heads": 32}'),
     r"model\.hidden_size: must be an integer, but got 4096\.5 \(read from model\.config_json\)"),
    ("config.json heads a boolean", lambda d: _model_json(d, b'{"hidden_size": 4096, "num_attention_heads": true}'),
     r"model\.num_attention_heads: must be an integer, but got True \(read from model\.config_json\)"),
    ("config.json NaN", lambda d: _model_json(d, b'{"hidden_size": NaN, "num_attention_heads": 32}'),
     r"model\.config_json: .*not valid JSON: NaN is not a JSON number"),
    ("config.json a list", lambda d: _model_json(d, b"[1, 2]"), r"model\.config_json: .* must hold a JSON object, but got list"),
    ("config.json nested", lambda d: _model_json(d, b"[" * 100000 + b"]" * 100000), r"model\.config_json: .*nested"),
    ("landscape FIFO", lambda d: _landscape(d, None), r"launcher\.options\.landscape: .*a landscape file must be a regular file, but it is a FIFO"),
    ("landscape binary", lambda d: _landscape(d, b"\x89PNG\r\n\x1a\n\x00\x00"), r"launcher\.options\.landscape: .*(UTF-8|not valid YAML)"),
    ("landscape extends itself", lambda d: _landscape(d, f"extends: {d / 'world.yaml'}\n".encode()),
     r"launcher\.options\.landscape: landscape .*world\.yaml extends itself"),
    ("landscape of the wrong shape", lambda d: _landscape(d, b"reward: 3\n"), r"launcher\.options\.landscape: "),
    ("landscape alias bomb", lambda d: _landscape(d, BILLION_LAUGHS.encode()), r"launcher\.options\.landscape: .*expands to more than"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("label,make,message", NAMED_FILES, ids=[c[0] for c in NAMED_FILES])
def test_hostile_files_a_study_names(tmp_path: Path, label: str, make: Callable[[Path], Change], message: str) -> None:
    path = _study_with(tmp_path, make(tmp_path))
    for command in ("validate", "run"):
        _one_line(cli(command, str(path), cwd=tmp_path, timeout=60), message)
    assert not list(tmp_path.rglob("*.db")) and not (tmp_path / "runs").exists()


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _foreign_sqlite(path: Path) -> Path:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
        conn.execute("INSERT INTO notes VALUES ('mine')")
    return path


def test_storage_urls_and_files_every_command(study_db: Path, tmp_path: Path) -> None:
    """Class 4 for each command that opens a database: one line, exit 2, the study's database
    and every file named unchanged, nothing created."""
    before = _fingerprint(study_db)
    random_bytes = _write(tmp_path / "random.db", bytes((i * 37 + 11) % 256 for i in range(4096)))
    empty = _write(tmp_path / "empty.db", b"")
    foreign = _foreign_sqlite(tmp_path / "foreign.db")
    a_file = _write(tmp_path / "a-file", b"x")
    digests = {p: _file_digest(p) for p in (random_bytes, empty, foreign, a_file)}
    cases = [
        (["status", "tiny", "--storage", "postgres://u:hunter2@127.0.0.1/db"], r"must start with postgresql://, but got 'postgres://u:\*\*\*@127"),
        (["export", "tiny", "--storage", "http://127.0.0.1/db"], r"must start with sqlite:/// or postgresql://"),
        (["report", "tiny", "--storage", "sqlite://relative.db"], r"has a host after sqlite://"),
        (["resume", "tiny", "--storage", "sqlite://u:hunter2@/tiny.db"], r"has a user or password after sqlite://"),
        (["worker", "tiny", "--storage", "sqlite://"], r"is in memory"),
        (["status", "tiny", "--storage", "sqlite:///:memory:"], r"is in memory"),
        (["status", "tiny", "--storage", f"sqlite:///{random_bytes}"], r"must be a SQLite database, but it is not"),
        (["resume", "tiny", "--storage", f"sqlite:///{random_bytes}"], r"must be a SQLite database, but it is not"),
        (["status", "tiny", "--storage", f"sqlite:///{empty}"], r"no study named .tiny. in the database sqlite:.*empty\.db: it holds no verl-sweep studies yet"),
        (["export", "tiny", "--storage", f"sqlite:///{empty}"], r"no study named .tiny. in the database .*: it holds no verl-sweep studies yet"),
        (["status", "tiny", "--storage", f"sqlite:///{foreign}"], r"holds no verl-sweep studies \(it has no Optuna tables; its tables: notes\)"),
        (["report", "tiny", "--storage", f"sqlite:///{foreign}"], r"holds no verl-sweep studies"),
        (["resume", "tiny", "--storage", f"sqlite:///{foreign}"], r"holds no verl-sweep studies"),
        (["status", "tiny", "--storage", f"sqlite:///{tmp_path}"], r"must be a regular file, but .* is not"),
        (["status", "tiny", "--storage", f"sqlite:///{a_file}/x.db"], r"no study database at"),
        (["export", "tiny", "--storage", f"sqlite:///{study_db}", "-o", str(tmp_path)], r"-o .*: must name a file, but it is a directory"),
        (["export", "tiny", "--storage", f"sqlite:///{study_db}", "-o", f"{a_file}/best.yaml"], r"-o .*: cannot create it, .*a-file is not a directory"),
        (["report", "tiny", "--storage", f"sqlite:///{study_db}", "-o", str(tmp_path)], r"-o .*: must name a file, but it is a directory"),
        (["report", "tiny", "--storage", f"sqlite:///{study_db}", "-o", f"{a_file}/r.html"], r"is not a directory"),
        (["export", "tiny", "--storage", f"sqlite:///{study_db}", "-o", "/proc/verl-sweep-best.yaml"], r"-o /proc/verl-sweep-best\.yaml: cannot write"),
        (["report", "tiny", "--storage", f"sqlite:///{study_db}", "-o", "/proc/verl-sweep.html"], r"-o /proc/verl-sweep\.html: cannot write"),
    ]
    for args, message in cases:
        line = _one_line(cli(*args, cwd=tmp_path), message)
        assert "hunter2" not in line, line
    assert _fingerprint(study_db) == before
    assert {p: _file_digest(p) for p in digests} == digests, "a refused database file was changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "empty.db", "foreign.db", "random.db"]


def test_run_refuses_storage_it_cannot_use_and_creates_nothing(tmp_path: Path) -> None:
    path = write_study(tmp_path, _tiny(), "tiny.yaml")
    foreign = _foreign_sqlite(tmp_path / "foreign.db")
    random_bytes = _write(tmp_path / "random.db", b"\x00\x01garbage" * 100)
    a_file = _write(tmp_path / "a-file", b"x")
    digests = {p: _file_digest(p) for p in (foreign, random_bytes, a_file)}
    for url, message in [
        (f"sqlite:///{foreign}", r"holds no verl-sweep studies .*its tables: notes"),
        (f"sqlite:///{random_bytes}", r"must be a SQLite database"),
        (f"sqlite:///{a_file}/sub/x.db", r"cannot create the directory of the study database .*a-file/sub"),
        ("postgresql://u:hunter2@[::1", r"cannot be parsed"),
    ]:
        line = _one_line(cli("run", str(path), "--storage", url, cwd=tmp_path), message)
        assert "hunter2" not in line
    assert {p: _file_digest(p) for p in digests} == digests
    assert not (tmp_path / "runs").exists()


def test_read_only_commands_never_write_a_schema(study_db: Path, tmp_path: Path) -> None:
    """status, export and report open SQLite read-only: a read-only database works, and an
    empty or unrelated one is left byte for byte as it was."""
    before = _fingerprint(study_db)
    study_db.chmod(0o444)
    try:
        for args in (["status", "tiny"], ["export", "tiny"], ["report", "tiny", "-o", str(tmp_path / "r.html")]):
            result = cli(*args, "--storage", f"sqlite:///{study_db}", cwd=tmp_path)
            assert result.returncode == 0, (args, result.stderr[-1000:])
    finally:
        study_db.chmod(0o644)
    assert _fingerprint(study_db) == before
    assert not list(study_db.parent.glob("tiny.db-*")), "a read-only open left a journal"


def test_a_flag_that_switches_the_launcher_drops_the_other_kinds_options(study_db: Path, tmp_path: Path, capsys: Any) -> None:
    """Class 7: `--launcher local` on a sim study leaves the sim options out, saying which,
    instead of Python's "unexpected keyword argument 'time_scale'"."""
    from verl_sweep.search.commands.launch import launcher_options
    from verl_sweep.search.spec.study_file import parse_study

    spec = parse_study(_tiny())
    assert launcher_options(spec, "local", on_dropped=print) == {}
    out = capsys.readouterr().out
    assert "--launcher local: leaving out the study's sim options landscape, time_scale (local takes " in out
    before = _fingerprint(study_db)
    result = cli("resume", "tiny", "--storage", f"sqlite:///{study_db}", "--launcher", "local", cwd=tmp_path)
    line = _one_line(result, r"(the local launcher needs GPUs|GPU)")
    assert "unexpected keyword" not in line and "__init__" not in line
    assert "leaving out the study's sim options landscape, time_scale" in result.stdout
    assert _fingerprint(study_db) == before
    line = _one_line(cli("resume", "tiny", "--storage", f"sqlite:///{study_db}", "--launcher", "ray", cwd=tmp_path),
                     r"launcher\.options: the ray launcher needs address")
    assert _fingerprint(study_db) == before


def test_runs_directory_that_is_a_file(tmp_path: Path) -> None:
    """Class 5: `runs` is a file: refused before a database exists."""
    path = write_study(tmp_path, _tiny(), "tiny.yaml")
    (tmp_path / "runs").write_text("not a directory")
    _one_line(cli("run", str(path), cwd=tmp_path), r"the runs directory .*runs/tiny cannot be created: .*runs is not a directory")
    assert not list(tmp_path.glob("*.db"))


def test_runs_directory_that_cannot_be_written(tmp_path: Path) -> None:
    """Class 5: a `runs` that cannot be written (immutable: read-only even to root)."""
    import subprocess

    path = write_study(tmp_path, _tiny(), "tiny.yaml")
    runs = tmp_path / "runs"
    runs.mkdir()
    if subprocess.run(["chattr", "+i", str(runs)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not permitted here")
    try:
        _one_line(cli("run", str(path), cwd=tmp_path), r"the runs directory .*runs/tiny cannot be created: .*runs is not writable")
    finally:
        subprocess.run(["chattr", "-i", str(runs)], capture_output=True)
    assert not list(tmp_path.glob("*.db")) and not list(runs.iterdir())


def test_a_console_that_cannot_show_eta(study_db: Path, tmp_path: Path) -> None:
    """Class 5: PYTHONIOENCODING=ascii (or a C locale): escapes, not a UnicodeEncodeError."""
    env = {"PYTHONIOENCODING": "ascii", "LC_ALL": "C"}
    url = f"sqlite:///{study_db}"
    for args in (["status", "tiny", "--storage", url], ["export", "tiny", "--storage", url, "--format", "command"]):
        result = cli(*args, cwd=tmp_path, env=env)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-1500:]
    status = cli("status", "tiny", "--storage", url, cwd=tmp_path, env=env)
    assert "\\u03b7" in status.stdout  # η, escaped
    bad = write_study(tmp_path, _edit(_set("stages/0/budget/max_trials", 0)), "bad.yaml")
    _one_line(cli("validate", str(bad), cwd=tmp_path, env=env), r"max_trials: must be \\u2265 1, but got 0")


def test_two_runs_creating_one_new_database_do_not_race(tmp_path: Path) -> None:
    """Class 4: the schema of a new SQLite file is created under a lock (it failed 1 in 8)."""
    import threading

    from verl_sweep.search.database.storage import open_storage

    for round_ in range(8):
        url = f"sqlite:///{tmp_path}/race{round_}.db"
        errors: list[BaseException] = []

        def open_it() -> None:
            try:
                open_storage(url).engine.dispose()
            except BaseException as e:  # noqa: BLE001 - collected for the assertion
                errors.append(e)

        threads = [threading.Thread(target=open_it) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors


@pytest.mark.timeout(60)
def test_a_server_that_accepts_but_never_answers_fails_in_under_30_s(tmp_path: Path) -> None:
    import socket
    import time

    pytest.importorskip("psycopg")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)  # the kernel completes the handshake; nothing ever answers
    port = server.getsockname()[1]
    try:
        started = time.monotonic()
        result = cli("status", "tiny", "--storage", f"postgresql://u:hunter2@127.0.0.1:{port}/db", cwd=tmp_path, timeout=45)
        elapsed = time.monotonic() - started
    finally:
        server.close()
    line = _one_line(result, rf"cannot reach the study database postgresql://u:\*\*\*@127\.0\.0\.1:{port}/db")
    assert "hunter2" not in line
    assert elapsed < 30, elapsed


def test_a_database_that_cannot_be_written(study_db: Path, tmp_path: Path) -> None:
    """Class 4: run on a read-only database says so (not Optuna's "exceeding max length");
    resume and run of the finished study in it say it is finished; status still reads it. An
    immutable file is read-only even to root."""
    import shutil
    import subprocess

    db = tmp_path / "tiny.db"
    shutil.copy(study_db, db)
    if subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not permitted here")
    try:
        before = _fingerprint(db)
        url = f"sqlite:///{db}"
        path = write_study(tmp_path, _tiny(), "tiny.yaml")
        for args in (["resume", "tiny"], ["run", str(path)]):
            result = cli(*args, "--storage", url, cwd=tmp_path)
            assert result.returncode == 0, result.stderr
            assert result.stdout.startswith(f"study tiny is finished: nothing left to run (its database {url} is "
                                            "read-only here).\n"), result.stdout
        other = write_study(tmp_path, {**_tiny(), "name": "other"}, "other.yaml")
        _one_line(cli("run", str(other), "--storage", url, cwd=tmp_path),
                  r"the study database .*tiny\.db cannot be written here \(.*(read-only|readonly)")
        assert cli("status", "tiny", "--storage", url, cwd=tmp_path).returncode == 0
        assert _fingerprint(db) == before
    finally:
        subprocess.run(["chattr", "-i", str(db)], capture_output=True)


def _too_big(gpu_memory_gb: float, **baseline: Any) -> dict[str, Any]:
    """The tiny study, one mini-batch stage, on GPUs of ``gpu_memory_gb``."""
    data = _tiny()
    data["hardware"]["gpu_memory_gb"] = gpu_memory_gb
    data["baseline"].update(baseline)
    data["stages"] = [{"name": "minibatch", "space": "mini_batch", "budget": {"max_trials": 3}}]
    return data


# (label, study, the phase and estimate the line names): baselines whose bf16 weights do not fit
# even vLLM's share, so nothing says the estimate is short for them
TOO_BIG: list[tuple[str, dict[str, Any], str]] = [
    ("the demo's 7.6B on 1 GB GPUs", _too_big(1), r"the update phase is estimated at 35\.4 GB per GPU \(update = "),
    ("a 32B model at rollout TP 1 on 32 GPUs of 24 GB", _too_big(24, **{
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1, "actor_rollout_ref.rollout.gpu_memory_utilization": 0.9,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 1}),
     r"the rollout phase is estimated at 34\.3 GB per GPU \(rollout = vLLM 0\.9 × 24 GB"),
]
TOO_BIG[1][1]["model"].update(n_params_b=32.0, hidden_size=5120, num_attention_heads=40, num_key_value_heads=8,
                              num_hidden_layers=64)
TOO_BIG[1][1]["hardware"]["nodes"] = 4


@pytest.mark.parametrize("label,data,phase", TOO_BIG, ids=[c[0] for c in TOO_BIG])
def test_a_baseline_beyond_its_gpus_memory_is_refused_before_any_probe(tmp_path: Path, label: str,
                                                                       data: dict[str, Any], phase: str) -> None:
    """On the simulator too: `validate` and `run` refuse the file, and `resume` a study an
    earlier verl-sweep stored with it (its stored definition is what resume reads), each in one
    line that names the phase and the estimate, exit 2, and no probe starts."""
    from verl_sweep.search.engine.driver import save_spec
    from verl_sweep.search.database.storage import open_storage
    from verl_sweep.search.spec.study_file import load_study

    path = write_study(tmp_path, data, "tiny.yaml")
    message = (r"^error: baseline: estimated peak GPU memory must fit the GPU's \d+ GB, but " + phase
               + r".* GB\)\. Lower the memory fraction or the micro-batch, .* or declare larger GPUs")
    for command in ("validate", "run"):
        _one_line(cli(command, str(path), cwd=tmp_path), message)
    assert not list(tmp_path.glob("*.db"))
    url = f"sqlite:///{tmp_path / 'stored.db'}"
    save_spec(open_storage(url), load_study(path))
    _one_line(cli("resume", "tiny", "--storage", url, cwd=tmp_path), message)
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.rglob("*.jsonl")), "no probe may start"


def test_a_baseline_that_fits_its_gpus_is_not_refused(tmp_path: Path) -> None:
    """The same 7.6B on 40 GB GPUs: within them by the estimate, accepted."""
    path = write_study(tmp_path, _too_big(40), "tiny.yaml")
    result = cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-1500:]
    assert "peak = max(" in result.stdout


def test_the_driver_refuses_a_stored_baseline_beyond_its_gpus_before_any_probe(tmp_path: Path) -> None:
    """What `resume` and `worker` run (they read the stored definition, not the file):
    StudyRunner.run makes the one pre-flight check first, so nothing is asked of Optuna and no
    run folder is made."""
    import optuna

    from verl_sweep.launchers.sim import SimLauncher
    from verl_sweep.search.views.console import Console
    from verl_sweep.search.engine.driver import StudyRunner, save_spec
    from verl_sweep.search.spec.errors import BadInputError
    from verl_sweep.search.database.storage import open_storage
    from verl_sweep.search.spec.study_file import load_study
    from verl_sweep.search.method.preflight import memory_refusal

    spec = load_study(write_study(tmp_path, _too_big(1), "tiny.yaml"))
    refusal = memory_refusal(spec)
    assert refusal is not None and "the update phase is estimated at 35.4 GB" in refusal
    storage = open_storage(f"sqlite:///{tmp_path / 'tiny.db'}")
    save_spec(storage, spec)
    launcher = SimLauncher(tmp_path / "runs", time_scale=20000)
    runner = StudyRunner(spec, storage, launcher, console=Console())
    with pytest.raises(BadInputError, match=re.escape(refusal)):
        runner.run()
    launcher.close()
    assert not any((tmp_path / "runs").glob("*")), "no run folder"
    assert all(not s.n_trials for s in optuna.get_all_study_summaries(storage) if s.study_name.startswith("tiny."))
