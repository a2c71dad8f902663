"""Study files: a malformed file gives exit 2 and one line naming the field, and no database."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from support import cli, demo_data, write_study
from verl_sweep.search.spec.errors import BadInputError
from verl_sweep.search.spec.study_file import default_stages, load_study
from verl_sweep.verl_knowledge import Algorithm


def _with(change: Any) -> dict[str, Any]:
    data = copy.deepcopy(demo_data())
    change(data)
    return data


BAD_FILES = [
    ("wrong type", lambda d: d["hardware"].update(gpus_per_node="eight"), r"^study\.yaml: hardware\.gpus_per_node: must be an integer, but got 'eight'$"),
    ("unknown key", lambda d: d.update(stagez=[]), r"^study\.yaml: stagez: is not a known field"),
    ("unknown nested key", lambda d: d["stages"][1]["budget"].update(max_trails=3), r"^study\.yaml: stages\[1\]\.budget\.max_trails: is not a known field"),
    ("missing field", lambda d: d.pop("hardware"), r"^study\.yaml: hardware: is required, but it is missing$"),
    ("out-of-range budget", lambda d: d["stages"][1]["budget"].update(max_trials=0), r"^study\.yaml: stages\[1\]\.budget\.max_trials: must be ≥ 1, but got 0$"),
    ("bad algorithm", lambda d: d.update(algorithm="dpo"), r"^study\.yaml: algorithm: must be 'grpo' or 'ppo', but got 'dpo'$"),
    ("NaN", lambda d: d["probe"].update(steps=float("nan")), r"^study\.yaml: probe\.steps: must be"),
    ("bad name", lambda d: d.update(name="../etc"), r"^study\.yaml: name: must be 1-64 letters"),
    ("bad override key", lambda d: d["baseline"].update({"a b": 1}), r"^study\.yaml: baseline: a b: override key must be a dotted config path"),
]


@pytest.mark.parametrize("label,change,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_study_file_exit_2_one_line_no_database(tmp_path: Path, label: str, change: Any, message: str) -> None:
    path = write_study(tmp_path, _with(change))
    for command in ("run", "validate"):
        result = cli(command, str(path), cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("error: ")
        import re

        assert re.search(message, lines[0][len("error: "):]), lines[0]
    assert not list(tmp_path.glob("*.db")), "a bad study file must not create a database"


def test_yaml_python_tags_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "study.yaml"
    path.write_text("name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(BadInputError, match=r"not valid YAML at line 1"):
        load_study(path)


def test_duplicate_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "study.yaml"
    path.write_text("name: a\nname: b\n")
    with pytest.raises(BadInputError, match=r"duplicate key 'name'"):
        load_study(path)


def test_missing_file_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"no such study file"):
        load_study(tmp_path / "nope.yaml")


def test_default_stages_follow_the_algorithm() -> None:
    assert [s.name for s in default_stages(Algorithm.GRPO)] == ["systems", "tokens", "minibatch", "kl", "lr", "polish"]
    assert [s.name for s in default_stages(Algorithm.PPO)] == ["systems", "tokens", "minibatch", "kl", "lr", "lam", "polish"]


def test_storage_defaults_to_sqlite_beside_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VERL_SWEEP_STORAGE", raising=False)
    data = demo_data()
    data.pop("storage", None)
    spec = load_study(write_study(tmp_path, data))
    assert spec.storage_url() == f"sqlite:///{tmp_path.resolve()}/demo.db"
    # the cluster guide's variable, which worker and status read too (run ignored it)
    monkeypatch.setenv("VERL_SWEEP_STORAGE", "postgresql://u@db/sweep")
    assert spec.storage_url() == "postgresql://u@db/sweep"
    assert load_study(write_study(tmp_path, {**data, "storage": "sqlite:///x.db"})).storage_url() == "sqlite:///x.db"


def test_model_facts_from_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 3584, "num_attention_heads": 28}')
    data = demo_data()
    data["model"] = {"config_json": "config.json", "n_params_b": 7}
    spec = load_study(write_study(tmp_path, data))
    assert (spec.model.hidden_size, spec.model.num_attention_heads) == (3584, 28)


def test_two_runs_creating_one_study_at_once_both_proceed(tmp_path: Path) -> None:
    """The second `run` (or a worker) saw the new root study before the first stored its
    definition, and said the study was not verl-sweep's."""
    import threading

    import optuna

    from verl_sweep.search.database.records import SPEC_ATTR
    from verl_sweep.search.spec.study_file import spec_to_dict
    from verl_sweep.search.database.study_root import load_spec, save_spec
    from verl_sweep.search.spec.errors import BadInputError as Bad
    from verl_sweep.search.database.storage import open_storage

    spec = load_study(write_study(tmp_path, demo_data()))
    storage = open_storage(f"sqlite:///{tmp_path}/race.db")
    root = optuna.create_study(study_name=spec.name, storage=storage, direction="maximize")  # the first run, mid-way
    late = threading.Timer(0.5, lambda: root.set_user_attr(SPEC_ATTR, spec_to_dict(spec)))
    late.start()
    save_spec(storage, spec)  # the second run: waits for the definition instead of refusing
    late.join()
    # A worker started as soon as the root study exists (test_workers) read it the same way.
    root = optuna.create_study(study_name="joined", storage=storage, direction="maximize")
    late = threading.Timer(0.5, lambda: root.set_user_attr(SPEC_ATTR, spec_to_dict(spec.model_copy(update={"name": "joined"}))))
    late.start()
    assert load_spec(storage, "joined").name == "joined"
    late.join()
    other = optuna.create_study(study_name="foreign", storage=storage, direction="maximize")
    with pytest.raises(Bad, match="that verl-sweep did not create"):
        save_spec(storage, spec.model_copy(update={"name": other.study_name}))
    with pytest.raises(Bad, match="study 'foreign' was not created by verl-sweep; verl-sweep cannot use it"):
        load_spec(storage, "foreign")
