"""Books and Jester end to end: the paper's model shapes (S1.2), every registered gate and its "+" variant training
a few batches on one of them (tiny fixtures), and the command line."""
from __future__ import annotations

import importlib
import json
import math
from functools import partial
from pathlib import Path

import jsonargparse
import lightning.pytorch as pl
import pytest
import torch

from mtmoe.data import DATASETS as REGISTRY
from mtmoe.data import BooksDataModule, JesterDataModule
from mtmoe.data.base import InMemoryDataModule
from mtmoe.gates import gate_class
from mtmoe.lit.module import MultiTaskMoE
from mtmoe.pack.settings import ModelSettings

from conftest import run_cli
from covering import variants_over
from recsys_fixtures import jester_matrices, random_book_ratings, write_book_crossing, write_jester

DATASETS = {"books": BooksDataModule, "jester": JesterDataModule}
# dataset -> (users, items, embedding, n experts, expert units, k, task 1)
SHAPES = {"books": (18_960, 31_070, 64, 9, 128, 4, "read"), "jester": (73_421, 100, 64, 16, 128, 2, "rated")}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("recsys")
    write_book_crossing(base / "books", random_book_ratings())
    write_jester(base / "jester", jester_matrices())
    return {"books": base / "books", "jester": base / "jester"}


def datamodule(name: str, roots: dict[str, Path], **kwargs) -> InMemoryDataModule:
    root = roots[name]
    return DATASETS[name](root=str(root), cache_dir=str(root / "cache"), download=False, **kwargs)


@pytest.mark.parametrize("name", DATASETS)
def test_registered_with_cli_arguments(name: str) -> None:
    module_name, class_name = REGISTRY[name].rsplit(".", 1)
    cls = getattr(importlib.import_module(module_name), class_name)
    assert cls is DATASETS[name] and cls(download=False).info.name == name
    parser = jsonargparse.ArgumentParser()  # what the CLI sees: **kwargs resolved through super().__init__
    parser.add_class_arguments(cls, "data")
    keys = {action.dest for action in parser._actions}
    assert {"data.split_seed", "data.stratify", "data.root", "data.cache_dir", "data.download"} <= keys
    assert parser.get_defaults().data.batch_size == 2048  # S1.3
    assert ("data.rating_scale" in keys) == (name == "jester")


@pytest.mark.parametrize("name", DATASETS)
def test_model_shapes(name: str) -> None:
    users, items, embedding, n, units, k, _ = SHAPES[name]
    model = MultiTaskMoE.build(DATASETS[name](download=False).info, ModelSettings(gate=partial(gate_class("topk"))))
    net = model.net
    assert net.bottom.user.weight.shape == (users, embedding) and net.bottom.item.weight.shape == (items, embedding)
    assert net.experts.linear.weight.shape == (n * units, 2 * embedding)  # n Dense(units) experts, one matmul
    assert [gate.k for gate in net.gates] == [k, k]
    assert [tuple(layer.weight.shape) for layer in (net.towers[0][0], net.towers[0][2])] == [(256, units), (1, 256)]
    assert len(net.towers) == 2 and list(model.trial.task_weights) == [0.9, pytest.approx(0.1)]


@pytest.mark.parametrize("variant, name", variants_over(list(DATASETS)))
def test_every_gate_trains(name: str, variant: str, roots: dict[str, Path]) -> None:
    """A few training batches and one validation pass; n/s where the gate fixes it; the weights moved. Every gate
    and "+" variant on one dataset, a gate and its "+" on different ones (``tests/covering.py``): each gate at both
    datasets' numbers of experts (9, 16) is in ``test_gates_registry.py``, comet+ on both through the CLI below."""
    gate, plus = variant.removesuffix("+"), variant.endswith("+")
    _, _, _, n, _, k, task = SHAPES[name]
    pl.seed_everything(0, verbose=False)
    data = datamodule(name, roots, batch_size=64)
    model = MultiTaskMoE.build(data.info, ModelSettings(gate=partial(gate_class(gate)), lr=1e-3,
                                                        perm_epochs=1 if plus else None))
    before = model.net.experts.linear.weight.detach().clone()
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, accelerator="cpu")
    trainer.fit(model, datamodule=data)
    val = model.last_results["val"]
    assert math.isfinite(val["loss"]) and math.isfinite(val["rating/mse"]) and 0 <= val[f"{task}/auroc"] <= 1
    assert len(val[f"{task}/utilisation"]) == n
    expected = {"softmax": n, "hash": 1, "topk": k}
    if gate in expected:
        assert val[f"{task}/experts_per_sample"] == pytest.approx(expected[gate])
    assert not torch.equal(before, model.net.experts.linear.weight)
    if plus:
        assert model.net.local_search.frozen  # the window (1 epoch) closed and the permutation was rounded


@pytest.mark.parametrize("name", DATASETS)
def test_cli_fit_comet_plus(name: str, roots: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture) -> None:
    """``python -m mtmoe fit --gate comet+ --data books|jester`` (the issue's command), on the tiny fixtures."""
    monkeypatch.chdir(tmp_path)
    task = SHAPES[name][-1]
    code = run_cli(["fit", "--gate", "comet+", "--data", name, f"--data.root={roots[name]}",
                    f"--data.cache_dir={roots[name] / 'cache'}", "--data.batch_size=128", "--model.perm_epochs=1",
                    "--model.alpha=0.1", "--trainer.max_epochs=1", "--trainer.limit_train_batches=3",
                    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"])
    assert code == 0
    assert f"comet+ on {name}" in capsys.readouterr().out
    results = json.loads(next(Path("runs").rglob("results.json")).read_text())
    assert (results["dataset"], results["gate"]) == (name, "comet+")
    test = results["test"]
    assert test["loss_dataset"] == pytest.approx(0.1 * test[f"{task}/loss"] + 0.9 * test["rating/loss"])
    assert math.isfinite(test["rating/mse"])
    assert [sorted(a) for a in results["permutation"]["assignment"]] == [list(range(SHAPES[name][3]))]  # shared P
