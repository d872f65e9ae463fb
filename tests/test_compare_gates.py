"""``benchmarks/compare_gates.py``: its FLOP accounting against hand counts, and one tiny end-to-end run."""
from __future__ import annotations

import csv
import importlib.util
from functools import partial
from pathlib import Path

import pytest
import torch

from mtmoe.data import MovieLens100KDataModule
from mtmoe.gates import gate_class
from mtmoe.lit.module import MultiTaskMoE
from mtmoe.pack.settings import ModelSettings

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_gates.py"
spec = importlib.util.spec_from_file_location("compare_gates", SCRIPT)
compare_gates = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_gates)

# MovieLens-100K architecture (S1.2): routing input p = 2 x 128, 16 experts of 256 units, 2 task gates, 2 towers
P, N, UNITS, TASKS = 256, 16, 256, 2
EXPERTS = 2 * P * N * UNITS  # one Linear(p, n * units), 2 FLOPs per multiply-add
MIXING = 2 * TASKS * N * UNITS  # bmm of [T, n] weights with [n, units] outputs
TOWERS = TASKS * (2 * UNITS * UNITS + 2 * UNITS * 1)  # Dense(256) then Dense(1) per task
GATES = TASKS * 2 * P * N  # one Linear(p, n) per task gate (Softmax); Hash-r has none


@pytest.mark.parametrize("gate, forward, inference", [
    ("softmax", EXPERTS + MIXING + TOWERS + GATES, EXPERTS + MIXING + TOWERS + GATES),  # every expert runs
    ("hash", EXPERTS + MIXING + TOWERS, EXPERTS // N + MIXING + TOWERS),  # one shared table: 1 expert per sample
])
def test_flops_per_sample_match_hand_counts(tiny_root: Path, gate: str, forward: int, inference: int) -> None:
    data = MovieLens100KDataModule(root=str(tiny_root), batch_size=100)
    data.setup()
    torch.manual_seed(0)
    model = MultiTaskMoE.build(data.info, ModelSettings(gate=partial(gate_class(gate))))
    flops = compare_gates.count_flops(model, data.test_dataloader())
    assert flops["forward_flops"] == forward
    assert flops["inference_flops"] == inference


def test_tiny_comparison_writes_csv_and_markdown(tiny_root: Path, tmp_path: Path) -> None:
    compare_gates.main(["--data", "movielens-100k", "--root", str(tiny_root), "--gates", "topk,usmoe+",
                        "--epochs", "1", "--batch-size", "256", "--out", str(tmp_path)])
    with open(tmp_path / "compare-movielens-100k-cpu.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["gate"] for r in rows] == ["topk", "usmoe+"]
    assert float(rows[0]["n_s"]) == 2.0 and float(rows[0]["zero_expert_fraction"]) == 0.0
    for row in rows:
        assert 0.0 <= float(row["watch/auroc"]) <= 1.0 and float(row["rating/mse"]) > 0
        assert float(row["inference_flops"]) < float(row["forward_flops"])
    table = (tmp_path / "compare-movielens-100k-cpu.md").read_text()
    assert table.startswith("movielens-100k: 1 epoch(s), Adam lr 0.0002, batch 256, seed 0")
    assert "| usmoe+ |" in table and "| watch AUC | watch accuracy | rating MSE |" in table
