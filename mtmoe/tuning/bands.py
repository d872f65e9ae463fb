"""Exact confidence bands for the tuning curve of the validation objective, and the reduction factor with its interval.

Lourie, Cho and He, "Show Your Work with Confidence: Confidence Bands for Tuning Curves" (NAACL 2024, arXiv
2311.09480), through their library ``opda`` (:class:`opda.nonparametric.EmpiricalDistribution`); nothing of it is
re-derived here.

* **The objective's tuning curve.** Per study, the N evaluated configurations' validation objectives (a failed
  trial counts with objective +inf: a gate that often fails pays for it) are N draws from the distribution F of the
  objective of a random configuration. The *median tuning curve* is the median of the best (lowest) objective among
  s random configurations, ``tau(s) = Q(1 - 2^(-1/s))`` with Q the quantile function of F (minimisation: the best
  of s is below y with probability ``1 - (1 - F(y))^s``); ``quantile_tuning_curve(s, q=0.5, minimize=True)``.
* **Its exact band.** ``confidence_bands`` gives a band that holds F everywhere at once with probability
  ``confidence`` (Learned-Miller-DeStefano, ``ld_equal_tailed``: opda's docs give it "almost the same size" as the
  highest-density variant and "significantly faster"); the quantile tuning curve of its upper CDF is the curve's
  lower edge and that of its lower CDF the upper edge, at every s at once: **simultaneous over s and
  distribution-free**. Exact for a continuous objective up to opda's simulated critical value (100,000 draws, from
  a fixed seed: 1 - confidence within about 5% of itself at 95%, 10% at 99%); with ties or failed trials (an atom
  at +inf) at least as wide as needed (``benchmarks/bench_band_coverage.py`` measures both). Where N trials cannot
  bound the curve an edge is infinite: the lower edge beyond a few budgets (N trials cannot show how much better
  many more might get), the upper edge at s = 1 below :func:`trials_needed`.
* **Not for the test loss of the best-validation trial** (Appendix F's plotted quantity): it depends on the joint
  distribution of validation objective and test loss, which a band for one CDF does not bound. There the bootstrap
  of :mod:`mtmoe.tuning.bootstrap` stays, a range of outcomes rather than a confidence band.
* **The expected best objective** of s configurations: Tang et al. 2020's unbiased estimator ("Showing Your Work
  Doesn't Always Work"; the U-statistic of drawing without replacement, opda's ``u_tuning_curve``), computed by the
  hypergeometric closed form of :func:`mtmoe.tuning.bootstrap.expected_curve`; Dodge et al.'s with-replacement
  estimator is biased. It has no distribution-free band: that needs a bounded support, and a loss has none above.
* **Reduction factor of A over B** at B's budget s_B, on the median curves: the paper's definition
  (:func:`mtmoe.tuning.bootstrap.reduction_factors`) with its point estimate, and its **interval**: the smallest and
  largest factors ``s_B' / s_A`` of any pair of non-increasing curves inside the two studies' bands
  (:func:`factor_interval`). Each band is taken at ``1 - (1 - confidence) / 2`` (Bonferroni), so the intervals of
  every s_B hold together with probability at least ``confidence``, whatever the dependence between the studies.
"""
from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import pandas as pd

from mtmoe.tuning.bootstrap import (
    PAPER_MAX_BUDGET,
    Settings,
    budget_grid,
    expected_curve,
    factor_range,
    reduction_factors,
)
from mtmoe.tuning.trials import as_text

METHOD = "ld_equal_tailed"


def pair_confidence(confidence: float) -> float:
    """Each band's confidence for a factor interval at ``confidence`` (Bonferroni over the two studies)."""
    return 1 - (1 - confidence) / 2


def percent(confidence: float) -> str:
    return f"{100 * confidence:.4g}%"


@functools.cache
def _generator(n: int, confidence: float) -> np.random.Generator:
    """The generator of opda's simulated critical value for n trials, from a fixed seed: one object per (n,
    confidence), so that opda's cache (keyed on it) computes each band's weights once per process and a band
    depends on the trials and the confidence alone."""
    return np.random.default_rng([n, round(confidence * 1e9)])


