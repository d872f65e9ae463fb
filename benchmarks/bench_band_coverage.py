"""Coverage of the tuning-curve bands on synthetic studies drawn from known distributions.

    python benchmarks/bench_band_coverage.py                                  # 1000 replications, N = 20, 50, 100, 500
    python benchmarks/bench_band_coverage.py --replications 100 --sizes 20    # a smoke run

A study of N trials is N draws of the validation objective from a known distribution; the best of s trials is the
lowest of s draws. Its true median tuning curve ``tau(s) = Q(1 - 2^(-1/s))`` and true expected best ``E[min of s]``
are computed from the distribution. Per replication, over s = 1..min(N, 250) (the expected curve: Appendix F's grid
of budgets), a band **covers** when it holds the true curve at every s at once (simultaneous), and pointwise at each s:

* **exact**: :func:`mtmoe.tuning.bands.median_band`, the band ``bootstrap`` reports (opda, Lourie et al. 2024);
* **bootstrap, median**: the percentile bootstrap confidence band of the same median curve (``--resamples`` resamples
  of the N trials with replacement, the 2.5th-97.5th percentile of the resampled curves at each s), the band Lourie
  et al. show to undercover;
* **bootstrap, expected**: the same for the expected best (Tang et al.'s unbiased estimator on each resample);
* **Appendix F**: the suite's bootstrap band as ``bootstrap`` computes it (``monte_carlo`` + ``summarize``: the
  2.5th-97.5th percentile of 1000 draws of s trials without replacement) read as a band for the expected best, the
  curve its mean estimates. It is a spread of outcomes, not a confidence band; this measures what reading it as one
  would give.

Distributions (objective-like: a floor and a right tail): ``normal`` 0.45 + 0.01 N(0, 1); ``gamma`` 0.40 + Gamma(1.5,
scale 0.02), the tests' model of a study; ``lomax`` 0.40 + 0.01 Lomax(1.5), a heavy tail (infinite variance);
``discrete`` a fifth of the configurations collapsed to 0.69, the others 0.40 + Gamma(1.5, 0.02) rounded to 3 decimals
(ties, as in real objectives). Prints a Markdown table and writes it with a JSON copy to
``benchmarks/out/band_coverage.{md,json}`` (``--out DIR``: to DIR).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
from scipy import integrate, stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtmoe.files import write_atomic  # noqa: E402
from mtmoe.tuning.bands import median_band  # noqa: E402
from mtmoe.tuning.bootstrap import (  # noqa: E402
    PAPER_MAX_BUDGET,
    BAND,
    best_rank_distribution,
    budget_grid,
    monte_carlo,
    summarize,
)

OUT = Path(__file__).resolve().parent / "out"


class Continuous:
    """A shifted and scaled scipy distribution."""

    def __init__(self, dist, shift: float, scale: float) -> None:
        self.dist, self.shift, self.scale = dist, shift, scale

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.shift + self.scale * self.dist.rvs(size=n, random_state=rng)

    def quantile(self, p: np.ndarray) -> np.ndarray:
        return self.shift + self.scale * self.dist.ppf(p)

    def expected_best(self, s: int) -> float:
        """E[min of s] = integral over v in (0, 1) of Q(1 - v^(1/s)): the lowest of s is Q(U) with U ~ Beta(1, s)."""
        value, _ = integrate.quad(lambda v: self.dist.isf(v ** (1 / s)), 0, 1, limit=400)
        return self.shift + self.scale * value


class Discrete:
    """Rounded Gamma(1.5, 0.02) above 0.40 (3 decimals), a fifth of the mass collapsed to 0.69."""

    def __init__(self) -> None:
        grid = np.round(np.arange(0.400, 0.800, 0.001), 3)
        gamma = stats.gamma(1.5, scale=0.02)
        mass = np.diff(gamma.cdf(np.r_[0.0, grid[1:] - 0.4005, np.inf]))  # round(0.40 + X, 3) = grid[i]
        mass = 0.8 * mass
        mass[np.flatnonzero(grid == 0.69)[0]] += 0.2
        self.values, self.cdf = grid, np.cumsum(mass)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        gamma = np.round(0.40 + rng.gamma(1.5, 0.02, n), 3)
        return np.where(rng.random(n) < 0.2, 0.69, gamma)

    def quantile(self, p: np.ndarray) -> np.ndarray:
        return self.values[np.minimum(np.searchsorted(self.cdf, p - 1e-12), len(self.values) - 1)]

    def expected_best(self, s: int) -> float:
        survival = 1 - self.cdf
        before = np.r_[1.0, survival[:-1]]
        return float(np.sum(self.values * (before ** s - survival ** s)))


DISTRIBUTIONS = {
    "normal": Continuous(stats.norm(), 0.45, 0.01),
    "gamma": Continuous(stats.gamma(1.5), 0.40, 0.02),
    "lomax": Continuous(stats.lomax(1.5), 0.40, 0.01),
    "discrete": Discrete(),
}


def median_index(n: int, budgets: np.ndarray) -> np.ndarray:
    """The order statistic (0-based) that the median curve of n trials takes at each budget: Q_n(1 - 2^(-1/s))."""
    return np.maximum(np.ceil(n * (1 - 0.5 ** (1 / budgets)) - 1e-9).astype(int) - 1, 0)


def covers(low: np.ndarray, high: np.ndarray, truth: np.ndarray) -> np.ndarray:
    return (low <= truth) & (truth <= high)


def replicate(dist, n: int, confidence: float, resamples: int, draws: int, rng: np.random.Generator,
              truth: dict) -> dict[str, np.ndarray]:
    """One synthetic study: per band, whether it holds the true curve at each budget."""
    budgets, grid = truth["budgets"], truth["grid"]
    values = dist.sample(rng, n)
    ordered = np.sort(values)
    exact = median_band(values, budgets, confidence)
    resampled = np.sort(values[rng.integers(n, size=(resamples, n))], axis=1)
    tails = ((1 - confidence) / 2, (1 + confidence) / 2)
    median_low, median_high = np.quantile(resampled[:, median_index(n, budgets)], tails, axis=0,
                                          method="inverted_cdf")
    expected = resampled @ truth["weights"].T  # Tang et al.'s unbiased estimate on every resample
    expected_low, expected_high = np.quantile(expected, tails, axis=0, method="inverted_cdf")
    paper = summarize(monte_carlo(ordered, grid, draws, seed=int(rng.integers(2 ** 62))))
    return {"exact": covers(exact["low"], exact["high"], truth["median"]),
            "bootstrap_median": covers(median_low, median_high, truth["median"]),
            "bootstrap_expected": covers(expected_low, expected_high, truth["expected"]),
            "appendix_f": covers(paper["mc_low"], paper["mc_high"], truth["expected"])}


def measure(name: str, n: int, args) -> dict:
    dist = DISTRIBUTIONS[name]
    largest = min(n, PAPER_MAX_BUDGET)
    budgets, grid = np.arange(1, largest + 1), budget_grid(largest)
    truth = {"budgets": budgets, "grid": grid, "median": dist.quantile(1 - 0.5 ** (1 / budgets)),
             "expected": np.array([dist.expected_best(int(s)) for s in grid]),
             "weights": best_rank_distribution(n, grid)}
    rng = np.random.default_rng([args.seed, list(DISTRIBUTIONS).index(name), n])
    median_band(dist.sample(rng, n), budgets, args.confidence)  # opda's critical value for n, once, not timed
    start = time.perf_counter()
    hits = [replicate(dist, n, args.confidence, args.resamples, args.draws, rng, truth)
            for _ in range(args.replications)]
    row = {"distribution": name, "n": n, "seconds": time.perf_counter() - start}
    for band in hits[0]:
        stack = np.stack([hit[band] for hit in hits])  # [replication, budget]
        pointwise = stack.mean(axis=0)
        at = (budgets if band.endswith("median") or band == "exact" else grid)[int(pointwise.argmin())]
        row[band] = {"simultaneous": float(stack.all(axis=1).mean()), "at_1": float(pointwise[0]),
                     "worst_pointwise": float(pointwise.min()), "worst_s": int(at)}
    return row


def cell(result: dict) -> str:
    """simultaneous; pointwise at s = 1; the worst pointwise (at its s)."""
    return (f"{100 * result['simultaneous']:.1f}; {100 * result['at_1']:.1f}; {100 * result['worst_pointwise']:.1f} "
            f"({result['worst_s']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replications", type=int, default=1000)
    parser.add_argument("--sizes", default="20,50,100,500", help="trials per study, comma-separated")
    parser.add_argument("--distributions", default=",".join(DISTRIBUTIONS))
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples per study")
    parser.add_argument("--draws", type=int, default=1000, help="Appendix F's draws per budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT, help="folder of band_coverage.{md,json} "
                        "(default: benchmarks/out)")
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for name in args.distributions.split(","):
        for n in (int(size) for size in args.sizes.split(",")):
            rows.append(measure(name, n, args))
            print(f"{name} N={n}: {rows[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    nominal = f"{100 * args.confidence:g}%"
    lines = [f"Coverage (%) of the true curve, nominal {nominal}, per cell: simultaneous over s = 1..min(N, "
             f"{PAPER_MAX_BUDGET}) (the expected curve: the grid 1, 2, 5, 10, ...); pointwise at s = 1; the worst "
             "pointwise coverage (at its s). "
             f"{args.replications} replications per row, {args.resamples} bootstrap resamples, {args.draws} Appendix F "
             f"draws, seed {args.seed}; {platform.machine()}, {platform.python_version()}, "
             f"{time.perf_counter() - start:.0f} s in all.", "",
             "| distribution | N | exact (median) | bootstrap (median) | bootstrap (expected) | Appendix F spread "
             "(expected) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['distribution']} | {r['n']} | {cell(r['exact'])} | {cell(r['bootstrap_median'])} | "
              f"{cell(r['bootstrap_expected'])} | {cell(r['appendix_f'])} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(text, args.out / "band_coverage.md")
    write_atomic(json.dumps({"args": {**vars(args), "out": str(args.out)}, "band": BAND, "rows": rows}, indent=1),
                 args.out / "band_coverage.json")


if __name__ == "__main__":
    main()
