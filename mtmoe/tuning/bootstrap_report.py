"""``python -m mtmoe bootstrap --data movielens``: the tuning-budget bootstrap report (Figures 2-3, Appendix F), with
exact confidence bands for the objective's tuning curve.

It reads the trials of the tuning studies (the trial table, :mod:`mtmoe.tuning.trials`; it never trains), runs the
estimators of :mod:`mtmoe.tuning.bootstrap` (the paper's) and :mod:`mtmoe.tuning.bands` (the exact bands and the
factor's interval) on them and renders the result: the figure, Markdown and HTML.

``--gates`` picks gates (default: every gate with a study of the dataset); each must have a study with finished
trials in the storage, and a panel shows those with a study at its alpha. ``--data`` takes a comma-separated list
for a figure of several datasets (Figure 2).

Outputs (written atomically into ``--out``, default ``studies/reports/<data>/`` under the current directory):
``bootstrap.png`` and its vector copy ``bootstrap.pdf`` (:func:`plot`), ``bootstrap_curves.csv`` (Appendix F),
``bootstrap_factors.csv`` (every s_B), ``bootstrap_ranges.csv`` (per pair, the paper's and the objective's ranges),
``bootstrap_objective.csv`` (the objective's curves and bands at every s), ``bootstrap_objective_factors.csv`` (every
s_B), ``bootstrap_parametric.csv`` (per study, the noisy quadratic model's best objective, its interval and the
trials to come within ``--within`` of it: :mod:`mtmoe.tuning.parametric`), and ``bootstrap.md`` / ``bootstrap.html`` (the HTML embeds the plot). Rows and gates in the paper's order
(:func:`mtmoe.tuning.trials.paper_order`); the storage URL without its password.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import math
import re
import sys
import textwrap
import time
from collections.abc import Callable

import numpy as np
import pandas as pd

from mtmoe.errors import UsageError
from mtmoe.gate_names import plus_variant, split_gate_name
from mtmoe.tuning.bands import (
    objective_curves,
    objective_factors,
    pair_confidence,
    percent,
    trials_needed,
    unbounded_studies,
)
from mtmoe.tuning.bootstrap import (
    DRAWS,
    PAPER_MAX_BUDGET,
    RESAMPLING,
    Settings,
    agreement,
    budget_grid,
    default_pairs,
    panel_factors,
    tuning_curves,
)
from mtmoe.tuning.parametric import MAX_TRIALS, TAIL, parametric_estimates
from mtmoe.tuning.storage import display_url
from mtmoe.tuning.trials import (
    alpha_order,
    as_text,
    collect,
    gate_order,
    output_dir,
    paper_order,
    parse_strict,
    studies_parser,
    unfinished_note,
    unfinished_paragraph,
    unfinished_studies,
    write_outputs,
)

SHOWN_BUDGETS = (1, 2, 5, 10, 25, 50, 100, 250)  # the Markdown table; every budget is in the CSV
#: Colour pairs (a gate without local search, its "+") per gate family: the paper's gates fixed, others in turn.
FAMILY_COLOURS = {"softmax": ("#969696", "#252525"), "topk": ("#6baed6", "#08519c"), "hash": ("#74c476", "#006d2c"),
                  "dselect": ("#9e9ac8", "#54278f"), "comet": ("#fb6a4a", "#a50f15")}
OTHER_COLOURS = (("#fd8d3c", "#a63603"), ("#c49c94", "#8c564b"), ("#66c2a4", "#006d5b"), ("#f768a1", "#ae017e"),
                 ("#bcbd22", "#6b6b12"))
MAX_COLUMNS = 4


def _panels(curves: pd.DataFrame) -> list[tuple[str, str]]:
    """The (dataset, alpha) pairs of the curves: datasets by name, alphas numerically."""
    pairs = {(row.data, row.alpha) for row in curves.itertuples()}
    return sorted(pairs, key=lambda pair: (pair[0], alpha_order(pair[1])))


def _panel_title(data: str, alpha: str) -> str:
    return f"{data}, α = {alpha or '-'}"


def gate_style(gate: str, gates: list[str]) -> dict:
    """A gate's line: its family's hue, light and dashed without local search, dark and solid with it ("+")."""
    families = list(dict.fromkeys(split_gate_name(g)[0] for g in gates))
    family, plus = split_gate_name(gate)
    others = [f for f in families if f not in FAMILY_COLOURS]
    light, dark = FAMILY_COLOURS.get(family) or OTHER_COLOURS[others.index(family) % len(OTHER_COLOURS)]
    return {"color": dark if plus else light, "linestyle": "-" if plus else (0, (4, 2)), "linewidth": 1.8}


def _band_panels(present: list[str], pairs: list[tuple[str, str]]) -> list[list[str]]:
    """The objective's panels of a (dataset, alpha): every gate, then one per factor pair of its gates, in the factor
    tables' order (A, then B, in the paper's gate order), then each gate in none."""
    ordered = sorted(pairs, key=lambda pair: (gate_order(pair[0]), gate_order(pair[1])))
    panels = [sorted(pair, key=gate_order) for pair in ordered if set(pair) <= set(present)]
    return [present, *panels, *([gate] for gate in present if not any(gate in panel for panel in panels))]


def _limits(*columns: pd.Series) -> tuple[float, float]:
    """y limits that fit every finite value of ``columns`` with a margin."""
    values = pd.concat(columns).to_numpy(dtype=float)
    values = values[np.isfinite(values)]
    low, high = values.min(), values.max()
    margin = 0.06 * (high - low) or 0.01 * abs(high) or 0.01
    return low - margin, high + margin


def plot(curves: pd.DataFrame, objective: pd.DataFrame, gates: list[str], pairs: list[tuple[str, str]],
         confidence: float, studies: str | None = None):
    """The tuning curves against the budget s (log scale), per (dataset, alpha), in two kinds of panels. **Test
    loss** (Appendix F, Figures 2-3): every gate's Monte-Carlo mean, then one panel per gate family with the mean
    and the 2.5th-97.5th percentile band of the draws (hatched) of the gate and its "+". **Objective**: every gate's
    median tuning curve of the validation objective, then per reduction-factor pair (or gate) the curves with their
    exact simultaneous bands (filled; :mod:`mtmoe.tuning.bands`). Markers at the budgets measured (the objective's
    curve is computed at every s up to N, its markers at the grid's budgets); a family's two gates share a hue, light
    and dashed without local search, dark and solid with it. The y axis of an overview fits its curves; the band
    panels of a kind and (dataset, alpha) share theirs, which fits every finite band edge; an infinite edge (the
    trials do not bound the curve there) is drawn to the axis; a study too small for the exact bands has its median
    curve and no band. Every panel has the same budget axis (1 to the largest N); ``studies`` (:func:`budgets`), N
    and the training budget of each study, is the figure's title."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    gates = sorted(gates, key=gate_order)
    groups = []  # per (dataset, alpha): its curves, objective and the gates of its test-loss and objective panels
    for data, alpha in _panels(curves):
        panel = curves[(curves.data == data) & (curves.alpha == alpha)]
        band = objective[(objective.data == data) & (objective.alpha == alpha)]
        present = [g for g in gates if g in set(panel.gate)]
        families = dict.fromkeys(split_gate_name(g)[0] for g in present)
        loss_panels = [present, *([g for g in present if split_gate_name(g)[0] == family] for family in families)]
        groups.append((data, alpha, panel, band, loss_panels, _band_panels(present, pairs)))
    kinds = [len(panels) for group in groups for panels in group[4:]]  # panels per kind and (dataset, alpha)

    def rows_of(columns: int) -> int:
        return sum(math.ceil(panels / columns) for panels in kinds)

    columns = min(range(1, MAX_COLUMNS + 1), key=lambda c: (rows_of(c), c))  # fewest rows, then the narrowest
    rows = rows_of(columns)
    figure = Figure(figsize=(3.4 * columns, 2.9 * rows + 1.2), layout="constrained")
    if studies:
        figure.suptitle(textwrap.fill(studies, int(16 * 3.4 * columns)), fontsize=8.5)
    largest = int(max(curves.s.max(), objective.s.max()))
    grid = figure.add_gridspec(rows, columns)
    row = 0

    def axes(index: int, title: str, ylabel: str, largest: int, ylim: tuple[float, float]):
        ax = figure.add_subplot(grid[row + index // columns, index % columns])
        ax.set_xscale("log")
        ticks = [s for s in SHOWN_BUDGETS if s <= largest]  # and the largest budget, unless it crowds the last
        ax.xaxis.set_major_locator(FixedLocator(ticks + [largest] * (largest > 1.6 * ticks[-1])))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(1, max(largest, 2))
        ax.set_ylim(*ylim)
        ax.set_title(title, fontsize=8.5)
        ax.set_xlabel("tuning budget s (trials)", fontsize=8.5)
        ax.set_ylabel(ylabel, fontsize=8.5)
        ax.tick_params(labelsize=8)
        ax.grid(True, color="#dddddd", linewidth=0.6)
        return ax

    for data, alpha, panel, band, loss_panels, band_panels in groups:
        scaled = panel.assign(**{c: 100 * panel[c] for c in ("mc_mean", "mc_low", "mc_high")})
        ylim = _limits(scaled.mc_mean, scaled.mc_low, scaled.mc_high)
        for index, members in enumerate(loss_panels):
            what = "all gates" if index == 0 else " vs ".join(members)
            ax = axes(index, f"{_panel_title(data, alpha)}: {what}", "test loss ×10⁻²", largest,
                      ylim if index else _limits(scaled.mc_mean))
            for gate in members:
                rows_ = scaled[scaled.gate == gate]
                style = gate_style(gate, gates)
                if index:  # a family panel: the spread of the draws, hatched
                    ax.fill_between(rows_.s, rows_.mc_low, rows_.mc_high, **_spread_style(gate, style["color"]))
                ax.plot(rows_.s, rows_.mc_mean, label=gate, marker="o", markersize=3.5, **style)
        row += math.ceil(len(loss_panels) / columns)
        scaled = band.assign(**{c: 100 * band[c] for c in ("median", "low", "high")})
        ylim = _limits(scaled["median"], scaled.low, scaled.high)
        beyond = (2 * ylim[0] - ylim[1], 2 * ylim[1] - ylim[0])  # where an infinite edge is drawn, off the axis
        shown = set(budget_grid(largest))
        for index, members in enumerate(band_panels):
            what = "all gates" if index == 0 else " vs ".join(members)
            ax = axes(index, f"{_panel_title(data, alpha)}: {what}, objective", "best validation objective ×10⁻²",
                      largest, ylim if index else _limits(scaled["median"]))
            for gate in members:
                rows_ = scaled[scaled.gate == gate]
                style = gate_style(gate, gates)
                if index and rows_.low.notna().any():  # a pair's panel: the exact bands (if any), filled and edged
                    low, high = (np.clip(rows_[c], *beyond) for c in ("low", "high"))
                    ax.fill_between(rows_.s, low, high, **_exact_style(style["color"]))
                    for edge in (low, high):
                        ax.plot(rows_.s, edge, color=style["color"], linestyle=style["linestyle"], linewidth=0.9)
                ax.plot(rows_.s, rows_["median"], label=gate, marker="o", markersize=3.5,
                        markevery=[i for i, s in enumerate(rows_.s) if s in shown], **style)
        row += math.ceil(len(band_panels) / columns)
    _legend(figure, gates, confidence, columns, bool(objective.low.notna().any()))
    return figure


def budgets(trials: pd.DataFrame) -> str:
    """Each study's N (evaluated trials) and training budget (the epochs its trials ran, and its
    ``trainer.max_epochs`` setting where it has one), as the figure's title states them."""
    parts = []
    for study, group in trials.groupby("study", sort=False):
        epochs = group.epochs_run.dropna()
        planned = group.planned.iloc[0]
        of = f" of {int(planned)} planned" if len(group) < planned else ""
        text = f"{study}: N = {len(group)}{of} trial{'s' * (len(group) != 1 or bool(of))}"
        if len(epochs):
            low, high = int(epochs.min()), int(epochs.max())
            text += f", {low}{f'-{high}' if high != low else ''} epoch{'s' * (high != 1)} each"
        if group.max_epochs.notna().any():
            text += f" (trainer.max_epochs={int(group.max_epochs.iloc[0])})"
        parts.append(text)
    return "; ".join(parts)


def _legend(figure, gates: list[str], confidence: float, columns: int, banded: bool) -> None:
    """What is drawn: the gates (with "+" gates, a column per family, the gate above its "+"), the two kinds of
    band (the exact one where a study has it: ``banded``), and the line styles where gates with and without local
    search are both drawn."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def line(gate: str) -> Line2D:
        return Line2D([], [], label=gate, marker="o", markersize=3.5, **gate_style(gate, gates))

    handles = [line(gate) for gate in gates]
    plus = [split_gate_name(gate)[1] for gate in gates]
    if any(plus):  # legends fill column by column
        blank = Line2D([], [], linestyle="none", label=" ")
        families = dict.fromkeys(split_gate_name(g)[0] for g in gates)
        handles = [line(gate) if gate in gates else blank for family in families
                   for gate in (family, plus_variant(family))]
    handles += [Patch(label="test loss: spread of the draws", **_spread_style("", "#555555"))]
    if banded:
        handles += [Patch(label=f"objective: exact {percent(confidence)} band", **_exact_style("#555555"))]
    if any(plus) and not all(plus):
        handles += [Line2D([], [], color="#555555", linestyle=(0, (4, 2)), label="dashed: without local search"),
                    Line2D([], [], color="#555555", label='solid: with local search ("+")')]
    title = ["Test loss (Appendix F): Monte-Carlo mean of the best-validation trial's test loss; hatched: 2.5th-97.5th "
             "percentile of the draws (a spread of outcomes, not a confidence band).",
             "Objective: median of the best validation objective of s random trials; "
             + (f"filled: its exact simultaneous {percent(confidence)} confidence band (Lourie et al. 2024), unbounded "
                "where it meets the axis." if banded else
                f"too few trials for its exact {percent(confidence)} band (Lourie et al. 2024).")]
    figure.legend(handles=handles, loc="outside lower center", ncol=math.ceil(len(handles) / 2), fontsize=8.5,
                  frameon=False, title_fontsize=8.5,
                  title="\n".join(textwrap.fill(text, int(16 * 3.4 * columns)) for text in title))


def _spread_style(gate: str, colour: str) -> dict:
    """The Appendix F band (a spread of outcomes, not a confidence band): hatched in the gate's colour, one way
    without local search and the other with it."""
    return {"facecolor": "none", "edgecolor": colour, "hatch": "\\\\\\\\" if split_gate_name(gate)[1] else "////",
            "linewidth": 0, "alpha": 0.6}


def _exact_style(colour: str) -> dict:
    """The exact confidence band: filled in the gate's colour (its edges are drawn as lines)."""
    return {"facecolor": colour, "edgecolor": colour, "alpha": 0.15, "linewidth": 0}


def figure_bytes(figure, format: str) -> bytes:
    """The figure as a PNG (150 dpi) or a vector PDF."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=format, dpi=150)
    return buffer.getvalue()


def _loss(value: float) -> str:
    if math.isinf(value):
        return "∞" if value > 0 else "−∞"
    return "n/a" if math.isnan(value) else f"{100 * value:.2f}"


def _factor(value: float, bound: str) -> str:
    if bound == "never":
        return "never"
    if math.isnan(value):
        return "n/a"
    return f"{'≥' if bound == '>=' else ''}{value:.3g}×"


def _objective_text(settings: Settings, objective: pd.DataFrame) -> str:
    """What the objective's bands are, where they hold and where they do not."""
    conservative = objective[objective.ties | (objective.failed > 0)].study.unique()
    note = (f" Studies with tied or failed objectives, where the band is at least as wide as needed: "
            f"{', '.join(f'`{study}`' for study in conservative)}." if len(conservative) else "")
    unbanded = objective[objective.low.isna()].study.unique()
    note += (f" Studies with fewer than {trials_needed(settings.confidence)} trials, whose bands (and factor intervals)"
             f" are left out: {', '.join(f'`{study}`' for study in unbanded)}." if len(unbanded) else "")
    return ("The validation objective of a study's N evaluated configurations (a failed one counts as +∞) is a sample "
            "of the objective of a random configuration. Its tuning curve, the best objective among s random "
            "configurations, has exact simultaneous distribution-free confidence bands (Lourie, Cho and He 2024, "
            "\"Show Your Work with Confidence\", through `opda`): here the median tuning curve with its "
            f"{percent(settings.confidence)} band (`--confidence`), which holds at every s at once, for any "
            "distribution of the objective (exact for a continuous one). An edge of −∞ or ∞: N trials do not bound the "
            "curve there (the lower edge beyond a few budgets: N trials cannot show how much better many more might "
            "get). Beside it, the expected best objective by Tang et al. 2020's unbiased estimator (drawing without "
            "replacement; Dodge et al.'s with replacement is biased), which has no distribution-free band (the loss "
            "is unbounded above). **The test loss of the best-validation trial** (Appendix F, the paper's curve) "
            "depends on the validation objective and the test loss together, which a band for one distribution does "
            "not bound: no exact band there; its band above is the bootstrap's 2.5th-97.5th percentile of the draws, "
            f"a spread of outcomes, not a confidence band. Every budget: `bootstrap_objective.csv`.{note}")


def _trials_cell(n: float) -> str:
    return "-" if math.isnan(n) else f"> {MAX_TRIALS:,}" if n > MAX_TRIALS else f"{int(n):,}"


def parametric_blocks(parametric: pd.DataFrame, band: str, within: float) -> list[tuple]:
    """The section of the best objective a gate can reach (:mod:`mtmoe.tuning.parametric`)."""
    rows = [[r.study, r.gate, as_text(r.alpha) or "-", f"{r.evaluated} ({r.tail}, {r.dims})", _loss(r.best),
             f"[{_loss(r.best_low)}, {_loss(r.best_high)}]", _trials_cell(r.trials_within),
             "-" if math.isnan(r.a) else f"{r.c}, {100 * r.o:.3g}", r.note or "-"]
            for r in parametric.itertuples()]
    return [("h2", "The best objective a gate can reach: the noisy quadratic model"),
            ("p", "The tail of a random search's objective approaches a noisy quadratic distribution (Lourie, Cho "
                  "and He; `opda.parametric.NoisyQuadraticDistribution`). Fitted by `opda` (maximum spacing, convex: "
                  f"the objective is minimised) to each study's best {TAIL:.0%} of trials, the others censored, with "
                  "its effective number of hyperparameters c at most the number tuned. Best: the fit's a, the mean "
                  "validation objective of the best configuration without the noise of one run (×10⁻²); its "
                  f"{band} interval: the range of a over the noisy quadratics inside the exact {band} band of the "
                  "trials over that tail (a consonance interval, as opda's authors compute it), unbounded (±∞) where "
                  "the trials do not bound it; it holds if the tail is a noisy quadratic "
                  "(`benchmarks/bench_parametric_coverage.py` measures it). Trials: the smallest s whose "
                  f"median best of s random trials under the fit is within {within:.3g} × |a| of a (`--within`). "
                  "o: the noise's standard deviation ×10⁻². Every value: `bootstrap_parametric.csv`."),
            ("table", ["Study", "Gate", "alpha", "N (tail, tuned)", "best ×10⁻²", f"{band} interval",
                       f"trials to within {within:.3g}", "c, o ×10⁻²", "note"], rows)]


def _factor_cell(row) -> str:
    """A median factor with its interval: ``2× [0.5×, ≥4×]``."""
    return (f"{_factor(row.factor, row.bound)} [{_factor(row.factor_low, row.low_bound)}, "
            f"{_factor(row.factor_high, row.high_bound)}]")


def report_blocks(curves: pd.DataFrame, ranges: pd.DataFrame, objective: pd.DataFrame, objective_detail: pd.DataFrame,
                  trials: pd.DataFrame, gates: list[str], settings: Settings, url: str, data: str,
                  parametric: pd.DataFrame, within: float, unfinished: str = "") -> list[tuple]:
    """The report as blocks (``("h1"|"h2"|"p", text)``, ``("img", file, alt)``, ``("table", header, rows)``),
    rendered to Markdown and to HTML; the frames in the paper's order (``ranges`` with the objective's ranges,
    ``parametric`` :func:`mtmoe.tuning.parametric.parametric_estimates` at ``--within``; ``unfinished``:
    :func:`~mtmoe.tuning.trials.unfinished_note`'s note, where any)."""
    scheme = ("with replacement; closed form of Dodge et al. 2019" if settings.replace else
              "without replacement; closed form hypergeometric, P(best of s is the i-th ranked) = C(N-i, s-1)/C(N, s)")
    band = percent(settings.confidence)
    estimator = ("with replacement: Dodge et al.'s estimate, biased" if settings.replace else
                 "without replacement: Tang et al. 2020's unbiased estimate, which Appendix F's draws approximate")
    blocks: list[tuple] = [
        ("h1", f"Tuning-budget bootstrap: {data}"),
        ("p", f"Storage `{display_url(url)}`. Appendix F: for each budget s in {{1, 2, 5, 10, ..., "
              f"{settings.max_budget or PAPER_MAX_BUDGET}}} (up to a study's N completed trials), {settings.draws} "
              f"repetitions draw s trials ({scheme}; {settings.resampling} draws, seed {settings.seed}), keep the best "
              "validation objective (ties: lower config_id) and record its test loss. Failed trials (diverged, or lost "
              "too often) are left out of this bag. Figure, against s: per dataset and alpha, the test loss ×10⁻² "
              "(every gate's Monte-Carlo mean, then each gate family, a gate and its '+', with the 2.5th-97.5th "
              "percentile of the draws hatched), then the validation objective ×10⁻² (every gate's median tuning "
              f"curve, then per reduction-factor pair the curves with their exact {band} confidence bands filled). A "
              "family's gates share a hue, light and dashed without local search, dark and solid with it; markers at "
              "the budgets measured. The closed form is in the tables below and in `bootstrap_curves.csv`. Vector "
              "copy of the figure: `bootstrap.pdf`."),
        *([("p", unfinished_paragraph(unfinished))] if unfinished else []),
        ("img", "bootstrap.png", "tuning curves"),
        ("h2", f"The objective's tuning curve with exact {band} confidence bands"),
        ("p", _objective_text(settings, objective)),
    ]
    for data_, alpha in _panels(objective):
        table = _budget_table(objective[(objective.data == data_) & (objective.alpha == alpha)], gates,
                              lambda hit: f"{_loss(hit['median'])} [{_loss(hit.low)}, {_loss(hit.high)}]; "
                                          f"{_loss(hit.expected)}")
        blocks += [("p", f"**{_panel_title(data_, alpha)}**: best validation objective ×10⁻² of s trials, median "
                         f"[exact {band} band]; unbiased expected"), table]
    blocks += parametric_blocks(parametric, band, within)
    blocks += [
        ("h2", "Tuning reduction factors"),
        ("p", "Factor of A over B at budget s_B: s_B' / s_A, where s_A and s_B' are the smallest budgets at which "
              "A's and B's curves reach B's at s_B (s_B' = s_B unless B's curve is as low before s_B: flat, as a "
              "median curve often is, or rising). Range over the grid's s_B >= 2; ≥: a lower bound (A beats that "
              "level with one trial); never: A does not reach it within its trials. The paper's, on the closed-form "
              f"expected test loss of the best-validation trial ({estimator}): `bootstrap_factors.csv`."),
    ]
    header = ["Dataset", "alpha", "A over B", "range (s_B ≥ 2)", "s_B at min – max", "never"]
    rows = [[r.data, r.alpha or "-", f"{r.gate_a} over {r.gate_b}",
             f"{_factor(r.factor_min, r.min_bound)} – {_factor(r.factor_max, r.max_bound)}",
             "-" if pd.isna(r.s_b_at_min) else f"{int(r.s_b_at_min)} – {int(r.s_b_at_max)}",
             str(r.never)] for r in ranges.itertuples()]
    if not rows:
        blocks.append(("p", "No pair of gates shares a panel."))
    else:
        pair_band = percent(pair_confidence(settings.confidence))
        blocks += [
            ("table", header, rows),
            ("p", "On the objective's curves: the same factor on the unbiased expected best objective and on the "
                  f"median, with the median's {band} interval: the smallest and largest factors of any curves "
                  f"inside both studies' exact bands, each taken at {pair_band} so that the intervals of every s_B "
                  f"hold together with probability at least {band} (Bonferroni). Every s_B: "
                  "`bootstrap_objective_factors.csv`."),
            ("table", ["Dataset", "alpha", "A over B", "unbiased expected (s_B ≥ 2)", "median (s_B ≥ 2)",
                       f"{band} interval, all s_B ≥ 2 at once"],
             [[r.data, r.alpha or "-", f"{r.gate_a} over {r.gate_b}",
               f"{_factor(r.unbiased_min, r.unbiased_min_bound)} – {_factor(r.unbiased_max, r.unbiased_max_bound)}",
               f"{_factor(r.median_min, r.median_min_bound)} – {_factor(r.median_max, r.median_max_bound)}",
               f"{_factor(r.interval_low, r.interval_low_bound)} – {_factor(r.interval_high, r.interval_high_bound)}"]
              for r in ranges.itertuples()])]
        budgets = [s for s in SHOWN_BUDGETS if s in set(objective_detail.s_b)]
        blocks += [("p", f"Median factor [{band} interval] at selected budgets s_B:"),
                   ("table", ["Dataset", "alpha", "A over B", *(f"s_B = {s}" for s in budgets)],
                    [[data_, alpha or "-", f"{gate_a} over {gate_b}",
                      *(_factor_cell(hit.iloc[0]) if len(hit := pair[pair.s_b == s]) else "-" for s in budgets)]
                     for (data_, alpha, gate_a, gate_b), pair in objective_detail.groupby(
                         ["data", "alpha", "gate_a", "gate_b"], sort=False)])]
    studies = curves.assign(z=agreement(curves.mc_mean, curves.exact_mean, curves.exact_std, settings.draws)).groupby(
        "study", sort=False).agg(gate=("gate", "first"), alpha=("alpha", "first"), trials=("trials", "first"),
                                 left_out=("left_out", "first"), largest=("s", "max"), z=("z", "max"))
    tuned = trials.groupby("study").agg(seed=("seed", "first"), settings=("settings", "first"))
    blocks += [("h2", "Studies"),
               ("p", "Settings: what the `tune` command's overrides changed from the search space (part of each "
                     "study's identity: a study never mixes settings)."),
               ("table", ["Study", "Gate", "alpha", "seed", "settings", "completed N", "left out (failed)",
                          "budgets up to", "max abs(MC − closed form) / SE"],
                [[study, r.gate, r.alpha or "-", as_text(tuned.seed[study]) or "-", tuned.settings[study],
                  str(r.trials), str(r.left_out), str(r.largest), f"{r.z:.2f}"] for study, r in studies.iterrows()])]
    blocks.append(("h2", "Test loss ×10⁻² at selected budgets: Monte-Carlo mean (closed form) [2.5th-97.5th "
                         "percentile of the draws]"))
    for data_, alpha in _panels(curves):
        table = _budget_table(curves[(curves.data == data_) & (curves.alpha == alpha)], gates,
                              lambda hit: f"{_loss(hit.mc_mean)} ({_loss(hit.exact_mean)}) [{_loss(hit.mc_low)}, "
                                          f"{_loss(hit.mc_high)}]")
        blocks += [("p", f"**{_panel_title(data_, alpha)}**"), table]
    return blocks


def _budget_table(panel: pd.DataFrame, gates: list[str], cell: Callable[[pd.Series], str]) -> tuple:
    """A panel's table block: a row per budget of ``SHOWN_BUDGETS`` it has, a column per gate of ``gates`` it has,
    ``cell(row)`` of the panel's row of that gate and budget ("-" where there is none)."""
    present = [g for g in gates if g in set(panel.gate)]
    rows = []
    for s in [s for s in SHOWN_BUDGETS if s in set(panel.s)]:
        hits = [panel[(panel.gate == gate) & (panel.s == s)] for gate in present]
        rows.append([str(s), *("-" if hit.empty else cell(hit.iloc[0]) for hit in hits)])
    return ("table", ["s", *present], rows)


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
    parser = studies_parser("bootstrap", "Appendix F's tuning-budget bootstrap of a dataset's tuning studies "
                                         "(Figures 2-3): for each budget s, the test loss of the best-validation "
                                         "trial among s drawn trials (Monte Carlo and closed form) and how many "
                                         "fewer trials a gate needs than another. It never trains. --data a,b: one "
                                         "figure of several datasets.")
    parser.add_argument("--gates", default=None, help="comma-separated gates (default: every gate with a study)")
    parser.add_argument("--pairs", default=None,
                        help="A:B,... reduction factors of A over B (default: every G+ over G, comet over the others)")
    parser.add_argument("--draws", type=int, default=DRAWS, help="repetitions per budget (Appendix F: 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (each study's own, from it and its "
                                                            "name)")
    parser.add_argument("--max-budget", type=int, default=None,
                        help=f"largest budget (default {PAPER_MAX_BUDGET}, cut at each study's completed trials; "
                             "given, every study must have that many)")
    parser.add_argument("--replacement", action="store_true",
                        help="draw with replacement (Dodge et al. 2019's closed form) instead of without (Appendix F)")
    parser.add_argument("--resample", choices=RESAMPLING, default="nested",
                        help="nested: one random order per repetition, its prefixes are the draws; independent: "
                             "fresh draws for every budget")
    parser.add_argument("--device", default="cpu", help="torch device of the draws (cuda: a GPU)")
    parser.add_argument("--confidence", type=float, default=0.95,
                        help="confidence of the objective's exact bands, in (0, 1) (default 0.95; the factor's "
                             "interval has it too, from bands at 1 - (1 - confidence)/2)")
    parser.add_argument("--within", type=float, default=0.01,
                        help="the noisy quadratic model's distance to the best objective, relative to it: the "
                             "trials needed to come within it (default 0.01, 1%%)")
    args = parse_strict(parser, argv)
    if not 0 < args.within < 1:
        raise UsageError(f"--within must be in (0, 1), got {args.within:g}")
    if args.draws < 2:
        raise UsageError(f"--draws must be >= 2, got {args.draws}")
    if not 0 < args.confidence < 1:
        raise UsageError(f"--confidence must be in (0, 1), got {args.confidence:g}")
    if args.max_budget is not None and args.max_budget < 1:
        raise UsageError(f"--max-budget must be >= 1, got {args.max_budget}")
    if args.device != "cpu":  # torch checks the name; help, bad flags and a missing storage answer without it
        import torch

        try:
            device = torch.device(args.device)
        except RuntimeError as error:
            raise UsageError(f"--device: {error}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: no CUDA device is available here")
    settings = Settings(args.draws, args.seed, args.max_budget, args.replacement, args.resample, args.device,
                        args.confidence)
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
            raise UsageError(f"no study with finished trials for gate {missing[0]!r} of dataset {data!r} in "
                             f"{display_url(url)} (gates with trials: {', '.join(sorted(set(table.gate)))})")
    if gates is not None:
        trials = trials[trials.gate.isin(gates)]
    studies = trials.groupby([trials.data, trials.alpha.map(as_text), trials.gate]).study.unique()
    for (data, alpha, gate), names in studies.items():
        if len(names) > 1:
            raise UsageError(f"gate {gate!r} of {_panel_title(data, alpha)} has several studies "
                             f"({', '.join(sorted(names))}): keep one per gate and alpha in the storage")
    return trials, sorted(gates or set(trials.gate), key=gate_order)


def split_pair(text: str, gates: list[str]) -> tuple[str, ...]:
    """``A:B`` of ``--pairs``: a gate named ``module:Class`` has a colon of its own, so the split is at the colon
    that leaves two of ``gates`` (else at the first)."""
    splits = [(text[:i], text[i + 1:]) for i, char in enumerate(text) if char == ":"]
    return next((pair for pair in splits if set(pair) <= set(gates)), tuple(text.split(":", 1)))


def bootstrap(argv: list[str]) -> None:
    args, settings = parse_bootstrap_args(argv)
    datasets = _names(args.data, "--data")
    requested = _names(args.gates, "--gates")
    pair_names = _names(args.pairs, "--pairs") or []
    title = "+".join(datasets)
    out = output_dir(args.out, title)
    tables = []
    for data in datasets:
        url, table = collect(args.storage, data)
        tables.append(table)
    trials, gates = select(url, pd.concat(tables, ignore_index=True), requested)
    pairs = [split_pair(pair, gates) for pair in pair_names]
    for pair in pairs:
        if len(pair) != 2 or not set(pair) <= set(gates):
            raise UsageError(f"--pairs: {':'.join(pair)!r} is not A:B of two of the bootstrapped gates "
                             f"({', '.join(gates)})")
    note = unfinished_note(unfinished_studies(trials))
    if note:
        print(f"note: {note}", file=sys.stderr, flush=True)
    small = unbounded_studies(trials, settings.confidence)
    if small:
        print(f"note: {', '.join(f'{study!r} has {n}' for study, n in small.items())} evaluated trial"
              f"{'s' * (max(small.values()) != 1)}: the exact {percent(settings.confidence)} bands and the factors' "
              f"intervals need at least {trials_needed(settings.confidence)}, left out (run more trials or lower "
              "--confidence); the bootstrap and the closed forms are drawn", file=sys.stderr, flush=True)
    start = time.perf_counter()
    objective = paper_order(objective_curves(trials, settings))
    pairs = pairs or default_pairs(gates)
    objective_detail, objective_ranges = objective_factors(trials, pairs, settings)
    banded = time.perf_counter() - start
    start = time.perf_counter()
    curves = paper_order(tuning_curves(trials, settings))
    elapsed = time.perf_counter() - start
    factors, ranges = panel_factors(trials, pairs, settings)
    keys = ["data", "alpha", "gate_a", "gate_b"]
    ranges = ranges.merge(objective_ranges, on=keys, how="left")
    factors, ranges, objective_detail = (paper_order(frame, ("gate_a", "gate_b"))
                                         for frame in (factors, ranges, objective_detail))
    start = time.perf_counter()
    parametric = paper_order(parametric_estimates(trials, settings.confidence, args.within, settings.seed))
    modelled = time.perf_counter() - start
    for row in parametric[parametric.note != ""].itertuples():
        print(f"note: {row.study!r}: {row.note}", file=sys.stderr, flush=True)
    blocks = report_blocks(curves, ranges, objective, objective_detail, trials, gates, settings, url,
                           ", ".join(datasets), parametric, args.within, note)
    figure = plot(curves, objective, gates, pairs, settings.confidence, budgets(trials))
    images = {"bootstrap.png": figure_bytes(figure, "png")}
    figure.set_layout_engine("none")  # the PDF keeps the PNG's layout: one constrained-layout solve, not two
    text = markdown(blocks)
    write_outputs(out, {**images, "bootstrap.pdf": figure_bytes(figure, "pdf"),
                        "bootstrap_curves.csv": curves.to_csv(index=False),
                        "bootstrap_factors.csv": factors.to_csv(index=False),
                        "bootstrap_ranges.csv": ranges.to_csv(index=False),
                        "bootstrap_objective.csv": objective.to_csv(index=False),
                        "bootstrap_objective_factors.csv": objective_detail.to_csv(index=False),
                        "bootstrap_parametric.csv": parametric.to_csv(index=False),
                        "bootstrap.md": text, "bootstrap.html": html_page(blocks, images)})
    print(text, end="")
    print(f"bootstrap: {curves.study.nunique()} studies, {settings.draws} draws x up to {curves.s.nunique()} budgets: "
          f"curves in {elapsed:.2f} s on {settings.device}; exact bands and factor intervals in {banded:.2f} s; "
          f"noisy quadratic fits and intervals in {modelled:.2f} s")
    print(f"written to {out}/bootstrap.md, bootstrap.html, bootstrap.png, bootstrap.pdf, bootstrap_curves.csv, "
          "bootstrap_factors.csv, bootstrap_ranges.csv, bootstrap_objective.csv, bootstrap_objective_factors.csv, "
          "bootstrap_parametric.csv")
