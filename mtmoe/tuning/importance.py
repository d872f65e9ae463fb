"""Which hyperparameters matter, per study: Optuna's PED-ANOVA and fANOVA importances of the validation objective.

Two of Optuna's evaluators, each named wherever its values appear:

* **PED-ANOVA** (Watanabe, Bansal and Hutter, IJCAI 2023; ``optuna.importance.PedAnovaImportanceEvaluator``, the
  evaluator optuna-dashboard shows) measures how much each hyperparameter's distribution among the top trials differs
  from its distribution among all: a hyperparameter that must be set right to reach the top has a high importance.
  Deterministic (Parzen estimators on a grid). Top: the best ``max(10%, 2 trials)``.
* **fANOVA** (Hutter, Hoos and Leyton-Brown, ICML 2014; ``FanovaImportanceEvaluator``, scikit-learn's random forest)
  fits a random forest to the objective over all completed trials and attributes the variance of its prediction over
  the search space to each hyperparameter's main effect (a functional ANOVA decomposition): a hyperparameter that
  moves the objective on average has a high importance. Optuna's defaults (64 trees of depth at most 64) with the forest's seed fixed
  (:data:`FANOVA_SEED`), so reruns agree.

Per study, over its completed configurations (each ``config_id`` once, as the trial table holds them; failed ones
have no objective to rank and are left out), importances normalised to sum to 1 (``get_param_importances(
normalize=True)``). A study with fewer than :data:`MIN_COMPLETED` completed trials, nothing tuned, or one objective
value or one configuration in every trial (fANOVA's forest would have no variance to attribute) gets a note instead; a study that tunes one hyperparameter gets its importance, 1 by
normalisation, and a note saying so.

``report --importance`` picks the evaluators that run (:func:`chosen`): both by default, one of them, or none
(fANOVA costs seconds per study of hundreds of trials; see ``benchmarks/README.md``).
"""
from __future__ import annotations

import inspect
import math
import textwrap
import warnings

import pandas as pd

from mtmoe.errors import UsageError, suggestion
from mtmoe.tuning.objective import quiet_optuna
from mtmoe.tuning.trials import as_text, gate_order

#: The evaluators, in the order the table, CSV and figure give them.
EVALUATORS = ("PED-ANOVA", "fANOVA")
#: How ``report --importance`` names them (any case).
OPTION_NAMES = {"ped-anova": "PED-ANOVA", "fanova": "fANOVA"}
COLORS = {"PED-ANOVA": "#4a78a8", "fANOVA": "#e08a3c"}
#: PED-ANOVA's default top quantile (gamma'), raised to hold at least :data:`MIN_TOP` trials in a small study.
TARGET_QUANTILE = 0.1
MIN_TOP = 2
MIN_COMPLETED = 2 * MIN_TOP
#: The seed of fANOVA's random forest.
FANOVA_SEED = 0


def chosen(value: str) -> tuple[str, ...]:
    """The evaluators ``report --importance VALUE`` runs, in :data:`EVALUATORS` order: a comma-separated list of
    ``ped-anova`` and ``fanova`` (any case), or ``none``; anything else is one :class:`UsageError` line."""
    names = [name.strip().lower() for name in value.split(",")]
    if names == ["none"]:
        return ()
    unknown = next((name for name in names if name not in OPTION_NAMES), None)
    if unknown is not None:
        problem = ("none cannot be given with an evaluator" if unknown == "none"
                   else f"unknown evaluator {unknown!r}")
        raise UsageError(f"--importance {value!r}: {problem}; give a comma-separated list of "
                         f"{' and '.join(OPTION_NAMES)}, or none{suggestion(unknown, OPTION_NAMES)}")
    return tuple(name for option, name in OPTION_NAMES.items() if option in names)


def tuned(distributions: dict) -> list[str]:
    """The hyperparameters a trial's distributions tune (more than one value), by name."""
    return sorted(name for name, distribution in distributions.items() if not distribution.single())


