"""What ``report``'s hyperparameter importances cost per evaluator (:mod:`mtmoe.tuning.importance`: PED-ANOVA and
fANOVA), on synthetic studies of N random trials and, with ``--storage``, on real studies.

    python benchmarks/bench_importance.py [--trials 8 60 200] [--runs 3] [--storage URL --data NAME]

Synthetic studies: the 4-hyperparameter space of ``tests/test_importance.py`` (learning rate, gamma, k, entropy
regulariser), random configurations, an objective driven by the learning rate plus noise. Per study and evaluator,
the best of ``--runs`` of Optuna's ``get_param_importances`` as ``report`` calls it, in CPU and wall seconds; then the
import of scikit-learn (which Optuna's ``optuna.importance`` loads) in a fresh interpreter that has already loaded
``report``'s modules. Prints Markdown tables.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import optuna
import pandas as pd

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))
from mtmoe.tuning import importance  # noqa: E402

SPACE = {"model.lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True),
         "model.gate.gamma": optuna.distributions.FloatDistribution(0.1, 10.0),
         "model.gate.k": optuna.distributions.IntDistribution(1, 4),
         "model.gate.entropy_reg": optuna.distributions.CategoricalDistribution([1, 5, 10])}
IMPORT = ("import time, mtmoe.tuning.report, optuna.study, pandas, matplotlib.figure; start = time.process_time(); "
          "import sklearn.ensemble; print(time.process_time() - start)")


def synthetic(n: int) -> pd.DataFrame:
    """A trial table (the columns :func:`importance.importances` reads) of ``n`` random configurations."""
    rng = np.random.default_rng(n)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(n))
    rows = []
    for _ in range(n):
        params = study.ask(SPACE).params
        rows.append({"study": f"synthetic/{n}", "gate": "comet", "alpha": None, "failed": False, "params": params,
                     "distributions": SPACE, "objective": 0.4 + 0.05 * np.log10(params["model.lr"] / 1e-3) ** 2
                     + rng.normal(0, 0.001)})
    return pd.DataFrame(rows)


def timed(trials: pd.DataFrame, evaluator: str, runs: int) -> tuple[float, float]:
    """Best CPU and wall seconds of ``report``'s importances of ``trials`` with ``evaluator`` alone."""
    best = (np.inf, np.inf)
    for _ in range(runs):
        wall, cpu = time.perf_counter(), time.process_time()
        importance.importances(trials, (evaluator,))
        best = min(best, (time.process_time() - cpu, time.perf_counter() - wall))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, nargs="+", default=[8, 60, 200])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--storage", help="also time the studies of this storage")
    parser.add_argument("--data", help="with --storage: the dataset whose studies to time")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.simplefilter("ignore")
    evaluators = importance.EVALUATORS
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, optuna "
          f"{optuna.__version__}, best of {args.runs}\n")
    tables = {f"{n} synthetic trials, 4 hyperparameters": synthetic(n) for n in args.trials}
    if args.storage:
        from mtmoe.tuning.report import collect

        trials = collect(args.storage, args.data)[1]
        tables[f"`{args.data}` studies of the storage ({trials.study.nunique()}, {len(trials)} trials)"] = trials
    print("| studies | " + " | ".join(f"{e} CPU (wall) s" for e in evaluators) + " |\n|---|"
          + "---|" * len(evaluators))
    for name, trials in tables.items():
        cells = [f"{cpu:.3f} ({wall:.3f})" for cpu, wall in (timed(trials, e, args.runs) for e in evaluators)]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    seconds = [float(subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, check=True,
                                    env={**os.environ, "PYTHONPATH": str(CHECKOUT)}).stdout) for _ in range(args.runs)]
    print(f"\nimport sklearn.ensemble after report's modules: {min(seconds):.2f} s CPU (best of {args.runs})")


if __name__ == "__main__":
    main()
