"""The noisy quadratic model of the tuning curve (:mod:`mtmoe.tuning.parametric`, through opda): on samples from
known noisy quadratic distributions its interval covers the true best objective, minimising and maximising, and
the trials it needs are the first budget whose median curve comes within the distance."""
from __future__ import annotations

import math

import numpy as np
import pytest
from opda.parametric import NoisyQuadraticDistribution

from mtmoe.tuning.parametric import MIN_TAIL, estimate, fit_tail, tail_threshold, trials_within


@pytest.mark.parametrize("minimize", [True, False])
def test_the_interval_covers_the_best_objective_of_a_known_noisy_quadratic(minimize: bool) -> None:
    """A loss minimised (convex, best a = 0.35) and an AUC maximised (concave, best b = 0.92), 64 trials each."""
    truth = NoisyQuadraticDistribution(0.35, 0.75, 2, 0.004, convex=True) if minimize else \
        NoisyQuadraticDistribution(0.60, 0.92, 2, 0.004, convex=False)
    best = truth.a if minimize else truth.b
    found = estimate(truth.sample(64, generator=np.random.default_rng(7)), 2, 0.95, 0.01, minimize)
    assert found["note"] == "" and found["tail"] == 32
    assert found["best_low"] <= best <= found["best_high"]
    assert np.isfinite([found["best_low"], found["best_high"]]).all()  # 64 trials bound it, at both ends
    assert found["best"] == pytest.approx(best, abs=0.1 * (truth.b - truth.a))


def test_trials_within_is_the_first_budget_whose_median_reaches_the_distance() -> None:
    fitted = NoisyQuadraticDistribution(0.5, 0.9, 2, 0.002, convex=True)
    s = trials_within(fitted, 0.01, True)
    target = 0.5 * 1.01
    assert fitted.quantile_tuning_curve(s, minimize=True) <= target < fitted.quantile_tuning_curve(s - 1,
                                                                                                    minimize=True)
    concave = NoisyQuadraticDistribution(-0.9, -0.5, 2, 0.002, convex=False)  # the same, maximising -y
    assert trials_within(concave, 0.01, False) == s


def test_too_few_trials_or_ties_give_a_note_and_no_estimate() -> None:
    few = estimate(np.linspace(0.4, 0.5, 2 * MIN_TAIL - 1), 1, 0.95, 0.01)
    assert "needs at least 8" in few["note"] and math.isnan(few["best"])
    failed = estimate(np.r_[np.linspace(0.4, 0.5, 3), [np.inf] * 7], 1, 0.95, 0.01)  # 3 finite of 10
    assert "3 finite of 10 trials" in failed["note"] and math.isnan(failed["best_low"])
    tied = estimate(np.r_[[0.4] * 6, np.linspace(0.5, 0.6, 6)], 1, 0.95, 0.01)
    assert tied["note"] == "the best trials tie: no spread to fit"


def test_the_fit_censors_the_worse_half_and_failed_trials() -> None:
    """Changing the censored trials' values (the worse half, a failed one) does not change the fit."""
    rng = np.random.default_rng(3)
    values = np.sort(NoisyQuadraticDistribution(0.3, 0.6, 1, 0.003, convex=True).sample(20, generator=rng))
    threshold = tail_threshold(values)
    assert threshold == values[9]
    moved = np.r_[values[:10], values[10:] + 5.0]
    moved[-1] = np.inf
    one, other = fit_tail(values, 1, threshold), fit_tail(moved, 1, threshold)
    assert (one.a, one.b, one.c, one.o) == pytest.approx((other.a, other.b, other.c, other.o))
