"""The forks of Optuna's private code (``search/_optuna_forks``) pass Optuna's own behavioural
suites for storages and samplers, and stand aside on any other Optuna version."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import optuna
import pytest
from optuna.testing.pytest_samplers import BasicSamplerTestCase, RelativeSamplerTestCase
from optuna.testing.pytest_storages import StorageTestCase

from conftest import REPO
from search import _optuna_forks
from search._optuna_forks.rdb import SweepStorage
from search._optuna_forks.tpe import ReadOnceTPESampler

pytestmark = pytest.mark.skipif(optuna.__version__ != _optuna_forks.FORKED_FROM,
                                reason="the forks are used only on the Optuna they were written against")


class TestSweepStorage(StorageTestCase):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> SweepStorage:
        return SweepStorage(f"sqlite:///{tmp_path}/optuna-suite.db")


class TestReadOnceTPESampler(BasicSamplerTestCase):
    @pytest.fixture
    def sampler(self) -> Callable[[], optuna.samplers.BaseSampler]:
        _optuna_forks.install()
        return lambda: ReadOnceTPESampler(n_startup_trials=2, constant_liar=True)


class TestReadOnceMultivariateTPESampler(RelativeSamplerTestCase):
    @pytest.fixture
    def sampler(self) -> Callable[[], optuna.samplers.BaseSampler]:
        _optuna_forks.install()
        # No startup trials: the suite asks for a relative sample after one trial. Without
        # group: the suite calls sample_relative with a search space of its own, which Optuna's
        # grouped TPE answers with {} too (test_sampler.py compares grouped TPE with Optuna's).
        return lambda: ReadOnceTPESampler(n_startup_trials=0, constant_liar=True, multivariate=True)


def test_another_optuna_version_gets_stock_optuna_and_one_log_line(tmp_path: Path) -> None:
    code = (
        "import logging, optuna\n"
        "logging.basicConfig(level=logging.WARNING, format='%(name)s: %(message)s')\n"
        "optuna.__version__ = '9.9.9'\n"
        "from search import _optuna_forks\n"
        "from search.storage import open_storage\n"
        "sampler = _optuna_forks.tpe_sampler(seed=0)\n"
        f"storage = open_storage('sqlite:///{tmp_path}/study.db')\n"  # in memory is refused
        "from search.sampler import tpe_class\n"
        "print(type(sampler).__name__, type(storage).__name__, tpe_class().__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["TPESampler", "RDBStorage", "TPESampler"]
    lines = [line for line in result.stderr.splitlines() if line.startswith("search._optuna_forks")]
    assert lines == ["search._optuna_forks: Optuna 9.9.9 is installed, but verl-sweep's TPE and storage speed-ups "
                     "were written against Optuna 5.0.0: using stock Optuna's (slower asks on large studies)"]
    # The stages' TPE that learns from OOMs overrides private TPE code too: fenced the same way.
    assert [line for line in result.stderr.splitlines() if line.startswith("search.sampler")] == [
        "search.sampler: Optuna 9.9.9 is installed, but verl-sweep's TPE learns from runs that ran out of memory "
        "only on Optuna 5.0.0: using TPE without it"]
