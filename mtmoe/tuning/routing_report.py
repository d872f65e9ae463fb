"""``report``'s routing section (issue 35, item 3): how each study's selected trials route, per task gate, at their
best epoch on the validation split (``tune`` records it as the trial's ``val/<task>/<key>`` attributes).

Per study and task: mean ± standard error over the selected trials of ``routing_entropy`` (nats), ``expert_overlap``
(Jaccard index with the other tasks' gates), ``selection_changed`` (share of samples whose selected experts changed
since the previous epoch) and the busiest expert's share of the selections (the largest entry of ``expert_load``);
the CSV adds the mean load of every expert. The statistics are defined in :mod:`mtmoe.pack.metrics`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pandas as pd

from mtmoe.tuning.trials import as_text

COLUMNS = (("routing_entropy", "entropy"), ("expert_overlap", "overlap"), ("selection_changed", "changed"),
           ("max_load", "max load"))


def routing_table(trials: pd.DataFrame, select: Callable[[pd.DataFrame], pd.DataFrame],
                  mean_se: Callable[[pd.Series], tuple[float, float]]) -> pd.DataFrame:
    """One row per study and task over the trials ``select`` keeps of each study; empty when no trial recorded
    routing statistics (studies tuned before they were)."""
    tasks = sorted({column.split(".")[1] for column in trials.columns if column.startswith("routing.")})
    rows = []
    for name, group in trials.groupby("study", sort=False):
        top = select(group)
        for task in tasks:
            load = top.get(f"routing.{task}.expert_load", pd.Series(dtype=object)).dropna()
            if load.empty:
                continue
            row: dict[str, Any] = {"study": name, "gate": top.gate.iloc[0], "alpha": top.alpha.iloc[0], "task": task,
                                   "selected": len(top)}
            values = {key: top.get(f"routing.{task}.{key}", pd.Series([math.nan] * len(top)))
                      for key, _ in COLUMNS[:-1]}
            values["max_load"] = load.map(max)
            for key, _ in COLUMNS:
                row[f"{key}_mean"], row[f"{key}_se"] = mean_se(values[key])
            row.update({f"load_{i}_mean": float(v) for i, v in enumerate(pd.DataFrame(load.tolist()).mean())})
            rows.append(row)
    return pd.DataFrame(rows)


def routing_markdown(table: pd.DataFrame, pm: Callable[[float, float, int], str]) -> str:
    """The section as Markdown (empty without routing statistics)."""
    if table.empty:
        return ""
    lines = ["", "## Routing: how the selected trials' gates route (validation split, best epoch)", "",
             "Mean ± SE over the selected trials. Entropy of a gate's weights in nats; overlap: Jaccard index of the "
             "experts two tasks' gates select; changed: share of samples whose selected experts changed since the "
             "previous epoch; max load: the busiest expert's share of the selections (per-expert loads in "
             "`routing.csv`).", "",
             "| Study | Gate | alpha | Task | " + " | ".join(label for _, label in COLUMNS) + " |",
             "|---|---|---|---|" + "---|" * len(COLUMNS)]
    for _, r in table.iterrows():
        cells = [pm(r[f"{key}_mean"], r[f"{key}_se"], 3) for key, _ in COLUMNS]
        lines.append(f"| {r['study']} | {r['gate']} | {as_text(r['alpha']) or '-'} | {r['task']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
