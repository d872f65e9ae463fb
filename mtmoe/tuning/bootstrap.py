"""``python -m mtmoe bootstrap --data movielens``: Appendix F's tuning-budget bootstrap (Figures 2-3, §5.1.2-5.1.3).

It reads the trials of the tuning studies (never trains). Pure functions over a **trial table**: one row per
evaluated configuration, as :func:`mtmoe.tuning.report.collect` reads it (columns ``study, gate, alpha,
config_id, objective, test_loss`` plus ``data``; ``objective`` is the validation objective, +inf for a diverged
trial), one study per dataset, alpha and gate.

* **The bag of trials.** Per study, the N *completed* trials: finite validation objective and finite test loss.
  Diverged trials (objective +inf, no test loss) are left out and counted (``left_out``): a draw made only of
  diverged trials would have no test loss to record. They are ranked by validation objective, **ties broken by
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

``--gates`` picks gates (default: every gate with a study of the dataset); each must have a study with finished
trials in the storage, and a panel shows those with a study at its alpha. ``--data`` takes a comma-separated list
for a figure of several datasets (Figure 2).

Outputs (written atomically into ``--out``, default ``studies/reports/<data>/``): ``bootstrap.png`` (one panel
per dataset and alpha: Monte-Carlo mean with its 95% band, closed form as markers), ``bootstrap_curves.csv``,
``bootstrap_factors.csv`` (every s_B), ``bootstrap_ranges.csv``, and ``bootstrap.md`` / ``bootstrap.html``
(the HTML embeds the plot).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import html
import io
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from mtmoe.errors import UsageError

PAPER_MAX_BUDGET = 250
DRAWS = 1000
BAND = (0.025, 0.975)
RESAMPLING = ("nested", "independent")
SHOWN_BUDGETS = (1, 2, 5, 10, 25, 50, 100, 250)  # the Markdown table; every budget is in the CSV


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
    """``E[s-1]``: the closed-form expected test loss at every budget s = 1..N."""
    return best_rank_distribution(len(losses), np.arange(1, len(losses) + 1), replace) @ losses


# ------------------------------------------------------------------------------------------------ Monte Carlo


def study_seed(seed: int, study: str) -> int:
    """A study's own seed: its draws do not depend on which other studies are bootstrapped."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{study}".encode()).digest()[:8], "little") >> 1


def _draw(n: int, s: int, draws: int, generator: torch.Generator, replace: bool) -> torch.Tensor:
    """``[draws, s]`` ranks (0-based), each row s draws in random order; distinct unless ``replace``."""
    device = generator.device
    if replace:
        return torch.randint(n, (draws, s), generator=generator, device=device)
    keys = torch.rand(draws, n, generator=generator, device=device, dtype=torch.float64)  # float64: no ties
    return keys.topk(s, dim=1, largest=False, sorted=True).indices


def best_ranks(n: int, budgets: np.ndarray, draws: int, generator: torch.Generator, replace: bool = False,
               resampling: str = "nested") -> torch.Tensor:
    """``[draws, len(budgets)]``: the best (lowest) rank among s drawn trials, per repetition and budget s."""
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


def tuning_curves(trials: pd.DataFrame, settings: Settings = Settings()) -> pd.DataFrame:
    """One row per study and budget: Monte-Carlo mean, SE and band, and the closed form of the same sampling."""
    frames = []
    for study, group in trials.groupby("study", sort=True):
        losses = ranked_test_losses(group)
        n = len(losses)
        if n == 0:
            raise UsageError(f"study {study!r} has no completed trials ({len(group)} diverged): nothing to draw")
        if settings.max_budget is not None and settings.max_budget > n:
            raise UsageError(f"study {study!r} has {n} completed trials, fewer than --max-budget {settings.max_budget}")
        budgets = budget_grid(min(n, settings.max_budget or PAPER_MAX_BUDGET))
        outcomes = monte_carlo(losses, budgets, settings.draws, study_seed(settings.seed, study), settings.replace,
                               settings.resampling, settings.device)
        first = group.iloc[0]
        frame = pd.DataFrame({"data": first.data, "alpha": _alpha_text(first.alpha), "gate": first.gate,
                              "study": study, "trials": n, "left_out": len(group) - n, "s": budgets,
                              **summarize(outcomes), **closed_form(losses, budgets, settings.replace)})
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def _alpha_text(alpha: Any) -> str:
    return "" if alpha is None or (isinstance(alpha, float) and math.isnan(alpha)) else str(alpha)


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
    pairs = [(gate, gate.removesuffix("+")) for gate in gates if gate.endswith("+") and gate[:-1] in gates]
    if "comet" in gates:
        pairs += [("comet", gate) for gate in gates if gate != "comet" and not gate.endswith("+")]
    return pairs


