"""Issue 32, items 1-2: a ``tune`` override of a tuned setting wins (it leaves the sampled space, every trial trains
with it, the study's identity records it), each trial's ``config.yaml`` retrains it with ``fit --config``, and
``--trainer.limit_*_batches`` is read as Lightning reads it (an integer a count, a float a fraction) in ``fit`` and
``tune``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from conftest import REAL_DATA, run_cli
from test_tuning import assert_each_config_once, one_torch_thread, trials_of, tune_args  # noqa: F401 (autouse)

REPO = Path(__file__).resolve().parents[1]
LIMITS = ("train", "val", "test")


@pytest.fixture(autouse=True)
def quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def trial_folder(log_dir: Path, study: str, config_id: int) -> Path:
    return log_dir / study.replace("/", "_") / f"config-{config_id:04d}"


def limits(value: str) -> list[str]:
    return [f"--trainer.limit_{split}_batches={value}" for split in LIMITS]


@pytest.mark.parametrize("pack", ["1", "3"])
def test_an_override_of_a_tuned_setting_reaches_every_trial(tiny_root: Path, tmp_path: Path, capsys,
                                                             pack: str) -> None:
    """comet+ tunes lr and E_perm (up to 10): given on the command line, neither is sampled, every trial of the pack
    (or alone) trains with the given values (its permutation freezes within the 2-epoch run) and writes them in its
    config.yaml; the study records them, and the same tune without them is another study (refused, one line)."""
    url, log_dir = f"sqlite:///{tmp_path / 'o.db'}", tmp_path / "runs"
    given = ["--trainer.max_epochs=2", "--data.batch_size=64", "--model.lr", "0.002", "--model.perm_epochs=1"]
    assert run_cli(tune_args(url, tiny_root, log_dir, *given, "--pack", pack, trials=3, gate="comet+")) == 0
    trials = trials_of(url, "movielens-100k/comet+")
    assert_each_config_once(trials, 3)
    for trial in trials:
        assert set(trial.params) == {"model.gate.entropy_reg"}  # lr and E_perm left the sampled space
        folder = trial_folder(log_dir, "movielens-100k/comet+", trial.user_attrs["config_id"])
        config = yaml.safe_load((folder / "config.yaml").read_text())
        assert config["model"]["lr"] == 0.002 and config["model"]["perm_epochs"] == 1
        assert config["model"]["gate"]["init_args"]["entropy_reg"] == trial.params["model.gate.entropy_reg"]
        assert config["seed_everything"] == trial.user_attrs["seed"] == trial.user_attrs["config_id"]
        permutation = json.loads((folder / "results.json").read_text())["permutation"]
        assert permutation["frozen"] == 1.0  # E_perm = 1 of 2 epochs: rounded and frozen
    settings = optuna.load_study(study_name="movielens-100k/comet+", storage=url).user_attrs["settings"]
    assert settings["model.lr"] == 0.002 and settings["model.perm_epochs"] == 1
    capsys.readouterr()
    assert run_cli(tune_args(url, tiny_root, log_dir, *given[:2], "--model.perm_epochs=1", trials=3,
                             gate="comet+")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: study 'movielens-100k/comet+' exists with other settings")
    assert "model.lr 0.002 there, (not set) now" in err[0]


def test_limit_batches_count_or_fraction_in_fit(tiny_root: Path) -> None:
    """``--trainer.limit_*_batches 1`` is one batch, ``1.0`` every batch (Lightning's rule), in the configuration,
    the trainer and the batches a fit trains, validates and tests on."""
    from mtmoe.run import build_run

    batches = {}
    for value in ("1", "1.0"):
        run = build_run(["--gate", "topk", "--data", "movielens-100k", f"--data.root={tiny_root}",
                         "--trainer.max_epochs=1", "--data.batch_size=64", *limits(value)])
        assert all(type(run.config.trainer[f"limit_{split}_batches"]) is type(eval(value)) for split in LIMITS)
        run.fit()
        batches[value] = (run.trainer.num_training_batches, *run.trainer.num_val_batches,
                          *run.trainer.num_test_batches)
    assert batches["1"] == (1, 1, 1)
    assert all(count > 1 for count in batches["1.0"])


def test_limit_batches_count_or_fraction_in_tune(tiny_root: Path, tmp_path: Path, capsys) -> None:
    """A tune of ``--trainer.limit_*_batches 1`` trains each trial on one batch: its config.yaml says 1, a fit of it
    trains one batch of each split and gives the trial's objective; with ``1.0`` (every batch) it is another study
    and another objective."""
    from mtmoe.run import build_run

    url, log_dir = f"sqlite:///{tmp_path / 'l.db'}", tmp_path / "runs"
    values = {}
    for value in ("1", "1.0"):
        args = tune_args(url, tiny_root, log_dir, "--trainer.max_epochs=1", "--data.batch_size=64", *limits(value),
                         trials=1, name=f"limit-{value}")
        assert run_cli(args) == 0
        trial = trials_of(url, f"limit-{value}")[0]
        assert trial.state == TrialState.COMPLETE
        settings = optuna.load_study(study_name=f"limit-{value}", storage=url).user_attrs["settings"]
        assert json.dumps(settings["trainer.limit_train_batches"]) == value
        run = build_run(["--config", str(trial_folder(log_dir, f"limit-{value}", 0) / "config.yaml")])
        results = run.fit()
        assert results["best_val_loss"] == pytest.approx(trial.value, rel=1e-6)
        assert (run.trainer.num_training_batches == 1) == (value == "1")
        values[value] = trial.value
    assert values["1"] != pytest.approx(values["1.0"], rel=1e-3)
    capsys.readouterr()
    args = tune_args(url, tiny_root, log_dir, "--trainer.max_epochs=1", "--data.batch_size=64", *limits("1.0"),
                     trials=1, name="limit-1")
    assert run_cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.limit_train_batches 1 there, 1.0 now" in err[0]


@pytest.mark.slow
@pytest.mark.integration
def test_fit_config_of_a_trial_retrains_it(tmp_path: Path, monkeypatch) -> None:
    """End to end on the real MovieLens-100K: a packed comet+ study with lr and E_perm given (2 epochs, a few
    batches), run here with one torch thread, then ``python -m mtmoe fit --config config-NNNN/config.yaml`` for each
    trial, a process of its own: the same validation objective and test loss, to float32 rounding."""
    data = Path(os.environ.get("MTMOE_DATA", REAL_DATA))
    if not (data / "ml-100k" / "u.data").exists():
        pytest.skip(f"needs the real MovieLens-100K (MTMOE_DATA; not under {data})")
    env = {**os.environ, "MTMOE_DATA": str(data), "MTMOE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    for name in ("MTMOE_DATA", "MTMOE_CACHE"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.chdir(tmp_path)
    url, log_dir = f"sqlite:///{tmp_path / 'e.db'}", tmp_path / "runs"
    tune = ["tune", "--gate", "comet+", "--data", "movielens-100k", "--trials", "2", "--pack", "2", "--storage", url,
            "--log-dir", str(log_dir), "--trainer.max_epochs=2", "--model.lr=0.001", "--model.perm_epochs=1",
            "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2"]
    assert run_cli(tune) == 0  # one torch thread (one_torch_thread), as the fits' OMP_NUM_THREADS=1
    trials = trials_of(url, "movielens-100k/comet+")
    assert_each_config_once(trials, 2)
    for trial in trials:
        config = trial_folder(log_dir, "movielens-100k/comet+", trial.user_attrs["config_id"]) / "config.yaml"
        fit = subprocess.run([sys.executable, "-m", "mtmoe", "fit", "--config", str(config)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        assert fit.returncode == 0, fit.stderr
        written = fit.stdout.split("results written to ")[1].splitlines()[0]
        results = json.loads((tmp_path / written).read_text())
        assert results["seed"] == trial.user_attrs["seed"] and results["epochs_run"] == 2
        assert results["best_val_loss"] == pytest.approx(trial.value, rel=1e-6)
        assert results["test"]["loss"] == pytest.approx(trial.user_attrs["test_loss"], rel=1e-6)


@pytest.mark.parametrize("recorded, resumed, refused", [(20.0, 20, False), (1.0, 1, True), (1.0, 1.0, False)])
def test_a_batch_limit_compares_as_lightning_reads_it(tmp_path: Path, recorded: float, resumed: float,
                                                      refused: bool) -> None:
    """A study recorded ``20.0`` batches before counts were parsed as integers: ``20`` resumes it (the same 20
    batches); a study of ``1.0`` (every batch) is not one of ``1`` (one batch)."""
    from mtmoe.errors import UsageError
    from mtmoe.tuning.objective import plan_configurations
    from mtmoe.tuning.space import load_space
    from mtmoe.tuning.study import prepare_study

    url, space = f"sqlite:///{tmp_path / 'c.db'}", load_space("movielens-100k", "topk")
    plan = plan_configurations(space, 2, 0)
    prepare_study(url, "limit", space, 0, plan, {"trainer.limit_train_batches": recorded})
    if refused:
        with pytest.raises(UsageError, match=rf"trainer.limit_train_batches {recorded} there, {resumed} now"):
            prepare_study(url, "limit", space, 0, plan, {"trainer.limit_train_batches": resumed})
    else:
        prepare_study(url, "limit", space, 0, plan, {"trainer.limit_train_batches": resumed})
    assert len(trials_of(url, "limit")) == 2
