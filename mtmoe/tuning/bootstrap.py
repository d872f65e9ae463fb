"""Appendix F's tuning-budget bootstrap (Figures 2-3, §5.1.2-5.1.3): the estimators, pure functions of a trial table.

A **trial table** has one row per evaluated configuration, as :func:`mtmoe.tuning.trials.collect` reads it
(columns ``study, gate, alpha, config_id, objective, test_loss`` plus ``data``; ``objective`` is the validation
objective, +inf for a failed trial), one study per dataset, alpha and gate. Nothing here reads a storage or
draws a figure: ``python -m mtmoe bootstrap`` (:mod:`mtmoe.tuning.bootstrap_report`) does, around these.

* **The bag of trials.** Per study, the N *completed* trials: finite validation objective and finite test loss.
  Failed trials (diverged or lost too often: objective +inf, no test loss) are left out and counted
  (``left_out``): a draw made only of failed trials would have no test loss to record. They are ranked by validation objective, **ties broken by
  config_id** (lower first), the order of the report's top 5%.
* **Monte Carlo (Appendix F).** For each budget s in {1, 2, 5, 10, 15, ..., 250} (``--max-budget``; up to N),
  ``--draws`` (1000) times: draw s of the N trials without replacement, keep the best by validation objective,
  record its test loss. Reported: the mean, its standard error, and a **95% band, the 2.5th and 97.5th
  percentiles of the recorded test losses** (inverted CDF), i.e. the range of what tuning with s trials gives.
  Draws are **nested** (default): per repetition one random order of the N trials, whose first s are the draw for
  budget s; each budget's draw is exactly a uniform sample of s without replacement, and the curves are monotone
  per repetition (common random numbers across s). ``--resample independent`` draws afresh for every budget.
  Each study's generator is seeded from ``--seed`` and its name, so adding or dropping a gate changes no other
  gate's numbers. Vectorised in torch (``--device cuda`` runs the draws on a GPU).
* **Closed form, same trial table.** With trials ranked 1..N by validation objective, the best of s draws without
  replacement is the i-th ranked with probability ``C(N-i, s-1) / C(N, s)`` (hypergeometric): the exact
  expectation of the Monte-Carlo estimate, its standard deviation, and the exact 95% band of the same discrete
  distribution. ``--replacement`` switches both the draws and the closed form to sampling with replacement, whose
  closed form is Dodge et al. 2019 ("Show Your Work"): ``((N-i+1)/N)^s - ((N-i)/N)^s``. The Monte-Carlo estimate
  is always compared with the closed form of its own sampling scheme.
* **Tuning reduction factor of gate A over gate B** (how the paper reads "5x-100x" off Figures 2-3). Let E_X(s)
  be gate X's closed-form expected test loss at budget s, for every integer s <= N_X. For each budget s_B of the
  grid (s_B <= N_B), the level is L = E_B(s_B);
  ``s_A = min{s <= N_A : E_A(s) <= L}`` and ``s_B' = min{s <= s_B : E_B(s) <= L}``, and the factor is
  ``s_B' / s_A``: how many times fewer trials A needs to reach B's expected test loss at s_B. ``s_B' = s_B``
  whenever E_B does not increase up to s_B (the usual case); taking the smallest budget at which B reaches its own
  level makes two identical gates give exactly 1 even where a curve is not monotone. When ``s_A = 1`` and
  ``E_A(1) < L`` the factor is a lower bound (``>=``: A beats B's level with a single trial); when A never reaches
  L within its N_A trials the factor is undefined (``never``). The **range** is the min and max over the grid's
  s_B >= 2 (at s_B = 1 the factor cannot exceed 1 by construction).
  Default pairs: every "G+" over its "G" (Figure 3) and ``comet`` over every other gate without "+" (Figure 2);
  ``--pairs A:B,...`` chooses. Factors compare gates within a panel (same dataset and alpha).
* **Not a confidence band.** The 95% band above is the spread of what tuning with s trials gives, not the
  uncertainty of the curve (at s = N without replacement it is one value). Exact confidence bands, for the
  validation objective's tuning curve, and the factor's interval: :mod:`mtmoe.tuning.bands`.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from mtmoe.errors import UsageError
from mtmoe.gate_names import split_gate_name
from mtmoe.tuning.trials import as_text

if TYPE_CHECKING:  # torch is imported where the draws are made: `bootstrap --help` and its bad input need none
    import torch

PAPER_MAX_BUDGET = 250
DRAWS = 1000
BAND = (0.025, 0.975)
RESAMPLING = ("nested", "independent")


# ------------------------------------------------------------------------------------------------ trial table


def budget_grid(max_budget: int) -> np.ndarray:
    """Appendix F's budgets up to ``max_budget``: 1, 2, then the multiples of 5."""
    return np.array([s for s in range(1, max_budget + 1) if s in (1, 2) or s % 5 == 0], dtype=np.int64)