def median_band(objectives: np.ndarray, budgets: np.ndarray, confidence: float) -> dict[str, np.ndarray]:
    """The median tuning curve of a minimised objective at ``budgets`` and its exact simultaneous band at
    ``confidence``: ``{"median", "low", "high"}``, an edge +-inf where the trials do not bound it."""
    from opda.nonparametric import EmpiricalDistribution  # here: scipy's import would slow `bootstrap --help`

    values = np.asarray(objectives, dtype=np.float64)
    with warnings.catch_warnings():  # ties make the band conservative; the report says which studies have them
        warnings.filterwarnings("ignore", "Duplicates detected", RuntimeWarning)
        lower_cdf, point, upper_cdf = EmpiricalDistribution.confidence_bands(
            values, confidence, generator=_generator(len(values), confidence), method=METHOD, n_jobs=1)
    curves = {name: cdf.quantile_tuning_curve(budgets, q=0.5, minimize=True)
              for name, cdf in (("median", point), ("low", upper_cdf), ("high", lower_cdf))}
    return {name: np.asarray(curve, dtype=np.float64) for name, curve in curves.items()}


def bounded(n: int, confidence: float) -> bool:
    """Whether the band of n trials bounds the median of one configuration on both sides (it depends on n alone)."""
    band = median_band(np.arange(n, dtype=np.float64), np.array([1]), confidence)
    return bool(np.isfinite(band["low"][0]) and np.isfinite(band["high"][0]))


def trials_needed(confidence: float) -> int:
    """The fewest trials whose band at ``confidence`` bounds the median of one configuration (8 at 95%)."""
    n = 1
    while not bounded(n, confidence):
        n += 1
    return n


def _objectives(trials: pd.DataFrame) -> np.ndarray:
    """A study's validation objectives, every evaluated configuration (failed: +inf)."""
    return trials.objective.to_numpy(dtype=np.float64)


def unbounded_studies(trials: pd.DataFrame, confidence: float) -> dict[str, int]:
    """The studies (and their evaluated trials) too small for the exact bands at ``confidence``: their bands and
    factor intervals are left out (:func:`trials_needed` says how many they need)."""
    sizes = trials.groupby("study", sort=False).size()  # in the table's order
    return {study: int(n) for study, n in sizes.items() if not bounded(int(n), confidence)}


def objective_curves(trials: pd.DataFrame, settings: Settings = Settings()) -> pd.DataFrame:
    """One row per study and budget s = 1..min(N, largest budget): the median tuning curve of the objective with its
    exact band at ``settings.confidence`` (``median, low, high``) and the unbiased expected best (``expected``).
    A study too small to bound the median of one configuration (:func:`unbounded_studies`) has its curves and no
    band (``low``, ``high`` NaN)."""
    frames = []
    small = unbounded_studies(trials, settings.confidence)
    for study, group in trials.groupby("study", sort=True):
        values = _objectives(group)
        n = len(values)
        budgets = np.arange(1, min(n, settings.max_budget or PAPER_MAX_BUDGET) + 1)
        curves = median_band(values, budgets, settings.confidence)
        if study in small:
            curves.update(low=np.full(len(budgets), np.nan), high=np.full(len(budgets), np.nan))
        first = group.iloc[0]
        frames.append(pd.DataFrame({
            "data": first.data, "alpha": as_text(first.alpha), "gate": first.gate, "study": study, "evaluated": n,
            "failed": int(np.isinf(values).sum()), "ties": len(np.unique(values)) < n, "s": budgets, **curves,
            "expected": expected_curve(np.sort(values))[budgets - 1]}))
    return pd.concat(frames, ignore_index=True)


# ------------------------------------------------------------------------------------------------ factor interval


def _first(curve: np.ndarray, levels: np.ndarray, default: float) -> np.ndarray:
    """Per level: the first budget (from 1) at which ``curve`` is at or below it; ``default`` where it never is."""
    hits = curve[None, :] <= levels[:, None]
    return np.where(hits.any(axis=1), hits.argmax(axis=1) + 1, default)


def factor_interval(band_a: dict[str, np.ndarray], band_b: dict[str, np.ndarray], s_b: int) -> dict[str, object]:
    """The smallest and largest factors ``s_B' / s_A`` at B's budget ``s_b`` of any non-increasing curves inside
    the bands (``band_x["low"|"high"][s-1]``, every s up to N_X): B's level L = tau_B(s_b), anywhere in its band;
    ``s_A = min{s : tau_A(s) <= L}``, ``s_B' = min{s <= s_b : tau_B(s) <= L}``. The largest puts A at its band's
    lower edge and B at its upper edge (before s_b), the smallest the other way round; both are step functions of L
    that change only at the edges' values, so every such value in B's band at s_b is tried. ``factor_low`` 0: A may
    not reach B's level within its N_A trials (bound ``never``); ``>=`` on ``factor_high``: A may beat B's level
    with one trial (the factor may be larger)."""
    low_b, high_b = band_b["low"][s_b - 1], band_b["high"][s_b - 1]
    edges = np.concatenate([band_a["low"], band_a["high"], band_b["low"][:s_b], band_b["high"][:s_b]])
    levels = np.unique(np.concatenate([[low_b], edges[(edges > low_b) & (edges <= high_b)]]))
    fastest_a = _first(band_a["low"], levels, math.inf)
    largest = _first(band_b["high"][:s_b], levels, s_b) / fastest_a
    smallest = _first(band_b["low"][:s_b], levels, s_b) / _first(band_a["high"], levels, math.inf)
    low, high = float(smallest.min()), float(largest.max())
    beats = np.any((largest == high) & (fastest_a == 1) & (band_a["low"][0] < levels))
    return {"factor_low": low, "low_bound": "never" if low == 0 else "", "factor_high": high,
            "high_bound": "never" if high == 0 else ">=" if beats else ""}


