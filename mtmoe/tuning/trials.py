"""The trial table: the evaluated configurations of a dataset's tuning studies, one row each (``report`` and
``bootstrap`` compute from it; it never trains), and the options those commands share to find it.

Columns: ``study, gate, alpha, seed, settings, config_id, trial, failed, fail_reason, objective, test_loss, n_s``,
``epochs_run`` (the trial's), ``max_epochs`` (the study's ``trainer.max_epochs`` setting, NaN where it set none),
``planned`` (the configurations the study plans, ``tune --trials``; NaN for a study that does not record it),
``device`` (what trained the trial, a GPU's name or ``cpu``; ``""`` where an older mtmoe did not record it),
``plain_kernels`` (the fused kernels it ran as torch operations, comma-separated; ``""``: none), ``code`` (the code
that trained it, :func:`mtmoe.code_version.code_version`; ``""`` where an older mtmoe did not record it),
``params`` and ``distributions`` (the trial's hyperparameters and their search distributions, dicts),
``data``, the per-task test metrics as ``<task>/<metric>`` and the routing statistics of the trial's best epoch
(on the validation split) as ``routing.<task>.<key>`` (``expert_load`` a list). A study is one row group per study
name (user attributes ``data`` and ``gate``, written by ``tune``), so ``.../alpha=0.1`` and ``.../alpha=0.9`` are
separate studies; a study without an alpha of its own shows the dataset's default. A failed trial (failed with a ``fail_reason``:
diverged, or lost too often) is a row with objective ``+inf`` and no test results; trials lost to a crash or an
interrupt (failed without a reason, re-run), waiting or running ones and skipped duplicates are not results and
have no row; each ``config_id`` counts once. Rows come in the paper's order (:func:`paper_order`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pandas as pd
from optuna.trial import TrialState

from mtmoe import dataset_info
from mtmoe.data import task_weighting
from mtmoe.errors import OneLineParser, UsageError, did_you_mean, suggestion
from mtmoe.files import remove_orphans, write_atomic
from mtmoe.gate_names import split_gate_name
from mtmoe.routing_names import BEHAVIOUR_KEYS
from mtmoe.tuning.storage import STUDIES_DIR, display_url, open_storage, readable

#: Per-task test metrics as the reports show them: (label, scale); AUC and accuracy x100, MSE as is (Table 7).
TASK_METRICS = {"auroc": ("AUC", 100.0), "accuracy": ("accuracy", 100.0), "mse": ("MSE", 1.0)}
#: The paper's order of its gates (Tables 2-3); other gates follow by name, each "+" after its gate.
PAPER_GATES = ("softmax", "topk", "topk+", "hash", "hash+", "dselect", "comet", "comet+")


def studies_parser(command: str, description: str) -> argparse.ArgumentParser:
    """``--data``, ``--storage``, ``--out``: how the commands that read the tuning studies (``report``,
    ``bootstrap``) find them and where they write."""
    parser = OneLineParser(prog=f"python -m mtmoe {command}", description=description)
    parser.add_argument("--data", required=True, help="dataset (the studies' 'data' attribute)")
    parser.add_argument("--storage", default=None,
                        help="RDB URL, journal:PATH or grpc://HOST:PORT that tune wrote (default: studies/optuna.db "
                             "under the current directory); the password may come from PGPASSWORD or ~/.pgpass")
    parser.add_argument("--out", default=None,
                        help="output folder (default: studies/reports/<data>/ under the current directory)")
    return parser


def parse_strict(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; a bad or unknown flag is a one-line UsageError naming the closest option."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        raise UsageError(f"{parser.prog.rpartition(' ')[2]}: unrecognized arguments: {' '.join(extra)}"
                         + did_you_mean(extra[0], parser._option_string_actions))
    return args


def output_dir(out: str | None, name: str) -> Path:
    """``--out``, else ``studies/reports/<name>/`` under the current directory, checked by :func:`writable_folder`."""
    return writable_folder(Path(out) if out else STUDIES_DIR / "reports" / name, "--out", "the outputs")


def writable_folder(path: Path, flag: str, what: str) -> Path:
    """``path``, the folder ``flag`` names for ``what``; a UsageError, before anything is computed or created,
    unless it is (or can be made) a folder this process may write in."""
    existing = path.absolute()
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"cannot write {what} to {path}: {existing} is a file, not a folder; pass {flag} FOLDER")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {what} to {path}: {existing} is not writable; pass {flag} FOLDER")
    return path


def write_outputs(out: Path, files: dict[str, str | bytes]) -> None:
    """Write each ``{name: content}`` into ``out`` atomically, after removing the temporary files a writer killed
    there left (:func:`mtmoe.files.remove_orphans`); a filesystem error is one UsageError line."""
    remove_orphans(out)
    try:
        for name, content in files.items():
            write_atomic(content, out / name)
    except OSError as error:
        raise UsageError(f"cannot write the outputs to {out} ({error.strerror or error}): pass a writable --out "
                         "folder, or free some space there") from None


def describe_settings(settings: dict[str, Any] | None) -> str:
    """A study's settings as text (``key=value, ...``); ``None``: not recorded (a study of an older mtmoe)."""
    if settings is None:
        return "not recorded"
    return ", ".join(f"{key}={json.dumps(value)}" for key, value in sorted(settings.items())) or "none"