def usable(trials: pd.DataFrame) -> pd.DataFrame:
    """The completed trials (finite validation objective and test loss), best validation objective first; ties
    broken by config_id."""
    finite = np.isfinite(trials.objective.astype(float)) & np.isfinite(trials.test_loss.astype(float))
    return trials[finite].sort_values(["objective", "config_id"], kind="mergesort")


def ranked_test_losses(trials: pd.DataFrame) -> np.ndarray:
    """One study's test losses in validation-objective order (index 0: the best-validation trial)."""
    return usable(trials).test_loss.to_numpy(dtype=np.float64)


# ------------------------------------------------------------------------------------------------ closed form


def best_rank_distribution(n: int, budgets: np.ndarray, replace: bool = False) -> np.ndarray:
    """``P[b, i-1]``: probability that the best (by validation) of ``budgets[b]`` draws from n ranked trials is the
    i-th ranked. Without replacement ``C(n-i, s-1) / C(n, s)``; with replacement (Dodge et al. 2019)
    ``((n-i+1)/n)^s - ((n-i)/n)^s``. Both as differences of the survival ``P(best rank >= i)``: the chance that all
    s draws fall among ranks i..n, ``C(n-i+1, s) / C(n, s)`` resp. ``((n-i+1)/n)^s``."""
    s = np.asarray(budgets, dtype=np.float64)[:, None]
    if np.any(s < 1) or (not replace and np.any(s > n)):
        raise ValueError(f"budgets must be in [1, {n}] without replacement, >= 1 with it; got {budgets}")
    j = np.arange(n, dtype=np.float64)[None, :]  # rank i = j + 1
    if replace:
        survival = ((n - j) / n) ** s
    else:  # C(n-j, s)/C(n, s) = prod_{m<j} (n-m-s)/(n-m): one cumulative product per budget
        ratios = np.clip((n - j - s) / (n - j), 0.0, None)
        survival = np.concatenate([np.ones_like(s), np.cumprod(ratios[:, :-1], axis=1)], axis=1)
    return survival - np.concatenate([survival[:, 1:], np.zeros_like(s)], axis=1)


def quantiles(values: np.ndarray, probabilities: np.ndarray, levels: tuple[float, ...]) -> np.ndarray:
    """``[b, q]``: the smallest value whose cumulative probability under ``probabilities[b]`` reaches ``levels[q]``
    (the inverted CDF, as ``np.quantile(..., method="inverted_cdf")`` on a sample)."""
    order = np.argsort(values, kind="stable")
    cdf = np.cumsum(probabilities[:, order], axis=1)
    index = np.stack([(cdf < level - 1e-12).sum(axis=1) for level in levels], axis=1)
    return values[order][np.minimum(index, len(values) - 1)]


def closed_form(losses: np.ndarray, budgets: np.ndarray, replace: bool = False) -> dict[str, np.ndarray]:
    """Exact mean, standard deviation and 95% band of the test loss of the best-validation trial among s draws, for
    each budget s; ``losses`` in validation-objective order (:func:`ranked_test_losses`)."""
    p = best_rank_distribution(len(losses), budgets, replace)
    mean = p @ losses
    std = np.sqrt(np.einsum("bi,bi->b", p, (losses[None, :] - mean[:, None]) ** 2))
    low, high = quantiles(losses, p, BAND).T
    return {"exact_mean": mean, "exact_std": std, "exact_low": low, "exact_high": high}


def expected_curve(losses: np.ndarray, replace: bool = False) -> np.ndarray:
    """``E[s-1]``: the closed-form expected value of the best-ranked draw at every budget s = 1..N; +inf where a
    +inf value (a failed trial's objective) can be it. Without replacement, Tang et al. 2020's unbiased estimator."""
    p = best_rank_distribution(len(losses), np.arange(1, len(losses) + 1), replace)
    return np.multiply(p, losses, out=np.zeros_like(p), where=p > 0).sum(axis=1)


