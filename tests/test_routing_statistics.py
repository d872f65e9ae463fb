"""The routing statistics of issue 35, item 3 (``routing_entropy``, ``expert_overlap``, ``expert_load``,
``selection_changed``; computed in ``mtmoe.pack.metrics``, checked there against a per-sample reference) through
the engine, ``fit`` and ``report``: a packed trial's values equal its values alone, through a refilled slot and a
compacted pack; ``fit`` logs them per epoch (CSV), writes them per epoch in ``results.json`` and counts neither the
sanity check nor the test pass as a previous epoch; ``report`` averages the selected trials' values."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch

from mtmoe.routing_names import routing_of
from mtmoe.tuning.storage import storage_for

from conftest import run_cli
from test_engine import batches, engine_of, step, trials

FAST = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--data.batch_size=64"]


def validate(engine, eval_batches) -> list[dict]:
    """One tracked validation pass of every slot; each slot's routing statistics."""
    engine.eval_metrics.reset()
    engine.eval_metrics.tracking = True
    engine.prepare_evaluation()
    for batch in eval_batches:
        engine.eval_step(batch)
    return [routing_of(results) for results in engine.eval_metrics.results()]


def assert_close(packed: dict, alone: dict) -> None:
    assert list(packed) == list(alone)
    for key, value in alone.items():
        torch.testing.assert_close(torch.tensor(packed[key]), torch.tensor(value), rtol=0, atol=1e-6, msg=key)


def train(engine, slot_batches: list[dict]) -> None:
    """One training step, each slot on its own batch."""
    engine.train_metrics.reset()
    engine.train_step({key: torch.stack([batch[key] for batch in slot_batches]) for key in slot_batches[0]})


@pytest.mark.parametrize("name", ["topk", "softmax"])
def test_a_packed_trial_routes_as_alone_through_a_refill_and_a_compaction(name: str) -> None:
    """Trials 0, 1, 2 in three slots: validate; train, validate; trial 3 replaces trial 1 (and has no previous
    selections of its own); train, validate; trial 0 ends and the pack shrinks to trials 3 and 2 (their recorded
    selections move along); train, validate. Each trial's statistics equal those of a pack of one that saw the same
    batches."""
    packed_trials, alone_trials = trials(name, 0.0, 4), trials(name, 0.0, 4)
    alone = [engine_of([trial]) for trial in alone_trials]
    data, eval_batches = [batches(p) for p in range(4)], batches(9, 3)
    engine = engine_of(packed_trials[:3])
    in_slots = [0, 1, 2]  # the trial in each slot
    got, expected = {p: [] for p in range(4)}, {p: [] for p in range(4)}
    for phase in range(4):
        if phase == 2:
            engine.slots[1] = None
            engine.load(1, packed_trials[3])
            in_slots = [0, 3, 2]
        if phase == 3:
            engine.slots[0] = None
            engine = engine.compacted()
            in_slots = [3, 2]
        for i in range(2 * phase - 2, 2 * phase) if phase else ():
            train(engine, [data[trial][i] for trial in in_slots])
            for trial in in_slots:
                train(alone[trial], [data[trial][i]])
        for trial, results in zip(in_slots, validate(engine, eval_batches)):
            got[trial].append(results)
            expected[trial].append(validate(alone[trial], eval_batches)[0])
    for trial in got:
        assert len(got[trial]) == {0: 3, 1: 2, 2: 4, 3: 2}[trial]
        for packed, by_itself in zip(got[trial], expected[trial]):
            assert_close(packed, by_itself)
        changed = ["watch/selection_changed" in results for results in got[trial]]
        assert changed == [False] + [True] * (len(changed) - 1)
    assert any(results["watch/selection_changed"] > 0 for results in got[2][1:])


def fit(root: Path, name: str, *extra: str) -> dict:
    assert run_cli(["fit", "--gate", "softmax", "--data", "movielens-100k", f"--data.root={root}", "--model.lr=1e-3",
                    "--trainer.num_sanity_val_steps=2", "--trainer.limit_train_batches=3",
                    f"--trainer.logger.init_args.name={name}", *FAST, *extra]) == 0
    return json.loads(next(Path("runs", name).rglob("results.json")).read_text())


