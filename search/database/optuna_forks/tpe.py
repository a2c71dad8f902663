"""A fork of Optuna 5.0's TPE internals: four changes that make an ask several times faster at
1,000 trials and leave its suggestions as they were: SciPy's vectorized log Φ and erf, one read
of the study's trials per ask, one split of them into good and bad per ask, and each finished
trial's parameters converted once, not on every ask (``ReadOnceTPESampler``).

Applied only through ``verl_sweep.search.database.optuna_forks.install`` (once a process, on the Optuna version
they were written against).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import optuna


class ReadOnceTPESampler(optuna.samplers.TPESampler):
    """TPE that reads the study's trials from the storage once per ask.

    With ``constant_liar`` Optuna 5.0 re-reads all trials for every parameter it samples, so
    that the other workers' running trials count (``use_cache=False`` in ``_sample``). On
    PostgreSQL each read is seven statements; a four-parameter ask made five. The trials read
    at the ask's first parameter already hold every running trial of every worker, and a
    trial that starts elsewhere between two parameters of one ask adds nothing to either.
    The same trials split the same way for every parameter: the split is made once an ask
    (``split_once_per_ask``)."""

    _view: "_TrialsReadOnce | None" = None  # the current ask's
    #: by (storage, study, search space): each finished trial's parameters in TPE's internal
    #: representation, or _LACKS_ONE
    _internal_reprs: dict[tuple[Any, ...], dict[int, Any]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._internal_reprs = {}

    def _sample(self, study: optuna.Study, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        key = (id(study._storage), study._study_id, trial._trial_id)  # the ask's own trial
        view = self._view
        if view is None or view.key != key:
            view = self._view = _TrialsReadOnce(study, key)
        return super()._sample(view, trial, search_space)  # type: ignore[arg-type]  # a Study in all it reads

    def _get_internal_repr(self, trials: list[Any], search_space: dict[str, Any], study: Any) -> dict[str, np.ndarray]:
        """Optuna's conversion of the trials' parameters, each finished trial converted once per
        study and search space instead of on every ask: Optuna's loop over them, twice for
        every parameter, is a large share of a TPE ask at 1,000 trials (docs/method.md,
        Evidence). A finished trial's
        parameters do not change; a running trial's (multivariate TPE reads its planned
        ones) are converted on every ask, as before."""
        known = self._internal_reprs.setdefault((id(study._storage), study._study_id, tuple(search_space.items())), {})
        rows = list(map(known.get, map(_TRIAL_ID, trials)))  # the loop in C: it runs 8 times an ask
        for i, trial in enumerate(trials) if None in rows else ():
            if rows[i] is None:  # running, or not seen yet
                params = self._get_params(trial, study)
                rows[i] = (tuple(dist.to_internal_repr(params[name]) for name, dist in search_space.items())
                           if search_space.keys() <= params.keys() else _LACKS_ONE)  # fmt: skip
                if trial.state.is_finished():
                    known[trial._trial_id] = rows[i]
        if _LACKS_ONE in rows:
            rows = [row for row in rows if row is not _LACKS_ONE]
        columns = list(zip(*rows)) if rows else [() for _ in search_space]
        return {name: np.asarray(column) for name, column in zip(search_space, columns)}


_TRIAL_ID = operator.attrgetter("_trial_id")
_LACKS_ONE = object()  # a trial without one of the search space's parameters: Optuna leaves it out


class _TrialsReadOnce:
    """The study as TPE sees it during one ask: its trials come from the ask's one read, and
    ``splits`` keeps their split into good and bad (by the number of good ones)."""

    def __init__(self, study: optuna.Study, key: tuple[int, int, int]) -> None:
        self._study = study
        self.key = key
        self.splits: dict[int, tuple[list[Any], list[Any]]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _get_trials(self, deepcopy: bool = True, states: Any = None, use_cache: bool = False) -> list[Any]:
        return self._study._get_trials(deepcopy, states, use_cache=True)


def patch() -> None:
    """Put the module-level changes in place (process-wide; ``install`` calls it once)."""
    use_scipy_normal_functions()
    split_once_per_ask()


def use_scipy_normal_functions() -> None:
    """Optuna 5.0's TPE computes log Φ of its truncated normals one element at a time in
    Python, to do without SciPy (optuna#5478), and erf the same way for arrays under 2,000
    elements (a TPE ask at 1,000 trials makes 18 such calls): at 1,000 trials those loops are
    most of an ask (docs/method.md, Evidence). SciPy's ``log_ndtr`` is the function Optuna's was ported from and its
    ``erf`` agrees with Optuna's to 3 ulp, both vectorized, and SciPy is a dependency here
    already; put them in place. Optuna looks the names up at call time."""
    from optuna.samplers._tpe import _truncnorm
    from scipy.special import erf, log_ndtr

    # a later Optuna may have renamed or vectorized them
    if hasattr(_truncnorm, "_log_ndtr"):
        _truncnorm._log_ndtr = log_ndtr
    if hasattr(_truncnorm, "erf"):
        _truncnorm.erf = erf


def split_once_per_ask() -> None:
    """Optuna 5.0's TPE splits the trials into good and bad for every parameter it samples:
    at 1,000 trials a third of a four-parameter ask. Within one ask of ``ReadOnceTPESampler``
    the trials are the same for every parameter, so the first split serves the others. Any
    other study is split as before. Optuna looks the name up at call time."""
    from optuna.samplers._tpe import sampler as tpe

    split = tpe._split_trials
    if getattr(split, "once_per_ask", False):
        return

    def split_trials(study: Any, trials: list[Any], n_below: int) -> tuple[list[Any], list[Any]]:
        if not isinstance(study, _TrialsReadOnce):
            return split(study, trials, n_below)
        if n_below not in study.splits:
            study.splits[n_below] = split(study, trials, n_below)  # type: ignore[arg-type]  # a Study in all it reads
        below, above = study.splits[n_below]
        return list(below), list(above)

    split_trials.once_per_ask = True  # type: ignore[attr-defined]
    tpe._split_trials = split_trials
