"""Does the matmul precision (or another way of computing the same model) change what a study concludes? The same
N planned configurations of a gate on MovieLens-100K trained as one pack in float32, as a variant of it, and in
float32 again under other seeds.

    MTMOE_DATA=../shared/data python benchmarks/bench_precision.py --gate comet --trials 32 --epochs 3 \\
        --train-batches 10 --val-batches 4 --variant bf16-mixed

Each configuration's objective is the study's (the validation loss at its early-stopping best epoch). Printed and
written to ``benchmarks/out/precision.{md,json}`` (``--out DIR``: to DIR): the largest and median difference between
float32 and the variant (same seeds), the seed-noise spread (the same differences between two seeds in float32),
the spread between configurations (standard deviation and range of the float32 objectives), and Spearman's rank
correlation of the objectives between float32 and the variant and between the seeds. ``--variant`` is one of
:data:`VARIANTS`: ``bf16-mixed`` (autocast; any device), ``high`` (``--model.matmul_precision high``: TF32 matmuls
on an Ampere or later GPU; see :mod:`mtmoe.pack.precision` for CPUs), ``fused-sums`` (``--model.fused_mixing_sums
true``: the mixing's sums in its kernels' order) or ``bf16-fused-sums`` (both).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

from bench_packs import OUT, factory, plan
from mtmoe.files import write_atomic
from mtmoe.pack.precision import matmul_precision

#: Each variant compared with float32: its ``--trainer.precision``, float32 matmul precision and further fit options.
VARIANTS = {"bf16-mixed": ("bf16-mixed", "highest", ()), "high": ("32", "high", ()),
            "fused-sums": ("32", "highest", ("--model.fused_mixing_sums=true",)),
            "bf16-fused-sums": ("bf16-mixed", "highest", ("--model.fused_mixing_sums=true",))}


def objectives(gate: str, trials: int, epochs: int, train_batches: int, val_batches: int, device: str,
               precision: str, matmuls: str, extra: tuple[str, ...], seed: int) -> tuple[list[float], float]:
    """The best validation loss of each planned configuration (``nan`` where a trial diverged), all trained as one
    pack; and the seconds it took."""
    import lightning.pytorch as pl

    from mtmoe.lit.module import PackModule

    configurations = plan(gate, trials, epochs)
    trials_factory = factory(gate, configurations[0], device, precision, extra)
    queue = [trials_factory.build(i, params, seed + i) for i, params in enumerate(configurations)]
    data = trials_factory.run.datamodule
    data.prepare_data()
    data.setup("fit")
    found = [float("nan")] * trials

    def finished(result) -> None:
        if result.diverged is None:
            found[result.key] = result.results["best_val_loss"]

    module = PackModule(data.info, data.splits, data.batch_size, data.eval_batch_size, trials,
                        lambda: queue.pop(0) if queue else None, finished)
    trainer = pl.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, precision=precision,
                         max_epochs=-1, limit_train_batches=train_batches, limit_val_batches=val_batches,
                         limit_test_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    start = time.perf_counter()
    with matmul_precision(matmuls):
        trainer.fit(module)
    return found, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gate", default="comet")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-batches", type=int, default=10)
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--variant", default="bf16-mixed", choices=list(VARIANTS),
                        help="what float32 is compared with (default bf16-mixed)")
    parser.add_argument("--trial-args", default="", help="fit options of every trial in every run, space-separated "
                        "(--trial-args='--model.n_experts=4'; gpu_check.py's dry run: tiny trials)")
    parser.add_argument("--out", type=Path, default=OUT, help="folder of precision.{md,json} (default: benchmarks/out)")
    args = parser.parse_args()
    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"CPU {platform.machine()}, {torch.get_num_threads()} threads")
    common = (args.gate, args.trials, args.epochs, args.train_batches, args.val_batches, args.device)
    trial_args = tuple(args.trial_args.split())
    precision, matmuls, variant_args = VARIANTS[args.variant]
    runs = {"fp32": objectives(*common, "32", "highest", trial_args, 0),
            args.variant: objectives(*common, precision, matmuls, (*trial_args, *variant_args), 0),
            "fp32, other seeds": objectives(*common, "32", "highest", trial_args, 10_000)}
    fp32, variant, reseeded = (runs[name][0] for name in runs)
    kept = [i for i in range(args.trials) if all(v[i] == v[i] for v in (fp32, variant, reseeded))]  # none diverged
    differences = [abs(fp32[i] - variant[i]) for i in kept]
    seeds = [abs(fp32[i] - reseeded[i]) for i in kept]
    values = [fp32[i] for i in kept]
    summary = {
        "where": where, "torch": torch.__version__, "settings": {**vars(args), "out": str(args.out)},
        "configurations": len(kept),
        "seconds": {name: run[1] for name, run in runs.items()},
        "variant_max": max(differences), "variant_median": statistics.median(differences),
        "seed_max": max(seeds), "seed_median": statistics.median(seeds),
        "configs_std": statistics.stdev(values), "configs_range": max(values) - min(values),
        "spearman_variant": spearmanr([fp32[i] for i in kept], [variant[i] for i in kept]).statistic,
        "spearman_seeds": spearmanr([fp32[i] for i in kept], [reseeded[i] for i in kept]).statistic,
        "objectives": {name: run[0] for name, run in runs.items()},
    }
    table = [f"{args.gate}, {len(kept)} of {args.trials} configurations (none diverged in any run), {args.epochs} "
             f"epochs of {args.train_batches} batches, {args.val_batches} validation batches; {where}, torch "
             f"{torch.__version__}", "",
             "| comparison | largest difference | median difference | Spearman |",
             "|---|---|---|---|",
             f"| fp32 vs {args.variant} (same seeds) | {summary['variant_max']:.2e} | "
             f"{summary['variant_median']:.2e} | {summary['spearman_variant']:.4f} |",
             f"| fp32 seed vs fp32 other seed | {summary['seed_max']:.2e} | {summary['seed_median']:.2e} | "
             f"{summary['spearman_seeds']:.4f} |", "",
             f"Spread between configurations (fp32): standard deviation {summary['configs_std']:.3e}, range "
             f"{summary['configs_range']:.3e}. Seconds per run: "
             + ", ".join(f"{name} {seconds:.0f}" for name, seconds in summary["seconds"].items())]
    print(*table, sep="\n", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic("\n".join(table) + "\n", args.out / "precision.md")
    write_atomic(json.dumps(summary, indent=2) + "\n", args.out / "precision.json")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
