"""``report``'s hyperparameter importances (:mod:`mtmoe.tuning.importance`, Optuna's PED-ANOVA): on a synthetic
study where one hyperparameter alone drives the objective it ranks first, the values are Optuna's on the study's
completed trials, reruns agree, and a study with too few trials gets a note."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import optuna
import pandas as pd
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from conftest import run_cli

optuna.logging.set_verbosity(optuna.logging.WARNING)
SPACE = {"model.lr": FloatDistribution(1e-4, 1e-2, log=True), "model.gate.gamma": FloatDistribution(0.1, 10.0),
         "model.gate.k": IntDistribution(1, 4), "model.gate.entropy_reg": CategoricalDistribution([1, 5, 10])}


def add_study(url: str, gate: str, n: int, seed: int, failed: int = 0) -> str:
    """A study as ``tune`` leaves it, random configurations whose objective depends on the learning rate alone
    (best at 1e-3) plus noise; ``failed`` more configurations diverged, and a lost trial to ignore."""
    name = f"synthetic/{gate}"
    study = optuna.create_study(study_name=name, storage=url, sampler=optuna.samplers.RandomSampler(seed))
    for key, value in {"data": "synthetic", "gate": gate, "seed": seed, "trials": n + failed}.items():
        study.set_user_attr(key, value)
    rng = np.random.default_rng(seed)
    for config_id in range(n + failed):
        trial = study.ask(SPACE)
        trial.set_user_attr("config_id", config_id)
        trial.set_user_attr("test_loss", 0.5)
        if config_id >= n:
            trial.set_user_attr("fail_reason", "diverged: train loss nan")
            study.tell(trial, state=TrialState.FAIL)
            continue
        study.tell(trial, 0.4 + 0.05 * np.log10(trial.params["model.lr"] / 1e-3) ** 2 + rng.normal(0, 0.001))
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={"config_id": 0}))  # lost
    return name


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('importance') / 'studies.db'}"
    add_study(url, "comet", 60, 1, failed=3)
    add_study(url, "topk", 3, 2)
    return url


def test_the_parameter_that_drives_the_objective_ranks_first_and_reruns_agree(storage: str, tmp_path: Path,
                                                                              capsys) -> None:
    assert run_cli(["report", "--data", "synthetic", "--storage", storage, "--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    table = pd.read_csv(tmp_path / "a" / "importance.csv")
    comet = table[table.study == "synthetic/comet"].sort_values("importance", ascending=False)
    assert list(comet.param)[0] == "model.lr" and comet.importance.iloc[0] > 2 * comet.importance.iloc[1]
    assert sorted(comet.param) == sorted(SPACE) and comet.importance.sum() == pytest.approx(1.0)
    assert set(comet.evaluator) == {"PED-ANOVA"} and set(comet.completed) == {60} and set(comet.top) == {6}

    study = optuna.load_study(study_name="synthetic/comet", storage=storage)  # Optuna's own, on the same trials
    expected = optuna.importance.get_param_importances(
        study, evaluator=optuna.importance.PedAnovaImportanceEvaluator(target_quantile=0.1))
    assert dict(zip(comet.param, comet.importance)) == pytest.approx(expected, rel=1e-12)

    topk = table[table.study == "synthetic/topk"]
    assert topk.importance.isna().all() and set(topk.note) == {"3 completed trials: importances need at least 4"}
    assert "## Hyperparameter importance (PED-ANOVA)" in printed
    assert "| synthetic/topk | topk | - | 3 (0) | n/a | n/a | n/a | n/a | 3 completed trials" in printed
    png = (tmp_path / "a" / "importance.png").read_bytes()
    assert png.startswith(b"\x89PNG") and (tmp_path / "a" / "importance.pdf").read_bytes().startswith(b"%PDF")

    assert run_cli(["report", "--data", "synthetic", "--storage", storage, "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "importance.csv").read_text() == (tmp_path / "a" / "importance.csv").read_text()
