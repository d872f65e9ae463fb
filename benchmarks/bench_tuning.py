"""Tuning throughput on MovieLens-100K: trials per hour with 1 and 2 workers, and the time a 500-trial study per gate
would take at the paper's settings (extrapolated, not measured).

    MTMOE_DATA=../shared/data python benchmarks/bench_tuning.py                       # 16 trials, 1 and 2 workers
    MTMOE_DATA=../shared/data python benchmarks/bench_tuning.py --trials 2 --gates topk --epochs 2   # a smoke run
    MTMOE_DATA=../shared/data python benchmarks/bench_tuning.py --storage postgresql+psycopg2://u@host/db -- \\
        --trainer.max_epochs=2                                                      # per-trial budget after "--"

1. **Trials per hour (measured).** ``python -m mtmoe tune --gate GATE --data movielens-100k --trials N --workers W``
   for each W of ``--workers``, on a fresh study in a JournalStorage file (default; several processes, no server)
   or ``--storage URL``. Each trial gets the per-trial budget given after ``--`` (default
   ``--trainer.max_epochs=1``; full data, the search space's batch size 512), so this measures the tuning
   machinery plus short trainings, not the paper's trials. The data cache is built before anything is timed. Two
   rates: end to end (the whole command: process start, planning, worker start-up) and within the study (first
   trial start to last trial end). One worker uses torch's default threads; W > 1 workers get cores / W each.
2. **500-trial study per gate (extrapolated).** Per gate, one configuration of its search space (seed 0) trains
   ``--epochs`` epochs at the paper's settings (batch 512, 16 experts) in its own process; the mean time of a
   training epoch with its validation (after the first epoch) and the fixed cost of a trial (building the data
   and model, testing) are measured. Then::

       T_trial(E) = fixed + E * epoch        T_study = 500 * T_trial(E) / workers

   with E the number of epochs a trial runs, which cannot be measured without running the study: early stopping
   with patience 25 and at most 100 epochs puts it in [26, 100]. Both ends are printed; 100 is an upper bound. For
   "+" gates the timed epochs are inside the permutation window (E_perm = --epochs), the costlier phase, so their
   figure is an upper bound too. Workers are assumed to scale linearly (check against part 1).
   ``--limit-batches N`` cuts each timed epoch (and the test) to N batches: a smoke run of the script, whose hours
   are then not the paper's (the table says so).

Prints Markdown tables and writes them with a JSON copy to ``benchmarks/out/tuning.{md,json}`` (``--out DIR``: to
DIR).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mtmoe.files import write_atomic
from mtmoe.gate_names import split_gate_name

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "out"
PAPER_TRIALS, MAX_EPOCHS, PATIENCE = 500, 100, 25


def throughput(gate: str, trials: int, workers: int, storage: str | None, overrides: list[str], scratch: Path,
               data_root: str | None) -> dict:
    """Run one fresh study with ``workers`` workers; its trials per hour."""
    import optuna

    name = f"bench-tuning/{gate}/w{workers}/{int(time.time())}"
    url = storage or f"journal:{scratch / f'w{workers}.log'}"
    command = [sys.executable, "-m", "mtmoe", "tune", "--gate", gate, "--data", "movielens-100k", "--trials",
               str(trials), "--workers", str(workers), "--storage", url, "--study-name", name, "--log-dir",
               str(scratch / "runs"), *([f"--data.root={data_root}"] if data_root else []), *overrides]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"tune failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    from mtmoe.tuning.storage import storage_for

    done = [t for t in optuna.load_study(study_name=name, storage=storage_for(url)).get_trials(deepcopy=False)
            if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL) and t.datetime_complete]
    span = (max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)).total_seconds()
    return {
        "gate": gate, "workers": workers, "trials": len(done), "wall_s": wall, "study_span_s": span,
        "trials_per_hour_end_to_end": 3600 * len(done) / wall,
        "trials_per_hour_in_study": 3600 * len(done) / span if span > 0 else float("nan"),
        "mean_trial_s": sum(t.user_attrs.get("wall_time_s", 0) for t in done) / max(1, len(done)),
    }


def warm_data_cache(gate: str, data_root: str | None) -> None:
    """Prepare MovieLens-100K's cached splits once, so that no timed study pays for it in its first trial."""
    from mtmoe.run import build_run
    from mtmoe.tuning.space import load_space
    from mtmoe.tuning.objective import cli_args, plan_configurations
    from mtmoe.tuning.study import quiet_libraries

    quiet_libraries()
    space = load_space("movielens-100k", gate)
    with tempfile.TemporaryDirectory() as scratch:
        run = build_run(cli_args(space, plan_configurations(space, 1, 0)[0],
                                 [f"--data.root={data_root}"] if data_root else [], 0, Path(scratch)))
        run.datamodule.prepare_data()
        run.datamodule.setup("fit")


