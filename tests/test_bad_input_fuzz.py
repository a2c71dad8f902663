"""Randomly mutated study files (hypothesis) thrown at what `validate` and `run`
do with a file before they launch anything, in-process. Every outcome is success or a
BadInputError of short lines (exit 2 at the CLI): never another exception, never a hang."""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from search.errors import BadInputError
from test_bad_input import _tiny

#: seconds any one file may take (the slowest legitimate one takes well under one)
MAX_SECONDS = 5.0

LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["${oc.env:HOME}", "sqlite://", "sqlite:///:memory:", "postgres://u:pw@h/d", "http://x",
                     "/dev/zero", "../../etc", "", "true", "1e400", "default", "kl_edge", "sim", "local", "ray",
                     "replay", "grpo", "ppo", "gae", "lr", "kl", "mini_batch", "systems", "polish", "tpe", "grid"]),
)
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                      max_leaves=6)
YAML_NOISE = st.text(alphabet=list(":-[]{}&*!|>#%@`'\"\n\t ,?=.0123456789aZ\\\x00\u03b7"), min_size=1, max_size=6)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


BASE = _tiny()
BASE["stages"].append({"name": "mb", "space": "mini_batch", "budget": {"max_trials": 3}, "params": {"low": 400}})
BASE["model"]["config_json"] = None
BASE["model"].pop("config_json")
PATHS = _paths(BASE)


@st.composite
def mutated_studies(draw: Any) -> bytes:
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path = draw(st.sampled_from(PATHS))
        parent: Any = data
        try:
            for part in path[:-1]:
                parent = parent[part]
            last = path[-1]
            action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
            if action == "replace":
                parent[last] = draw(VALUES)
            elif action == "delete":
                del parent[last]
            elif isinstance(parent, dict):
                parent[draw(st.text(max_size=8))] = draw(VALUES)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation removed or replaced the way there
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    if draw(st.booleans()):  # and the text itself, a few characters at a time
        for _ in range(draw(st.integers(min_value=1, max_value=3))):
            at = draw(st.integers(min_value=0, max_value=len(text)))
            cut = draw(st.integers(min_value=0, max_value=4))
            text = text[:at] + draw(YAML_NOISE) + text[at + cut:]
    return text.encode("utf-8", errors="surrogatepass")


def load_like_run(path: Path) -> None:
    """What `run` does with a file before it opens a database (and `validate` before verl):
    load, rules and bounds, the launcher's options and build, the storage URL's checks."""
    from search.launch import launcher_problems
    from search.storage import preflight
    from search.study_file import load_study
    from search.validate import one_line, validate_study

    try:
        spec = load_study(path)
    except BadInputError as e:
        raise BadInputError(one_line(str(e).splitlines(), path)) from None
    problems, _ = validate_study(spec, with_verl=False)
    problems += launcher_problems(spec)
    if problems:
        raise BadInputError(one_line(problems, path))
    preflight(spec.storage_url())


def _check_outcome(content: bytes, directory: Path) -> None:
    path = directory / "study.yaml"
    path.write_bytes(content)
    started = time.monotonic()
    try:
        load_like_run(path)
    except BadInputError as e:
        lines = str(e).splitlines()
        assert len(lines) == 1 and lines[0].strip(), repr(str(e))  # what `run` prints: one line
        assert len(lines[0]) < 1000 and "Traceback" not in lines[0], lines
    elapsed = time.monotonic() - started
    assert elapsed < MAX_SECONDS, f"{elapsed:.1f} s for {content[:300]!r}"
    assert not list(directory.glob("*.db")), "checking a file created a database"


@pytest.mark.timeout(300)
@settings(max_examples=1000, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated_studies())
def test_a_thousand_mutated_study_files(content: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="vs-fuzz-") as tmp:
        _check_outcome(content, Path(tmp))


def validate_like_cli(path: Path) -> None:
    """`validate`'s checks, verl's compose and validation included (what `run` checks too)."""
    from search.cli import _check_study
    from search.study_file import load_study

    problems, _ = _check_study(load_study(path))
    if problems:
        raise BadInputError("\n".join(problems))


SMALL = _tiny()  # one stage: five configs for verl to compose per file (~1-3 s a file)


@st.composite
def mutated_baselines(draw: Any) -> bytes:
    """Baseline values (what verl composes): a key of verl's config set to any value."""
    data = copy.deepcopy(SMALL)
    key = draw(st.sampled_from(sorted(data["baseline"]) + ["actor_rollout_ref.actor.optim.lr",
                                                            "actor_rollout_ref.actor.use_kl_loss", "algorithm.gamma"]))
    data["baseline"][key] = draw(VALUES)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).encode()


@pytest.mark.verl
@pytest.mark.timeout(300)
@settings(max_examples=6, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated_baselines())
def test_mutated_baselines_through_verl(content: bytes) -> None:
    from spaces import verl_check

    if not verl_check.verl_available():  # imports verl, before the clock starts
        pytest.skip("needs verl")
    with tempfile.TemporaryDirectory(prefix="vs-fuzz-") as tmp:
        path = Path(tmp) / "study.yaml"
        path.write_bytes(content)
        started = time.monotonic()
        try:
            validate_like_cli(path)
        except BadInputError as e:
            assert all(line.strip() and len(line) < 700 for line in str(e).splitlines()), str(e)
        assert time.monotonic() - started < 60
