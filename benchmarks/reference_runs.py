"""One run per gate at the centre of its search space, beside the COMET paper's Tables 2, 3 and 7.

    MTMOE_DATA=../shared/data python benchmarks/reference_runs.py --data books --alphas 0.1,0.9
    MTMOE_DATA=../shared/data python benchmarks/reference_runs.py --data multimnist --accelerator gpu
    python benchmarks/reference_runs.py --data books --epochs 15 --gates softmax,comet   # a shorter budget

Other ``--key=value`` arguments go to every ``fit`` as they are (e.g. ``--trainer.limit_train_batches=5``).

Setting (stated in the table's header): each gate's section of ``mtmoe/tuning/spaces/<data>.yaml`` (the paper's S1.3
search spaces) with every searched hyperparameter at the centre of its range: the geometric mean of a log-uniform
range (two significant digits: lr 1.6e-4 for [5e-5, 5e-4]), the midpoint of a uniform one, the middle integer (lower
middle) and the middle choice (lower middle); the file's fixed values as they are (batch size, experts, epochs,
patience). ``--epochs`` replaces the file's ``trainer.max_epochs`` when the paper's budget does not fit the machine,
and ``--perm-epochs`` the centre of the "+" gates' searched E_perm (5 of 1..10) when it is longer than ``--epochs``
(``fit`` refuses a window longer than the run); the setting column shows the value.
Each run is ``python -m mtmoe fit`` with those arguments and seed 0, so the best-validation epoch is restored and
tested as in a tuning trial.

One run is not the paper's 500-trial search and 100 repetitions: the gap to the paper is a sanity check of the
pipeline (same loss scale, same ordering where the gaps are large), not a reproduction. Each finished run is a JSON
file in ``--out`` (written atomically), named by dataset, gate, alpha and a hash of its setting and seed; a rerun
with the same values skips it, so an interrupted table resumes, and processes with different ``--gates`` can share
one folder. The table (Markdown and CSV) covers the runs the command names: rerun with every gate (nothing trains
again) for one table of all.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtmoe.errors import UsageError  # noqa: E402
from mtmoe.tuning.trials import TASK_METRICS  # noqa: E402
from mtmoe.files import write_atomic, write_csv_atomic  # noqa: E402
from mtmoe.tuning.space import SearchSpace, load_space  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "reference"
RECOMMENDERS = ("books", "movielens", "movielens-100k", "jester")
SHARED_KEYS = {"data.batch_size", "trainer.max_epochs", "early_stopping.patience", "model.n_experts"}  # in headers
PAPER_GATES = ["softmax", "hash", "hash+", "topk", "topk+", "dselect", "comet", "comet+"]


def paper_rows(text: str) -> dict[str, dict[str, str]]:
    """The paper's figures of one dataset and alpha, a line per gate, ``gate loss n/s task1 task2`` (figures the
    paper does not give: ``-``, or left out at the end) -> {gate: {"loss": ..., "n_s": ..., ...}}, as printed."""
    columns = ("loss", "n_s", "task1", "task2")
    return {gate: {column: value for column, value in zip(columns, values) if value != "-"}
            for gate, *values in map(str.split, text.strip().splitlines())}


# The paper's figures (comet-protocol.md §8): Table 2/3 test loss ×1e-2 and n/s, Table 7 task metrics
# (AUC ×100 and MSE for the recommenders, accuracy ×100 averaged over the tasks for the images). Mean ± SE of the
# best configurations of 500-trial searches, over 100 repetitions. "movielens" is MovieLens-1M; Jester's softmax
# loss at alpha 0.9 is not recoverable from the text version.
PAPER: dict[tuple[str, float | None], dict[str, dict[str, str]]] = {
    ("books", 0.1): paper_rows("""
        softmax  244.47  9.00  56.70  2.6470
        hash     247.43  1.00  54.55  2.6791
        hash+    247.33  1.00
        topk     247.87  4.00  55.28  2.6783
        topk+    247.88  4.00
        dselect  246.43  1.09  59.19  2.6667
        comet    240.79  2.81
        comet+   240.82  3.03  68.18  2.6063
    """),
    ("books", 0.9): paper_rows("""
        softmax  73.88  9.00  77.85  2.6195
        hash     75.02  1.00  77.32  2.7152
        hash+    75.06  1.00
        topk     74.78  4.00  77.46  2.6942
        topk+    74.86  4.00
        dselect  75.98  1.07  77.07  2.7581
        comet    73.62  2.94
        comet+   73.55  3.15  77.95  2.6158
    """),
    ("movielens", 0.9): paper_rows("""
        softmax  42.26  16.00  90.92  0.7585
        hash     46.91  1.00   88.95  0.8065
        hash+    46.84  1.00
        topk     41.83  2.00   91.25  0.7635
        topk+    41.74  2.00
        dselect  40.82  1.94   91.65  0.7455
        comet    40.76  1.76
        comet+   40.69  1.66   91.70  0.7437
    """),
    ("movielens", 0.1): paper_rows("""
        softmax  75.52  16.00  85.50  0.7867
        hash     79.41  1.00   84.27  0.8279
        hash+    78.92  1.00
        topk     76.52  2.00   87.12  0.8005
        topk+    75.12  2.00
        dselect  73.91  1.94   88.16  0.7734
        comet    73.91  1.94
        comet+   73.67  1.98   88.02  0.7707
    """),
    ("jester", 0.1): paper_rows("""
        softmax  68.17  16.00  97.22  0.7380
        hash     67.47  1.00   97.01  0.7301
        topk     68.38  2.00   97.38  0.7412
        topk+    68.00  2.00
        dselect  67.06  1.96   97.45  0.7273
        comet    67.12  1.98
        comet+   66.91  2.00   97.45  0.7257
    """),
    ("jester", 0.9): paper_rows("""
        softmax  -       16.00  97.350  0.7460
        hash     22.083  1.00   97.323  0.7530
        topk     21.958  2.00   97.346  0.7456
        topk+    21.961  2.00
        dselect  21.930  2.00   97.361  0.7464
        comet    21.946  2.00
        comet+   21.906  2.00   97.362  0.7439
    """),
    ("multimnist", None): paper_rows("""
        softmax  6.88  16.00  98.01
        topk     6.84  4.00   98.01
        topk+    6.70  4.00
        dselect  6.64  3.40   98.03
        comet    6.48  3.49
        comet+   6.49  3.53   98.07
    """),
    ("multifashionmnist", None): paper_rows("""
        softmax  34.21  5.00  87.99
        topk     33.82  2.00  88.03
        topk+    33.62  2.00
        dselect  35.49  1.00  87.42
        comet    33.70  1.49
        comet+   33.67  1.54  88.12
    """),
    ("celeba", None): paper_rows("""
        softmax  35.10  6.00  83.84
        topk     34.48  2.00  83.95
        topk+    34.54  2.00
        dselect  35.39  1.00  83.53
        comet    33.96  1.00
        comet+   33.93  1.00  84.27
    """),
    ("digits", None): paper_rows("""
        softmax  17.48  8.00  93.53
        topk     17.46  2.00  95.34
        topk+    17.29  2.00
        dselect  17.18  1.15  95.41
        comet    17.19  1.07
        comet+   17.08  1.06  95.45
    """),
}


def centre(distribution) -> object:
    """The centre of an Optuna distribution, as the module docstring defines it."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(distribution, CategoricalDistribution):
        return distribution.choices[(len(distribution.choices) - 1) // 2]
    if isinstance(distribution, IntDistribution):
        return (distribution.low + distribution.high) // 2
    if distribution.log:
        value = math.sqrt(distribution.low * distribution.high)
        return float(f"{value:.2g}")
    return (distribution.low + distribution.high) / 2


def setting(data: str, gate: str, perm_epochs: int | None = None) -> tuple[SearchSpace, dict]:
    """(the study file's fixed values, the searched keys at their centres) for one gate; ``perm_epochs``, when
    given, replaces the centre of a searched E_perm (it must lie in the searched range)."""
    space = load_space(data, gate)
    params = {key: centre(d) for key, d in space.distributions.items()}
    searched = space.distributions.get("model.perm_epochs")
    if perm_epochs is not None and searched is not None:
        if not searched.low <= perm_epochs <= searched.high:
            raise UsageError(f"--perm-epochs {perm_epochs} is outside {gate}'s searched range "
                             f"[{searched.low}, {searched.high}] in mtmoe/tuning/spaces/{data}.yaml; give a value "
                             "inside it")
        params["model.perm_epochs"] = perm_epochs
    return space, params


def run_setting(space: SearchSpace, params: dict, args: argparse.Namespace) -> dict:
    """Every value a run is given: the study file's, the centres, ``--epochs`` and the fit arguments."""
    return {**space.fixed, **params, **({"trainer.max_epochs": args.epochs} if args.epochs else {}),
            **dict(arg.removeprefix("--").split("=", 1) for arg in args.fit_args if "=" in arg)}


def run_file(data: str, gate: str, alpha: float | None, run: dict, seed: int) -> str:
    """A run's file name; its last part hashes the setting and seed, so a rerun with other values trains anew."""
    digest = hashlib.sha256(json.dumps({"setting": run, "seed": seed}, sort_keys=True, default=str).encode())
    return f"{data}-{gate}" + (f"-alpha{alpha:g}" if alpha is not None else "") + f"-{digest.hexdigest()[:8]}.json"


def run_one(space: SearchSpace, params: dict, run: dict, alpha: float | None, path: Path,
            args: argparse.Namespace) -> dict:
    """``fit`` with ``space``'s fixed values and ``params`` (``run`` records both and the overrides); logs go
    beside ``path``."""
    from mtmoe.run import build_run
    from mtmoe.tuning.objective import cli_args
    from mtmoe.tuning.study import quiet_libraries

    overrides = [f"--trainer.accelerator={args.accelerator}", *args.fit_args]
    if args.epochs is not None:
        overrides.append(f"--trainer.max_epochs={args.epochs}")
    if alpha is not None:
        overrides.append(f"--model.alpha={alpha}")
    quiet_libraries()
    start = time.perf_counter()
    results = build_run(cli_args(space, params, overrides, args.seed, path.parent / "logs" / path.stem)).fit()
    return {
        "data": space.data, "gate": space.gate, "alpha": alpha, "seed": args.seed, "setting": run,
        "epochs_run": results["epochs_run"], "best_epoch": results.get("best_epoch"),
        "test": results["test"], "seconds": round(time.perf_counter() - start, 1),
        "device": args.accelerator,
    }


def task_columns(test: dict) -> list[tuple[str, str, float]]:
    """(task, metric, value in the paper's units) per task, Table 7's metric: AUC for a binary task (accuracy
    where there is no AUC), accuracy for a multiclass one, MSE for a rating."""
    metrics: dict[str, dict[str, float]] = {}
    for key, value in test.items():
        task, _, metric = key.partition("/")
        if metric in TASK_METRICS:
            metrics.setdefault(task, {})[metric] = value * TASK_METRICS[metric][1]
    out = []
    for task, found in metrics.items():
        metric = next(m for m in ("auroc", "accuracy", "mse") if m in found)
        out.append((task, metric, found[metric]))
    return out


def table(rows: list[dict]) -> str:
    """Markdown: ours beside the paper's, one table per (dataset, alpha)."""
    lines = []
    for (data, alpha) in sorted({(r["data"], r["alpha"]) for r in rows}, key=str):
        group = sorted((r for r in rows if (r["data"], r["alpha"]) == (data, alpha)),
                       key=lambda r: PAPER_GATES.index(r["gate"]) if r["gate"] in PAPER_GATES else 99)
        paper = PAPER.get((data, alpha), {})
        metrics = task_columns(group[0]["test"])
        image = data not in RECOMMENDERS
        epochs = sorted({str(r["setting"].get("trainer.max_epochs")) for r in group})
        lines += [
            f"**{data}" + (f", alpha {alpha:g}" if alpha is not None else "") + "**: one run per gate, seed "
            f"{', '.join(sorted({str(r['seed']) for r in group}))}, the centre of each gate's search space "
            f"(`mtmoe/tuning/spaces/{data}.yaml`), up to {' or '.join(epochs)} "
            f"epoch{'' if epochs == ['1'] else 's'}, the best-validation epoch tested; "
            f"{', '.join(sorted({r['device'] for r in group}))}. Paper: the best "
            "configurations of 500-trial searches, mean of 100 repetitions. Gap: ours minus the paper's (positive: "
            "ours is worse).",
            "",
            "| gate | setting | best epoch / run | test loss ×10⁻² | paper | gap | "
            + " | ".join(f"{t} {TASK_METRICS[m][0]}" for t, m, _ in metrics)
            + (" | accuracy, mean of tasks | paper" if image else " | paper task 1 | paper task 2")
            + " | n/s | paper n/s |",
            "|---|---|---|---|---|---|" + "---|" * len(metrics) + "---|---|" + "---|---|",
        ]
        for r in group:
            ours = 100 * r["test"]["loss"]
            theirs = paper.get(r["gate"], {})
            gap = f"{ours - float(theirs['loss']):+.2f}" if "loss" in theirs else ""
            searched = {k.removeprefix("model."): v for k, v in r["setting"].items() if k not in SHARED_KEYS}
            columns = task_columns(r["test"])
            cells = [f"{v:.4f}" if m == "mse" else f"{v:.2f}" for _, m, v in columns]
            if image:
                cells += [f"{sum(v for _, _, v in columns) / len(columns):.2f}", theirs.get("task1", "")]
            else:
                cells += [theirs.get("task1", ""), theirs.get("task2", "")]
            n_s = [v for k, v in r["test"].items() if k.endswith("/experts_per_sample")]
            lines.append(
                f"| {r['gate']} | {', '.join(f'{k} {v}' for k, v in searched.items())} "
                f"| {r['best_epoch']} / {r['epochs_run']} | {ours:.2f} | {theirs.get('loss', '')} | {gap} | "
                + " | ".join(cells) + f" | {sum(n_s) / len(n_s):.2f} | {theirs.get('n_s', '')} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a dataset with a study file, e.g. books, multimnist")
    parser.add_argument("--gates", default=None, help="comma-separated (default: those the paper reports for the "
                        "dataset; Table 2 or 3)")
    parser.add_argument("--alphas", default=None, help="comma-separated task weights alpha (recommenders; "
                        "default: 0.1,0.9, the paper's)")
    parser.add_argument("--epochs", type=int, default=None, help="replaces the study file's trainer.max_epochs")
    parser.add_argument("--perm-epochs", type=int, default=None, help="replaces the centre of a searched E_perm "
                        "(a value of its range) when --epochs is shorter than the centre")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--out", type=Path, default=OUT, help="folder of per-run JSON files and the table")
    args, args.fit_args = parser.parse_known_args(argv)
    if args.alphas:
        alphas = [float(a) for a in args.alphas.split(",")]
    else:  # the paper's two task weightings on the recommenders; the image datasets weight their tasks equally
        alphas = [0.1, 0.9] if args.data in RECOMMENDERS else [None]
    reported = [g for g in PAPER_GATES if any(g in PAPER.get((args.data, a), {}) for a in alphas)]
    gates = args.gates.split(",") if args.gates else reported or PAPER_GATES
    try:  # every gate's space loads before any training
        settings = {gate: setting(args.data, gate, args.perm_epochs) for gate in gates}
    except UsageError as error:
        parser.exit(2, f"error: {error}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    paths = []
    for alpha in alphas:
        for gate, (space, params) in settings.items():
            run = run_setting(space, params, args)
            path = args.out / run_file(args.data, gate, alpha, run, args.seed)
            paths.append(path)
            if path.exists():
                continue
            try:
                row = run_one(space, params, run, alpha, path, args)
            except UsageError as error:
                parser.exit(2, f"error: {error}\n")
            write_atomic(json.dumps(row, indent=2) + "\n", path)
            print(f"{path.stem}: test loss {100 * row['test']['loss']:.2f}e-2, best epoch {row['best_epoch']}, "
                  f"{row['seconds']:.0f} s", file=sys.stderr, flush=True)
    rows = [json.loads(path.read_text()) for path in paths]
    markdown = table(rows)
    write_atomic(markdown, args.out / f"reference-{args.data}.md")
    flat = [{"data": r["data"], "gate": r["gate"], "alpha": r["alpha"], "seed": r["seed"],
             "best_epoch": r["best_epoch"], "epochs_run": r["epochs_run"], "device": r["device"],
             **{f"test/{k}": v for k, v in r["test"].items()}} for r in rows]
    write_csv_atomic(flat, args.out / f"reference-{args.data}.csv")
    print(markdown)


if __name__ == "__main__":
    main()
