"""``--model.matmul_precision highest|high`` (issue 31, item 4): in force while ``fit`` and ``tune``'s packs train,
the previous setting back after them, recorded in a study's identity (a study never mixes precisions), and a bad
value is one error line."""
from __future__ import annotations

from pathlib import Path

import optuna
import torch
from lightning.pytorch.callbacks import Callback

from conftest import run_cli
from test_cli import fit, one_error_line
from test_tuning import TINY, trials_of, tune_args

#: The float32 matmul precision in force at each training batch of the runs that use :class:`PrecisionProbe`.
SEEN: list[str] = []
PROBE = "--trainer.callbacks+=test_matmul_precision.PrecisionProbe"


class PrecisionProbe(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        SEEN.append(torch.get_float32_matmul_precision())


def test_fit_trains_in_the_chosen_precision_and_restores_the_previous_one(tiny_root: Path) -> None:
    SEEN.clear()
    assert torch.get_float32_matmul_precision() == "highest"
    assert run_cli(fit(tiny_root, "--model.matmul_precision=high", PROBE)) == 0
    assert SEEN and set(SEEN) == {"high"}, SEEN
    assert torch.get_float32_matmul_precision() == "highest"
    SEEN.clear()
    assert run_cli(fit(tiny_root, PROBE)) == 0  # the default: float32 matmuls in float32
    assert SEEN and set(SEEN) == {"highest"}, SEEN


def test_a_study_records_its_precision_and_refuses_another(tiny_root: Path, tmp_path: Path, capsys) -> None:
    url, name = f"sqlite:///{tmp_path / 's.db'}", "movielens-100k/topk"
    SEEN.clear()
    high = tune_args(url, tiny_root, tmp_path / "runs", *TINY, PROBE, "--model.matmul_precision", "high", trials=2)
    assert run_cli([*high, "--pack", "2"]) == 0
    assert SEEN and set(SEEN) == {"high"}, SEEN  # the packed engine trained in it
    assert torch.get_float32_matmul_precision() == "highest"
    settings = optuna.load_study(study_name=name, storage=url).user_attrs["settings"]
    assert settings["model.matmul_precision"] == "high", settings
    before = [(t.number, t.state, t.params) for t in trials_of(url, name)]
    capsys.readouterr()

    highest = tune_args(url, tiny_root, tmp_path / "runs", *TINY, PROBE, trials=3)
    assert run_cli(highest) == 2
    assert one_error_line(capsys) == (
        f"error: study '{name}' exists with other settings (model.matmul_precision \"high\" there, (not set) now): "
        "refusing to mix trials of different settings; pass --study-name NAME to start another study, or another "
        "--storage")
    assert [(t.number, t.state, t.params) for t in trials_of(url, name)] == before
    assert run_cli([*high, "--pack", "2", "--trials", "3"]) == 0  # the same precision: the study goes on
    assert len(trials_of(url, name)) == 3


def test_an_unknown_precision_is_one_error_line(tiny_root: Path, capsys) -> None:
    assert run_cli(fit(tiny_root, "--model.matmul_precision=medium")) == 2
    line = one_error_line(capsys)
    assert "matmul_precision" in line and "medium" in line, line
    assert not Path("runs").exists()