RANGE_COLUMNS = ["data", "alpha", "gate_a", "gate_b", "factor_min", "factor_max", "s_b_at_min", "s_b_at_max",
                 "min_bound", "max_bound", "never"]


def panel_factors(trials: pd.DataFrame, pairs: list[tuple[str, str]], settings: Settings = Settings()
                  ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(every s_B of every pair, one range row per pair), in each panel (dataset, alpha) that holds both gates."""
    details, ranges = [], []
    for (data, alpha), panel in trials.groupby([trials.data, trials.alpha.map(_alpha_text)], sort=True):
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


# ------------------------------------------------------------------------------------------------ outputs


def _panels(curves: pd.DataFrame) -> list[tuple[str, str]]:
    return sorted({(row.data, row.alpha) for row in curves.itertuples()})


def _panel_title(data: str, alpha: str) -> str:
    return f"{data}, α = {alpha}" if alpha else data


def plot(curves: pd.DataFrame, gates: list[str]):
    """The tuning curves, one panel per (dataset, alpha) as in Figures 2-3: Monte-Carlo mean and 95% band per gate
    (a "+" gate solid, in its base gate's colour; the base gate dashed), the closed form as dots. The y axis fits
    the bands' lower ends and the mean curves; the bands' upper ends at small s may run past it."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    panels = _panels(curves)
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(5.4 * columns, 4.2 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    bases = list(dict.fromkeys(gate.removesuffix("+") for gate in gates))
    palette = [f"C{i % 10}" for i in range(len(bases))]
    for ax, (data, alpha) in zip(axes, panels):
        panel = curves[(curves.data == data) & (curves.alpha == alpha)]
        for gate in [g for g in gates if g in set(panel.gate)]:
            rows_ = panel[panel.gate == gate]
            colour = palette[bases.index(gate.removesuffix("+"))]
            plus = gate.endswith("+")
            ax.fill_between(rows_.s, rows_.mc_low, rows_.mc_high, color=colour, alpha=0.18 if plus else 0.10,
                            linewidth=0)
            ax.plot(rows_.s, rows_.mc_mean, color=colour, linestyle="-" if plus else "--", linewidth=1.8,
                    label=gate)
            ax.plot(rows_.s, rows_.exact_mean, color=colour, linestyle="none", marker=".", markersize=3.5)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator([s for s in SHOWN_BUDGETS if s <= panel.s.max()]))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        low, high = panel.mc_low.min(), panel.mc_mean.max()
        margin = 0.1 * (high - low) or 0.01 * abs(high) or 0.01
        ax.set_ylim(low - margin, high + margin)
        ax.set_title(_panel_title(data, alpha))
        ax.set_xlabel("tuning budget s (trials)")
        ax.set_ylabel("test loss of the best-validation trial")
        ax.grid(True, alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    handles = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels())}
    figure.legend([handles[g] for g in gates if g in handles], [g for g in gates if g in handles],
                  loc="outside right upper", title="gate (dots: closed form)")
    return figure


def png_bytes(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def _loss(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.2f}"


def _factor(value: float, bound: str) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{'≥' if bound == '>=' else ''}{value:.3g}×"


def report_blocks(curves: pd.DataFrame, ranges: pd.DataFrame, gates: list[str], settings: Settings, url: str,
                  data: str) -> list[tuple]:
    """The report as blocks (``("h1"|"h2"|"p", text)``, ``("img", file, alt)``, ``("table", header, rows)``),
    rendered to Markdown and to HTML."""
    scheme = ("with replacement; closed form of Dodge et al. 2019" if settings.replace else
              "without replacement; closed form hypergeometric, P(best of s is the i-th ranked) = C(N-i, s-1)/C(N, s)")
    blocks: list[tuple] = [
        ("h1", f"Tuning-budget bootstrap: {data}"),
        ("p", f"Storage `{url}`. Appendix F: for each budget s in {{1, 2, 5, 10, ..., "
              f"{settings.max_budget or PAPER_MAX_BUDGET}}} (up to a study's N completed trials), {settings.draws} "
              f"repetitions draw s trials ({scheme}; {settings.resampling} draws, seed {settings.seed}), keep the best "
              "validation objective (ties: lower config_id) and record its test loss. Lines: the Monte-Carlo mean; "
              "bands: 2.5th-97.5th percentiles of the recorded test losses (the y axis fits the means and the "
              "bands' lower ends: the upper ends at small s may run past it); dots: the closed form. Diverged "
              "trials are left out of the bag."),
        ("img", "bootstrap.png", "tuning curves"),
        ("h2", "Tuning reduction factors"),
        ("p", "Factor of A over B at budget s_B: s_B' / s_A, where s_A and s_B' are the smallest budgets at which "
              "A's and B's closed-form expected test loss reach B's at s_B (s_B' = s_B when B's curve does not "
              "rise). Range over the grid's s_B >= 2; ≥: a lower bound (A beats that level with one trial); "
              "never: budgets s_B whose level A does not reach within its trials. Every s_B: "
              "`bootstrap_factors.csv`."),
    ]
    header = ["Dataset", "alpha", "A over B", "range (s_B ≥ 2)", "s_B at min – max", "never"]
    rows = [[r.data, r.alpha, f"{r.gate_a} over {r.gate_b}",
             f"{_factor(r.factor_min, r.min_bound)} – {_factor(r.factor_max, r.max_bound)}",
             "-" if pd.isna(r.s_b_at_min) else f"{int(r.s_b_at_min)} – {int(r.s_b_at_max)}",
             str(r.never)] for r in ranges.itertuples()]
    blocks.append(("table", header, rows) if rows else ("p", "No pair of gates shares a panel."))
    studies = curves.assign(z=agreement(curves.mc_mean, curves.exact_mean, curves.exact_std, settings.draws)).groupby(
        "study", sort=False).agg(gate=("gate", "first"), alpha=("alpha", "first"), trials=("trials", "first"),
                                 left_out=("left_out", "first"), largest=("s", "max"), z=("z", "max"))
    blocks += [("h2", "Studies"),
               ("table", ["Study", "Gate", "alpha", "completed N", "left out (diverged)", "budgets up to",
                          "max abs(MC − closed form) / SE"],
                [[study, r.gate, r.alpha, str(r.trials), str(r.left_out), str(r.largest), f"{r.z:.2f}"]
                 for study, r in studies.iterrows()])]
    blocks.append(("h2", "Test loss ×10⁻² at selected budgets: Monte-Carlo mean (closed form) [95% band]"))
    for data_, alpha in _panels(curves):
        panel = curves[(curves.data == data_) & (curves.alpha == alpha)]
        present = [g for g in gates if g in set(panel.gate)]
        budgets = [s for s in SHOWN_BUDGETS if s in set(panel.s)]
        table_rows = []
        for s in budgets:
            cells = []
            for gate in present:
                hit = panel[(panel.gate == gate) & (panel.s == s)]
                cells.append("-" if hit.empty else (f"{_loss(hit.mc_mean.iloc[0])} ({_loss(hit.exact_mean.iloc[0])}) "
                                                    f"[{_loss(hit.mc_low.iloc[0])}, {_loss(hit.mc_high.iloc[0])}]"))
            table_rows.append([str(s), *cells])
        blocks += [("p", f"**{_panel_title(data_, alpha)}**"), ("table", ["s", *present], table_rows)]
    return blocks


def markdown(blocks: list[tuple]) -> str:
    lines: list[str] = []
    for kind, *body in blocks:
        if kind in ("h1", "h2"):
            lines += [("# " if kind == "h1" else "## ") + body[0], ""]
        elif kind == "p":
            lines += [body[0], ""]
        elif kind == "img":
            lines += [f"![{body[1]}]({body[0]})", ""]
        else:
            header, rows = body
            lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(row) + " |" for row in rows] + [""]
    return "\n".join(lines)


def _inline_html(text: str) -> str:
    import re

    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def html_page(blocks: list[tuple], images: dict[str, bytes]) -> str:
    """A self-contained page: the plots inlined as base64 PNG."""
    parts = ["<!DOCTYPE html>", '<html><head><meta charset="utf-8"><title>'
             + html.escape(next(b[1] for b in blocks if b[0] == "h1")) + "</title><style>"
             "body{font-family:sans-serif;max-width:1200px;margin:2em auto}"
             "table{border-collapse:collapse}td,th{border:1px solid #bbb;padding:3px 8px;text-align:left}"
             "img{max-width:100%}</style></head><body>"]
    for kind, *body in blocks:
        if kind in ("h1", "h2", "p"):
            parts.append(f"<{kind}>{_inline_html(body[0])}</{kind}>")
        elif kind == "img":
            encoded = base64.b64encode(images[body[0]]).decode("ascii")
            parts.append(f'<img alt="{html.escape(body[1])}" src="data:image/png;base64,{encoded}">')
        else:
            header, rows = body
            parts.append("<table><tr>" + "".join(f"<th>{_inline_html(h)}</th>" for h in header) + "</tr>"
                         + "".join("<tr>" + "".join(f"<td>{_inline_html(c)}</td>" for c in row) + "</tr>"
                                   for row in rows) + "</table>")
    return "\n".join(parts + ["</body></html>", ""])


# ------------------------------------------------------------------------------------------------ command line


def parse_bootstrap_args(argv: list[str]) -> tuple[argparse.Namespace, Settings]:
    from mtmoe.tuning.report import parse_strict, studies_parser

    parser = studies_parser("bootstrap")
    parser.add_argument("--gates", default=None, help="comma-separated gates (default: every gate with a study)")
    parser.add_argument("--pairs", default=None,
                        help="A:B,... reduction factors of A over B (default: every G+ over G, comet over the others)")
    parser.add_argument("--draws", type=int, default=DRAWS, help="repetitions per budget (Appendix F: 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-budget", type=int, default=None,
                        help=f"largest budget (default {PAPER_MAX_BUDGET}, cut at each study's completed trials; "
                             "given, every study must have that many)")
    parser.add_argument("--replacement", action="store_true",
                        help="draw with replacement (Dodge et al. 2019's closed form) instead of without (Appendix F)")
    parser.add_argument("--resample", choices=RESAMPLING, default="nested",
                        help="nested: one random order per repetition, its prefixes are the draws; independent: "
                             "fresh draws for every budget")
    parser.add_argument("--device", default="cpu", help="torch device of the draws (cuda: a GPU)")
    args = parse_strict(parser, argv)
    if args.draws < 2:
        raise UsageError(f"--draws must be >= 2, got {args.draws}")
    if args.max_budget is not None and args.max_budget < 1:
        raise UsageError(f"--max-budget must be >= 1, got {args.max_budget}")
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        raise UsageError(f"--device: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device is available here")
    settings = Settings(args.draws, args.seed, args.max_budget, args.replacement, args.resample, args.device)
    return args, settings


def _names(text: str | None, flag: str) -> list[str] | None:
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UsageError(f"{flag} needs at least one name")
    return names


def select(url: str, trials: pd.DataFrame, gates: list[str] | None) -> tuple[pd.DataFrame, list[str]]:
    """The requested gates' trials (every gate by default); a gate without a study, or two studies of one gate in one
    panel, is a UsageError."""
    for data, table in trials.groupby("data"):
        missing = [gate for gate in gates or [] if gate not in set(table.gate)]
        if missing:
            raise UsageError(f"no study with finished trials for gate {missing[0]!r} of dataset {data!r} in {url} "
                             f"(gates with trials: {', '.join(sorted(set(table.gate)))})")
    if gates is not None:
        trials = trials[trials.gate.isin(gates)]
    studies = trials.groupby([trials.data, trials.alpha.map(_alpha_text), trials.gate]).study.unique()
    for (data, alpha, gate), names in studies.items():
        if len(names) > 1:
            raise UsageError(f"gate {gate!r} of {_panel_title(data, alpha)} has several studies "
                             f"({', '.join(sorted(names))}): keep one per gate and alpha in the storage")
    return trials, gates or sorted(set(trials.gate))


def bootstrap(argv: list[str]) -> None:
    from mtmoe.files import write_atomic
    from mtmoe.tuning.report import collect
    from mtmoe.tuning.space import STUDIES_DIR

    args, settings = parse_bootstrap_args(argv)
    datasets = _names(args.data, "--data")
    requested = _names(args.gates, "--gates")
    pairs = [tuple(pair.split(":", 1)) for pair in _names(args.pairs, "--pairs") or []]
    tables = []
    for data in datasets:
        url, table = collect(args.storage, data)
        tables.append(table.assign(data=data))
    trials, gates = select(url, pd.concat(tables, ignore_index=True), requested)
    for pair in pairs:
        if len(pair) != 2 or not set(pair) <= set(gates):
            raise UsageError(f"--pairs: {':'.join(pair)!r} is not A:B of two of the bootstrapped gates "
                             f"({', '.join(gates)})")
    start = time.perf_counter()
    curves = tuning_curves(trials, settings)
    elapsed = time.perf_counter() - start
    factors, ranges = panel_factors(trials, pairs or default_pairs(gates), settings)
    title = "+".join(datasets)
    blocks = report_blocks(curves, ranges, gates, settings, url, ", ".join(datasets))
    images = {"bootstrap.png": png_bytes(plot(curves, gates))}
    out = Path(args.out) if args.out else STUDIES_DIR / "reports" / title
    write_atomic(images["bootstrap.png"], out / "bootstrap.png")
    write_atomic(curves.to_csv(index=False), out / "bootstrap_curves.csv")
    write_atomic(factors.to_csv(index=False), out / "bootstrap_factors.csv")
    write_atomic(ranges.to_csv(index=False), out / "bootstrap_ranges.csv")
    text = markdown(blocks)
    write_atomic(text, out / "bootstrap.md")
    write_atomic(html_page(blocks, images), out / "bootstrap.html")
    print(text, end="")
    print(f"bootstrap: {curves.study.nunique()} studies, {settings.draws} draws x up to {curves.s.nunique()} budgets: "
          f"curves in {elapsed:.2f} s on {settings.device}")
    print(f"written to {out}/bootstrap.md, bootstrap.html, bootstrap.png, bootstrap_curves.csv, "
          "bootstrap_factors.csv, bootstrap_ranges.csv")