def gate_order(gate: str) -> tuple:
    """Sort key of a gate: the paper's order, then the others by name, each "+" after its gate."""
    if gate in PAPER_GATES:
        return (0, PAPER_GATES.index(gate), False)
    return (1, *split_gate_name(gate))


def alpha_order(alpha: Any) -> float:
    try:
        return float(alpha)
    except (TypeError, ValueError):
        return math.inf


def paper_order(frame: pd.DataFrame, gates: tuple[str, ...] = ("gate",)) -> pd.DataFrame:
    """Rows sorted by dataset (where there is a ``data`` column), alpha (numerically), the paper's gate order of the
    ``gates`` columns, and the study name; rows that tie keep their order."""
    def key(i: int) -> tuple:
        row = frame.iloc[i]
        return (str(row.get("data", "")), alpha_order(row["alpha"]), *(gate_order(str(row[g])) for g in gates),
                str(row.get("study", "")))

    return frame.iloc[sorted(range(len(frame)), key=key)].reset_index(drop=True)


def trial_rows(study_name: str, attrs: dict[str, Any], trials: list, alpha: str | None = None) -> list[dict[str, Any]]:
    """One row per evaluated configuration: complete trials, and failed ones with objective +inf and no test
    results (a diverged trial's metrics are not results). ``alpha``: the study's, where ``attrs`` has none."""
    rows: dict[int, dict[str, Any]] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        user = trial.user_attrs
        if "config_id" not in user:
            continue
        if trial.state == TrialState.COMPLETE and trial.value is not None:
            reason, objective = "", float(trial.value)
        elif trial.state == TrialState.FAIL and user.get("fail_reason"):
            reason, objective = str(user["fail_reason"]), math.inf
        else:  # lost (crash, Ctrl-C), waiting, running, skipped duplicates: not a result
            continue
        config_id = int(user["config_id"])
        if config_id in rows and not rows[config_id]["failed"]:
            continue  # a configuration counts once (its first complete evaluation)
        row = {
            "study": study_name, "gate": attrs.get("gate"), "alpha": attrs.get("alpha", _alpha_of(study_name) or alpha),
            "seed": attrs.get("seed"), "settings": describe_settings(attrs.get("settings")),
            "config_id": config_id, "trial": trial.number, "failed": bool(reason), "fail_reason": reason,
            "objective": objective, "test_loss": math.nan, "n_s": math.nan,
            "epochs_run": _number(user.get("epochs_run")),
            "max_epochs": _number((attrs.get("settings") or {}).get("trainer.max_epochs")),
            "planned": _number(attrs.get("trials")),
            "device": str(user.get("device", "")), "plain_kernels": ",".join(user.get("plain_kernels", [])),
            "code": str(user.get("code", "")),
            "params": dict(trial.params), "distributions": dict(trial.distributions),
        }
        if not reason:
            tasks = sorted({k.split("/")[1] for k in user if k.startswith("test/") and k.endswith("/experts_per_sample")})
            per_task_ns = [_number(user[f"test/{t}/experts_per_sample"]) for t in tasks]
            row["test_loss"] = _number(user.get("test_loss"))
            row["n_s"] = float(np.mean(per_task_ns)) if per_task_ns else math.nan
            for key, value in user.items():
                parts = key.split("/")
                if len(parts) == 3 and parts[0] == "test" and parts[2] in TASK_METRICS:
                    row[f"{parts[1]}/{parts[2]}"] = _number(value)
                elif len(parts) == 3 and parts[0] == "val" and parts[2] in BEHAVIOUR_KEYS:
                    row[f"routing.{parts[1]}.{parts[2]}"] = value if isinstance(value, list) else _number(value)
        rows[config_id] = row
    return list(rows.values())


