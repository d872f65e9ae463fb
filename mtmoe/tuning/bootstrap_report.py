"""``python -m mtmoe bootstrap --data movielens``: the tuning-budget bootstrap report (Figures 2-3, Appendix F).

It reads the trials of the tuning studies (the trial table, :mod:`mtmoe.tuning.trials`; it never trains), runs the
estimators of :mod:`mtmoe.tuning.bootstrap` on them and renders the result: the figure, Markdown and HTML.

``--gates`` picks gates (default: every gate with a study of the dataset); each must have a study with finished
trials in the storage, and a panel shows those with a study at its alpha. ``--data`` takes a comma-separated list
for a figure of several datasets (Figure 2).

Outputs (written atomically into ``--out``, default ``studies/reports/<data>/`` under the current directory):
``bootstrap.png`` and its vector copy ``bootstrap.pdf`` (:func:`plot`: per dataset and alpha, every gate's mean, then
each gate family with its 95% bands), ``bootstrap_curves.csv``, ``bootstrap_factors.csv`` (every s_B),
``bootstrap_ranges.csv``, and ``bootstrap.md`` / ``bootstrap.html`` (the HTML embeds the plot). Rows and gates in
the paper's order (:func:`mtmoe.tuning.trials.paper_order`); the storage URL without its password.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import math
import re
import time

import pandas as pd
import torch

from mtmoe.errors import UsageError
from mtmoe.tuning.bootstrap import (
    DRAWS,
    PAPER_MAX_BUDGET,
    RESAMPLING,
    Settings,
    agreement,
    default_pairs,
    panel_factors,
    tuning_curves,
)
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
    families = list(dict.fromkeys(g.removesuffix("+") for g in gates))
    family = gate.removesuffix("+")
    others = [f for f in families if f not in FAMILY_COLOURS]
    light, dark = FAMILY_COLOURS.get(family) or OTHER_COLOURS[others.index(family) % len(OTHER_COLOURS)]
    plus = gate.endswith("+")
    return {"color": dark if plus else light, "linestyle": "-" if plus else (0, (4, 2)), "linewidth": 1.8}


def plot(curves: pd.DataFrame, gates: list[str]):
    """The tuning curves, test loss ×10⁻² against the budget s (log scale), as Figures 2-3: for each (dataset,
    alpha), a panel with every gate's Monte-Carlo mean (Figure 2), then one panel per gate family with the means
    and 95% bands of the gate and its "+" (Figure 3). A family's two gates share a hue, light and dashed without
    local search, dark and solid with it; the panels of a (dataset, alpha) share their y axis, which fits the
    means and the bands' lower ends (the bands' upper ends at small s may run past it)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    gates = sorted(gates, key=gate_order)
    groups = []  # per (dataset, alpha): its curves and its panels' gates (every gate, then each family)
    for data, alpha in _panels(curves):
        panel = curves[(curves.data == data) & (curves.alpha == alpha)]
        present = [g for g in gates if g in set(panel.gate)]
        families = dict.fromkeys(g.removesuffix("+") for g in present)
        groups.append((data, alpha, panel, [present, *([g for g in present if g.removesuffix("+") == family]
                                                      for family in families)]))
    most = max(len(panels) for *_, panels in groups)
    columns = math.ceil(most / math.ceil(most / MAX_COLUMNS))  # rows of even length: 6 panels as 3 + 3, not 4 + 2
    rows = sum(math.ceil(len(panels) / columns) for *_, panels in groups)
    figure = Figure(figsize=(3.4 * columns, 2.9 * rows + 0.7), layout="constrained")
    grid = figure.add_gridspec(rows, columns)
    row = 0
    for data, alpha, panel, panels in groups:
        scaled = panel.assign(**{c: 100 * panel[c] for c in ("mc_mean", "mc_low", "mc_high")})
        low, high = scaled.mc_low.min(), scaled.mc_mean.max()
        margin = 0.06 * (high - low) or 0.01 * abs(high) or 0.01
        for index, members in enumerate(panels):
            ax = figure.add_subplot(grid[row + index // columns, index % columns])
            for gate in members:
                rows_ = scaled[scaled.gate == gate]
                style = gate_style(gate, gates)
                if index:  # a family panel: the "+" gate's band filled, the other's outlined in its dashes
                    if gate.endswith("+"):
                        ax.fill_between(rows_.s, rows_.mc_low, rows_.mc_high, color=style["color"], alpha=0.15,
                                        linewidth=0)
                    for end in (rows_.mc_low, rows_.mc_high):
                        ax.plot(rows_.s, end, color=style["color"], linewidth=0.8, linestyle=style["linestyle"])
                ax.plot(rows_.s, rows_.mc_mean, label=gate, **style)
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(FixedLocator([s for s in SHOWN_BUDGETS if s <= panel.s.max()]))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlim(1, panel.s.max())
            ax.set_ylim(low - margin, high + margin)
            what = "all gates" if index == 0 else " vs ".join(members)
            ax.set_title(f"{_panel_title(data, alpha)}: {what}", fontsize=9.5)
            ax.set_xlabel("tuning budget s (trials)", fontsize=8.5)
            ax.set_ylabel("test loss ×10⁻²", fontsize=8.5)
            ax.tick_params(labelsize=8)
            ax.grid(True, color="#dddddd", linewidth=0.6)
        row += math.ceil(len(panels) / columns)
    blank = Line2D([], [], linestyle="none", label=" ")
    handles = []  # a column per gate family (the gate above its "+"), then the styles: legends fill column by column
    for family in dict.fromkeys(gate.removesuffix("+") for gate in gates):
        handles += [Line2D([], [], label=gate, **gate_style(gate, gates)) if gate in gates else blank
                    for gate in (family, family + "+")]
    handles += [Line2D([], [], color="#555555", linestyle=(0, (4, 2)), label="dashed: without local search"),
                Line2D([], [], color="#555555", label='solid: with local search ("+")')]
    figure.legend(handles=handles, loc="outside lower center", ncol=len(handles) // 2, fontsize=8.5, frameon=False,
                  title_fontsize=8.5, title="Lines: Monte-Carlo mean of the best-validation trial's test loss. Bands: "
                                            '95% of the draws (2.5th-97.5th percentile), filled for "+".')
    return figure


def figure_bytes(figure, format: str) -> bytes:
    """The figure as a PNG (150 dpi) or a vector PDF."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=format, dpi=150)
    return buffer.getvalue()


def _loss(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.2f}"


def _factor(value: float, bound: str) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{'≥' if bound == '>=' else ''}{value:.3g}×"


def report_blocks(curves: pd.DataFrame, ranges: pd.DataFrame, trials: pd.DataFrame, gates: list[str],
                  settings: Settings, url: str, data: str) -> list[tuple]:
    """The report as blocks (``("h1"|"h2"|"p", text)``, ``("img", file, alt)``, ``("table", header, rows)``),
    rendered to Markdown and to HTML; ``curves`` and ``ranges`` in the paper's order."""
    scheme = ("with replacement; closed form of Dodge et al. 2019" if settings.replace else
              "without replacement; closed form hypergeometric, P(best of s is the i-th ranked) = C(N-i, s-1)/C(N, s)")
    blocks: list[tuple] = [
        ("h1", f"Tuning-budget bootstrap: {data}"),
        ("p", f"Storage `{display_url(url)}`. Appendix F: for each budget s in {{1, 2, 5, 10, ..., "
              f"{settings.max_budget or PAPER_MAX_BUDGET}}} (up to a study's N completed trials), {settings.draws} "
              f"repetitions draw s trials ({scheme}; {settings.resampling} draws, seed {settings.seed}), keep the best "
              "validation objective (ties: lower config_id) and record its test loss. Figure: test loss ×10⁻² against "
              "s; per dataset and alpha, every gate's Monte-Carlo mean, then each gate family (a gate and its '+', "
              "one hue: light and dashed without local search, dark and solid with it) with its 95% bands, the "
              "2.5th-97.5th percentiles of the recorded test losses (the y axis fits the means and the bands' lower "
              "ends: the upper ends at small s may run past it). The closed form is in the tables below and in "
              "`bootstrap_curves.csv`. Failed trials (diverged, or lost too often) are left out of the bag. Vector "
              "copy of the figure: `bootstrap.pdf`."),
        ("img", "bootstrap.png", "tuning curves"),
        ("h2", "Tuning reduction factors"),
        ("p", "Factor of A over B at budget s_B: s_B' / s_A, where s_A and s_B' are the smallest budgets at which "
              "A's and B's closed-form expected test loss reach B's at s_B (s_B' = s_B when B's curve does not "
              "rise). Range over the grid's s_B >= 2; ≥: a lower bound (A beats that level with one trial); "
              "never: budgets s_B whose level A does not reach within its trials. Every s_B: "
              "`bootstrap_factors.csv`."),
    ]
    header = ["Dataset", "alpha", "A over B", "range (s_B ≥ 2)", "s_B at min – max", "never"]
    rows = [[r.data, r.alpha or "-", f"{r.gate_a} over {r.gate_b}",
             f"{_factor(r.factor_min, r.min_bound)} – {_factor(r.factor_max, r.max_bound)}",
             "-" if pd.isna(r.s_b_at_min) else f"{int(r.s_b_at_min)} – {int(r.s_b_at_max)}",
             str(r.never)] for r in ranges.itertuples()]
    blocks.append(("table", header, rows) if rows else ("p", "No pair of gates shares a panel."))
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
    studies = trials.groupby([trials.data, trials.alpha.map(as_text), trials.gate]).study.unique()
    for (data, alpha, gate), names in studies.items():
        if len(names) > 1:
            raise UsageError(f"gate {gate!r} of {_panel_title(data, alpha)} has several studies "
                             f"({', '.join(sorted(names))}): keep one per gate and alpha in the storage")
    return trials, sorted(gates or set(trials.gate), key=gate_order)


def bootstrap(argv: list[str]) -> None:
    args, settings = parse_bootstrap_args(argv)
    datasets = _names(args.data, "--data")
    requested = _names(args.gates, "--gates")
    pairs = [tuple(pair.split(":", 1)) for pair in _names(args.pairs, "--pairs") or []]
    title = "+".join(datasets)
    out = output_dir(args.out, title)
    tables = []
    for data in datasets:
        url, table = collect(args.storage, data)
        tables.append(table)
    trials, gates = select(url, pd.concat(tables, ignore_index=True), requested)
    for pair in pairs:
        if len(pair) != 2 or not set(pair) <= set(gates):
            raise UsageError(f"--pairs: {':'.join(pair)!r} is not A:B of two of the bootstrapped gates "
                             f"({', '.join(gates)})")
    start = time.perf_counter()
    curves = paper_order(tuning_curves(trials, settings))
    elapsed = time.perf_counter() - start
    factors, ranges = (paper_order(frame, ("gate_a", "gate_b"))
                       for frame in panel_factors(trials, pairs or default_pairs(gates), settings))
    blocks = report_blocks(curves, ranges, trials, gates, settings, url, ", ".join(datasets))
    figure = plot(curves, gates)
    images = {"bootstrap.png": figure_bytes(figure, "png")}
    text = markdown(blocks)
    write_outputs(out, {**images, "bootstrap.pdf": figure_bytes(figure, "pdf"),
                        "bootstrap_curves.csv": curves.to_csv(index=False),
                        "bootstrap_factors.csv": factors.to_csv(index=False),
                        "bootstrap_ranges.csv": ranges.to_csv(index=False), "bootstrap.md": text,
                        "bootstrap.html": html_page(blocks, images)})
    print(text, end="")
    print(f"bootstrap: {curves.study.nunique()} studies, {settings.draws} draws x up to {curves.s.nunique()} budgets: "
          f"curves in {elapsed:.2f} s on {settings.device}")
    print(f"written to {out}/bootstrap.md, bootstrap.html, bootstrap.png, bootstrap.pdf, bootstrap_curves.csv, "
          "bootstrap_factors.csv, bootstrap_ranges.csv")
