"""Training, evaluation and the command line end to end (tiny fixture; real MovieLens-100K smoke marked slow)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from mtmoe.data import MovieLens100KDataModule
from mtmoe.data.base import TaskSpec
from mtmoe.gates import gate_class, list_gates
from mtmoe.lit.module import MultiTaskMoE
from mtmoe.pack.settings import ModelSettings
from mtmoe.losses import task_loss

from conftest import run_cli

FAST = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--data.batch_size=64"]


@pytest.mark.parametrize("gate", list_gates())
def test_fit_end_to_end_every_gate(tiny_root: Path, gate: str, capsys: pytest.CaptureFixture) -> None:
    """``fit`` of every gate: 2 epochs of 3 training batches, the whole validation and test splits."""
    code = run_cli(["fit", "--gate", gate, "--data", "movielens-100k", f"--data.root={tiny_root}",
                    "--trainer.max_epochs=2", "--trainer.limit_train_batches=3", "--model.lr=1e-3", *FAST])
    assert code == 0
    out = capsys.readouterr().out
    assert f"{gate} on movielens-100k" in out and "watch/auroc" in out and "rating/mse" in out
    results_path = next(Path("runs").rglob("results.json"))
    results = json.loads(results_path.read_text())
    test = results["test"]
    for key in ("loss", "watch/auroc", "rating/mse", "watch/experts_per_sample", "rating/experts_per_sample"):
        assert math.isfinite(test[key]), key
    assert 0.0 <= test["watch/auroc"] <= 1.0
    n_experts = 16
    assert len(test["watch/utilisation"]) == n_experts
    expected = {"softmax": n_experts, "hash": 1, "topk": 2, "competesmoe": 2, "competesmoe-v2": 2, "sparsemixer": 1,
                "usmoe": 2}  # USMoE: floor(2 B) pairs in every eval batch
    if gate in expected:
        assert test["watch/experts_per_sample"] == pytest.approx(expected[gate])
    assert results["best_epoch"] in (0, 1) and results["epochs_run"] == 2
    # USMoE, Expert Choice and SparseMixer rows do not sum to 1 by design: no "violations" to report for them
    assert ("watch/simplex_violations" in test) == gate_class(gate).simplex
    assert (results_path.parent / "config.yaml").exists()


@pytest.mark.parametrize("gate", ["sparsemixer+", "expertchoice+", "usmoe+"])
def test_fit_local_search_variants_of_the_other_routers(tiny_root: Path, gate: str) -> None:
    assert run_cli(["fit", "--gate", gate, "--data", "movielens-100k", f"--data.root={tiny_root}",
                    "--trainer.max_epochs=2", "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=2",
                    "--trainer.limit_test_batches=2", "--model.perm_epochs=1", *FAST]) == 0
    results = json.loads(next(Path("runs").rglob("results.json")).read_text())
    assert results["gate"] == gate and results["permutation"]["frozen"] == 1.0
    assert math.isfinite(results["test"]["loss"])


def test_the_planned_run_length_reaches_the_gates(tiny_root: Path) -> None:
    """CompeteSMoE v2's warm-up is 5% of the run's training forward passes (max_epochs x batches per epoch)."""
    data = MovieLens100KDataModule(root=str(tiny_root), batch_size=64)
    model = MultiTaskMoE.build(data.info,
                               ModelSettings(gate=partial(gate_class("competesmoe-v2"), competition_prob=1.0)))
    trainer = pl.Trainer(max_epochs=2, limit_train_batches=10, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    for gate in model.net.gates:
        assert int(gate.warmup_steps) == round(0.05 * 2 * 10) == 1
        assert int(gate.step) == 2 * 10


def test_build_run_gives_the_objects_of_fit_untrained_and_fits_them_as_the_command(tiny_root: Path) -> None:
    """``mtmoe.run.build_run``: the parsed configuration, DataModule, LightningModule and Trainer of ``fit``
    arguments, seeded and not trained; ``run.fit()`` then gives what ``python -m mtmoe fit`` gives: a fit with a
    seed is reproducible, its test loss the same to the bit on a second run."""
    from mtmoe.run import build_run

    args = ["--gate", "comet", "--data", "movielens-100k", f"--data.root={tiny_root}", "--trainer.max_epochs=1",
            "--seed_everything=7", "--model.lr=2e-3", *FAST]
    run, again = build_run([*args, "--trainer.logger.init_args.name=built"]), build_run(args)
    assert run.config.seed_everything == 7 and run.config.model.lr == 2e-3 and run.config.trainer.max_epochs == 1
    assert isinstance(run.datamodule, MovieLens100KDataModule) and run.datamodule.batch_size == 64
    assert run.model.net.gates[0].registry_name == "comet" and run.trainer.max_epochs == 1
    assert run.trainer.global_step == 0 and run.datamodule.splits is None and not Path("runs").exists()
    initial = again.model.state_dict()
    assert all(torch.equal(value, initial[key]) for key, value in run.model.state_dict().items())

    results = run.fit()
    assert results == json.loads(next(Path("runs/built").rglob("results.json")).read_text())
    assert run_cli(["fit", *args, "--trainer.logger.init_args.name=command"]) == 0
    command = json.loads(next(Path("runs/command").rglob("results.json")).read_text())
    assert results["test"]["loss"] == command["test"]["loss"] and results["best_epoch"] == command["best_epoch"]


def test_validate_and_test_from_checkpoint(tiny_root: Path) -> None:
    common = ["--gate", "topk", "--data", "movielens-100k", f"--data.root={tiny_root}", *FAST]
    assert run_cli(["fit", *common, "--trainer.max_epochs=1"]) == 0
    checkpoint = next(Path("runs").rglob("*.ckpt"))
    for command in ("validate", "test"):
        assert run_cli([command, *common, f"--ckpt_path={checkpoint}"]) == 0
    assert len(list(Path("runs").rglob("results.json"))) == 3


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gate", "nope"], "unknown gate 'nope'; valid gates: comet"),
        (["--gate", "topk", "--data", "nope"], "unknown dataset 'nope'; valid datasets: "),  # names: test_data_images.py
        (["--gate", "topk", "--model.gate.k=17"], "--model.gate.k 17 is not allowed: k must satisfy 1 <= k <= "
                                                  "n_experts = 16; pass another --model.gate.k, or change "
                                                  "--model.n_experts"),
        (["--gate", "comet", "--model.gate.k=0"], "--model.gate.k 0 is not allowed: k must satisfy 1 <= k <="),
        (["--gate", "softmax", "--model.n_experts=1"], "--model.n_experts 1 is not allowed: n_experts must be >= 2"),
        (["--gate", "dselect", "--model.gate.gamma=0"], "--model.gate.gamma 0.0 is not allowed: gamma must be > 0"),
        (["--gate", "comet", "--model.gate.gamma=-1"], "--model.gate.gamma -1.0 is not allowed: gamma must be > 0"),
        (["--gate", "topk", "--model.alpha=1.5"], "--model.alpha 1.5 is not allowed: alpha must be in [0, 1]"),
        (["--gate", "topk", "--model.lr=abc"], "model.lr"),
    ],
)
def test_bad_input_one_line_exit_2(tiny_root: Path, extra: list[str], message: str, capsys) -> None:
    argv = ["fit", "--data", "movielens-100k", f"--data.root={tiny_root}", "--trainer.max_epochs=1", *FAST]
    if extra[0] == "--gate" and "--data" in extra:
        argv = ["fit", *extra, f"--data.root={tiny_root}", *FAST]
    else:
        argv += extra
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not Path("runs").exists()


def test_missing_data_file_names_it_and_writes_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MTMOE_CACHE", str(tmp_path / "cache"))
    empty = tmp_path / "empty"
    empty.mkdir()
    code = run_cli(["fit", "--gate", "topk", "--data", "movielens-100k", f"--data.root={empty}",
                    "--data.download=false", *FAST])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(empty / "ml-100k" / "u.data") in err[0]
    assert list(empty.iterdir()) == [] and not (tmp_path / "cache").exists()
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("results.json"))


def test_process_exit_code_and_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mtmoe", "fit", "--gate", "comet+x", "--data", "movielens"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr


def test_eval_loss_is_the_pure_task_loss(tiny_root: Path) -> None:
    """Gate regularisers are training-only: in eval the loss is alpha*BCE + (1-alpha)*masked MSE exactly."""
    data = MovieLens100KDataModule(root=str(tiny_root), batch_size=64)
    data.setup()
    gate = partial(gate_class("dselect"), gamma=5.0, entropy_reg=10.0)
    model = MultiTaskMoE.build(data.info, ModelSettings(gate=gate, alpha=0.3))
    batch = next(iter(data.val_dataloader()))
    model.eval()
    with torch.no_grad():
        output = model(batch)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(output.predictions[0], batch["watch"])
        mask = batch["rating_mask"]
        mse = ((output.predictions[1][mask] - batch["rating"][mask]) ** 2).mean()
    assert float(output.aux_loss) == 0.0
    expected = 0.3 * bce + 0.7 * mse
    got = sum(w * task_loss(t, p, batch)[0] for w, t, p in zip(model.trial.task_weights, model.info.tasks, output.predictions))
    assert torch.allclose(got, expected)
    model.train()
    assert float(model(batch).aux_loss) > 0.0


def test_masked_loss_uses_the_explicit_mask() -> None:
    """A genuine 0.0 target stays in the MSE when its mask is set (official defect #13 infers the mask from y != 0)."""
    task = TaskSpec("rating", "regression", masked=True)
    prediction = torch.tensor([1.0, 2.0, 3.0])
    batch = {"rating": torch.tensor([0.0, 2.0, 0.0]), "rating_mask": torch.tensor([True, True, False])}
    loss, count = task_loss(task, prediction, batch)
    assert count == 2 and loss == pytest.approx((1.0**2 + 0.0) / 2)
    empty = {"rating": torch.zeros(3), "rating_mask": torch.zeros(3, dtype=torch.bool)}
    loss, count = task_loss(task, prediction.requires_grad_(), empty)
    assert count == 0 and float(loss) == 0.0 and not torch.isnan(loss)


def test_restore_best_weights(tiny_root: Path) -> None:
    """After fit, the model holds the best-validation epoch's weights (Keras' restore_best_weights)."""
    pl.seed_everything(0, verbose=False)
    data = MovieLens100KDataModule(root=str(tiny_root), batch_size=64)
    model = MultiTaskMoE.build(data.info, ModelSettings(gate=partial(gate_class("topk")), lr=3e-2))
    trainer = pl.Trainer(max_epochs=4, limit_train_batches=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    best = model.engine.summary(0)
    assert 0 <= best["best_epoch"] < 3  # not the last epoch: its weights must be restored
    trainer.validate(model, datamodule=data, verbose=False)
    assert model.last_results["val"]["loss"] == pytest.approx(best["best_val_loss"], rel=1e-6)
