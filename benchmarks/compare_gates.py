"""Every gate on one dataset with one training budget: test loss, per-task test metrics, n/s and inference FLOPs
per sample (the COMET paper's Table 6 convention), written as CSV and as a Markdown table.

    MTMOE_DATA=../shared/data python benchmarks/compare_gates.py --data movielens-100k
    MTMOE_DATA=../shared/data python benchmarks/compare_gates.py --data movielens-100k --gates topk,usmoe --epochs 1
    python benchmarks/compare_gates.py --data movielens-100k --accelerator gpu

Budget (the same for every gate, stated in the table's header): ``--epochs`` epochs of Adam at ``--lr`` on batches of
``--batch-size`` (evaluation batches of the same size), the paper's architecture for the dataset, each gate's
default hyperparameters (their papers' recommendations) and seed ``--seed``. The best-validation epoch's weights are
restored (Keras' ``restore_best_weights``, as ``fit`` does; no early stopping), then tested. A "+" variant learns
its permutation during the first ``--perm-epochs`` epochs (default: min(5, epochs), Table 1's E_perm = 5).
``--train-batches`` cuts every epoch short, for smoke runs only.

The CSV also has each task gate's per-expert utilisation (mean weight) and selection rate on the test split.

Columns: test loss (the ``test/loss`` of ``fit``, ×10⁻² as the paper's tables), the per-task test metrics (AUC and
accuracy ×100, MSE as is), n/s (experts with non-zero weight per sample, mean over the task gates), the fraction of
samples that a batch-level router left with no expert, training seconds per epoch, and two FLOP counts per test
sample from ``torch.utils.flop_counter.FlopCounterMode`` over the model's eval forward pass on the test split:

* ``forward FLOPs``: what this implementation executes: every expert densely, the gates, the mixing, the towers;
* ``inference FLOPs`` (Table 6): the same count with the experts' share scaled to the (sample, expert) pairs an
  inference path that skips zero-weight experts would evaluate; an expert runs for a sample when at least one task
  gate gives it a non-zero weight (the experts are shared by the tasks).

The CSV also has each task gate's per-expert utilisation (``<task> utilisation``: its mean test weight per expert).

Batch-dependent routers (Expert Choice, USMoE) are evaluated with their default policy, over the test batches as
the loader cuts them (a fixed, seeded permutation; the last batch partial). Every gate runs in this process, one
after another; ``--accelerator gpu`` runs the same code on one GPU.
"""
from __future__ import annotations

import argparse
import importlib
import platform
import sys
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtmoe.data import DATASETS  # noqa: E402
from mtmoe.errors import UsageError  # noqa: E402
from mtmoe.files import write_atomic, write_csv_atomic  # noqa: E402
from mtmoe.gates import PLUS_PERM_EPOCHS, list_gates, parse_gate_name  # noqa: E402
from mtmoe.lit.callbacks import EpochTimer  # noqa: E402
from mtmoe.tuning.trials import TASK_METRICS  # noqa: E402
from mtmoe.lit.module import MultiTaskMoE  # noqa: E402
from mtmoe.pack.settings import ModelSettings

OUT = Path(__file__).resolve().parent / "out"


def datamodule(args: argparse.Namespace):
    module_name, class_name = DATASETS[args.data].rsplit(".", 1)
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(batch_size=args.batch_size, **({"root": args.root} if args.root else {}))


@torch.no_grad()
def count_flops(model: MultiTaskMoE, batches) -> dict[str, float]:
    """Forward and Table-6 inference FLOPs per sample over ``batches`` (eval mode, the model's device)."""
    net = model.net.eval()
    device = next(net.parameters()).device
    rows = evaluated_pairs = total = experts = 0
    for batch in batches:
        batch = {key: value.to(device) for key, value in batch.items()}
        with FlopCounterMode(display=False) as counter:  # a mode counts from zero each time it is entered
            output = net(batch)
        total += counter.get_total_flops()
        with FlopCounterMode(display=False) as counter:  # the expert layer alone (the forward may fuse it)
            net.experts(net.bottom(batch))
        experts += counter.get_total_flops()
        active = torch.stack([g.weights != 0 for g in output.gates]).any(dim=0)  # [B, n]: experts to run
        evaluated_pairs += int(active.sum())
        rows += active.shape[0]
    evaluated = evaluated_pairs / (rows * net.experts.n_experts)
    return {"forward_flops": total / rows, "inference_flops": (total - experts * (1 - evaluated)) / rows}