def trained_on(trials: pd.DataFrame) -> str:
    """What trained a study's trials (``trials``, one study's rows): each device and the kernels it ran as torch
    operations, and the code where the trials have more than one, with its count of trials (``NVIDIA H200 ×234;
    cpu, plain epilogue ×2``; ``NVIDIA H200, code 5252e5a ×181; NVIDIA H200, code 9e35c08 ×266``), ``-`` where none
    is recorded."""
    several = trials.code.nunique() > 1  # "" among them: trials of an mtmoe that did not record it
    kinds = (trials.device.replace("", "not recorded")
             + trials.plain_kernels.map(lambda names: f", plain {names}" if names else "")
             + trials.code.map(lambda code: f", code {code or 'not recorded'}" if several else ""))
    counts = kinds.value_counts(sort=False)
    if set(counts.index) == {"not recorded"}:
        return "-"
    return "; ".join(f"{kind} ×{n}" for kind, n in counts.items())


def unfinished_studies(trials: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """The studies with fewer evaluated configurations than they plan: ``{study: (evaluated, planned)}``, in the
    table's order."""
    unfinished = {}
    for study, group in trials.groupby("study", sort=False):
        planned = group.planned.iloc[0]
        if not math.isnan(planned) and len(group) < planned:
            unfinished[study] = (len(group), int(planned))
    return unfinished


def unfinished_note(unfinished: dict[str, tuple[int, int]]) -> str:
    """Why an unfinished study's results are provisional, naming each (empty when none is)."""
    if not unfinished:
        return ""
    names = ", ".join(f"'{study}' has {done} of its {planned} configurations evaluated"
                      for study, (done, planned) in unfinished.items())
    return (f"unfinished: {names}. A study's trials finish in the order they stop, those that stop early first, so "
            "its evaluated configurations are not a random sample of its plan, and its top trials and tuning curves "
            "can move as the rest finish: run the same tune command to finish it before citing these figures")


def unfinished_paragraph(note: str) -> str:
    """:func:`unfinished_note`'s note as the reports' Markdown paragraph: a bold sentence."""
    return f"**{note[:1].upper()}{note[1:]}.**"


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


def default_alpha(data: str) -> str | None:
    """The task weight alpha that ``data``'s runs use without ``--model.alpha`` (``None``: a dataset that weights its
    tasks equally, or not a registered one); read from its DataModule's file, without importing Lightning or torch."""
    alpha = dataset_info.default_alpha(task_weighting(data) or "equal")
    return None if alpha is None else f"{alpha:g}"


def collect(url: str | None, data: str | None = None, study: str | None = None) -> tuple[str, pd.DataFrame]:
    """(storage URL, trial table in the paper's order) of the studies of dataset ``data``, or of the study named
    ``study``, or both (neither: every study ``tune`` wrote); ``url=None`` reads the default storage."""
    url, storage = open_storage(url)
    rows: list[dict[str, Any]] = []
    names = []
    with readable(url):
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    for summary in summaries:
        attrs = summary.user_attrs
        if "gate" not in attrs or data not in (None, attrs.get("data")) or study not in (None, summary.study_name):
            continue
        names.append(summary.study_name)
        with readable(url):
            trials = optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(deepcopy=False)
        alpha = default_alpha(attrs.get("data"))
        rows += [{**row, "data": attrs.get("data")} for row in trial_rows(summary.study_name, attrs, trials, alpha)]
    where = display_url(url)
    if not names:
        which = (f" named {study!r}" if study else "") + (f" for dataset {data!r}" if data else "")
        tuned = {summary.study_name: str(summary.user_attrs.get("data")) for summary in summaries
                 if "gate" in summary.user_attrs}
        datasets = sorted(set(tuned.values()))
        close = suggestion(study, tuned) if study else suggestion(data or "", datasets)
        hint = f"its studies are of {', '.join(datasets)}{close}" if tuned else \
            f"run `python -m mtmoe tune --data {data or 'NAME'}` first"
        raise UsageError(f"no studies{which} in {where} ({hint})")
    if not rows:
        raise UsageError(f"the studies in {where} ({', '.join(sorted(names))}) have no finished trials yet")
    return url, paper_order(pd.DataFrame(rows))