#: The factor interval of a pair with a study too small for the exact bands: left out.
NO_INTERVAL = {"factor_low": math.nan, "low_bound": "", "factor_high": math.nan, "high_bound": ""}
OBJECTIVE_RANGE_COLUMNS = ["median_min", "median_max", "median_min_bound", "median_max_bound", "interval_low",
                           "interval_high", "interval_low_bound", "interval_high_bound", "unbiased_min",
                           "unbiased_max", "unbiased_min_bound", "unbiased_max_bound"]


def objective_factors(trials: pd.DataFrame, pairs: list[tuple[str, str]], settings: Settings = Settings()
                      ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(every grid s_B of every pair, one range row per pair) on the objective's curves, in each panel (dataset,
    alpha) that holds both gates. Per s_B: the median curves' factor (``level, s_b_reach, s_a, factor, bound``) with
    its interval from the bands at :func:`pair_confidence` (``factor_low, low_bound, factor_high, high_bound``), and
    the unbiased expected curves' factor (``unbiased_factor, unbiased_bound``). Ranges over s_B >= 2 as
    :func:`mtmoe.tuning.bootstrap.factor_range`; the interval's over the s_B >= 2, which hold together."""
    confidence = pair_confidence(settings.confidence)
    small = unbounded_studies(trials, settings.confidence)
    details, ranges = [], []
    for (data, alpha), panel in trials.groupby([trials.data, trials.alpha.map(as_text)], sort=True):
        curves = {}
        for gate, group in panel.groupby("gate"):
            values = _objectives(group)
            budgets = np.arange(1, len(values) + 1)
            curves[gate] = {**median_band(values, budgets, confidence), "banded": group.study.iloc[0] not in small,
                            "expected": expected_curve(np.sort(values))}
        for gate_a, gate_b in pairs:
            if gate_a not in curves or gate_b not in curves:
                continue
            a, b = curves[gate_a], curves[gate_b]
            grid = budget_grid(min(len(b["median"]), settings.max_budget or PAPER_MAX_BUDGET))
            median = reduction_factors(a["median"], b["median"], grid)
            unbiased = reduction_factors(a["expected"], b["expected"], grid)
            interval = pd.DataFrame([factor_interval(a, b, int(s_b)) if a["banded"] and b["banded"] else NO_INTERVAL
                                     for s_b in grid])
            key = {"data": data, "alpha": alpha, "gate_a": gate_a, "gate_b": gate_b}
            details.append(pd.concat([median.assign(**key)[[*key, *median.columns]], interval,
                                      unbiased[["factor", "bound"]].add_prefix("unbiased_")], axis=1))
            late = interval[(grid >= 2) & interval.factor_low.notna()]  # empty for --max-budget 1, or no bands
            span = {"interval_low": math.nan, "interval_high": math.nan, "interval_low_bound": "",
                    "interval_high_bound": ""}
            if len(late):
                low, high = late.loc[late.factor_low.idxmin()], late.loc[late.factor_high.idxmax()]
                span = {"interval_low": low.factor_low, "interval_high": high.factor_high,
                        "interval_low_bound": low.low_bound, "interval_high_bound": high.high_bound}
            ranges.append({**key, **_prefixed(factor_range(median), "median"), **span,
                           **_prefixed(factor_range(unbiased), "unbiased")})
    columns = ["data", "alpha", "gate_a", "gate_b", *OBJECTIVE_RANGE_COLUMNS]
    detail = pd.concat(details, ignore_index=True) if details else pd.DataFrame(columns=columns[:4])
    return detail, pd.DataFrame(ranges, columns=columns)


def _prefixed(span: dict, prefix: str) -> dict:
    """:func:`factor_range`'s min, max and bounds under ``prefix``."""
    return {f"{prefix}_min": span["factor_min"], f"{prefix}_max": span["factor_max"],
            f"{prefix}_min_bound": span["min_bound"], f"{prefix}_max_bound": span["max_bound"]}
