"""How good a gate can get: the parametric model of the tuning curve, through ``opda``.

Lourie, Cho and He show that the objective of random search approaches a *noisy quadratic* distribution in its tail
(``opda.parametric.NoisyQuadraticDistribution``, opda 0.8: ``a`` the mean objective of the best configurations, ``b``
the largest, ``c`` the effective number of hyperparameters, ``o`` the noise's standard deviation; convex when
minimising, concave when maximising). As their notebook "Validating the Parametric Analysis in Practice" does:

* **The fit.** ``NoisyQuadraticDistribution.fit`` (maximum spacing) to the best :data:`TAIL` of a study's
  objectives, the others censored above the threshold (``limits``), ``convex`` fixed by the direction and ``c`` at
  most the number of tuned hyperparameters. The **best objective a gate can reach** is ``a`` when minimising
  (``b`` when maximising): the mean objective of its best configuration without the noise of one training run.
* **The interval** (a consonance interval, Easterling 1976, as the notebook computes it): every noisy quadratic of a
  grid over ``(a, b, c, o)`` whose CDF lies inside the exact distribution-free band of the trials
  (:func:`mtmoe.tuning.bands` uses the same ``EmpiricalDistribution.confidence_bands``) over the tail; the interval
  is the range of their ``a``, widened by one grid step each side. If the tail is a noisy quadratic, the true one
  is inside the band with probability at least ``confidence``, so the interval covers ``a`` with that probability
  (up to the grid); an end at the grid's edge is unbounded (the trials do not bound it).
* **Trials to come within a distance** of the best: the smallest s whose median best of s random configurations
  under the fit (``quantile_tuning_curve``) is within ``within * |a|`` of ``a``.

``benchmarks/bench_parametric_coverage.py`` measures how often the interval covers the truth.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd

from mtmoe.tuning.bands import METHOD, _generator

#: The fraction of the best trials the model is fitted to (the rest censored); the notebook's tails hold 34-57%.
TAIL = 0.5
#: Fewest trials in the tail for a fit (the model has four parameters).
MIN_TAIL = 4
#: The largest number of trials searched for ``trials_within``.
MAX_TRIALS = 10**7
#: The consonance grid, in units of the tail's spread (threshold - best trial): ``a`` from 3 spreads below the best
#: trial to 1 above the threshold, ``b - a`` and ``o`` on log grids.
A_STEPS, B_STEPS, O_STEPS = 32, 16, 6


def tail_threshold(objectives: np.ndarray, minimize: bool = True) -> float:
    """The censoring threshold: the worst of the best :data:`TAIL` of ``objectives`` (at least :data:`MIN_TAIL`;
    the caller checks there are that many finite ones)."""
    values = np.asarray(objectives, dtype=np.float64)
    finite = np.sort(values[np.isfinite(values)])
    return float((finite if minimize else finite[::-1])[max(MIN_TAIL, math.ceil(TAIL * len(values))) - 1])


def fit_tail(objectives: np.ndarray, dims: int, threshold: float, minimize: bool = True, seed: int = 0):
    """The ``NoisyQuadraticDistribution`` fitted to ``objectives`` censored beyond ``threshold`` (a failed trial,
    +inf, too), ``convex`` by the direction, ``c`` in ``[1, dims]``."""
    from opda.parametric import NoisyQuadraticDistribution

    values = np.asarray(objectives, dtype=np.float64)
    limits = (-np.inf, threshold) if minimize else (threshold, np.inf)
    censored = np.where(np.isfinite(values), values, np.inf if minimize else -np.inf)
    constraints = {"convex": minimize, "c": (1, min(max(dims, 1), NoisyQuadraticDistribution.C_MAX))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return NoisyQuadraticDistribution.fit(censored, limits=limits, constraints=constraints,
                                              generator=np.random.default_rng(seed))


def consonance_interval(objectives: np.ndarray, dims: int, threshold: float, confidence: float,
                        minimize: bool = True) -> tuple[float, float]:
    """The range of the best objective (``a`` minimising, ``b`` maximising) over the noisy quadratics inside the
    exact band of ``objectives`` on their tail (beyond ``threshold``): ``(low, high)``, an end ``-inf``/``inf`` where
    the grid's edge is inside (unbounded). Maximising is minimising ``-objectives`` (opda's duality ``Y ~ Q_max(a,
    b) <=> -Y ~ Q_min(-b, -a)``)."""
    from opda.nonparametric import EmpiricalDistribution
    from opda.parametric import NoisyQuadraticDistribution

    sign = 1.0 if minimize else -1.0
    values = sign * np.asarray(objectives, dtype=np.float64)  # failed trials: +inf either way
    values = np.where(np.isfinite(values), values, np.inf)
    cut = sign * threshold
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Duplicates detected", RuntimeWarning)
        lower, _, upper = EmpiricalDistribution.confidence_bands(
            values, confidence, generator=_generator(len(values), confidence), method=METHOD, n_jobs=1)
    tail = np.sort(values[values <= cut])
    points = np.concatenate([[-np.inf], tail, [cut]])
    floor, ceiling = lower.cdf(points[1:]), upper.cdf(points[:-1])
    spread = max(cut - tail[0], 1e-12 * max(abs(cut), 1.0))
    a_grid = np.linspace(tail[0] - 3 * spread, cut + spread, A_STEPS)
    widths = np.geomspace(0.05 * spread, 100 * spread, B_STEPS)
    noises = np.concatenate([[0.0], np.geomspace(0.01 * spread, 2 * spread, O_STEPS - 1)])
    c_max = min(max(dims, 1), NoisyQuadraticDistribution.C_MAX)

    def inside(a: float) -> bool:
        for c in range(1, c_max + 1):
            for o in noises:
                for width in widths:
                    cdf = NoisyQuadraticDistribution(a, a + width, c, o, convex=True).cdf(points[1:])
                    if np.all(cdf >= floor) and np.all(cdf <= ceiling):
                        return True
        return False

    first = next((i for i in range(A_STEPS) if inside(a_grid[i])), None)
    if first is None:  # no noisy quadratic fits the tail at this confidence
        return math.nan, math.nan
    last = next(i for i in reversed(range(first, A_STEPS)) if i == first or inside(a_grid[i]))
    low = -np.inf if first == 0 else a_grid[first - 1]
    high = np.inf if last == A_STEPS - 1 else a_grid[last + 1]
    return (float(low), float(high)) if minimize else (float(-high), float(-low))


def trials_within(fitted, within: float, minimize: bool = True) -> int:
    """The smallest s whose median best of s configurations under ``fitted`` is within ``within * |best|`` of its
    best (``a`` minimising, ``b`` maximising); :data:`MAX_TRIALS` + 1 if none up to it."""
    best = fitted.a if minimize else fitted.b
    target = best + within * abs(best) if minimize else best - within * abs(best)

    def reached(s: int) -> bool:
        value = float(fitted.quantile_tuning_curve(s, q=0.5, minimize=minimize))
        return value <= target if minimize else value >= target

    if not reached(MAX_TRIALS):
        return MAX_TRIALS + 1
    low, high = 0, MAX_TRIALS  # reached(high), not reached(low) (s = 0: no trial)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if reached(middle) else (middle, high)
    return high


def estimate(objectives: np.ndarray, dims: int, confidence: float, within: float, minimize: bool = True,
             seed: int = 0) -> dict:
    """A study's estimate: ``best`` with its interval (``best_low``, ``best_high``), ``trials_within``, the fit's
    parameters and its tail (``tail``: trials fitted, ``threshold``); ``note`` says why there is none (too few
    finite trials, or no spread)."""
    values = np.asarray(objectives, dtype=np.float64)
    finite = values[np.isfinite(values)]
    needed = max(MIN_TAIL, math.ceil(TAIL * len(values)))
    empty = {"best": math.nan, "best_low": math.nan, "best_high": math.nan, "trials_within": math.nan,
             "a": math.nan, "b": math.nan, "c": math.nan, "o": math.nan, "tail": 0, "threshold": math.nan}
    if len(finite) < needed or len(values) < 2 * MIN_TAIL:
        return {**empty, "note": f"{len(finite)} finite of {len(values)} trials: the noisy quadratic model needs at "
                                 f"least {2 * MIN_TAIL}, and {MIN_TAIL} finite in its tail (run more trials)"}
    threshold = tail_threshold(values, minimize)
    tail = finite[finite <= threshold] if minimize else finite[finite >= threshold]
    if np.ptp(tail) == 0:
        return {**empty, "note": "the best trials tie: no spread to fit"}
    fitted = fit_tail(values, dims, threshold, minimize, seed)
    low, high = consonance_interval(values, dims, threshold, confidence, minimize)
    return {"best": float(fitted.a if minimize else fitted.b), "best_low": low, "best_high": high,
            "trials_within": trials_within(fitted, within, minimize), "a": float(fitted.a), "b": float(fitted.b),
            "c": int(fitted.c), "o": float(fitted.o), "tail": len(tail), "threshold": threshold,
            "note": "" if not math.isnan(low) else "no noisy quadratic lies inside the band: the model does not fit"}


def search_dims(group: pd.DataFrame) -> int:
    """The number of hyperparameters a study tunes (distributions of more than one value), from its first trial."""
    distributions = group.distributions.iloc[0]
    return sum(not distribution.single() for distribution in distributions.values())


def parametric_estimates(trials: pd.DataFrame, confidence: float, within: float, seed: int = 0) -> pd.DataFrame:
    """One row per study of the trial table: :func:`estimate` of its validation objective (minimised; a failed
    trial counts as +inf, censored)."""
    rows = []
    for study, group in trials.groupby("study", sort=False):
        first = group.iloc[0]
        rows.append({"data": first.data, "alpha": first.alpha, "gate": first.gate, "study": study,
                     "evaluated": len(group), "dims": search_dims(group),
                     **estimate(group.objective.to_numpy(), search_dims(group), confidence, within, True, seed)})
    return pd.DataFrame(rows)
