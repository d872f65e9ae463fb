"""Which hyperparameters matter, per study: Optuna's PED-ANOVA importances of the validation objective.

PED-ANOVA (Watanabe, Bansal and Hutter, IJCAI 2023; ``optuna.importance.PedAnovaImportanceEvaluator``, the evaluator
optuna-dashboard shows) measures how much each hyperparameter's distribution among the top trials differs from its
distribution among all: a hyperparameter that must be set right to reach the top has a high importance. It is
deterministic (Parzen estimators on a grid), so reruns agree. fANOVA (``FanovaImportanceEvaluator``) needs
scikit-learn, which the suite does not depend on: it is not offered.

Per study, over its completed configurations (each ``config_id`` once, as the trial table holds them; failed ones
have no objective to rank and are left out): the top ``max(10%, 2 trials)`` against all, importances normalised to
sum to 1 (``get_param_importances(normalize=True)``). A study with fewer than :data:`MIN_COMPLETED` completed trials,
or nothing tuned, gets a note instead.
"""
from __future__ import annotations

import math
import textwrap
import warnings

import pandas as pd

from mtmoe.tuning.trials import as_text, gate_order

EVALUATOR = "PED-ANOVA"
#: PED-ANOVA's default top quantile (gamma'), raised to hold at least :data:`MIN_TOP` trials in a small study.
TARGET_QUANTILE = 0.1
MIN_TOP = 2
MIN_COMPLETED = 2 * MIN_TOP


def tuned(distributions: dict) -> list[str]:
    """The hyperparameters a trial's distributions tune (more than one value), by name."""
    return sorted(name for name, distribution in distributions.items() if not distribution.single())


def study_importances(group: pd.DataFrame) -> dict:
    """One study's importances: ``{"completed", "top", "importances": {param: value}, "note"}``."""
    import optuna

    completed = group[~group.failed]
    names = tuned(group.distributions.iloc[0])
    result = {"completed": len(completed), "top": 0, "importances": {}, "note": ""}
    if not names:
        return {**result, "note": "no hyperparameter is tuned"}
    if len(completed) < MIN_COMPLETED:
        return {**result, "note": f"{len(completed)} completed trial{'s' * (len(completed) != 1)}: importances "
                                  f"need at least {MIN_COMPLETED}"}
    quantile = max(TARGET_QUANTILE, MIN_TOP / len(completed))
    study = optuna.create_study(direction="minimize")  # in memory: the trial table's objective is minimised
    study.add_trials([optuna.trial.create_trial(value=row.objective, params=row.params,
                                                distributions=row.distributions)
                      for row in completed.itertuples()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optuna's experimental and equal-importance warnings; the note says why
        values = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.PedAnovaImportanceEvaluator(target_quantile=quantile), params=names)
    return {**result, "top": math.ceil(quantile * len(completed)), "importances": dict(values)}


def importances(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per study and tuned hyperparameter (``importance`` NaN and a ``note`` for a study without them),
    in the trial table's order."""
    rows = []
    for study, group in trials.groupby("study", sort=False):
        first = group.iloc[0]
        found = study_importances(group)
        key = {"study": study, "gate": first.gate, "alpha": first.alpha, "evaluator": EVALUATOR,
               "completed": found["completed"], "top": found["top"]}
        params = found["importances"] or {name: math.nan for name in tuned(first.distributions) or [""]}
        rows += [{**key, "param": param, "importance": value, "note": found["note"]}
                 for param, value in params.items()]
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame) -> str:
    """The importances as a Markdown section: a row per study, a column per hyperparameter."""
    params = sorted(p for p in table.param.unique() if p)
    lines = ["", f"## Hyperparameter importance ({EVALUATOR})", "",
             f"Optuna's `PedAnovaImportanceEvaluator` (PED-ANOVA, Watanabe et al. 2023; the evaluator optuna-dashboard "
             "shows) of the validation objective, per study over its completed trials: how much each "
             "hyperparameter's distribution among the top trials (top: the best max(10%, 2)) differs from its "
             "distribution among all, normalised to sum to 1. Deterministic. fANOVA needs scikit-learn, not a "
             "dependency of the suite. Figure: `importance.png` (vector: `importance.pdf`); values: "
             "`importance.csv`.", "",
             "| Study | Gate | alpha | Completed (top) | " + " | ".join(f"`{p}`" for p in params) + " | note |",
             "|---|---|---|---|" + "---|" * len(params) + "---|"]
    for study, group in table.groupby("study", sort=False):
        first = group.iloc[0]
        values = dict(zip(group.param, group.importance))
        cells = ["-" if p not in values else "n/a" if math.isnan(values[p]) else f"{values[p]:.3f}" for p in params]
        lines.append(f"| {study} | {first.gate} | {as_text(first.alpha) or '-'} | {first.completed} ({first.top}) | "
                     + " | ".join(cells) + f" | {first.note or '-'} |")
    return "\n".join(lines) + "\n"


def plot(table: pd.DataFrame):
    """A panel per study with importances (in the gates' order): a horizontal bar per tuned hyperparameter, the
    most important on top, on a shared 0-1 axis, naming the evaluator."""
    from matplotlib.figure import Figure

    shown = table[table.importance.notna()]
    studies = sorted(shown.study.unique(), key=lambda s: (gate_order(shown[shown.study == s].gate.iloc[0]), s))
    columns = min(3, max(len(studies), 1))
    rows = max(math.ceil(len(studies) / columns), 1)
    height = max((shown.groupby("study").size().max() if len(shown) else 1) * 0.32 + 1.0, 1.6)
    figure = Figure(figsize=(3.6 * columns, height * rows + 0.6), layout="constrained")
    figure.suptitle(f"Hyperparameter importance of the validation objective ({EVALUATOR}, Optuna)", fontsize=9)
    for index, study in enumerate(studies):
        group = shown[shown.study == study].sort_values("importance")
        ax = figure.add_subplot(rows, columns, index + 1)
        ax.barh(range(len(group)), group.importance, color="#4a78a8", height=0.6)
        ax.set_yticks(range(len(group)), [textwrap.shorten(p, 28) for p in group.param], fontsize=8)
        ax.set_xlim(0, 1)
        ax.set_xlabel("importance (sums to 1)", fontsize=8)
        first = group.iloc[0]
        ax.set_title(f"{study}\n{first.completed} trials, top {first.top}", fontsize=8.5)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(True, axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
    if not studies:
        figure.add_subplot().text(0.5, 0.5, "no study has importances (see report.md)", ha="center", va="center")
    return figure