def test_fit_logs_the_routing_of_every_epoch_and_resumes_it(tiny_root: Path) -> None:
    """A dense gate (Softmax, its top 2 of 16 experts selected), 3 epochs: every epoch's validation has the
    statistics, in ``metrics.csv`` and in ``results.json``'s ``routing``; the first has no ``selection_changed``
    (the sanity check is not a previous epoch), the test results none (a test pass is not a validation). A run
    resumed after epoch 2 from its last checkpoint gives the uninterrupted run's epoch 3; ``validate`` of that
    checkpoint has no ``selection_changed``."""
    results = fit(tiny_root, "whole", "--trainer.max_epochs=3")
    routing = results["routing"]
    assert [epoch["epoch"] for epoch in routing] == [0, 1, 2]
    assert "watch/selection_changed" not in routing[0] and all("rating/selection_changed" in e for e in routing[1:])
    for epoch in routing:
        assert sum(epoch["watch/expert_load"]) == pytest.approx(1.0)
        assert 0 < epoch["watch/routing_entropy"] < math.log(16) and 0 <= epoch["rating/expert_overlap"] <= 1
    assert routing[results["best_epoch"]] == {"epoch": results["best_epoch"], **routing_of(results["val"])}
    assert "watch/routing_entropy" in results["test"] and "watch/selection_changed" not in results["test"]
    with open(next(Path("runs/whole").rglob("metrics.csv"))) as file:
        logged = [row for row in csv.DictReader(file) if row["val/watch/routing_entropy"]]
    assert [float(row["val/watch/routing_entropy"]) for row in logged] == pytest.approx(
        [epoch["watch/routing_entropy"] for epoch in routing], rel=1e-6)  # logged as float32
    assert [row["val/watch/selection_changed"] != "" for row in logged] == [False, True, True]
    assert all(row[f"val/watch/expert_load/{i}"] != "" for row in logged for i in range(16))

    fit(tiny_root, "first", "--trainer.max_epochs=2")
    last = next(Path("runs/first").rglob("last.ckpt"))
    resumed = fit(tiny_root, "resumed", "--trainer.max_epochs=3", f"--ckpt_path={last}")
    assert resumed["routing"] == routing
    assert run_cli(["validate", "--gate", "softmax", "--data", "movielens-100k", f"--data.root={tiny_root}", *FAST,
                    "--trainer.logger.init_args.name=validated", f"--ckpt_path={last}"]) == 0
    validated = json.loads(next(Path("runs/validated").rglob("results.json")).read_text())["val"]
    assert "watch/routing_entropy" in validated and "watch/selection_changed" not in validated  # not an epoch


def test_dense_selection_above_uniform(tiny_root: Path) -> None:
    """``--model.dense_selection above_uniform`` counts a Softmax gate's weights above 1/16: another selection."""
    results = fit(tiny_root, "uniform", "--trainer.max_epochs=1", "--model.dense_selection=above_uniform")
    top2 = fit(tiny_root, "top2", "--trainer.max_epochs=1")
    assert results["val"]["watch/routing_entropy"] == top2["val"]["watch/routing_entropy"]
    assert results["val"]["watch/expert_load"] != top2["val"]["watch/expert_load"]
    assert results["val"]["watch/loss"] == top2["val"]["watch/loss"]


def test_report_averages_the_routing_of_each_studys_selected_trials(tmp_path: Path, capsys) -> None:
    """Two studies of 40 trials with the attributes ``tune`` records; ``report``'s routing section and
    ``routing.csv`` hold the mean ± SE over each study's 2 best trials, as pandas computes them."""
    url = f"journal:{tmp_path / 'studies.log'}"
    storage = storage_for(url)
    g = torch.Generator().manual_seed(0)
    selected = {}
    for gate in ("topk", "comet"):
        study = optuna.create_study(study_name=f"movielens-100k/{gate}", storage=storage)
        study.set_user_attr("data", "movielens-100k")
        study.set_user_attr("gate", gate)
        rows = []
        for config_id in range(40):
            value = float(torch.rand((), generator=g))
            attrs = {"config_id": config_id, "test_loss": value, "test/watch/experts_per_sample": 2.0}
            for task in ("watch", "rating"):
                load = torch.rand(4, generator=g)
                attrs |= {f"val/{task}/routing_entropy": float(torch.rand((), generator=g)),
                          f"val/{task}/expert_overlap": float(torch.rand((), generator=g)),
                          f"val/{task}/selection_changed": float(torch.rand((), generator=g)),
                          f"val/{task}/expert_load": (load / load.sum()).tolist()}
            study.add_trial(optuna.trial.create_trial(value=value, user_attrs=attrs))
            rows.append({"objective": value, **attrs})
        selected[gate] = pd.DataFrame(rows).nsmallest(2, "objective")  # ceil(5% of 40)
    out = tmp_path / "report"
    assert run_cli(["report", "--data", "movielens-100k", "--storage", url, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = pd.read_csv(out / "routing.csv").set_index(["study", "task"])
    assert len(table) == 4 and "## Routing" in printed and "routing.csv" in printed
    for gate, top in selected.items():
        for task in ("watch", "rating"):
            row = table.loc[(f"movielens-100k/{gate}", task)]
            for key in ("routing_entropy", "expert_overlap", "selection_changed"):
                values = top[f"val/{task}/{key}"]
                assert row[f"{key}_mean"] == pytest.approx(values.mean())
                assert row[f"{key}_se"] == pytest.approx(values.std(ddof=1) / math.sqrt(2))
            loads = pd.DataFrame(top[f"val/{task}/expert_load"].tolist())
            assert row.max_load_mean == pytest.approx(loads.max(axis=1).mean())
            assert [row[f"load_{i}_mean"] for i in range(4)] == pytest.approx(loads.mean().tolist())
            shown = f"| movielens-100k/{gate} | {gate} | 0.9 | {task} | {row.routing_entropy_mean:.3f} ± "
            assert shown in printed
