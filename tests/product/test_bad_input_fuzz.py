"""Randomly mutated study files (hypothesis) thrown at the CLI's `run` and `validate` commands
themselves, in-process: exit 2 with short lines (one for `run`) and, for `run`, nothing
stored, or success; never another exception, never a hang."""

from __future__ import annotations

import copy
import logging
import os
import re
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner, Result

from test_bad_input import _tiny

#: seconds one file may take: well under one, but seconds where it reaches verl's checks (the first imports verl)
MAX_SECONDS = 30.0
#: files per run of the test: ~5% pass every check before verl's, whose checks take ~4 s a file
#: here (~27 ms for each other file): 250 files take ~60 s
N_EXAMPLES = 250

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



def _in(directory: Path, *args: str) -> Result:
    """A verl-sweep command, in this process (a subprocess would import verl for each file),
    run from ``directory``: the relative paths a mutated file names land in it."""
    from verl_sweep.search.commands.cli import app

    here, handlers = os.getcwd(), list(logging.root.handlers)
    os.chdir(directory)
    try:
        return CliRunner().invoke(app, list(args))
    finally:
        os.chdir(here)
        # The command's logging.basicConfig wrote to this invocation's stderr, closed now: the
        # next command sets up its own, as a new process would.
        for handler in logging.root.handlers[len(handlers):]:
            logging.root.removeHandler(handler)


def _no_bug(result: Result) -> None:
    """The command ended by its own exit, not by an exception that escaped it."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError("".join(traceback.format_exception(result.exception)))


#: files whose check passed in this session: hypothesis draws some files more than once (a
#: mutation that lands nowhere, a neighbour of an earlier one); the same bytes check the same
#: way, so a repeat is not run again (~10% of the files, two of them valid ones at ~5 s each).
#: Only passes are kept: a failing file fails again each time hypothesis replays it.
_PASSED: set[bytes] = set()


def _run_locked(content: bytes, directory: Path) -> Result:
    """`verl-sweep run` on ``content`` as ``directory``/study.yaml, its database an empty file
    this test holds the driver's lock on."""
    from verl_sweep.search.database.storage import DriverLock

    (directory / "study.yaml").write_bytes(content)
    database = directory / "fuzz.db"
    database.write_bytes(b"")  # the lock is keyed on the database file
    url = f"sqlite:///{database}"
    with DriverLock(url):
        return _in(directory, "run", str(directory / "study.yaml"), "--storage", url)


def _check_outcome(content: bytes, directory: Path) -> None:
    """`verl-sweep run` on the file, while this test drives its database (the lock `run`
    takes just before it stores the study; the database is an empty file, which `run` takes
    for a new one): a bad file exits 2 with one line and leaves nothing behind, the database
    untouched; a file that passes every check reaches the lock, is refused there in one line,
    takes back the runs directory it made, and its database holds no study. Either way nothing
    runs, so a valid file costs only verl's checks."""
    if content in _PASSED:
        return
    import optuna

    path, database = directory / "study.yaml", directory / "fuzz.db"
    url = f"sqlite:///{database}"
    started = time.monotonic()
    result = _run_locked(content, directory)
    elapsed = time.monotonic() - started
    _no_bug(result)
    assert result.exit_code == 2, (result.exit_code, result.stdout[-800:], result.stderr[-1500:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines  # what `run` prints: one line
    assert len(lines[0]) < 1000 and "Traceback" not in lines[0], lines
    if elapsed >= MAX_SECONDS:  # the file's own cost, or the process's (a first import, a busy machine)?
        started = time.monotonic()
        _run_locked(content, directory)
        elapsed = time.monotonic() - started  # a file that is slow itself is slow twice
    assert elapsed < MAX_SECONDS, f"{elapsed:.1f} s for {content[:300]!r}"
    left = sorted(p.name for p in directory.iterdir() if p not in (path, database))
    assert not left, f"a refused file left {left}"  # no runs directory, nothing beside the database
    if "one driver per SQLite study database" in lines[0]:  # a valid file: every check passed
        assert optuna.get_all_study_names(storage=url) == [], "a study was stored"
    else:
        assert database.read_bytes() == b"", "a refused file wrote to the database"
    _PASSED.add(content)


@pytest.fixture(scope="module", autouse=True)
def _checks_imported() -> None:
    """What a file's checks and `run` import once a process (verl, Hydra's compose, verl's
    config dataclasses and torch with them, the launcher, the database's modules: 12 s and
    more on 2 busy cores) is imported before the files are timed: a cost of the process, not
    of the file that happens to come first (one took 30.3 s in CI, then 35.2 s after a warm-up
    by `validate`, which imports less than `run`). The warm-up is the test's own path: `run`
    on the unmutated file, up to the lock."""
    with tempfile.TemporaryDirectory(prefix="vs-fuzz-warm-") as tmp:
        result = _run_locked(yaml.safe_dump(BASE, sort_keys=False).encode(), Path(tmp))
    _no_bug(result)


@pytest.mark.timeout(600)
@settings(max_examples=N_EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated_studies())
def test_mutated_study_files_through_run(content: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="vs-fuzz-") as tmp:
        _check_outcome(content, Path(tmp))


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
    """`validate`, verl's compose and validation included: exit 0, or exit 2 with short lines."""
    from verl_sweep.verl_knowledge import verl_check

    if not verl_check.verl_available():  # imports verl, before the clock starts
        pytest.skip("needs verl")
    with tempfile.TemporaryDirectory(prefix="vs-fuzz-") as tmp:
        path = Path(tmp) / "study.yaml"
        path.write_bytes(content)
        started = time.monotonic()
        result = _in(Path(tmp), "validate", str(path))
        _no_bug(result)
        assert result.exit_code in (0, 2), (result.exit_code, result.stderr[-1500:])
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        assert (result.exit_code == 2) == bool(errors), result.stderr[-1500:]
        assert all(line.startswith("error: ") and len(line) < 700 for line in errors), errors
        assert time.monotonic() - started < 60