def epoch_cost(gate: str, epochs: int, data_root: str | None, limit: int | None = None) -> dict:
    """In this process: one configuration of the gate's space at the paper's settings, ``epochs`` epochs, timed."""
    from mtmoe.lit.callbacks import EpochTimer  # an epoch ends after its validation
    from mtmoe.run import build_run
    from mtmoe.tuning.space import load_space
    from mtmoe.tuning.objective import cli_args, plan_configurations
    from mtmoe.tuning.study import quiet_libraries

    quiet_libraries()
    space = load_space("movielens-100k", gate)
    params = plan_configurations(space, 1, 0)[0]
    overrides = [f"--trainer.max_epochs={epochs}", "--early_stopping.patience=1000"]
    overrides += [f"--model.perm_epochs={epochs}"] if split_gate_name(gate)[1] else []
    overrides += [f"--data.root={data_root}"] if data_root else []
    overrides += [f"--trainer.limit_{split}_batches={limit}" for split in ("train", "val", "test")] if limit else []
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        run = build_run(cli_args(space, params, overrides, 0, Path(scratch)))
        timer = EpochTimer()
        run.trainer.callbacks.append(timer)
        run.fit()
        total = time.perf_counter() - start
    timed = timer.seconds[1:] or timer.seconds
    epoch = sum(timed) / len(timed)
    return {"gate": gate, "epochs": len(timer.seconds), "epoch_s": epoch, "first_epoch_s": timer.seconds[0],
            "trial_s": total, "fixed_s": max(0.0, total - sum(timer.seconds)),
            "train_rows": len(run.datamodule.splits["train"]["user"]) if hasattr(run.datamodule, "splits") else None}