def run_gate(gate: str, args: argparse.Namespace) -> dict:
    pl.seed_everything(args.seed, verbose=False)
    data = datamodule(args)
    data.setup()
    gate_cls, plus = parse_gate_name(gate)
    perm_epochs = min(args.perm_epochs or PLUS_PERM_EPOCHS, args.epochs) if plus else None
    model = MultiTaskMoE.build(data.info, ModelSettings(gate=partial(gate_cls), lr=args.lr, perm_epochs=perm_epochs))
    timer = EpochTimer()
    trainer = pl.Trainer(
        max_epochs=args.epochs, limit_train_batches=args.train_batches, accelerator=args.accelerator, devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model, datamodule=data)
    trainer.test(model, datamodule=data, verbose=False)
    test = model.last_results["test"]
    tasks = [task.name for task in data.info.tasks]
    row = {
        "gate": gate, "best_epoch": model.engine.summary(0).get("best_epoch", -1), "test_loss": test["loss"],
        **{f"{t}/{m}": test[f"{t}/{m}"] for t in tasks for m in TASK_METRICS if f"{t}/{m}" in test},
        "n_s": sum(test[f"{t}/experts_per_sample"] for t in tasks) / len(tasks),
        "zero_expert_fraction": sum(test[f"{t}/zero_expert_fraction"] for t in tasks) / len(tasks),
        "train_s_per_epoch": sum(timer.seconds) / len(timer.seconds),
        **count_flops(model, data.test_dataloader()),
        **{f"{t} {name}": test[f"{t}/{name}"] for t in tasks for name in ("utilisation", "selection_rate")},
    }
    print(f"{gate}: test loss {row['test_loss']:.4f}, n/s {row['n_s']:.2f}, "
          f"{row['inference_flops'] / 1e3:.0f}K inference FLOPs/sample", file=sys.stderr)
    return row


def markdown(rows: list[dict], args: argparse.Namespace, device: str) -> str:
    metrics = [key for key in rows[0] if "/" in key]
    header = [f"{k.split('/')[0]} {TASK_METRICS[k.split('/')[1]][0]}" for k in metrics]
    lines = [
        f"{args.data}: {args.epochs} epoch(s)"
        + (f" of {args.train_batches} batches" if args.train_batches else "")
        + f", Adam lr {args.lr:g}, batch {args.batch_size}, seed {args.seed}, "
        f"best-validation epoch restored; each gate's default hyperparameters; {device}",
        "",
        "| gate | test loss ×10⁻² | " + " | ".join(header) + " | n/s | zero-expert % | train s/epoch "
        "| forward FLOPs/sample | inference FLOPs/sample |",
        "|---|---|" + "---|" * len(metrics) + "---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{r[k] * TASK_METRICS[k.split('/')[1]][1]:.4f}" if k.endswith("mse")
                 else f"{r[k] * TASK_METRICS[k.split('/')[1]][1]:.2f}" for k in metrics]
        lines.append(f"| {r['gate']} | {100 * r['test_loss']:.2f} | " + " | ".join(cells)
                     + f" | {r['n_s']:.2f} | {100 * r['zero_expert_fraction']:.1f} | {r['train_s_per_epoch']:.1f}"
                     f" | {r['forward_flops'] / 1e3:,.0f}K | {r['inference_flops'] / 1e3:,.0f}K |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="movielens-100k", choices=sorted(DATASETS))
    parser.add_argument("--gates", default=None,
                        help="comma-separated gate names, '+' for local search (default: every gate, and comet+)")
    parser.add_argument("--epochs", type=int, default=20, help="training epochs for every gate (default 20)")
    parser.add_argument("--lr", type=float, default=2e-4, help="Adam's learning rate (default 2e-4, inside the "
                        "paper's MovieLens range 5e-5..5e-4)")
    parser.add_argument("--batch-size", type=int, default=512, help="training and evaluation batch (default 512)")
    parser.add_argument("--perm-epochs", type=int, default=None, help="E_perm of '+' gates (default min(5, epochs))")
    parser.add_argument("--train-batches", type=int, default=None,
                        help="training batches per epoch, for smoke runs (default: the whole training split)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--root", default=None, help="data root (default: $MTMOE_DATA)")
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default benchmarks/out/)")
    args = parser.parse_args(argv)
    gates = args.gates.split(",") if args.gates else [*list_gates(), "comet+"]
    try:  # unknown names fail before any training
        for gate in gates:
            parse_gate_name(gate)
    except UsageError as error:
        parser.error(str(error))
    device = (torch.cuda.get_device_name() if args.accelerator == "gpu"
              else f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"compare-{args.data}-{args.accelerator}"
    rows: list[dict] = []
    for gate in gates:  # tables rewritten after every gate: an interrupted run keeps what it measured
        rows.append(run_gate(gate, args))
        table = markdown(rows, args, f"{device}, torch {torch.__version__}")
        write_atomic(table, stem.with_suffix(".md"))
        write_csv_atomic(rows, stem.with_suffix(".csv"))
    print(table)
    print(f"written to {stem}.md and {stem}.csv", file=sys.stderr)


if __name__ == "__main__":
    main()
