"""``python -m mtmoe report --data movielens``: the paper's Tables 2-3 and Table 7 from the tuning studies.

For every study of the dataset in the storage (study user attributes ``data`` and ``gate``, written by ``tune``;
one row per study name, so ``.../alpha=0.1`` and ``.../alpha=0.9`` are separate rows, compared within their alpha):

* the **top 5% of trials by validation objective** (``ceil(0.05 * n)``, at least 1) of the ``n`` evaluated
  configurations. A diverged trial (failed with a ``fail_reason``) counts among the ``n`` with objective ``+inf``,
  so it is never selected while a finite one is left (comet-protocol.md §7, ecosystem.md §3.1). Trials lost to a
  crash or an interrupt (failed without a reason, re-run on resume) and duplicates are not configurations and are
  ignored; each ``config_id`` counts once.
* **Tables 2-3**: mean ± standard error (``s / sqrt(m)``, ``ddof=1``) of the selected trials' test loss, shown
  ×10⁻² as in the paper (i.e. multiplied by 100), and of n/s (experts per sample, averaged over the task gates).
* **Significance**: one-sided unpaired Welch t-test ``scipy.stats.ttest_ind(a, b, alternative="less",
  equal_var=False)`` of each study's selected test losses against those of the best non-"+" baseline of the same
  dataset and alpha (lowest mean test loss among the other non-"+" gates); an asterisk when p < 0.05. The paper does
  not say Student or Welch: Welch is used and stated.
* **Table 7**: per-task test metrics of the same selected trials, mean ± SE: AUC and accuracy ×100, MSE as is.

Printed, and written atomically as Markdown (``report.md``) and CSV (``table_2_3.csv``, ``table_7.csv``) into
``--out`` (default ``studies/reports/<data>/``).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from optuna.trial import TrialState

from mtmoe.errors import UsageError
from mtmoe.files import write_atomic
from mtmoe.lit.metrics import TASK_METRICS
from mtmoe.tuning.space import STUDIES_DIR

TOP_FRACTION = 0.05
SIGNIFICANCE = 0.05


class OneLineParser(argparse.ArgumentParser):
    """Every parse error (a missing required flag too, which ``exit_on_error=False`` does not cover before Python
    3.12) is a one-line UsageError."""

    def error(self, message: str):
        raise UsageError(f"{self.prog.rpartition(' ')[2]}: {message}")


def studies_parser(command: str) -> argparse.ArgumentParser:
    """``--data``, ``--storage``, ``--out``: how the commands that read the tuning studies (``report``,
    ``bootstrap``) find them and where they write."""
    parser = OneLineParser(prog=f"python -m mtmoe {command}", exit_on_error=False)
    parser.add_argument("--data", required=True, help="dataset (the studies' 'data' attribute)")
    parser.add_argument("--storage", default=None, help="RDB URL or journal:PATH (default: studies/optuna.db)")
    parser.add_argument("--out", default=None, help="output folder (default: studies/reports/<data>/)")
    return parser


def parse_strict(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; a bad or unknown flag is a one-line UsageError."""
    try:
        args, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as error:
        raise UsageError(str(error)) from None
    if extra:
        raise UsageError(f"{parser.prog.rpartition(' ')[2]}: unrecognised arguments: {' '.join(extra)}")
    return args


def parse_report_args(argv: list[str]) -> argparse.Namespace:
    return parse_strict(studies_parser("report"), argv)


def open_storage(url: str | None):
    """The tuning storage, read-only in spirit: a missing SQLite file is an error, never created."""
    from mtmoe.tuning.study import storage_for

    url = url or f"sqlite:///{STUDIES_DIR / 'optuna.db'}"
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        if not path.is_file():
            raise UsageError(f"no study storage at {path} (run `python -m mtmoe tune` first, or pass --storage)")
    elif url.startswith("journal:") and not Path(url.removeprefix("journal:")).is_file():
        raise UsageError(f"no journal file {url.removeprefix('journal:')} (run tune first, or pass --storage)")
    return url, storage_for(url)


def trial_rows(study_name: str, attrs: dict[str, Any], trials: list) -> list[dict[str, Any]]:
    """One row per evaluated configuration: complete trials, and diverged ones with objective +inf."""
    rows: dict[int, dict[str, Any]] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        user = trial.user_attrs
        if "config_id" not in user:
            continue
        if trial.state == TrialState.COMPLETE and trial.value is not None:
            diverged, objective = False, float(trial.value)
        elif trial.state == TrialState.FAIL and str(user.get("fail_reason", "")).startswith("diverged"):
            diverged, objective = True, math.inf
        else:  # lost (crash, Ctrl-C), waiting, running, skipped duplicates: not a result
            continue
        config_id = int(user["config_id"])
        if config_id in rows and not rows[config_id]["diverged"]:
            continue  # a configuration counts once (its first complete evaluation)
        tasks = sorted({k.split("/")[1] for k in user if k.startswith("test/") and k.endswith("/experts_per_sample")})
        per_task_ns = [user[f"test/{t}/experts_per_sample"] for t in tasks]
        row = {
            "study": study_name, "gate": attrs.get("gate"), "alpha": attrs.get("alpha", _alpha_of(study_name)),
            "config_id": config_id, "trial": trial.number, "diverged": diverged, "objective": objective,
            "test_loss": _number(user.get("test_loss")),
            "n_s": float(np.mean([_number(v) for v in per_task_ns])) if per_task_ns else math.nan,
        }
        for key, value in user.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "test" and parts[2] in TASK_METRICS:
                row[f"{parts[1]}/{parts[2]}"] = _number(value)
        rows[config_id] = row
    return list(rows.values())


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _text(value: Any) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def _alpha_of(study_name: str) -> str | None:
    _, _, alpha = study_name.partition("/alpha=")
    return alpha or None


