"""The TPE sampler as the driver builds it: SciPy's vectorized log Φ in place of Optuna 5.0's
per-element loop (an ask at 1,000 trials is several times faster), with the same values and
so the same suggestions."""

from __future__ import annotations

import numpy as np
import optuna
import pytest
from optuna.samplers._tpe import _truncnorm

from search.driver import build_sampler
from search.study_file import StageSettings

optuna.logging.set_verbosity(optuna.logging.WARNING)
OPTUNA_LOG_NDTR = np.frompyfunc(_truncnorm._log_ndtr_single, 1, 1)


def _tpe_stage() -> StageSettings:
    return StageSettings.model_validate({"name": "lr", "space": "lr", "budget": {"max_trials": 40},
                                         "sampler": {"name": "tpe", "seed": 3}})  # fmt: skip


def _suggestions(sampler: optuna.samplers.BaseSampler) -> list[tuple[float, int]]:
    study = optuna.create_study(sampler=sampler)
    study.optimize(lambda t: (np.log10(t.suggest_float("lr", 5e-7, 5e-6, log=True)) + 6) ** 2
                   + abs(t.suggest_int("mini_batch", 384, 640, step=16) - 512) / 256, n_trials=40)  # fmt: skip
    return [(t.params["lr"], t.params["mini_batch"]) for t in study.trials]


def test_tpe_uses_scipy_log_ndtr_with_optuna_s_values_and_suggestions(monkeypatch: pytest.MonkeyPatch) -> None:
    from scipy.special import log_ndtr

    sampler = build_sampler(_tpe_stage(), 0)
    monkeypatch.setattr(_truncnorm, "_log_ndtr", lambda a: OPTUNA_LOG_NDTR(a).astype(float))  # restored afterwards
    before = _suggestions(sampler)

    sampler = build_sampler(_tpe_stage(), 0)

    assert _truncnorm._log_ndtr is log_ndtr
    # every branch of Optuna's function: the upper tail (where Optuna's log(1 - x) ≈ -x is
    # off by up to 6e-17 absolute), the middle, the asymptotic series
    x = np.concatenate([np.linspace(-60, 60, 24_001), [-1e3, -20.0, 6.0, 1e3]])
    np.testing.assert_allclose(_truncnorm._log_ndtr(x), OPTUNA_LOG_NDTR(x).astype(float), rtol=1e-12, atol=1e-15)
    after = _suggestions(sampler)
    assert np.allclose(np.array(after), np.array(before), rtol=1e-9)