def ped_anova(quantile: float):
    """Optuna's PED-ANOVA of the top ``quantile`` of trials (gamma') against all; Optuna 5 renamed the argument
    ``baseline_quantile`` of Optuna 4 to ``target_quantile``."""
    from optuna.importance import PedAnovaImportanceEvaluator

    parameters = inspect.signature(PedAnovaImportanceEvaluator).parameters
    return PedAnovaImportanceEvaluator(**{"target_quantile" if "target_quantile" in parameters
                                          else "baseline_quantile": quantile})


def evaluator(name: str, completed: int) -> tuple:
    """Optuna's evaluator ``name`` (of :data:`EVALUATORS`) for a study of ``completed`` trials, and the number of top
    trials it compares with all (``None``: it uses them all)."""
    if name == "fANOVA":
        from optuna.importance import FanovaImportanceEvaluator

        return FanovaImportanceEvaluator(seed=FANOVA_SEED), None
    quantile = max(TARGET_QUANTILE, MIN_TOP / completed)
    return ped_anova(quantile), math.ceil(quantile * completed)


def study_importances(group: pd.DataFrame, names_run: tuple[str, ...] = EVALUATORS) -> dict:
    """One study's importances by the evaluators ``names_run``: ``{"completed", "top": {evaluator: trials},
    "importances": {evaluator: {param: value}}, "note"}``."""
    import optuna

    completed = group[~group.failed]
    names = tuned(group.distributions.iloc[0])
    result = {"completed": len(completed), "top": {"PED-ANOVA": 0}, "importances": {}, "note": ""}
    if not names:
        return {**result, "note": "no hyperparameter is tuned"}
    if len(completed) < MIN_COMPLETED:
        return {**result, "note": f"{len(completed)} completed trial{'s' * (len(completed) != 1)}: importances "
                                  f"need at least {MIN_COMPLETED}"}
    if completed.objective.nunique() == 1:
        return {**result, "note": "every completed trial has the same objective: nothing to attribute"}
    if completed.params.map(lambda params: tuple(params.get(name) for name in names)).nunique() == 1:
        return {**result, "note": "every completed trial has the same configuration: nothing to attribute"}
    found = {}
    with quiet_optuna():
        study = optuna.create_study(direction="minimize")  # in memory: the trial table's objective is minimised
        study.add_trials([optuna.trial.create_trial(value=row.objective, params=row.params,
                                                    distributions=row.distributions)
                          for row in completed.itertuples()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # optuna's experimental and equal-importance warnings; the note says why
            for name in names_run:
                made, top = evaluator(name, len(completed))
                found[name] = dict(optuna.importance.get_param_importances(study, evaluator=made, params=names))
                result["top"][name] = top
    note = "one hyperparameter tuned: its importance is 1 by normalisation" if len(names) == 1 else ""
    return {**result, "importances": found, "note": note}


def importances(trials: pd.DataFrame, names_run: tuple[str, ...] = EVALUATORS, bar: bool = False) -> pd.DataFrame:
    """One row per study, evaluator of ``names_run`` and tuned hyperparameter (``importance`` NaN and a ``note`` for
    a study without them; ``top`` empty for an evaluator that uses all completed trials), in the trial table's
    order. ``bar``: a progress bar of the studies on stderr (fANOVA's forests take a while on studies of hundreds
    of trials)."""
    from tqdm import tqdm

    rows = []
    studies = trials.groupby("study", sort=False)
    for study, group in tqdm(studies, total=studies.ngroups, desc="importances", unit="study", disable=not bar,
                             leave=False):
        first = group.iloc[0]
        found = study_importances(group, names_run)
        for name in names_run:
            key = {"study": study, "gate": first.gate, "alpha": first.alpha, "evaluator": name,
                   "completed": found["completed"], "top": found["top"].get(name)}
            params = found["importances"].get(name) or {param: math.nan
                                                        for param in tuned(first.distributions) or [""]}
            rows += [{**key, "param": param, "importance": value, "note": found["note"]}
                     for param, value in params.items()]
    table = pd.DataFrame(rows)
    return table.astype({"top": "Int64"}) if len(table) else table


#: The report's sentence on each evaluator.
DESCRIPTIONS = {
    "PED-ANOVA": "PED-ANOVA (`PedAnovaImportanceEvaluator`, Watanabe et al. 2023; the evaluator optuna-dashboard "
                 "shows): how much each hyperparameter's distribution among the top trials (the best max(10%, 2)) "
                 "differs from its distribution among all; deterministic.",
    "fANOVA": "fANOVA (`FanovaImportanceEvaluator`, Hutter et al. 2014): the share of the objective's variance, as a "
              "random forest fitted to all completed trials predicts it, that each hyperparameter's main effect "
              f"explains; Optuna's defaults, forest seed {FANOVA_SEED}.",
}


def markdown(table: pd.DataFrame, names_run: tuple[str, ...] = EVALUATORS) -> str:
    """The importances of the evaluators ``names_run`` as a Markdown section: a row per study and evaluator, a column
    per hyperparameter."""
    params = sorted(p for p in table.param.unique() if p)
    lines = ["", f"## Hyperparameter importance ({', '.join(names_run)})", "",
             f"{'Two of' if len(names_run) > 1 else 'One of'} Optuna's evaluators of the validation objective, per "
             "study over its completed trials, normalised to sum to 1. "
             + " ".join(DESCRIPTIONS[name] for name in names_run)
             + " Figure: `importance.png` (vector: `importance.pdf`); values: `importance.csv`.", "",
             "| Study | Gate | alpha | Evaluator | Completed (top) | " + " | ".join(f"`{p}`" for p in params)
             + " | note |",
             "|---|---|---|---|---|" + "---|" * len(params) + "---|"]
    for (study, evaluator), group in table.groupby(["study", "evaluator"], sort=False):
        first = group.iloc[0]
        values = dict(zip(group.param, group.importance))
        cells = ["-" if p not in values else "n/a" if math.isnan(values[p]) else f"{values[p]:.3f}" for p in params]
        top = "all" if pd.isna(first.top) else first.top
        lines.append(f"| {study} | {first.gate} | {as_text(first.alpha) or '-'} | {evaluator} | {first.completed} "
                     f"({top}) | " + " | ".join(cells) + f" | {first.note or '-'} |")
    return "\n".join(lines) + "\n"


def plot(table: pd.DataFrame, names_run: tuple[str, ...] = EVALUATORS):
    """A panel per study with importances (in the gates' order): a bar per tuned hyperparameter and evaluator of
    ``names_run``, grouped by hyperparameter, the most important on average on top, on a shared 0-1 axis; a legend
    names the evaluators."""
    from matplotlib.figure import Figure

    shown = table[table.importance.notna()]
    studies = sorted(shown.study.unique(), key=lambda s: (gate_order(shown[shown.study == s].gate.iloc[0]), s))
    columns = min(3, max(len(studies), 1))
    rows = max(math.ceil(len(studies) / columns), 1)
    height = max((shown.groupby("study").size().max() if len(shown) else 1) * 0.2 + 1.0, 1.6)
    figure = Figure(figsize=(3.6 * columns, height * rows + 0.8), layout="constrained")
    figure.suptitle("Hyperparameter importance of the validation objective (Optuna)", fontsize=9)
    width = 0.8 / len(names_run)
    for index, study in enumerate(studies):
        group = shown[shown.study == study]
        order = list(group.groupby("param", sort=True).importance.mean().sort_values(kind="stable").index)
        ax = figure.add_subplot(rows, columns, index + 1)
        for offset, name in enumerate(names_run):
            values = group[group.evaluator == name].set_index("param").importance.reindex(order)
            ax.barh([i - (offset - (len(names_run) - 1) / 2) * width for i in range(len(order))], values,
                    height=width * 0.9, color=COLORS[name], label=name if index == 0 else None)
        ax.set_yticks(range(len(order)), [textwrap.shorten(p, 28) for p in order], fontsize=8)
        ax.set_xlim(0, 1)
        ax.set_xlabel("importance (sums to 1)", fontsize=8)
        first = group.iloc[0]
        top = f", PED-ANOVA top {first.top}" if first.evaluator == "PED-ANOVA" else ""
        ax.set_title(f"{study}\n{first.completed} trials{top}", fontsize=8.5)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(True, axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
    if studies:
        figure.legend(loc="outside lower center", ncols=len(names_run), fontsize=8, frameon=False)
    else:
        figure.add_subplot().text(0.5, 0.5, "no study has importances (see report.md)", ha="center", va="center")
    return figure