def collect(url: str | None, data: str) -> tuple[str, pd.DataFrame]:
    """All evaluated configurations of the dataset's studies, one row each."""
    import optuna

    url, storage = open_storage(url)
    rows: list[dict[str, Any]] = []
    names = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if summary.user_attrs.get("data") != data or "gate" not in summary.user_attrs:
            continue
        names.append(summary.study_name)
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        rows += trial_rows(summary.study_name, summary.user_attrs, study.get_trials(deepcopy=False))
    if not names:
        raise UsageError(f"no studies for dataset {data!r} in {url} (run `python -m mtmoe tune --data {data}` first)")
    if not rows:
        raise UsageError(f"the studies of {data!r} in {url} ({', '.join(sorted(names))}) have no finished trials yet")
    return url, pd.DataFrame(rows)


def top_trials(trials: pd.DataFrame) -> pd.DataFrame:
    """The top ``ceil(5% of n)`` (at least one) by validation objective; ties broken by config_id."""
    m = max(1, math.ceil(TOP_FRACTION * len(trials)))
    return trials.sort_values(["objective", "config_id"], kind="mergesort").head(m)


def mean_se(values: pd.Series) -> tuple[float, float]:
    values = values.astype(float)
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
    selected = {name: top_trials(group) for name, group in trials.groupby("study", sort=True)}
    rows = []
    for name, top in selected.items():
        every = trials[trials.study == name]
        loss_mean, loss_se = mean_se(top.test_loss)
        ns_mean, ns_se = mean_se(top.n_s)
        rows.append({
            "study": name, "gate": every.gate.iloc[0], "alpha": every.alpha.iloc[0], "trials": len(every),
            "diverged": int(every.diverged.sum()), "selected": len(top),
            "test_loss_x100_mean": loss_mean * 100, "test_loss_x100_se": loss_se * 100,
            "n_s_mean": ns_mean, "n_s_se": ns_se,
        })
    table = pd.DataFrame(rows)
    table["alpha_key"] = [_text(a) for a in table.alpha]  # not astype(str): pandas 3 keeps None missing
    baselines, p_values = [], []
    for row in table.itertuples():
        candidates = table[(table.alpha_key == row.alpha_key) & (table.study != row.study)
                           & ~table.gate.astype(str).str.endswith("+") & table.test_loss_x100_mean.notna()]
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
    return table, pd.DataFrame(rows7)


def _pm(mean: float, se: float, digits: int) -> str:
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f} ± " + ("n/a" if math.isnan(se) else f"{se:.{digits}f}")


def markdown(data: str, url: str, table: pd.DataFrame, table7: pd.DataFrame) -> str:
    lines = [
        f"# Tuning report: {data}",
        "",
        f"Storage: `{url}`. Top 5% of trials by validation objective (ceil(0.05 n), at least 1; diverged trials count "
        "with objective +inf). Mean ± standard error over the selected trials. Test loss ×10⁻² (×100). "
        "`*`: one-sided unpaired Welch t-test (`scipy.stats.ttest_ind(alternative='less', equal_var=False)`) against "
        "the baseline, the best non-'+' gate of the same alpha, p < 0.05. n/s: experts per sample, mean over tasks.",
        "",
        "## Tables 2-3: test loss and n/s",
        "",
        "| Study | Gate | alpha | Trials | Diverged | Selected | Test loss ×10⁻² | n/s | Baseline | p |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples():
        star = "*" if r.significant else ""
        p = "n/a" if math.isnan(r.p_value) else f"{r.p_value:.3g}"
        lines.append(f"| {r.study} | {r.gate} | {_text(r.alpha)} | {r.trials} | {r.diverged} "
                     f"| {r.selected} | {star}{_pm(r.test_loss_x100_mean, r.test_loss_x100_se, 2)} "
                     f"| {_pm(r.n_s_mean, r.n_s_se, 2)} | {_text(r.baseline) or '-'} | {p} |")
    metrics = [c.removesuffix(" mean") for c in table7.columns if c.endswith(" mean")]
    lines += ["", "## Table 7: per-task test metrics (AUC and accuracy ×100, MSE as is)", "",
              "| Study | Gate | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
    for _, r in table7.iterrows():
        cells = [_pm(r[f"{m} mean"], r[f"{m} se"], 4 if m.endswith("MSE") else 2) for m in metrics]
        lines.append(f"| {r['study']} | {r['gate']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(argv: list[str]) -> None:
    args = parse_report_args(argv)
    url, trials = collect(args.storage, args.data)
    table, table7 = aggregate(trials)
    text = markdown(args.data, url, table, table7)
    out = Path(args.out) if args.out else STUDIES_DIR / "reports" / args.data
    write_atomic(text, out / "report.md")
    write_atomic(table.to_csv(index=False), out / "table_2_3.csv")
    write_atomic(table7.to_csv(index=False), out / "table_7.csv")
    print(text, end="")
    print(f"written to {out}/report.md, table_2_3.csv, table_7.csv")
