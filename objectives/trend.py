"""Trend fits of a reward series and their moving-block bootstrap (see objectives/score.py).

Every fit takes steps on a unit time axis and a (1 + n_boot, n) weight matrix whose first row
is the data (all ones) and whose other rows count each step in one bootstrap resample, and
returns the chord of its trend over the scored window with the resamples' chords.
"""

from __future__ import annotations

import math

import numpy as np


def block_indices(n: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Moving-block bootstrap: (n_boot, n) indices built from runs of consecutive steps."""
    block = max(2, int(round(n ** (1.0 / 3.0) * 1.5)))
    n_blocks = int(math.ceil(n / block))
    starts = rng.integers(0, n - block + 1, size=(n_boot, n_blocks))
    idx = (starts[:, :, None] + np.arange(block)[None, None, :]).reshape(n_boot, n_blocks * block)
    return idx[:, :n]


class Fit:
    """The fitted trend of one run, plus its moving-block bootstrap replicates of the chord."""

    def __init__(self, chord: float, first: float, last: float, boot: np.ndarray,
                 ceiling: float | None = None, curve: tuple[float, float, float, float] | None = None) -> None:
        self.chord, self.first, self.last, self.boot, self.ceiling = chord, first, last, boot, ceiling
        #: the data's fitted (R0, A, t_mid, B), for a curve fit
        self.curve = curve

    def chord_over(self, t_lo: float, t_hi: float) -> float:
        """The fitted curve's rise between two times on the fit's axis (a curve fit only)."""
        if self.curve is None:
            raise ValueError("chord_over needs a curve fit (fit_curve)")
        r0, a, t_mid, b = self.curve
        g = _curve_basis(np.array([t_lo, t_hi]), np.array([t_mid]), np.array([b]))[0]
        return float((a - r0) * (g[1] - g[0]))


def boot_weights(n: int, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot, n) counts of how often each step appears in each block-bootstrap resample."""
    rng = np.random.default_rng(seed)
    idx = block_indices(n, n_boot, rng)
    weights = np.zeros((n_boot, n))
    np.add.at(weights, (np.repeat(np.arange(n_boot), n), idx.ravel()), 1.0)
    return weights


def _weighted_lstsq(weights: np.ndarray, design: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients of y ≈ design @ c for each row of weights: (b, n), (n, p), (n,) → (b, p)."""
    gram = np.einsum("bn,np,nq->bpq", weights, design, design)
    moment = weights @ (design * y[:, None])
    gram += np.eye(design.shape[1])[None] * 1e-12  # a resample of few blocks can be singular
    return np.linalg.solve(gram, moment[..., None])[..., 0]


def fit_poly(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> Fit:
    """OLS line on the unit time axis: chord = slope (the row of ones in weights is the data)."""
    design = np.stack([np.ones_like(x), x], axis=1)
    coef = _weighted_lstsq(weights, design, y)
    chord = coef[:, 1]
    return Fit(float(chord[0]), float(coef[0, 0]), float(coef[0].sum()), chord[1:])


def fit_windows(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> Fit:
    """Mean of the last fifth minus mean of the first fifth over the time between them."""
    n = x.size
    w = max(2, n // 5)
    head, tail = np.zeros(n), np.zeros(n)
    head[:w], tail[-w:] = 1.0, 1.0
    wh, wt = weights * head, weights * tail
    with np.errstate(divide="ignore", invalid="ignore"):
        dy = (wt @ y) / wt.sum(1) - (wh @ y) / wh.sum(1)
        dx = (wt @ x) / wt.sum(1) - (wh @ x) / wh.sum(1)
        chord = dy / dx
    centre = float(y.mean() - chord[0] * x.mean())
    return Fit(float(chord[0]), centre, centre + float(chord[0]), chord[1:])


def _curve_basis(t: np.ndarray, t_mids: np.ndarray, bs: np.ndarray) -> np.ndarray:
    """g(t) = 1/(1+(t_mid/t)^B) for each grid point: (k, n); g(0) = 0. As exp(B·log(t_mid/t)):
    faster than a float power, and in one buffer: fresh (k, n) temporaries cost more in page
    faults than the arithmetic on them (values bit-identical; docs/method.md, Evidence)."""
    with np.errstate(divide="ignore", over="ignore"):
        g = np.subtract.outer(np.log(t_mids), np.log(np.maximum(t, 1e-12)))
        g *= bs[:, None]
        np.exp(g, out=g)
        g += 1.0
        return np.reciprocal(g, out=g)


#: rows of a solve whose (rows, grid) arithmetic is done together: ~200 KB an array, so its
#: two dozen temporaries stay in cache (bit-identical: each element is computed as before;
#: docs/method.md, Evidence)
_ROW_BLOCK = 32


def _grid_solve(weights: np.ndarray, g: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Closed-form (R0, A) for every (resample, grid point) and its weighted SSE.

    R(t) = R0 (1 − g) + A g is linear in (R0, A) given the grid point's g, and each weighted
    sum is a matrix product over steps, so refitting every bootstrap resample on the whole
    grid costs three matrix products (the sums with u = 1 − g follow from those with g).
    """
    sw, swg, svv, svr = weights.sum(1)[:, None], weights @ g.T, weights @ (g * g).T, weights @ (g * y).T  # (b, k)
    wy, syy = (weights @ y)[:, None], (weights @ (y * y))[:, None]
    r0, a, sse = np.empty_like(swg), np.empty_like(swg), np.empty_like(swg)
    for lo in range(0, weights.shape[0], _ROW_BLOCK):
        rows = slice(lo, lo + _ROW_BLOCK)
        r0[rows], a[rows], sse[rows] = _solve_rows(sw[rows], swg[rows], svv[rows], svr[rows], wy[rows], syy[rows])
    return r0, a, sse


def _solve_rows(sw: np.ndarray, swg: np.ndarray, svv: np.ndarray, svr: np.ndarray, wy: np.ndarray,
                syy: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    suv = swg - svv  # Σ w (1−g) g
    suu = sw - 2 * swg + svv  # Σ w (1−g)²
    sur = wy - svr  # Σ w (1−g) y
    det = suu * svv - suv**2
    with np.errstate(divide="ignore", invalid="ignore"):
        r0 = (svv * sur - suv * svr) / det
        a = (suu * svr - suv * sur) / det
        sse = syy - 2 * (r0 * sur + a * svr) + r0 * r0 * suu + a * a * svv + 2 * r0 * a * suv
    sse = np.where(np.isfinite(sse) & (np.abs(det) > 1e-12 * suu * svv), sse, np.inf)
    return r0, a, sse


def fit_curve(t: np.ndarray, y: np.ndarray, weights: np.ndarray, t_lo: float, t_hi: float,
               *, max_extrapolation: float = 3.0) -> Fit:
    """Saturating-curve fit R(t) = R0 + (A−R0)/(1+(t_mid/t)^B); chord over [t_lo, t_hi].

    ``t`` is time since training began (so R(0) = R0 is the untrained policy's reward). The
    coarse grid spans t_mid from 1% of the run to ``2 × max_extrapolation`` × its length; a
    finer grid around the data's optimum is added, and every resample takes the best point of
    both. A single row of weights (the data alone) gives the rate without an interval.
    """
    span = t_hi
    t_grid = np.geomspace(span / 100.0, span * max_extrapolation * 2, 40)
    b_grid = np.geomspace(0.3, 5.0, 20)
    tm, bb = (m.ravel() for m in np.meshgrid(t_grid, b_grid, indexing="ij"))
    coarse = _curve_basis(t, tm, bb)
    r0, a, sse = _grid_solve(weights[:1], coarse, y)
    best = int(np.argmin(sse[0]))  # the fine grid centres on the data's own optimum
    # The data alone is solved as two rows: a matrix product of one row sums in another order,
    # and on a few steps that rounding alone moves the picked point (and the rate) far.
    n_rows = weights.shape[0]
    weights = weights if n_rows > 1 else np.vstack([weights, weights])
    r0, a, sse = _grid_solve(weights, coarse, y)
    fine_t = np.geomspace(tm[best] / 1.4, tm[best] * 1.4, 15)
    fine_b = np.geomspace(bb[best] / 1.4, bb[best] * 1.4, 15)
    ft, fb = (m.ravel() for m in np.meshgrid(fine_t, fine_b, indexing="ij"))
    fine_r0, fine_a, fine_sse = _grid_solve(weights, _curve_basis(t, ft, fb), y)
    rows = np.arange(weights.shape[0])
    pick, fine_pick = np.argmin(sse, axis=1), np.argmin(fine_sse, axis=1)  # row 0 = the data
    fine = fine_sse[rows, fine_pick] < sse[rows, pick]  # a tie keeps the coarse point
    r0_b = np.where(fine, fine_r0[rows, fine_pick], r0[rows, pick])
    a_b = np.where(fine, fine_a[rows, fine_pick], a[rows, pick])
    tm_b, bb_b = np.where(fine, ft[fine_pick], tm[pick]), np.where(fine, fb[fine_pick], bb[pick])
    g_lo = _curve_basis(np.array([t_lo]), tm_b, bb_b)[:, 0]
    g_hi = _curve_basis(np.array([t_hi]), tm_b, bb_b)[:, 0]
    # Chord on the unit axis of the scored window, like the other estimators.
    chord = (a_b - r0_b) * (g_hi - g_lo)
    first = float(r0_b[0] + (a_b[0] - r0_b[0]) * g_lo[0])
    last = float(r0_b[0] + (a_b[0] - r0_b[0]) * g_hi[0])
    t_mid0, b0 = float(tm_b[0]), float(bb_b[0])
    identified = (
        t_mid0 <= max_extrapolation * t_hi
        and t_mid0 > t_grid[0]
        and b0 < b_grid[-1]
        and math.isfinite(float(a_b[0]))
    )
    return Fit(float(chord[0]), first, last, chord[1:n_rows], float(a_b[0]) if identified else None,
               curve=(float(r0_b[0]), float(a_b[0]), t_mid0, b0))