# ------------------------------------------------------------------------------------------------ Monte Carlo


def study_seed(seed: int, study: str) -> int:
    """A study's own seed: its draws do not depend on which other studies are bootstrapped."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{study}".encode()).digest()[:8], "little") >> 1


def _draw(n: int, s: int, draws: int, generator: torch.Generator, replace: bool) -> torch.Tensor:
    """``[draws, s]`` ranks (0-based), each row s draws in random order; distinct unless ``replace``."""
    import torch

    device = generator.device
    if replace:
        return torch.randint(n, (draws, s), generator=generator, device=device)
    keys = torch.rand(draws, n, generator=generator, device=device, dtype=torch.float64)  # float64: no ties
    return keys.topk(s, dim=1, largest=False, sorted=True).indices


def best_ranks(n: int, budgets: np.ndarray, draws: int, generator: torch.Generator, replace: bool = False,
               resampling: str = "nested") -> torch.Tensor:
    """``[draws, len(budgets)]``: the best (lowest) rank among s drawn trials, per repetition and budget s."""
    import torch

    if resampling == "nested":
        order = _draw(n, int(budgets.max()), draws, generator, replace)
        index = torch.as_tensor(budgets - 1, device=order.device)
        return order.cummin(dim=1).values.index_select(1, index)
    if resampling == "independent":
        return torch.stack([_draw(n, int(s), draws, generator, replace).min(dim=1).values for s in budgets], dim=1)
    raise ValueError(f"resampling must be one of {RESAMPLING}, got {resampling!r}")


def monte_carlo(losses: np.ndarray, budgets: np.ndarray, draws: int = DRAWS, seed: int = 0, replace: bool = False,
                resampling: str = "nested", device: str = "cpu") -> np.ndarray:
    """``[draws, len(budgets)]``: the recorded test losses of Appendix F's repetitions."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    ranks = best_ranks(len(losses), budgets, draws, generator, replace, resampling)
    return torch.tensor(losses, device=device)[ranks].cpu().numpy()


def agreement(mc_mean: np.ndarray, exact_mean: np.ndarray, exact_std: np.ndarray, draws: int) -> np.ndarray:
    """|Monte-Carlo mean - closed form| in standard errors of the Monte-Carlo mean (0 where they agree to rounding,
    e.g. at s = N without replacement, where every draw is the whole bag)."""
    difference = np.abs(np.asarray(mc_mean) - np.asarray(exact_mean))
    error = np.asarray(exact_std) / math.sqrt(draws)
    return np.divide(difference, error, out=np.zeros_like(difference), where=difference > 1e-12)


def summarize(outcomes: np.ndarray) -> dict[str, np.ndarray]:
    """Per budget: the Monte-Carlo mean, its standard error and the 95% band (percentiles, inverted CDF)."""
    low, high = np.quantile(outcomes, BAND, axis=0, method="inverted_cdf")
    return {"mc_mean": outcomes.mean(axis=0), "mc_se": outcomes.std(axis=0, ddof=1) / math.sqrt(len(outcomes)),
            "mc_low": low, "mc_high": high}


# ------------------------------------------------------------------------------------------------ curves


@dataclass(frozen=True)
class Settings:
    """How the bootstrap draws: Appendix F's defaults."""

    draws: int = DRAWS
    seed: int = 0
    max_budget: int | None = None  # None: the paper's 250, cut at each study's N; a number: every study must reach it
    replace: bool = False
    resampling: str = "nested"
    device: str = "cpu"
    confidence: float = 0.95  # of the objective's exact bands (mtmoe.tuning.bands)


def tuning_curves(trials: pd.DataFrame, settings: Settings = Settings()) -> pd.DataFrame:
    """One row per study and budget: Monte-Carlo mean, SE and band, and the closed form of the same sampling."""
    frames = []
    for study, group in trials.groupby("study", sort=True):
        losses = ranked_test_losses(group)
        n = len(losses)
        if n == 0:
            raise UsageError(f"study {study!r} has no completed trials ({len(group)} failed): nothing to draw")
        if settings.max_budget is not None and settings.max_budget > n:
            raise UsageError(f"study {study!r} has {n} completed trials, fewer than --max-budget {settings.max_budget}")
        budgets = budget_grid(min(n, settings.max_budget or PAPER_MAX_BUDGET))
        outcomes = monte_carlo(losses, budgets, settings.draws, study_seed(settings.seed, study), settings.replace,
                               settings.resampling, settings.device)
        first = group.iloc[0]
        frame = pd.DataFrame({"data": first.data, "alpha": as_text(first.alpha), "gate": first.gate,
                              "study": study, "trials": n, "left_out": len(group) - n, "s": budgets,
                              **summarize(outcomes), **closed_form(losses, budgets, settings.replace)})
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


