"""``python -m mtmoe bootstrap --data movielens``: the tuning-budget bootstrap report (Figures 2-3, Appendix F).

It reads the trials of the tuning studies (the trial table, :mod:`mtmoe.tuning.trials`; it never trains), runs the
estimators of :mod:`mtmoe.tuning.bootstrap` on them and renders the result: the figure, Markdown and HTML.

``--gates`` picks gates (default: every gate with a study of the dataset); each must have a study with finished
trials in the storage, and a panel shows those with a study at its alpha. ``--data`` takes a comma-separated list
for a figure of several datasets (Figure 2).

Outputs (written atomically into ``--out``, default ``studies/reports/<data>/`` under the current directory):
``bootstrap.png`` (one panel per dataset and alpha: Monte-Carlo mean with its 95% band, closed form as markers),
``bootstrap_curves.csv``, ``bootstrap_factors.csv`` (every s_B), ``bootstrap_ranges.csv``, and ``bootstrap.md`` /
``bootstrap.html`` (the HTML embeds the plot).
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
from mtmoe.files import write_atomic
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
from mtmoe.tuning.trials import as_text, collect, output_dir, parse_strict, studies_parser

SHOWN_BUDGETS = (1, 2, 5, 10, 25, 50, 100, 250)  # the Markdown table; every budget is in the CSV


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
    studies = trials.groupby([trials.data, trials.alpha.map(as_text), trials.gate]).study.unique()
    for (data, alpha, gate), names in studies.items():
        if len(names) > 1:
            raise UsageError(f"gate {gate!r} of {_panel_title(data, alpha)} has several studies "
                             f"({', '.join(sorted(names))}): keep one per gate and alpha in the storage")
    return trials, gates or sorted(set(trials.gate))


def bootstrap(argv: list[str]) -> None:
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
    out = output_dir(args.out, title)
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
