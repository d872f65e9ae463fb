"""The trial table: the evaluated configurations of a dataset's tuning studies, one row each (``report`` and
``bootstrap`` compute from it; it never trains), and the options those commands share to find it.

Columns: ``study, gate, alpha, config_id, trial, diverged, objective, test_loss, n_s`` and the per-task test
metrics as ``<task>/<metric>``. A study is one row group per study name (user attributes ``data`` and ``gate``,
written by ``tune``), so ``.../alpha=0.1`` and ``.../alpha=0.9`` are separate studies. A diverged trial (failed
with a ``fail_reason``) is a row with objective ``+inf``; trials lost to a crash or an interrupt (failed without a
reason, re-run on resume), waiting or running ones and skipped duplicates are not results and have no row; each
``config_id`` counts once.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pandas as pd
from optuna.trial import TrialState

from mtmoe.errors import UsageError
from mtmoe.lit.metrics import TASK_METRICS
from mtmoe.tuning.storage import STUDIES_DIR, open_storage


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
    parser.add_argument("--storage", default=None,
                        help="RDB URL or journal:PATH (default: studies/optuna.db under the current directory)")
    parser.add_argument("--out", default=None,
                        help="output folder (default: studies/reports/<data>/ under the current directory)")
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


def output_dir(out: str | None, name: str) -> Path:
    """``--out``, else ``studies/reports/<name>/`` under the current directory."""
    return Path(out) if out else STUDIES_DIR / "reports" / name


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


def as_text(value: Any) -> str:
    """A cell as text: ``""`` for a missing value (``None`` or NaN, e.g. the alpha of a study without one)."""
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def _alpha_of(study_name: str) -> str | None:
    _, _, alpha = study_name.partition("/alpha=")
    return alpha or None


def collect(url: str | None, data: str) -> tuple[str, pd.DataFrame]:
    """(storage URL, trial table) of the dataset's studies; ``url=None`` reads the default storage."""
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
