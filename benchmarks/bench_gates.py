"""Per-gate throughput on a dataset (default MovieLens-100K): training samples/s, epoch time, inference samples/s,
peak memory, and the ratio of a training step to its floor (the bare expert matmuls of the same batch, forward
and backward).

    MTMOE_DATA=../shared/data python benchmarks/bench_gates.py [--gates comet,comet+] [--epochs 2] [--device cpu]
    MTMOE_DATA=../shared/data python benchmarks/bench_gates.py --data books --gates comet   # batch 2048 (S1.3)

``--data`` takes any registered dataset (``python -m mtmoe datasets``), at the paper's architecture and batch size
for it (``--batch-size`` overrides); ``--limit-batches N`` times the first N steps of each epoch only (a short run on
a slow machine) and reports the epoch time extrapolated to the full epoch, marked as such.

Each gate runs in its own subprocess (so peak RSS is per gate). The epoch time is a full Lightning training epoch
(data batching, forward, backward, Adam, metrics, logging), measured on the last of ``--epochs`` epochs (the first
warms up); validation is switched off while timing. A name ending in "+" times the local-search variant with the
permutation window covering every timed epoch (E_perm = --epochs), i.e. the Sinkhorn phase, the costly one; after
the window a "+" step is the base gate's step with a cached matrix. Prints a Markdown table and writes it with a
JSON copy to ``benchmarks/out/`` (``--out DIR``: to DIR).
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

from mtmoe.files import write_atomic
from mtmoe.gate_names import split_gate_name

OUT = Path(__file__).resolve().parent / "out"


def floor_step_seconds(batch_size: int, in_features: int, units: int, n_experts: int, device: str) -> float:
    """Median time of the expert layer's matmuls alone: forward and backward of Linear(p, n*units) on one batch."""
    x = torch.randn(batch_size, in_features, device=device, requires_grad=True)
    layer = torch.nn.Linear(in_features, n_experts * units).to(device)
    grad = torch.randn(batch_size, n_experts * units, device=device)
    times = []
    for i in range(40):
        start = time.perf_counter()
        layer(x).backward(grad)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 10:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run_one(gate: str, epochs: int, device: str, data_name: str, batch_size: int | None, limit: int | None) -> dict:
    import importlib

    import lightning.pytorch as pl

    from mtmoe.data import DATASETS
    from mtmoe.gates import parse_gate_name
    from mtmoe.lit.callbacks import EpochTimer
    from mtmoe.lit.module import MultiTaskMoE
    from mtmoe.pack.settings import ModelSettings

    pl.seed_everything(0, verbose=False)
    module_name, class_name = DATASETS[data_name].rsplit(".", 1)
    data_class = getattr(importlib.import_module(module_name), class_name)
    data = data_class(**({} if batch_size is None else {"batch_size": batch_size}))
    data.setup()
    model = MultiTaskMoE.build(data.info, ModelSettings(gate=partial(parse_gate_name(gate)[0]), lr=1e-4,
                                                        perm_epochs=epochs if parse_gate_name(gate)[1] else None))
    timer = EpochTimer()
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator=device, devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[timer],
        limit_train_batches=limit,
    )
    trainer.fit(model, datamodule=data)
    train_rows = len(data.splits["train"]["user"])
    steps = len(data.train_dataloader())
    timed_steps = min(limit or steps, steps)
    epoch_s = timer.seconds[-1] * steps / timed_steps  # extrapolated to the full epoch when limited

    model.eval().to(device)
    test = data.splits["test"]
    batches = [{k: v[i : i + 4096].to(device) for k, v in test.items()} for i in range(0, len(test["user"]), 4096)]
    with torch.no_grad():
        model.net(batches[0])
        start = time.perf_counter()
        for _ in range(3):
            for batch in batches:
                model.net(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        inference_s = (time.perf_counter() - start) / 3
    experts = model.net.experts
    floor = floor_step_seconds(data.batch_size, experts.in_features, experts.units, experts.n_experts, device)
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {
        "gate": gate,
        "dataset": data.info.name,
        "batch_size": data.batch_size,
        "timed_steps": timed_steps,
        "steps": steps,
        "train_rows": train_rows,
        "epoch_s": epoch_s,
        "train_samples_per_s": train_rows / epoch_s,
        "inference_samples_per_s": len(test["user"]) / inference_s,
        "peak_memory_mib": peak,
        "step_ms": 1e3 * epoch_s / steps,
        "floor_ms": 1e3 * floor,
        "step_over_floor": epoch_s / steps / floor,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gates", default=None, help="comma-separated gate names (default: every registered gate, "
                        "each with its '+' where it has one)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--data", default="movielens-100k", help="a registered dataset (default: movielens-100k)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the paper's for the dataset")
    parser.add_argument("--limit-batches", type=int, default=None, help="time only the first N steps of each epoch")
    parser.add_argument("--out", type=Path, default=OUT, help="folder of gates-*.{md,json} (default: benchmarks/out)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one gate in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.epochs, args.device, args.data, args.batch_size, args.limit_batches)))
        return
    from mtmoe.data import DATASETS
    from mtmoe.gates import gate_variants

    if args.data not in DATASETS:
        parser.error(f"unknown dataset {args.data!r}; valid datasets: {', '.join(sorted(DATASETS))}")
    options = ["--epochs", str(args.epochs), "--device", args.device, "--data", args.data]
    options += [] if args.batch_size is None else ["--batch-size", str(args.batch_size)]
    options += [] if args.limit_batches is None else ["--limit-batches", str(args.limit_batches)]

    gates = args.gates.split(",") if args.gates else gate_variants()  # a "+" only where the gate has one
    rows = []
    for gate in gates:
        proc = subprocess.run(
            [sys.executable, __file__, "--one", gate, *options],
            capture_output=True, text=True, check=True,
        )
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{gate}: {rows[-1]['epoch_s']:.2f} s/epoch", file=sys.stderr)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    if args.device == "cuda":
        machine = torch.cuda.get_device_name()
    first = rows[0]
    timed = ("" if first["timed_steps"] == first["steps"] else
             f"; epoch times extrapolated from the first {first['timed_steps']} of {first['steps']} steps")
    lines = [
        f"{first['dataset']}, batch {first['batch_size']}, {first['train_rows']:,} training rows; {args.device} "
        f"({machine}){timed}",
        "",
        "| gate | epoch (s) | train samples/s | inference samples/s | peak memory (MiB) | step (ms) "
        "| floor (ms) | step / floor | step / base gate's step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    step_of = {r["gate"]: r["step_ms"] for r in rows}
    for r in rows:
        base, plus = split_gate_name(r["gate"])
        lines.append(
            f"| {r['gate']} | {r['epoch_s']:.2f} | {r['train_samples_per_s']:,.0f} | {r['inference_samples_per_s']:,.0f}"
            f" | {r['peak_memory_mib']:.0f} | {r['step_ms']:.1f} | {r['floor_ms']:.1f} | {r['step_over_floor']:.2f} | "
            + (f"{r['step_ms'] / step_of[base]:.3f} |" if plus and base in step_of else "|")
        )
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gates-{args.device}" if args.data == "movielens-100k" else f"gates-{args.data}-{args.device}"
    write_atomic(table + "\n", args.out / f"{stem}.md")
    write_atomic(json.dumps(rows, indent=2) + "\n", args.out / f"{stem}.json")


if __name__ == "__main__":
    main()
