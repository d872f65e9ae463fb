"""``report``'s hyperparameter importances (:mod:`mtmoe.tuning.importance`, Optuna's PED-ANOVA and fANOVA): on a
synthetic study where one hyperparameter alone drives the objective both evaluators rank it first, the values are
Optuna's on the study's completed trials, the table, CSV and figure name the evaluator, reruns agree, and a study with
too few trials, one tuned hyperparameter, one objective value or one configuration gets a note."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from conftest import run_cli, sqlite_file
from test_tuning import synthetic_study
from mtmoe.tuning.importance import FANOVA_SEED, ped_anova
from mtmoe.tuning.objective import quiet_optuna

optuna.logging.set_verbosity(optuna.logging.WARNING)
pytestmark = pytest.mark.xdist_group("importance")
CHECKOUT = Path(__file__).resolve().parents[1]
SPACE = {"model.lr": FloatDistribution(1e-4, 1e-2, log=True), "model.gate.gamma": FloatDistribution(0.1, 10.0),
         "model.gate.k": IntDistribution(1, 4), "model.gate.entropy_reg": CategoricalDistribution([1, 5, 10])}


def lr_bowl(params: dict, rng: np.random.Generator) -> float:
    """Best at a learning rate of 1e-3, whatever the other hyperparameters, plus noise."""
    return 0.4 + 0.05 * np.log10(params["model.lr"] / 1e-3) ** 2 + rng.normal(0, 0.001)


def add_study(url: str | optuna.storages.BaseStorage, gate: str, n: int, seed: int, failed: int = 0,
              space: dict = SPACE, objective=lr_bowl) -> str:
    """A study as ``tune`` leaves it, ``n`` random configurations of ``space`` scored by ``objective``; ``failed``
    more configurations diverged, and a lost trial to ignore."""
    name = f"synthetic/{gate}"
    study = optuna.create_study(study_name=name, storage=url, sampler=optuna.samplers.RandomSampler(seed))
    for key, value in {"data": "synthetic", "gate": gate, "seed": seed, "trials": n + failed}.items():
        study.set_user_attr(key, value)
    rng = np.random.default_rng(seed)
    for config_id in range(n + failed):
        trial = study.ask(space)
        trial.set_user_attr("config_id", config_id)
        trial.set_user_attr("test_loss", 0.5)
        if config_id >= n:
            trial.set_user_attr("fail_reason", "diverged: train loss nan")
            study.tell(trial, state=TrialState.FAIL)
            continue
        study.tell(trial, objective(trial.params, rng))
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={"config_id": 0}))  # lost
    return name


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> str:
    """The studies in one SQLite file (:func:`conftest.sqlite_file`); the tests of this module share an
    ``xdist_group``: one worker builds it."""
    def build(into) -> None:
        add_study(into, "comet", 60, 1, failed=3)
        add_study(into, "topk", 3, 2)
        add_study(into, "softmax", 8, 3, space={"model.lr": SPACE["model.lr"]})
        add_study(into, "hash", 8, 4, objective=lambda params, rng: 0.4)
        synthetic_study(into, "synthetic/dselect", "dselect", 8, 0.4, np.random.default_rng(5), data="synthetic")

    return sqlite_file(tmp_path_factory.mktemp("importance") / "studies.db", build)


def test_the_parameter_that_drives_the_objective_ranks_first_and_reruns_agree(storage: str, tmp_path: Path,
                                                                              capsys) -> None:
    assert run_cli(["report", "--data", "synthetic", "--storage", storage, "--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    table = pd.read_csv(tmp_path / "a" / "importance.csv", keep_default_na=False, na_values={"importance": [""]})
    assert list(table.drop_duplicates(["study", "evaluator"])[["study", "evaluator"]].itertuples(index=False)) == [
        (f"synthetic/{gate}", evaluator) for gate in ("softmax", "topk", "hash", "dselect", "comet")
        for evaluator in ("PED-ANOVA", "fANOVA")]

    study = optuna.load_study(study_name="synthetic/comet", storage=storage)  # Optuna's own, on the same trials
    comet = table[table.study == "synthetic/comet"]
    for evaluator, optunas in {
            "PED-ANOVA": ped_anova(0.1),  # Optuna's, under the installed version's argument name
            "fANOVA": optuna.importance.FanovaImportanceEvaluator(seed=FANOVA_SEED)}.items():
        found = comet[comet.evaluator == evaluator].sort_values("importance", ascending=False)
        assert list(found.param)[0] == "model.lr" and found.importance.iloc[0] > 2 * found.importance.iloc[1]
        assert sorted(found.param) == sorted(SPACE) and found.importance.sum() == pytest.approx(1.0)
        expected = optuna.importance.get_param_importances(study, evaluator=optunas)
        assert dict(zip(found.param, found.importance)) == pytest.approx(expected, rel=1e-12)
        assert set(found.completed) == {60} and set(found.note) == {""}
    assert set(comet[comet.evaluator == "PED-ANOVA"].top) == {"6"}
    assert set(comet[comet.evaluator == "fANOVA"].top) == {""}  # fANOVA uses all completed trials

    notes = {"synthetic/topk": "3 completed trials: importances need at least 4",
             "synthetic/hash": "every completed trial has the same objective: nothing to attribute",
             "synthetic/dselect": "every completed trial has the same configuration: nothing to attribute",
             "synthetic/softmax": "one hyperparameter tuned: its importance is 1 by normalisation"}
    for study_name, note in notes.items():
        assert set(table[table.study == study_name].note) == {note}
    assert table[table.study.isin(["synthetic/topk", "synthetic/hash", "synthetic/dselect"])].importance.isna().all()
    assert list(table[table.study == "synthetic/softmax"].importance) == [1.0, 1.0]

    assert "## Hyperparameter importance (PED-ANOVA, fANOVA)" in printed
    assert "| synthetic/topk | topk | - | PED-ANOVA | 3 (0) | n/a | n/a | n/a | n/a | 3 completed trials" in printed
    assert "| synthetic/topk | topk | - | fANOVA | 3 (all) | n/a | n/a | n/a | n/a | 3 completed trials" in printed
    assert "| synthetic/softmax | softmax | - | fANOVA | 8 (all) | - | - | - | 1.000 | one hyperparameter" in printed
    png = (tmp_path / "a" / "importance.png").read_bytes()
    assert png.startswith(b"\x89PNG") and (tmp_path / "a" / "importance.pdf").read_bytes().startswith(b"%PDF")

    assert run_cli(["report", "--data", "synthetic", "--storage", storage, "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "importance.csv").read_text() == (tmp_path / "a" / "importance.csv").read_text()
    assert (tmp_path / "b" / "report.md").read_text() == (tmp_path / "a" / "report.md").read_text()


def test_importance_picks_the_evaluators_that_run(storage: str, tmp_path: Path, capsys) -> None:
    """``--importance``: one evaluator gives that evaluator's rows of the default report, any case; ``none`` gives
    the default report without its importance section and no importance files (an earlier report's are removed)."""
    def report(out: str, *extra: str) -> str:
        assert run_cli(["report", "--data", "synthetic", "--storage", storage, "--out", str(tmp_path / out),
                        *extra]) == 0
        capsys.readouterr()
        return (tmp_path / out / "report.md").read_text()

    both = report("both")
    table = pd.read_csv(tmp_path / "both" / "importance.csv", dtype=str)
    for given, evaluator in (("fanova", "fANOVA"), ("PED-ANOVA", "PED-ANOVA"), ("fanova, ped-anova", None)):
        text = report(given, "--importance", given)
        found = pd.read_csv(tmp_path / given / "importance.csv", dtype=str)
        expected = table if evaluator is None else table[table.evaluator == evaluator].reset_index(drop=True)
        pd.testing.assert_frame_equal(found, expected)
        assert (f"## Hyperparameter importance ({evaluator})" if evaluator else
                "## Hyperparameter importance (PED-ANOVA, fANOVA)") in text
        assert (tmp_path / given / "importance.png").read_bytes().startswith(b"\x89PNG")

    (tmp_path / "none").mkdir()
    for name in ("importance.csv", "importance.png", "importance.pdf"):  # an earlier report's
        (tmp_path / "none" / name).write_text("stale")
    text = report("none", "--importance", "none")
    section = both.index("\n## Hyperparameter importance")
    assert text == both[:section]
    assert sorted(path.name for path in (tmp_path / "none").iterdir()) == ["report.md", "table_2_3.csv",
                                                                            "table_7.csv"]


@pytest.mark.parametrize("given, problem", [
    ("fanov", "unknown evaluator 'fanov'; give a comma-separated list of ped-anova and fanova, or none; did you "
              "mean fanova?"),
    ("none,fanova", "none cannot be given with an evaluator; give a comma-separated list of ped-anova and fanova, "
                    "or none"),
    ("", "unknown evaluator ''; give a comma-separated list of ped-anova and fanova, or none"),
])
def test_a_bad_importance_value_is_one_error_line(storage: str, tmp_path: Path, capsys, given: str,
                                                  problem: str) -> None:
    out = tmp_path / "out"
    assert run_cli(["report", "--data", "synthetic", "--storage", storage, "--out", str(out),
                    "--importance", given]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: --importance {given!r}: {problem}"]
    assert not out.exists()


def test_the_progress_bar_shows_the_studies_and_changes_nothing(storage: str, capsys) -> None:
    """``report`` at a terminal shows a bar of the studies while the importances are computed (fANOVA's forests
    take a while on studies of hundreds of trials); the table is the same without it."""
    from mtmoe.tuning.importance import importances
    from mtmoe.tuning.trials import collect

    trials = collect(storage, "synthetic")[1]
    quiet = importances(trials)
    assert capsys.readouterr().err == ""
    shown = importances(trials, bar=True)
    err = capsys.readouterr().err
    # of the 5 studies (the bar is cleared at its end: its last refresh, throttled to one per 0.1 s, may be 4/5)
    assert "importances" in err and "/5 [" in err, err
    pd.testing.assert_frame_equal(shown, quiet)


#: A user's script: Optuna's info lines on for their own studies, then mtmoe's plan and importances (in-memory
#: studies of its own), then a study of the user's.
USER_SCRIPT = """
import optuna
from mtmoe.tuning.importance import importances
from mtmoe.tuning.objective import plan_configurations
from mtmoe.tuning.space import load_space
from mtmoe.tuning.trials import collect

optuna.logging.set_verbosity(optuna.logging.INFO)
plan_configurations(load_space("movielens-100k", "comet"), 3, 0)
assert len(importances(collect(STORAGE, "synthetic")[1])) > 0
print("mtmoe done", flush=True)
optuna.create_study(study_name="mine")
print("verbosity", optuna.logging.get_verbosity() == optuna.logging.INFO)
"""


@pytest.mark.integration  # Optuna's handler writes to the stderr of the process's start: a process of its own
def test_optuna_says_nothing_of_mtmoes_own_in_memory_studies(storage: str, tmp_path: Path) -> None:
    """Before: ``report`` printed Optuna's "A new study created in memory with name: no-name-..." per study with
    importances, and the plan of ``tune`` (and the benchmarks using it) another; now only mtmoe's output, and a
    user's own study still gets Optuna's line at the verbosity the user set."""
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    report = subprocess.run([sys.executable, "-m", "mtmoe", "report", "--data", "synthetic", "--storage", storage,
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert report.returncode == 0 and "synthetic/comet" in report.stdout, report.stderr[-2000:]
    assert report.stderr == ""
    user = subprocess.run([sys.executable, "-c", USER_SCRIPT.replace("STORAGE", repr(storage))],
                          capture_output=True, text=True, env=env, timeout=300)
    assert user.returncode == 0, user.stderr[-2000:]
    assert user.stdout.splitlines() == ["mtmoe done", "verbosity True"]
    assert [line.split("] ", 1)[1] for line in user.stderr.splitlines()] == [
        "A new study created in memory with name: mine"]


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_quiet_optuna_silences_only_its_own_thread() -> None:
    """Before: ``quiet_optuna`` set Optuna's verbosity to WARNING for the whole process while mtmoe planned or
    computed importances, so a user's thread creating its own study meanwhile lost Optuna's line about it. Now
    Optuna's verbosity stays the user's, the lines of the thread inside (nested too) are dropped, another
    thread's pass, and so does a warning of the thread inside."""
    kept, verbosity = _Kept(), optuna.logging.get_verbosity()
    optuna.logging.get_logger("optuna").addHandler(kept)
    optuna.logging.set_verbosity(optuna.logging.INFO)
    inside, done = threading.Event(), threading.Event()

    def user() -> None:
        inside.wait(60)
        optuna.create_study(study_name="user's")
        done.set()

    thread = threading.Thread(target=user)
    thread.start()
    try:
        with quiet_optuna():
            with quiet_optuna():
                optuna.create_study(study_name="nested")
            inside.set()
            assert done.wait(60)
            optuna.create_study(study_name="mtmoe's")
            logging.getLogger(optuna.Study.__module__).warning("a warning of mtmoe's thread")
            assert optuna.logging.get_verbosity() == optuna.logging.INFO
        optuna.create_study(study_name="after")
    finally:
        thread.join(60)
        optuna.logging.get_logger("optuna").removeHandler(kept)
        optuna.logging.set_verbosity(verbosity)
    assert kept.messages == ["A new study created in memory with name: user's", "a warning of mtmoe's thread",
                             "A new study created in memory with name: after"]
