"""Training epoch time of one sparse gate per dataset (the paper's architecture and batch size for each, S1.2-S1.3).

    MTMOE_DATA=../shared/data python benchmarks/bench_datasets.py --data multimnist [--gate comet] [--device cpu]
    MTMOE_DATA=../shared/data python benchmarks/bench_datasets.py --data multimnist,multifashionmnist --batches 20

Each dataset runs in its own subprocess (peak memory is per dataset). Data preparation is done before timing. The
time is that of Lightning training epochs (batching by index, host-to-device copy of the uint8 batch, forward,
backward, Adam, metrics; validation off) on the last of ``--epochs`` epochs, the first warming up. With
``--batches N`` an epoch is cut to N steps and the full epoch is extrapolated as N-step time x steps per epoch
(marked "extrapolated"); without it the whole epoch is timed. Inference samples/s: eval-mode forward passes over
(at most ``--batches``) test batches of 1024. Prints a Markdown table and writes it, with a JSON copy, to
``benchmarks/out/datasets-<device>.md`` (``--out DIR``: to DIR).

Where the real files are not at hand, ``--root`` points at files written in the official formats (e.g. by
``tests/image_fixtures.py``), and ``--train-rows N`` extrapolates the epoch to the real training split's N rows
when the written split is smaller: a step's time depends on the batch's shape, not on the images' content or the
split's size (the split must hold at least ``--batches`` full batches).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

from mtmoe.files import write_atomic

OUT = Path(__file__).resolve().parent / "out"


def run_one(data_name: str, gate: str, epochs: int, batches: int | None, device: str, root: str | None,
            train_rows: int | None) -> dict:
    import importlib

    import lightning.pytorch as pl

    from mtmoe.data import DATASETS
    from mtmoe.gates import gate_class
    from mtmoe.lit.callbacks import EpochTimer
    from mtmoe.lit.module import MultiTaskMoE
    from mtmoe.pack.settings import ModelSettings

    module_name, class_name = DATASETS[data_name].rsplit(".", 1)
    data = getattr(importlib.import_module(module_name), class_name)(**({"root": root} if root else {}))
    data.setup()
    steps_per_epoch = math.ceil(train_rows / data.batch_size) if train_rows else len(data.train_dataloader())
    if batches and len(data.splits["train"]["sample_id"]) < batches * data.batch_size:
        raise SystemExit(f"{data_name}: the training split holds fewer than --batches {batches} full batches")
    pl.seed_everything(0, verbose=False)
    model = MultiTaskMoE.build(data.info, ModelSettings(gate=partial(gate_class(gate)), lr=1e-4))
    timer = EpochTimer()
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator=device, devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        limit_train_batches=batches or 1.0, callbacks=[timer],
    )
    trainer.fit(model, datamodule=data)
    steps = batches or steps_per_epoch
    step_s = timer.seconds[-1] / steps

    model.eval().to(device)
    test = data.splits["test"]
    n_test = len(test["sample_id"])
    n_eval = min(n_test, 1024 * (batches or n_test))
    eval_batches = [{k: v[i : i + 1024].to(device) for k, v in test.items()} for i in range(0, n_eval, 1024)]
    with torch.no_grad():
        model.net(eval_batches[0])
        start = time.perf_counter()
        for batch in eval_batches:
            model.net(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        inference_s = time.perf_counter() - start
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {
        "data": data_name, "gate": gate, "n_experts": data.info.n_experts, "k": data.info.k,
        "batch_size": data.batch_size, "train_rows": train_rows or len(data.splits["train"]["sample_id"]),
        "steps_per_epoch": steps_per_epoch, "timed_steps": steps, "extrapolated": batches is not None,
        "step_ms": 1e3 * step_s, "epoch_s": step_s * steps_per_epoch, "train_samples_per_s": data.batch_size / step_s,
        "inference_samples_per_s": n_eval / inference_s, "peak_memory_mib": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="multimnist,multifashionmnist,celeba,digits", help="comma-separated")
    parser.add_argument("--gate", default="comet", help="one registered sparse gate (default: comet)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=None, help="time N steps an epoch and extrapolate")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--root", default=None, help="data root (default: $MTMOE_DATA)")
    parser.add_argument("--train-rows", type=int, default=None, help="the real training split's size, when --root "
                        "holds a smaller one (with --batches)")
    parser.add_argument("--out", type=Path, default=OUT, help="folder of datasets-<device>.{md,json} "
                        "(default: benchmarks/out)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one dataset in this process
    args = parser.parse_args()
    if args.train_rows is not None and (args.train_rows < 1 or not args.batches or "," in (args.one or args.data)):
        parser.error("--train-rows N needs N >= 1, --batches and one dataset in --data")
    if args.one:
        print(json.dumps(run_one(args.one, args.gate, args.epochs, args.batches, args.device, args.root,
                                 args.train_rows)))
        return
    rows = []
    for name in args.data.split(","):
        command = [sys.executable, __file__, "--one", name, "--gate", args.gate, "--epochs", str(args.epochs),
                   "--device", args.device] + (["--batches", str(args.batches)] if args.batches else [])
        command += (["--root", args.root] if args.root else []) + (
            ["--train-rows", str(args.train_rows)] if args.train_rows else [])
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{name}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'failed'}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{name}: {rows[-1]['epoch_s']:.1f} s/epoch", file=sys.stderr)
    threads = torch.get_num_threads()
    machine = f"{platform.processor() or platform.machine()}, {threads} threads, torch {torch.__version__}"
    if args.device == "cuda":
        machine = torch.cuda.get_device_name()
    lines = [
        f"gate {args.gate}; {args.device} ({machine}); epochs {args.epochs}, the last timed"
        + (f"; {args.batches} steps an epoch, full epoch extrapolated" if args.batches else ""),
        "",
        "| dataset | n | k | batch | steps/epoch | step (ms) | epoch (s) | train samples/s | inference samples/s "
        "| peak memory (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        epoch = f"{r['epoch_s']:.1f}" + (" (extrapolated)" if r["extrapolated"] else "")
        rows_note = f" ({r['train_rows']:,} rows)" if args.train_rows else ""
        lines.append(
            f"| {r['data']}{rows_note} | {r['n_experts']} | {r['k']} | {r['batch_size']} | {r['steps_per_epoch']} "
            f"| {r['step_ms']:.1f} | {epoch} | {r['train_samples_per_s']:,.0f} | {r['inference_samples_per_s']:,.0f} "
            f"| {r['peak_memory_mib']:.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(table + "\n", args.out / f"datasets-{args.device}.md")
    write_atomic(json.dumps(rows, indent=2) + "\n", args.out / f"datasets-{args.device}.json")


if __name__ == "__main__":
    main()
