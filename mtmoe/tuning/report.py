"""``python -m mtmoe report --data movielens``: the paper's Tables 2-3 and Table 7 from the tuning studies.

For every study of the dataset in the storage (the trial table, :mod:`mtmoe.tuning.trials`: one row per study
name, so ``.../alpha=0.1`` and ``.../alpha=0.9`` are separate rows, compared within their alpha):

* the **top 5% of trials by validation objective** (``ceil(0.05 * n)``, at least 1) of the ``n`` evaluated
  configurations. A diverged trial (failed with a ``fail_reason``) counts among the ``n`` with objective ``+inf``,
  so it is never selected while a finite one is left (comet-protocol.md §7, ecosystem.md §3.1). Trials lost to a
  crash or an interrupt (failed without a reason, re-run on resume) and duplicates are not configurations and are
  ignored; each ``config_id`` counts once.
* **Tables 2-3**: mean ± standard error (``s / sqrt(m)``, ``ddof=1``) of the selected trials' test loss, shown
  ×10⁻² as in the paper (in hundredths: 51.36 is a loss of 0.5136), and of n/s (experts per sample, averaged over the task gates).
* **Significance**: one-sided unpaired Welch t-test ``scipy.stats.ttest_ind(a, b, alternative="less",
  equal_var=False)`` of each study's selected test losses against those of the best non-"+" baseline of the same
  dataset and alpha (lowest mean test loss among the other non-"+" gates); an asterisk when p < 0.05. The paper does
  not say Student or Welch: Welch is used and stated.
* **Table 7**: per-task test metrics of the same selected trials, mean ± SE: AUC and accuracy ×100, MSE as is.
* **Routing**: how the selected trials' gates route at their best epoch on the validation split, per task: entropy,
  Jaccard overlap, selections changed since the previous epoch, the busiest expert's load
  (:mod:`mtmoe.tuning.routing_report`; studies tuned before these statistics have none).
* **Unfinished studies** (fewer evaluated configurations than ``tune --trials`` planned) show ``234 of 500`` trials
  and a note, printed and in the report: their trials finished in the order they stopped, so the evaluated ones are
  not a random sample of the plan (:func:`mtmoe.tuning.trials.unfinished_note`).
* **Studies**: each study's seed, settings (what ``tune``'s overrides changed), what trained its trials (devices, and
  kernels run as torch operations: :func:`~mtmoe.tuning.trials.trained_on`) and failed configurations with their
  reasons (diverged, or lost too often). Rows by alpha, then the paper's gate order.
* **Hyperparameter importance** of each study's validation objective (:mod:`mtmoe.tuning.importance`: Optuna's PED-ANOVA
  and fANOVA), a table and a figure naming the evaluator; ``--importance`` picks the evaluators (``none``: no
  importance section, and no importance files: those an earlier report left in ``--out`` are removed).

Printed, and written atomically as Markdown (``report.md``), CSV (``table_2_3.csv``, ``table_7.csv``,
``routing.csv``, ``importance.csv``) and the importance figure (``importance.png``, ``importance.pdf``) into ``--out``
(default ``studies/reports/<data>/`` under the current directory). The storage URL is shown without its password.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import pandas as pd

from mtmoe.gate_names import split_gate_name
from mtmoe.tuning import importance
from mtmoe.tuning.bootstrap_report import figure_bytes
from mtmoe.tuning.routing_report import routing_markdown, routing_table
from mtmoe.tuning.storage import display_url
from mtmoe.tuning.trials import (
    TASK_METRICS, as_text, collect, output_dir, paper_order, parse_strict, studies_parser, trained_on,
    unfinished_note, unfinished_paragraph, unfinished_studies, write_outputs,
)

TOP_FRACTION = 0.05
IMPORTANCE_FILES = frozenset({"importance.csv", "importance.png", "importance.pdf"})
SIGNIFICANCE = 0.05


def parse_report_args(argv: list[str]) -> argparse.Namespace:
    parser = studies_parser("report", "The paper's Tables 2-3 and 7 from the tuning studies of a dataset: mean ± SE of "
                                      "the test loss, n/s and per-task metrics over each study's top 5% of trials by "
                                      "validation objective, with a one-sided Welch t-test against the best gate "
                                      "without local search. It never trains.")
    parser.add_argument("--importance", default="ped-anova,fanova", metavar="EVALUATORS",
                        help="the hyperparameter-importance evaluators that run: a comma-separated list of ped-anova "
                             "and fanova, or none (no importance table, figure or CSV); fANOVA costs seconds per "
                             "study of hundreds of trials (default: ped-anova,fanova)")
    args = parse_strict(parser, argv)
    args.importance = importance.chosen(args.importance)
    return args


def top_trials(trials: pd.DataFrame) -> pd.DataFrame:
    """The top ``ceil(5% of n)`` (at least one) by validation objective; ties broken by config_id."""
    m = max(1, math.ceil(TOP_FRACTION * len(trials)))
    return trials.sort_values(["objective", "config_id"], kind="mergesort").head(m)


def mean_se(values: pd.Series) -> tuple[float, float]:
    values = values.astype(float).dropna()
    if len(values) == 0:
        return math.nan, math.nan
    se = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan
    return float(values.mean()), se


def welch_less(a: pd.Series, b: pd.Series) -> float:
    """One-sided unpaired Welch t-test p-value for mean(a) < mean(b); NaN when either side has < 2 finite values."""
    from scipy.stats import ttest_ind

    a, b = a.dropna().astype(float), b.dropna().astype(float)
    if len(a) < 2 or len(b) < 2:
        return math.nan
    p = ttest_ind(a, b, alternative="less", equal_var=False).pvalue
    return float(p)


def aggregate(trials: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(Tables 2-3 rows, Table 7 rows), one row per study."""
    selected = {name: top_trials(group) for name, group in trials.groupby("study", sort=False)}
    rows = []
    for name, top in selected.items():
        every = trials[trials.study == name]
        loss_mean, loss_se = mean_se(top.test_loss)
        ns_mean, ns_se = mean_se(top.n_s)
        rows.append({
            "study": name, "gate": every.gate.iloc[0], "alpha": every.alpha.iloc[0], "seed": every.seed.iloc[0],
            "settings": every.settings.iloc[0], "trials": len(every), "planned": every.planned.iloc[0],
            "failed": int(every.failed.sum()),
            "selected": len(top),
            "test_loss_x100_mean": loss_mean * 100, "test_loss_x100_se": loss_se * 100,
            "n_s_mean": ns_mean, "n_s_se": ns_se,
        })
    table = paper_order(pd.DataFrame(rows))
    table["alpha_key"] = [as_text(a) for a in table.alpha]  # not astype(str): pandas 3 keeps None missing
    baselines, p_values = [], []
    for row in table.itertuples():
        candidates = table[(table.alpha_key == row.alpha_key) & (table.study != row.study)
                           & ~table.gate.astype(str).map(lambda g: split_gate_name(g)[1]) & table.test_loss_x100_mean.notna()]
        if candidates.empty:
            baselines.append(None)
            p_values.append(math.nan)
            continue
        best = candidates.sort_values(["test_loss_x100_mean", "study"], kind="mergesort").iloc[0]
        baselines.append(best.study)
        p_values.append(welch_less(selected[row.study].test_loss, selected[best.study].test_loss))
    table["baseline"] = baselines
    table["p_value"] = p_values
    table["significant"] = table.p_value < SIGNIFICANCE
    table = table.drop(columns="alpha_key")

    metric_columns = sorted(c for c in trials.columns if "/" in c)
    rows7 = []
    for name, top in selected.items():
        row: dict[str, Any] = {"study": name, "gate": top.gate.iloc[0], "alpha": top.alpha.iloc[0],
                               "selected": len(top)}
        for column in metric_columns:
            task, metric = column.split("/")
            label, scale = TASK_METRICS[metric]
            mean, se = mean_se(top[column] * scale)
            row[f"{task} {label} mean"], row[f"{task} {label} se"] = mean, se
        rows7.append(row)
    return table, paper_order(pd.DataFrame(rows7))


