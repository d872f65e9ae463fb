"""The objective's exact bands (:mod:`mtmoe.tuning.bands`, Lourie et al. 2024 through opda): the minimisation
direction, coverage on a few hundred replications, the trials they need, the unbiased expected best, and the factor's
interval against enumeration of every pair of curves inside two bands.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from opda.nonparametric import EmpiricalDistribution
from scipy import stats

from mtmoe.tuning.bands import bounded, factor_interval, median_band, objective_curves, objective_factors, trials_needed
from mtmoe.tuning.bootstrap import Settings, budget_grid

from test_bootstrap import correlated_trials, table


def test_the_median_curve_minimises_and_its_band_holds_it() -> None:
    """s = 1: the sample's (lower) median; large s: the sample's minimum, not its maximum (opda maximises by
    default); the band around it, its lower edge unbounded beyond a few budgets, its upper edge bounded."""
    values = np.random.default_rng(0).gamma(1.5, 0.02, 21) + 0.4
    ordered = np.sort(values)
    band = median_band(values, np.arange(1, 22), 0.95)
    assert band["median"][0] == ordered[10] and band["median"][-1] == ordered[0]
    for curve in band.values():  # non-increasing, infinite edges included
        assert np.all(curve[1:] <= curve[:-1])
    assert np.all(band["low"] <= band["median"]) and np.all(band["median"] <= band["high"])
    assert np.isfinite(band["high"]).all() and ordered[0] <= band["high"][-1] < band["high"][0] <= ordered[-1]
    unbounded = np.isinf(band["low"])
    assert unbounded[-1] and not unbounded[0] and np.all(np.diff(unbounded.astype(int)) >= 0)
    assert median_band(values, np.arange(1, 22), 0.95)["low"].tolist() == band["low"].tolist()  # seeded


def true_median_curve(quantile, budgets: np.ndarray) -> np.ndarray:
    """tau(s) = Q(1 - 2^(-1/s)): the median of the best (lowest) of s draws."""
    return quantile(1 - 0.5 ** (1 / budgets))


COVERAGE_CASES = {
    "gamma": (lambda rng, n: 0.4 + rng.gamma(1.5, 0.02, n), lambda p: 0.4 + stats.gamma.ppf(p, 1.5, scale=0.02)),
    # ties: 3-decimal losses and a fifth of the configurations collapsed to one loss
    "discrete": (lambda rng, n: np.where(rng.random(n) < 0.2, 0.69, np.round(0.4 + rng.gamma(1.5, 0.02, n), 3)),
                 None),
}


def observed_coverage(case: str, n: int, confidence: float, replications: int, seed: int) -> float:
    draw, quantile = COVERAGE_CASES[case]
    rng = np.random.default_rng(seed)
    budgets = np.arange(1, n + 1)
    if quantile is None:  # the discrete case's quantiles, from a sample large enough to hold every atom's mass
        population = np.sort(draw(rng, 400_000))
        quantile = lambda p: population[np.ceil(p * len(population)).astype(int) - 1]  # noqa: E731
    truth = true_median_curve(quantile, budgets)
    hits = 0
    for _ in range(replications):
        band = median_band(draw(rng, n), budgets, confidence)
        hits += bool(np.all((band["low"] <= truth) & (truth <= band["high"])))
    return hits / replications


@pytest.mark.parametrize("case", list(COVERAGE_CASES))
def test_exact_bands_cover_at_least_nominally(case: str) -> None:
    """300 studies of 20 trials: the 95% band holds the true curve at every s at once in at least 95% of them, within
    two standard errors of a binomial proportion. The check can fail: a 50% band of the continuous objective does."""
    replications, nominal = 300, 0.95
    floor = nominal - 2 * math.sqrt(nominal * (1 - nominal) / replications)
    assert observed_coverage(case, 20, nominal, replications, seed=1) >= floor
    if case == "gamma":
        assert observed_coverage(case, 20, 0.5, replications, seed=1) < floor


def test_trials_needed_is_where_the_band_first_bounds_one_trial() -> None:
    assert trials_needed(0.95) == 8 and trials_needed(0.5) < 8
    assert bounded(8, 0.95) and not bounded(7, 0.95)
    band = median_band(np.arange(7.0), np.array([1]), 0.95)
    assert np.isinf(band["high"][0]) or np.isinf(band["low"][0])


def test_objective_curves_count_failed_trials_and_give_the_unbiased_expected_best() -> None:
    """A failed trial is a draw of +inf: the expected best is +inf while every draw can be failed, then Tang et al.'s
    unbiased U-statistic (opda's ``u_tuning_curve``) of the others' contribution."""
    objectives, losses = correlated_trials(12, 0)
    finite = objective_curves(table(objectives, losses), Settings(confidence=0.9))
    u = EmpiricalDistribution(objectives).u_tuning_curve(np.arange(1, 13), minimize=True)
    assert finite.expected.to_numpy() == pytest.approx(u, rel=1e-12)
    assert list(finite.s) == list(range(1, 13)) and set(finite.failed) == {0} and not finite.ties.any()
    failed = objective_curves(table(np.r_[objectives, np.inf, np.inf], np.r_[losses, np.nan, np.nan]))
    assert set(failed.evaluated) == {14} and set(failed.failed) == {2} and failed.ties.all()
    assert np.isinf(failed.expected[:2]).all() and np.isfinite(failed.expected[2:]).all()
    assert failed["median"].iloc[0] == np.sort(np.r_[objectives, np.inf, np.inf])[6]


# ------------------------------------------------------------------------------------------- factor interval


def curves_inside(band: dict[str, np.ndarray], values: np.ndarray) -> np.ndarray:
    """Every non-increasing curve with values in ``values`` inside the band, one per row."""
    n = len(band["low"])
    choices = [values[(values >= band["low"][s]) & (values <= band["high"][s])] for s in range(n)]
    rows = [c for c in itertools.product(*choices) if all(a >= b for a, b in zip(c, c[1:]))]
    return np.array(rows)


def enumerated_interval(band_a, band_b, s_b: int, values: np.ndarray) -> tuple[float, float]:
    """min and max of s_B' / s_A over every pair of curves inside the bands (0 where A never reaches the level)."""
    a, b = curves_inside(band_a, values), curves_inside(band_b, values)
    level = b[:, s_b - 1]
    reach_b = (b[:, :s_b] <= level[:, None]).argmax(axis=1) + 1
    hits = a[None, :, :] <= level[:, None, None]  # [curve of B, curve of A, s]
    s_a = np.where(hits.any(axis=2), hits.argmax(axis=2) + 1, np.inf)
    factors = reach_b[:, None] / s_a
    return factors.min(), factors.max()


def random_band(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """A non-increasing band on the integers 0..6 (its edges' values are the only levels that matter)."""
    low = np.sort(rng.integers(0, 5, n))[::-1].astype(float)
    high = np.maximum(np.sort(rng.integers(0, 7, n))[::-1], low).astype(float)
    return {"low": low, "high": high}


def test_factor_interval_is_the_min_and_max_over_every_pair_of_curves_inside_the_bands() -> None:
    """Random integer bands (A over 3 budgets, B over 4); the curves enumerated on a half-integer grid, so levels
    between the edges' values are tried too."""
    rng = np.random.default_rng(0)
    values = np.arange(0, 6.5, 0.5)
    seen = set()
    for _ in range(40):
        band_a, band_b = random_band(rng, 3), random_band(rng, 4)
        for s_b in range(1, 5):
            interval = factor_interval(band_a, band_b, s_b)
            low, high = enumerated_interval(band_a, band_b, s_b, values)
            assert (interval["factor_low"], interval["factor_high"]) == pytest.approx((low, high)), (band_a, band_b)
            assert (interval["low_bound"] == "never") == (low == 0)
            seen.add((low == 0, high >= 2))
    assert seen >= {(True, True), (False, True), (False, False)}  # "never", wide and narrow intervals all occurred


def test_the_point_factor_lies_in_its_interval_and_identical_studies_give_1() -> None:
    objectives, losses = correlated_trials(40, 3)
    trials = pd.concat([table(objectives, losses, gate="hash"), table(objectives, losses, gate="hash+"),
                        table(objectives - 0.004, losses, gate="topk"), table(objectives[:25], losses[:25], "comet")],
                       ignore_index=True)
    detail, ranges = objective_factors(trials, [("hash+", "hash"), ("topk", "hash"), ("hash", "comet")])
    assert len(detail) == 2 * len(budget_grid(40)) + len(budget_grid(25))
    defined = detail[detail.factor.notna()]
    assert (defined.factor_low <= defined.factor + 1e-12).all() and (defined.factor <= defined.factor_high).all()
    identical = detail[detail.gate_a == "hash+"]
    assert (identical.factor == 1).all() and (identical.unbiased_factor == 1).all()
    assert (identical.factor_low <= 1).all() and (identical.factor_high >= 1).all()
    better = ranges.set_index("gate_a").loc["topk"]
    assert better.median_max > 1 and better.unbiased_max > 1 and better.interval_high >= better.median_max
