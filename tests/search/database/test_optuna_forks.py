"""The forks of Optuna's private code (``search/database/optuna_forks``) apply on the installed Optuna
(CI runs the pinned release and the newest in range: a release that changed the code they rely
on fails here the day it ships), pass Optuna's own behavioural suites for storages and
samplers, and stand aside, in one log line, on an Optuna whose private code changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import optuna
import pytest
from optuna.testing.pytest_samplers import BasicSamplerTestCase, RelativeSamplerTestCase
from optuna.testing.pytest_storages import StorageTestCase

from support import REPO
from verl_sweep.search.database import optuna_forks
from verl_sweep.search.database.optuna_forks.rdb import SweepStorage
from verl_sweep.search.database.optuna_forks.tpe import ReadOnceTPESampler

pytestmark = pytest.mark.newest


def test_the_forks_apply_on_the_installed_optuna() -> None:
    assert optuna_forks.shape_differences() == [], optuna.__version__
    assert optuna_forks.install()


def test_a_changed_private_function_or_table_is_found() -> None:
    relied_on = {
        "optuna.storages._rdb.storage:RDBStorage.get_trial": {"params": ("self", "trial_id", "deepcopy")},
        "optuna.samplers._tpe.sampler:TPESampler._sample": {
            "params": ("self", "study", "trial", "search_space"), "reads": ("_split_trials", "_split_trials_once")},
        "optuna.storages._rdb.models:TrialModel": {"columns": ("trial_id", "number")},
        "optuna.samplers._tpe.sampler:_split_trials_once": {"params": ()},
    }
    assert optuna_forks.shape_differences(relied_on) == [
        "RDBStorage.get_trial takes (self, trial_id)",
        "TPESampler._sample no longer reads _split_trials_once",
        "TrialModel's columns are trial_id, number, study_id, state, datetime_start, datetime_complete",
        "_split_trials_once is gone",
    ]


class TestSweepStorage(StorageTestCase):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> SweepStorage:
        return SweepStorage(f"sqlite:///{tmp_path}/optuna-suite.db")


class TestReadOnceTPESampler(BasicSamplerTestCase):
    @pytest.fixture
    def sampler(self) -> Callable[[], optuna.samplers.BaseSampler]:
        optuna_forks.install()
        return lambda: ReadOnceTPESampler(n_startup_trials=2, constant_liar=True)


class TestReadOnceMultivariateTPESampler(RelativeSamplerTestCase):
    @pytest.fixture
    def sampler(self) -> Callable[[], optuna.samplers.BaseSampler]:
        optuna_forks.install()
        # No startup trials: the suite asks for a relative sample after one trial. Without
        # group: the suite calls sample_relative with a search space of its own, which Optuna's
        # grouped TPE answers with {} too (test_sampler.py compares grouped TPE with Optuna's).
        return lambda: ReadOnceTPESampler(n_startup_trials=0, constant_liar=True, multivariate=True)


def test_changed_private_code_gets_stock_optuna_and_one_log_line(tmp_path: Path) -> None:
    code = (
        "import logging, optuna\n"
        "logging.basicConfig(level=logging.WARNING, format='%(name)s: %(message)s')\n"
        "optuna.__version__ = '5.9.0'\n"
        "from optuna.samplers._tpe import sampler\n"
        "del sampler._split_trials\n"  # as a release that renamed it
        "from verl_sweep.search.database import optuna_forks\n"
        "from verl_sweep.search.database.storage import open_storage\n"
        "sampler = optuna_forks.tpe_sampler(seed=0)\n"
        f"storage = open_storage('sqlite:///{tmp_path}/study.db')\n"  # in memory is refused
        "from verl_sweep.search.method.sampler import tpe_class\n"
        "print(type(sampler).__name__, type(storage).__name__, tpe_class().__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["TPESampler", "RDBStorage", "TPESampler"]
    # One line for the forks and the stages' TPE that learns from OOMs (which overrides private
    # TPE code too, fenced the same way); nothing from verl_sweep.search.method.sampler.
    lines = [line for line in result.stderr.splitlines() if line.startswith("verl_sweep.search.")]
    assert lines == ["verl_sweep.search.database.optuna_forks: Optuna 5.9.0 changed private code that verl-sweep's TPE and storage "
                     "speed-ups rely on (_split_trials is gone): using stock Optuna's (slower asks on large "
                     "studies, TPE not learning from runs that ran out of memory). Install optuna==5.0.0 for them."]