def _pm(mean: float, se: float, digits: int) -> str:
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f} ± " + ("n/a" if math.isnan(se) else f"{se:.{digits}f}")


def failure_summary(trials: pd.DataFrame) -> str:
    """A study's failed configurations by kind (``diverged ×3; lost ×1 (config 2: ...)``); lost ones in full."""
    failed = trials[trials.failed]
    parts = []
    for kind, group in failed.groupby(failed.fail_reason.str.split(":").str[0], sort=True):
        detail = "" if kind == "diverged" else " (" + "; ".join(
            f"config {r.config_id}: {r.fail_reason.partition(':')[2].strip()}" for r in group.itertuples()) + ")"
        parts.append(f"{kind} ×{len(group)}{detail}")
    return "; ".join(parts)


def markdown(data: str, url: str, trials: pd.DataFrame, table: pd.DataFrame, table7: pd.DataFrame,
             unfinished: str = "") -> str:
    """The report's Markdown; ``unfinished``: :func:`~mtmoe.tuning.trials.unfinished_note`'s note, where any."""
    lines = [
        f"# Tuning report: {data}",
        "",
        f"Storage: `{display_url(url)}`. Top 5% of trials by validation objective (ceil(0.05 n), at least 1; failed "
        "trials count with objective +inf). Mean ± standard error over the selected trials. Test loss ×10⁻², as the "
        "paper writes it: in hundredths (51.36 is a loss of 0.5136). "
        "`*`: one-sided unpaired Welch t-test (`scipy.stats.ttest_ind(alternative='less', equal_var=False)`) against "
        "the baseline, the best non-'+' gate of the same alpha, p < 0.05. n/s: experts per sample, mean over tasks.",
        "",
        "## Tables 2-3: test loss and n/s",
        "",
        "| Study | Gate | alpha | Trials | Failed | Selected | Test loss ×10⁻² | n/s | Baseline | p |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples():
        star = "*" if r.significant else ""
        p = "n/a" if math.isnan(r.p_value) else f"{r.p_value:.3g}"
        trials_cell = f"{r.trials} of {int(r.planned)}" if r.trials < r.planned else f"{r.trials}"
        lines.append(f"| {r.study} | {r.gate} | {as_text(r.alpha) or '-'} | {trials_cell} | {r.failed} "
                     f"| {r.selected} | {star}{_pm(r.test_loss_x100_mean, r.test_loss_x100_se, 2)} "
                     f"| {_pm(r.n_s_mean, r.n_s_se, 2)} | {as_text(r.baseline) or '-'} | {p} |")
    if unfinished:
        lines += ["", unfinished_paragraph(unfinished)]
    metrics = [c.removesuffix(" mean") for c in table7.columns if c.endswith(" mean")]
    lines += ["", "## Table 7: per-task test metrics (AUC and accuracy ×100, MSE as is)", "",
              "| Study | Gate | alpha | " + " | ".join(metrics) + " |", "|---|---|---|" + "---|" * len(metrics)]
    for _, r in table7.iterrows():
        cells = [_pm(r[f"{m} mean"], r[f"{m} se"], 4 if m.endswith("MSE") else 2) for m in metrics]
        lines.append(f"| {r['study']} | {r['gate']} | {as_text(r['alpha']) or '-'} | " + " | ".join(cells) + " |")
    lines += ["", "## Studies: how they were tuned", "",
              "Settings: what the `tune` command's overrides changed from the search space (part of each study's "
              "identity: a study never mixes settings).", "",
              "| Study | Gate | alpha | Seed | Settings | Failed configurations | Trained on |",
              "|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        failures = failure_summary(trials[trials.study == r.study]) or "-"
        lines.append(f"| {r.study} | {r.gate} | {as_text(r.alpha) or '-'} | {as_text(r.seed) or '-'} | {r.settings} "
                     f"| {failures} | {trained_on(trials[trials.study == r.study])} |")
    return "\n".join(lines) + "\n"


def report(argv: list[str]) -> None:
    args = parse_report_args(argv)
    out = output_dir(args.out, args.data)
    url, trials = collect(args.storage, args.data)
    note = unfinished_note(unfinished_studies(trials))
    if note:
        print(f"note: {note}", file=sys.stderr, flush=True)
    table, table7 = aggregate(trials)
    routing = routing_table(trials, top_trials, mean_se)
    text = markdown(args.data, url, trials, table, table7, note) + routing_markdown(routing, _pm)
    files = {"table_2_3.csv": table.to_csv(index=False), "table_7.csv": table7.to_csv(index=False)}
    if not routing.empty:
        files["routing.csv"] = routing.to_csv(index=False)
    if args.importance:
        importances = paper_order(importance.importances(trials, args.importance, bar=sys.stderr.isatty()))
        text += importance.markdown(importances, args.importance)
        figure = importance.plot(importances, args.importance)
        png = figure_bytes(figure, "png")
        figure.set_layout_engine("none")  # the PDF keeps the PNG's layout
        files |= {"importance.csv": importances.to_csv(index=False), "importance.png": png,
                  "importance.pdf": figure_bytes(figure, "pdf")}
    files = {"report.md": text, **files}
    write_outputs(out, files)
    for name in IMPORTANCE_FILES.difference(files):  # an earlier report's, of evaluators this one did not run
        (out / name).unlink(missing_ok=True)
    print(text, end="")
    print(f"written to {out}/" + ", ".join(files))
