"""Rerun the design of the COMET paper's Table 1 (Section 4.4) on MovieLens-100K: each gate with and without
permutation local search, over many random initialisations.

    MTMOE_DATA=../shared/data python studies/ablation_local_search.py --seeds 10 [--workers 4]

Protocol (Section 4.4; comet-protocol.md §3.11): the S1.2 MovieLens architecture with 16 experts, k = 2, 10 epochs
at batch 512 and learning rate 2.5e-5 (Adam), the "+" variants learning the permutation for the first 5 epochs with
zeta = 1e-5, COMET with gamma = 0.01 and lambda = 1; the test loss of the model after the last epoch (the paper
trains for a fixed 10 epochs; no early stopping). The paper used a 200k-row subsample of MovieLens-1M; MovieLens-100K
with its sampled negatives has 200k rows too. The paper does not state alpha; it is a flag (default 0.9).

Seed s initialises base and "+" models identically apart from the permutation (the run seed also draws the Hash-r
table). Results go to ``<out>/runs.csv`` one row per finished run, so an interrupted study resumes where it stopped
and ``--seeds`` can be raised later. ``--workers N`` trains N runs at a time in separate processes (on one GPU, or
splitting the CPU's cores between them; ``--threads`` sets torch's threads per worker); the parent alone writes
``runs.csv``. Ctrl-C or SIGTERM stops the workers and keeps the finished runs. The table reports mean +- standard
error (x 1e-2, as Table 1) and the one-sided unpaired Welch t-test of "+" < base
(``scipy.stats.ttest_ind(..., alternative="less", equal_var=False)``).
"""
from __future__ import annotations

import argparse
import csv
import math
import multiprocessing
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path

from mtmoe import interrupts
from mtmoe.files import write_atomic
from mtmoe.gate_names import plus_variant, split_gate_name

PAPER_TABLE_1 = {  # test loss x 1e-2, mean +- SE over 100 initialisations (MovieLens 200k)
    "hash": "57.434 ± 0.025", "hash+": "*57.000 ± 0.037",
    "topk": "53.345 ± 0.033", "topk+": "*53.140 ± 0.031",
    "comet": "52.034 ± 0.007", "comet+": "*52.017 ± 0.005",
}
FIELDS = ["gate", "seed", "test_loss", "watch_auroc", "rating_mse", "experts_per_sample", "seconds"]


_WORKER_DATA = None  # the DataModule of a worker process, loaded once by ``_init_worker``


