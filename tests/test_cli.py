"""The command line says what it does (issue 14: 4-8; issue 15: 4, 10): help and listings, start-up without
Lightning, no adverts or noise, the configuration in force, and bad input as one ``error:`` line with exit code 2
and nothing written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_cli

FAST = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--data.batch_size=64"]
COMMANDS = ("fit", "validate", "test", "tune", "report", "bootstrap", "gates", "datasets")
CHECKOUT = Path(__file__).resolve().parents[1]


def fit(root: Path, *extra: str, gate: str = "topk") -> list[str]:
    return ["fit", "--gate", gate, "--data", "movielens-100k", f"--data.root={root}", "--trainer.max_epochs=1", *FAST,
            *extra]


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, lines
    return lines[0]


def python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter on this checkout."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(CHECKOUT), **env})


# ----------------------------------------------------------------------------------- 14.4: what the commands are


@pytest.mark.parametrize("argv", [["--help"], ["-h"], []], ids=["--help", "-h", "no-arguments"])
def test_the_top_level_help_lists_every_command_once(argv: list[str], capsys) -> None:
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)
    assert "predict" not in out and "subcommand" not in out and "usage: python -m mtmoe COMMAND" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_documents_its_options(command: str, capsys) -> None:
    assert run_cli([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as words: the help is wrapped to the terminal
    assert f"python -m mtmoe {command}" in out or f"python -m mtmoe [options] {command}" in out
    if command in ("fit", "validate", "test"):
        assert "--gate NAME" in out and "--data NAME" in out and "--ckpt_path" in out and "--trainer.max_epochs" in out


def test_an_unknown_command_names_the_commands(capsys) -> None:
    assert run_cli(["predict"]) == 2
    line = one_error_line(capsys)
    assert "unknown command 'predict'" in line and ", ".join(COMMANDS) in line


# ------------------------------------------------------------------------------------------- 14.7: start-up


@pytest.mark.parametrize("command, absent", [("--help", ("torch", "lightning", "optuna")),
                                             ("datasets", ("torch", "lightning", "optuna")),
                                             ("gates", ("lightning", "pandas", "torchvision"))])
def test_help_and_listings_import_no_lightning(command: str, absent: tuple[str, ...], tmp_path: Path) -> None:
    """What made ``gates`` and ``datasets`` take 6.5-10 s: importing Lightning for commands that train nothing."""
    proc = python(f"import sys\nfrom mtmoe.cli import main\nmain([{command!r}])\n"
                  f"print('imported:', [m for m in {absent!r} if m in sys.modules])", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "imported: []"


# ------------------------------------------------------------------------------------------------ 14.6: noise


def test_a_fit_prints_its_progress_results_and_no_adverts(tiny_root: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mtmoe", *fit(tiny_root, "--trainer.limit_train_batches=3")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(CHECKOUT)})
    assert proc.returncode == 0, proc.stderr
    assert "topk on movielens-100k: val and test of epoch 0's weights" in proc.stdout
    for noise in ("Tip", "litlogger", "LeafSpec", "log_every_n_steps", "Warning"):
        assert noise not in proc.stderr, noise
    assert "GPU available: " in proc.stderr  # Lightning's account of the hardware stays


# ---------------------------------------------------------------------------------------- 14.8: small truths


def test_gates_shows_what_each_search_space_tunes(capsys) -> None:
    assert run_cli(["gates"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["topk"].split()[3:] == ["lr"]  # every space fixes Top-k's k at 2: the old listing said "k"
    assert rows["topk+"].endswith("lr, perm_epochs")
    assert rows["comet"].endswith("lr, gate.gamma, gate.entropy_reg")
    assert "competesmoe+" not in rows and "softmax" in rows


def test_print_config_shows_the_values_in_force(tiny_root: Path, capsys) -> None:
    assert run_cli(fit(tiny_root, "--print_config")) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    model = config["model"]
    assert model["alpha"] == 0.9 and model["n_experts"] == 16 and model["gate"]["init_args"]["k"] == 2
    assert (model["embedding_dim"], model["expert_units"], model["expert_dropout"]) == (128, 256, 0.5)
    assert not Path("runs").exists()


def test_perm_epochs_on_a_gate_without_plus_names_the_plus_gate(tiny_root: Path, capsys) -> None:
    assert run_cli(fit(tiny_root, "--model.perm_epochs=2")) == 2
    assert "pass --gate topk+" in one_error_line(capsys)
    assert not Path("runs").exists()


# ------------------------------------------------------------- 14.5, 15.4, 15.10: bad input, one line, exit 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--trainer.accelerator=tpu"], "the trainer settings cannot run here: "),
        (["--trainer.devices=0"], "the trainer settings cannot run here: "),
        (["--trainer.strategy=nonsense"], "invalid strategy name"),
        (["--trainer.max_epochs=0"], "--trainer.max_epochs must be >= 1 (or -1: until early stopping), got 0"),
        (["--trainer.limit_train_batches=0"], "--trainer.limit_train_batches 0 leaves no train batch"),
        (["--early_stopping.patience=-1"], "--early_stopping.patience must be >= 0, got -1"),
        (["--data.batch_size=0"], "error: batch_size must be >= 1, got 0"),
        (["--data.eval_batch_size=-5"], "error: eval_batch_size must be >= 1, got -5"),
    ],
)
def test_bad_settings_are_one_error_line_and_leave_nothing(tiny_root: Path, extra: list[str], message: str,
                                                           capsys) -> None:
    assert run_cli(fit(tiny_root, *extra)) == 2
    assert message in one_error_line(capsys)
    assert not Path("runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_readmes_gpu_command_on_a_machine_without_one(tiny_root: Path, capsys) -> None:
    """README's ``fit --gate comet+ --data multimnist --trainer.accelerator gpu`` (here on the tiny MovieLens)."""
    assert run_cli(fit(tiny_root, "--trainer.accelerator=gpu", gate="comet+")) == 2
    assert "the trainer settings cannot run here: No supported gpu backend found" in one_error_line(capsys)
    assert not Path("runs").exists()


def test_evaluating_needs_a_checkpoint(tiny_root: Path, capsys) -> None:
    for command in ("validate", "test"):
        assert run_cli([command, *fit(tiny_root)[1:]]) == 2
        assert f"{command} evaluates a checkpoint: pass --ckpt_path" in one_error_line(capsys)
    assert not Path("runs").exists()


def test_an_output_folder_that_cannot_be_made_is_one_error_line(tiny_root: Path, capsys) -> None:
    blocked = Path("a-file")
    blocked.write_text("not a folder")
    assert run_cli(fit(tiny_root, f"--trainer.logger.init_args.save_dir={blocked / 'runs'}")) == 2
    line = one_error_line(capsys)
    assert f"cannot create the run's log folder in {blocked / 'runs' / 'lightning_logs'} (Not a directory)" in line
    assert "--trainer.logger.init_args.save_dir" in line


def test_a_diverged_fit_says_so_and_exits_1(tiny_root: Path, capsys) -> None:
    assert run_cli(fit(tiny_root, "--model.adam_eps=0", "--trainer.max_epochs=2")) == 1
    line = one_error_line(capsys)
    results = json.loads(next(Path("runs").rglob("results.json")).read_text())
    assert line.startswith(f"error: the fit diverged ({results['diverged']})") and "loss nan at epoch 0" in line
    assert "best_epoch" not in results and not list(Path("runs").rglob("best.ckpt"))