# ------------------------------------------------------------------------------------------------ reduction factor


def reduction_factors(expected_a: np.ndarray, expected_b: np.ndarray, budgets: np.ndarray) -> pd.DataFrame:
    """Per grid budget s_B: B's level ``E_B(s_B)``, the budgets s_B' and s_A at which B and A first reach it, the
    factor ``s_B' / s_A``, and ``bound`` (``>=``: a lower bound, A beats the level at s = 1; ``never``: A does not
    reach it within its trials). ``expected_x[s-1]`` is :func:`expected_curve`'s E_X(s)."""
    rows = []
    for s_b in budgets[budgets <= len(expected_b)]:
        level = expected_b[s_b - 1]
        reach_b = 1 + int(np.argmax(expected_b[:s_b] <= level))
        hits = np.flatnonzero(expected_a <= level)
        if hits.size == 0:
            s_a, factor, bound = math.nan, math.nan, "never"
        else:
            s_a = int(hits[0]) + 1
            factor = reach_b / s_a
            bound = ">=" if s_a == 1 and expected_a[0] < level else ""
        rows.append({"s_b": int(s_b), "level": level, "s_b_reach": reach_b, "s_a": s_a, "factor": factor,
                     "bound": bound})
    return pd.DataFrame(rows).astype({"s_a": "Int64"})


def factor_range(factors: pd.DataFrame) -> dict[str, Any]:
    """The range of the factor over the grid's s_B >= 2, with where it is attained and whether an end is a bound."""
    defined = factors[(factors.s_b >= 2) & factors.factor.notna()]
    never = int(((factors.s_b >= 2) & (factors.bound == "never")).sum())
    if defined.empty:
        return {"factor_min": math.nan, "factor_max": math.nan, "s_b_at_min": None, "s_b_at_max": None,
                "min_bound": "", "max_bound": "", "never": never}
    low, high = defined.loc[defined.factor.idxmin()], defined.loc[defined.factor.idxmax()]
    return {"factor_min": low.factor, "factor_max": high.factor, "s_b_at_min": int(low.s_b),
            "s_b_at_max": int(high.s_b), "min_bound": low.bound, "max_bound": high.bound, "never": never}


def default_pairs(gates: list[str]) -> list[tuple[str, str]]:
    """Figure 3: every "G+" over its "G"; Figure 2: comet over every other gate without "+"."""
    split = {gate: split_gate_name(gate) for gate in gates}
    pairs = [(gate, base) for gate, (base, plus) in split.items() if plus and base in gates]
    if "comet" in gates:
        pairs += [("comet", gate) for gate in gates if gate != "comet" and not split[gate][1]]
    return pairs


RANGE_COLUMNS = ["data", "alpha", "gate_a", "gate_b", "factor_min", "factor_max", "s_b_at_min", "s_b_at_max",
                 "min_bound", "max_bound", "never"]


def panel_factors(trials: pd.DataFrame, pairs: list[tuple[str, str]], settings: Settings = Settings()
                  ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(every s_B of every pair, one range row per pair), in each panel (dataset, alpha) that holds both gates."""
    details, ranges = [], []
    for (data, alpha), panel in trials.groupby([trials.data, trials.alpha.map(as_text)], sort=True):
        curves = {gate: expected_curve(ranked_test_losses(group), settings.replace)
                  for gate, group in panel.groupby("gate")}
        for gate_a, gate_b in pairs:
            if gate_a not in curves or gate_b not in curves:
                continue
            budgets = budget_grid(min(len(curves[gate_b]), settings.max_budget or PAPER_MAX_BUDGET))
            factors = reduction_factors(curves[gate_a], curves[gate_b], budgets)
            key = {"data": data, "alpha": alpha, "gate_a": gate_a, "gate_b": gate_b}
            details.append(factors.assign(**key)[[*key, *factors.columns]])
            ranges.append({**key, **factor_range(factors)})
    detail = pd.concat(details, ignore_index=True) if details else pd.DataFrame(columns=RANGE_COLUMNS[:4])
    return detail, pd.DataFrame(ranges, columns=RANGE_COLUMNS)