def _init_worker(root: str | None, threads: int) -> None:
    global _WORKER_DATA
    import logging

    import torch

    from mtmoe.data import MovieLens100KDataModule

    torch.set_num_threads(threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one progress line per run, from the parent
    _WORKER_DATA = MovieLens100KDataModule(root=root, batch_size=512)
    _WORKER_DATA.setup()


def _train_in_worker(job: tuple[str, int, argparse.Namespace]) -> dict:
    return train_one(_WORKER_DATA, *job)


def train_one(data, gate: str, seed: int, args: argparse.Namespace) -> dict:
    import lightning.pytorch as pl

    from mtmoe.gates import gate_class
    from mtmoe.lit.module import MultiTaskMoE
    from mtmoe.pack.settings import ModelSettings

    base, plus = split_gate_name(gate)
    hparams = {"gamma": 0.01, "entropy_reg": 1.0} if base == "comet" else {}
    if base in ("topk", "comet"):
        hparams["k"] = 2
    pl.seed_everything(seed, verbose=False)
    settings = ModelSettings(gate=partial(gate_class(base), **hparams), lr=args.lr, alpha=args.alpha,
                             perm_epochs=args.perm_epochs if plus else None, zeta=args.zeta)
    model = MultiTaskMoE.build(data.info, settings)
    trainer = pl.Trainer(
        max_epochs=args.epochs, accelerator=args.accelerator, devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    trainer.test(model, datamodule=data, verbose=False)
    test = model.last_results["test"]
    return {
        "gate": gate, "seed": seed, "test_loss": test["loss"], "watch_auroc": test["watch/auroc"],
        "rating_mse": test["rating/mse"], "experts_per_sample": test["watch/experts_per_sample"],
        "seconds": round(time.perf_counter() - start, 1),
    }


def summarise(rows: list[dict], gates: list[str]) -> str:
    from scipy.stats import ttest_ind

    lines = [
        "| gate | runs | test loss (x1e-2), mean ± SE | one-sided p (+ < base) | paper Table 1 |",
        "|---|---|---|---|---|",
    ]
    for gate in gates:
        for variant in (gate, plus_variant(gate)):
            losses = [100 * r["test_loss"] for r in rows if r["gate"] == variant]
            if not losses:
                continue
            mean = sum(losses) / len(losses)
            se = (
                math.sqrt(sum((x - mean) ** 2 for x in losses) / (len(losses) - 1) / len(losses))
                if len(losses) > 1
                else float("nan")
            )
            p_cell = ""
            base_losses = [100 * r["test_loss"] for r in rows if r["gate"] == gate]
            if split_gate_name(variant)[1] and len(losses) > 1 and len(base_losses) > 1:
                p = ttest_ind(losses, base_losses, alternative="less", equal_var=False).pvalue
                p_cell = f"{p:.3g}" + (" *" if p < 0.05 else "")
            lines.append(f"| {variant} | {len(losses)} | {mean:.3f} ± {se:.3f} | {p_cell} | {PAPER_TABLE_1[variant]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="random initialisations per variant (paper: 100)")
    parser.add_argument("--gates", default="hash,topk,comet")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--perm-epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=2.5e-5)
    parser.add_argument("--zeta", type=float, default=1e-5)
    parser.add_argument("--alpha", type=float, default=0.9)
    parser.add_argument("--root", default=None, help="data root (default: $MTMOE_DATA, else ~/.cache/mtmoe/data)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--workers", type=int, default=1, help="runs trained at a time, each in its own process")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    parser.add_argument("--out", default="studies/out/ablation_local_search", help="folder for runs.csv and table.md")
    args = parser.parse_args()
    if args.seeds < 1 or args.workers < 1 or (args.threads is not None and args.threads < 1) \
            or args.perm_epochs > args.epochs:
        print("error: need --seeds >= 1, --workers >= 1, --threads >= 1 and --perm-epochs <= --epochs",
              file=sys.stderr)
        sys.exit(2)

    from mtmoe.data import MovieLens100KDataModule
    from mtmoe.errors import UsageError

    gates = args.gates.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs_csv = out / "runs.csv"
    rows = []
    if runs_csv.exists():
        with open(runs_csv) as handle:
            rows = [{**r, "seed": int(r["seed"]), "test_loss": float(r["test_loss"])} for r in csv.DictReader(handle)]
    done = {(r["gate"], r["seed"]) for r in rows}
    todo = [(g + s, seed) for seed in range(args.seeds) for g in gates for s in ("", "+") if (g + s, seed) not in done]
    try:
        MovieLens100KDataModule(root=args.root, batch_size=512).prepare_data()  # once, before any worker reads it
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 1) // args.workers)
    start = time.perf_counter()
    pool = multiprocessing.get_context("spawn").Pool(args.workers, _init_worker, (args.root, threads))
    interrupts.handle_interrupts()  # ``kill`` stops the workers too, as Ctrl-C does
    try:
        jobs = pool.imap_unordered(_train_in_worker, [(gate, seed, args) for gate, seed in todo])
        for i, row in enumerate(jobs, 1):
            rows.append(row)
            new_file = not runs_csv.exists()
            stops = {signal.SIGINT, signal.SIGTERM}
            signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # a stop waits until the row is whole
            try:
                with open(runs_csv, "a", newline="") as handle:
                    writer = csv.DictWriter(handle, fieldnames=FIELDS)
                    if new_file:
                        writer.writeheader()
                    writer.writerow(row)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
            eta = (time.perf_counter() - start) / i * (len(todo) - i)
            print(f"[{i}/{len(todo)}] {row['gate']} seed {row['seed']}: test loss {row['test_loss']:.4f} "
                  f"({row['seconds']} s; ETA {eta / 60:.1f} min)", flush=True)
    except KeyboardInterrupt:
        pool.terminate()  # runs in progress are lost; finished ones are in runs.csv
        print(f"interrupted: {len(rows)} runs kept in {runs_csv}; rerun the same command to resume", file=sys.stderr)
        sys.exit(interrupts.exit_code())  # 143 for SIGTERM, 130 for Ctrl-C
    pool.close()
    pool.join()
    table = summarise(rows, gates)
    header = (
        f"MovieLens-100K, {args.epochs} epochs ({args.perm_epochs} of permutation learning), batch 512, "
        f"lr {args.lr}, zeta {args.zeta}, alpha {args.alpha}, k = 2, COMET gamma 0.01 / lambda 1"
    )
    print(header + "\n\n" + table)
    write_atomic(header + "\n\n" + table + "\n", out / "table.md")


if __name__ == "__main__":
    main()
