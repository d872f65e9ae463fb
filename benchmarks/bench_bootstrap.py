"""Speed of the tuning-budget bootstrap (``python -m mtmoe bootstrap``, Appendix F) at the paper's scale.

    python benchmarks/bench_bootstrap.py                              # 10 gates x 500 trials, 1000 draws, cpu
    python benchmarks/bench_bootstrap.py --devices cpu,cuda           # and on a GPU
    python benchmarks/bench_bootstrap.py --gates 2 --trials 100 --repeats 1   # a smoke run

A synthetic trial table (``--gates`` studies of ``--trials`` completed trials each, validation objective and test
loss correlated through a shared quality) goes through the library functions the command runs, timed separately:
the Monte-Carlo draws of every study on the full grid {1, 2, 5, ..., 250} (``monte_carlo``), the closed form on
the same grid (``closed_form``), both together as the command computes them (``tuning_curves``), and the
reduction factors of 9 pairs (``panel_factors``: closed-form curves at every budget 1..N). Each cell is the median
of ``--repeats`` runs after one warm-up run; "nested" is the default resampling, "independent" the option. The
last column checks the draws: the largest |Monte-Carlo mean - closed form| over all budgets and studies, in
standard errors of the mean.

Prints a Markdown table and writes it with a JSON copy to ``benchmarks/out/bootstrap.{md,json}`` (``--out DIR``:
to DIR).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtmoe.files import write_atomic  # noqa: E402
from mtmoe.tuning.bootstrap import (  # noqa: E402
    PAPER_MAX_BUDGET,
    Settings,
    agreement,
    budget_grid,
    closed_form,
    monte_carlo,
    panel_factors,
    ranked_test_losses,
    study_seed,
    tuning_curves,
)

OUT = Path(__file__).resolve().parent / "out"


def synthetic_trials(gates: int, trials: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frames = []
    for g in range(gates):
        quality = 0.40 + 0.01 * g + rng.exponential(0.01 + 0.005 * g, trials)
        frames.append(pd.DataFrame({
            "data": "synthetic", "study": f"synthetic/gate{g}", "gate": f"gate{g}", "alpha": None,
            "config_id": np.arange(trials), "objective": quality + rng.normal(0, 0.003, trials),
            "test_loss": quality + rng.normal(0, 0.003, trials), "failed": False,
        }))
    return pd.concat(frames, ignore_index=True)


def timed(function, repeats: int) -> float:
    function()  # warm-up: CUDA context, kernels, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gates", type=int, default=10)
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", default="cpu", help="comma-separated torch devices")
    parser.add_argument("--out", type=Path, default=OUT, help="folder of bootstrap.{md,json} (default: benchmarks/out)")
    args = parser.parse_args()

    trials = synthetic_trials(args.gates, args.trials)
    studies = {study: ranked_test_losses(group) for study, group in trials.groupby("study")}
    grid = budget_grid(min(args.trials, PAPER_MAX_BUDGET))
    pairs = [(f"gate{g}", f"gate{g + 1}") for g in range(args.gates - 1)]
    rows = []
    for device in args.devices.split(","):
        for resampling in ("nested", "independent"):
            settings = Settings(draws=args.draws, resampling=resampling, device=device)

            def draws() -> list[np.ndarray]:
                return [monte_carlo(losses, grid, args.draws, study_seed(0, study), resampling=resampling,
                                    device=device) for study, losses in studies.items()]

            outcomes = draws()
            exact = [closed_form(losses, grid) for losses in studies.values()]
            worst = max(float(agreement(o.mean(0), e["exact_mean"], e["exact_std"], args.draws).max())
                        for o, e in zip(outcomes, exact))
            rows.append({
                "device": device, "resampling": resampling,
                "draws_s": timed(draws, args.repeats),
                "closed_form_s": timed(lambda: [closed_form(losses, grid) for losses in studies.values()],
                                       args.repeats),
                "curves_s": timed(lambda: tuning_curves(trials, settings), args.repeats),
                "factors_s": timed(lambda: panel_factors(trials, pairs, settings), args.repeats),
                "max_z": worst,
            })
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() and "cuda" in args.devices else ""
    machine = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
               f"torch {torch.__version__}{gpu}")
    header = (f"{args.gates} studies x {args.trials} trials, {args.draws} draws x {len(grid)} budgets "
              f"(1..{grid[-1]}), median of {args.repeats}; {machine}")
    lines = [header, "", "| device | resampling | draws (s) | closed form (s) | curves: both (s) | "
             f"factors, {len(pairs)} pairs (s) | max abs(MC - exact) / SE |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['device']} | {r['resampling']} | {r['draws_s']:.3f} | {r['closed_form_s']:.3f} | "
              f"{r['curves_s']:.3f} | {r['factors_s']:.3f} | {r['max_z']:.2f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(text, args.out / "bootstrap.md")
    write_atomic(json.dumps({"setup": header, "rows": rows}, indent=2) + "\n", args.out / "bootstrap.json")


if __name__ == "__main__":
    main()