def study_hours(row: dict, epochs: int, workers: int) -> float:
    return PAPER_TRIALS * (row["fixed_s"] + epochs * row["epoch_s"]) / workers / 3600


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=16, help="trials per throughput study")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--gate", default="topk", help="gate of the throughput studies")
    parser.add_argument("--gates", default=None, help="gates to extrapolate (default: all, with their '+' variants)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs timed per gate for the extrapolation")
    parser.add_argument("--limit-batches", type=int, default=None, help="extrapolation: cut each timed epoch and the "
                        "test to N batches (a smoke run; the hours are then not the paper's)")
    parser.add_argument("--storage", default=None, help="RDB URL (default: a JournalStorage file per study)")
    parser.add_argument("--data-root", default=None, help="default: $MTMOE_DATA")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-extrapolation", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT, help="folder of tuning.{md,json} (default: benchmarks/out)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: time one gate in this process
    parser.add_argument("--warm", help=argparse.SUPPRESS)  # internal: build the data cache
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"] or ["--trainer.max_epochs=1"]
    if args.one:
        print(json.dumps(epoch_cost(args.one, args.epochs, args.data_root, args.limit_batches)))
        return
    if args.warm:
        warm_data_cache(args.warm, args.data_root)
        return
    import torch

    from mtmoe.gates import gate_variants

    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
               f"load average {os.getloadavg()[0]:.1f} at start")
    report: dict = {"machine": machine, "throughput": [], "extrapolation": []}
    lines = [f"Machine: {machine}.", ""]
    subprocess.run([sys.executable, __file__, "--warm", args.gate,
                    *(["--data-root", args.data_root] if args.data_root else [])], cwd=ROOT, check=True,
                   capture_output=True)
    if not args.skip_throughput:
        with tempfile.TemporaryDirectory() as scratch:
            for workers in (int(w) for w in args.workers.split(",")):
                row = throughput(args.gate, args.trials, workers, args.storage, overrides, Path(scratch), args.data_root)
                report["throughput"].append(row)
                print(f"{workers} worker(s): {row['trials_per_hour_in_study']:.0f} trials/h in the study", file=sys.stderr)
        lines += [
            f"### Trials per hour (measured): MovieLens-100K, gate {args.gate}, {args.trials} trials, per-trial budget "
            f"`{' '.join(overrides)}`, storage {args.storage or 'JournalStorage file'}",
            "",
            "| workers | trials | wall (s) | trials/h end to end | trials/h in the study | mean trial (s) |",
            "|---|---|---|---|---|---|",
        ]
        for r in report["throughput"]:
            lines.append(f"| {r['workers']} | {r['trials']} | {r['wall_s']:.1f} | {r['trials_per_hour_end_to_end']:.0f} "
                         f"| {r['trials_per_hour_in_study']:.0f} | {r['mean_trial_s']:.1f} |")
        lines.append("")
    if not args.skip_extrapolation:
        gates = args.gates.split(",") if args.gates else gate_variants()  # a "+" only where the gate has one
        for gate in gates:
            proc = subprocess.run([sys.executable, __file__, "--one", gate, "--epochs", str(args.epochs),
                                   *(["--limit-batches", str(args.limit_batches)] if args.limit_batches else []),
                                   *(["--data-root", args.data_root] if args.data_root else [])],
                                  cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{gate}: timing failed:\n{proc.stderr[-4000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            report["extrapolation"].append(row)
            print(f"{gate}: {row['epoch_s']:.2f} s/epoch, {row['fixed_s']:.1f} s fixed", file=sys.stderr)
        low = PATIENCE + 1
        lines += [
            f"### A {PAPER_TRIALS}-trial study per gate: EXTRAPOLATED, not measured",
            "",
            f"`T_study = {PAPER_TRIALS} * (fixed + E * epoch) / workers`; epoch = one training epoch with its validation "
            f"at the paper's settings (batch 512, 16 experts), mean of epochs 2..{args.epochs}; fixed = data, model, "
            f"test. E = epochs a trial runs: unknown without running the study; early stopping (patience {PATIENCE}, "
            f"at most {MAX_EPOCHS} epochs) puts it in [{low}, {MAX_EPOCHS}], {MAX_EPOCHS} an upper bound. '+' gates: "
            "epochs timed inside the permutation window (upper bound). Linear scaling in workers assumed."
            + (f" A smoke run: epochs and test cut to {args.limit_batches} batches (--limit-batches), so these are not "
               "the paper's hours." if args.limit_batches else ""),
            "",
            f"| gate | epoch (s) | fixed (s) | 1 worker, E={low} (h) | 1 worker, E={MAX_EPOCHS} (h) "
            f"| 2 workers, E={low} (h) | 2 workers, E={MAX_EPOCHS} (h) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in report["extrapolation"]:
            r["study_hours"] = {f"{w}w_E{e}": study_hours(r, e, w) for w in (1, 2) for e in (low, MAX_EPOCHS)}
            h = r["study_hours"]
            lines.append(f"| {r['gate']} | {r['epoch_s']:.2f} | {r['fixed_s']:.1f} | {h[f'1w_E{low}']:.1f} "
                         f"| {h[f'1w_E{MAX_EPOCHS}']:.1f} | {h[f'2w_E{low}']:.1f} | {h[f'2w_E{MAX_EPOCHS}']:.1f} |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(table + "\n", args.out / "tuning.md")
    write_atomic(json.dumps(report, indent=2, default=str) + "\n", args.out / "tuning.json")


if __name__ == "__main__":
    main()
