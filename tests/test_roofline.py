"""The device-cost accounting of ``bench_packs.py --roofline`` (:mod:`mtmoe.pack.roofline`, issue 31 item 3): exact
FLOPs, bytes and launches on cases small enough to count by hand, the kernels that run outside ATen counted by
their own report, and the pack-size extrapolation the benchmark uses equal to a direct count."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtmoe.pack.adam import PackedAdam
from mtmoe.pack.roofline import BANDWIDTH, H100_FLOPS, Cost, floor_bytes, measure, projected_ms, tensor_bytes
from mtmoe.pack.stack import TrialStack
from mtmoe.random import dropout

from conftest import require_dataset
from test_engine import batches, engine_of, trials


def test_one_matmul_is_its_flops_its_operands_read_and_its_result_written() -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    cost = measure(lambda: a @ b)
    assert (cost.flops, cost.bytes, cost.launches) == (2 * 64 * 32 * 48, 4 * (64 * 32 + 32 * 48 + 64 * 48), 1)
    assert cost.by_kernel == {"mm": cost.bytes}


def test_views_and_allocations_are_free_and_an_expanded_operand_is_read_once() -> None:
    x = torch.randn(10, 20)
    assert measure(lambda: (x.t(), x.view(200), torch.empty(1000))) == Cost(0, 0, 0, {})
    row = torch.randn(20)
    wide = row.expand(10, 20)
    assert tensor_bytes(wide) == 4 * 20
    cost = measure(lambda: x + wide)  # reads x and the 20 distinct values of the row, writes 10 x 20
    assert (cost.flops, cost.bytes, cost.launches) == (0, 4 * (200 + 20 + 200), 1)
    cost = measure(lambda: x.add_(1.0))  # in place: x read and written
    assert (cost.bytes, cost.launches) == (4 * 400, 1)
    cost = measure(lambda: x.zero_())  # written, not read
    assert (cost.bytes, cost.launches) == (4 * 200, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_dropout_kernel_reports_what_it_reads_and_writes(dtype: torch.dtype) -> None:
    h = torch.randn(3, 1000).to(dtype)
    seed, step = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    cost = measure(lambda: dropout(h, seed, 1, step, 0.5))
    # the numba kernel (no dispatch mode sees it): h read, the output written, a seed and a step per row read
    assert cost.by_kernel["dropout (numba)"] == 2 * h.nbytes + 3 * 16
    assert cost.flops == 0


def test_the_fused_adam_reports_four_tensors_read_and_three_written() -> None:
    stack = TrialStack(torch.nn.Linear(5, 3), 4, "cpu")
    adam = PackedAdam(stack)
    for slot in range(4):
        adam.reset(slot, 1e-3, 1e-7)
    stack.flat_grad.normal_()
    cost = measure(adam.step)
    assert cost.by_kernel["adam (numba)"] == 7 * stack.flat.nbytes
    # the weight's bfloat16 copy written, and with its gradient read in bfloat16, 2 bytes an element where 4 were
    adam.bfloat16_copies(frozenset({"weight"}))
    copies = measure(lambda: adam.step(copies=True)).by_kernel["adam (numba)"]
    assert copies == 7 * stack.flat.nbytes + 2 * 4 * 15
    adam.bfloat16_gradients()
    assert measure(lambda: adam.step(copies=True, gradients=True)).by_kernel["adam (numba)"] == copies - 2 * 4 * 15


def test_the_cost_at_a_pack_size_is_extrapolated_exactly_from_packs_of_one_and_two() -> None:
    """What ``bench_packs.py --roofline`` relies on: every tensor of a training step is a trial's own or shared, so
    FLOPs, bytes and launches are linear in P."""
    costs = {}
    for size in (1, 2, 4):
        engine = engine_of(trials("comet", 0.5, size))
        data = [batches(p, 1)[0] for p in range(size)]
        batch = {key: torch.stack([d[key] for d in data]) for key in data[0]}
        engine.train_step(batch)
        costs[size] = measure(lambda: engine.train_step(batch))
    assert costs[1].launches == costs[4].launches and costs[4].bytes > costs[1].bytes > 0
    assert costs[1].extrapolated(costs[2], 3) == costs[4]


def test_the_projection_is_the_slower_of_arithmetic_and_traffic() -> None:
    assert projected_ms(H100_FLOPS["bf16"], 0, "bf16") == 1000.0  # a second of matrix work
    assert projected_ms(1, BANDWIDTH, "fp32") == 1000.0  # a second of traffic
    assert projected_ms(H100_FLOPS["tf32"] / 1000, BANDWIDTH / 10, "tf32") == 100.0
    # training: parameter, gradient and two moments read and written once, the batch read once, activations
    # written and read once; evaluation: parameters and batch read once
    assert floor_bytes(10, 7, 5, True) == 32 * 10 + 7 + 2 * 5
    assert floor_bytes(10, 7, 5, False) == 4 * 10 + 7


@pytest.mark.slow  # the real Book-Crossing files
@pytest.mark.integration  # the benchmark's own process
def test_the_benchmark_projects_a_trial_epoch_of_another_dataset(tmp_path) -> None:
    """``bench_packs.py --roofline --data books``: per precision, the trial-epoch line is the training step's
    projection times the training split's batches plus the evaluation batch's times the validation split's, over P;
    ``--data`` without ``--roofline`` is one error line, exit 2."""
    require_dataset("books")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_packs.py"
    run = subprocess.run([sys.executable, str(script), "--roofline", "--gates", "topk", "--packs", "2", "--data",
                          "books", "--trial-args=--data.batch_size=4096", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    fields = [dict(pair.split("=", 1) for pair in line.split()[1:]) for line in run.stdout.splitlines()
              if line.startswith(("roofline ", "trial-epoch "))]
    projected = {(f.get("phase", "epoch"), f["precision"]): float(f["projected_ms"]) for f in fields}
    rows = {"train": 389_706, "val": 83_509}  # Book-Crossing's training and validation rows, as the loader splits them
    train_batches, eval_batches = math.ceil(rows["train"] / 4096), math.ceil(rows["val"] / 4096)
    for precision in ("fp32", "tf32", "bf16"):
        expected = (projected["train", precision] * train_batches + projected["eval", precision] * eval_batches) / 2
        assert projected["epoch", precision] == pytest.approx(expected, rel=1e-3), precision
    refused = subprocess.run([sys.executable, str(script), "--data", "books"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith("--data is for --roofline")
