"""Coverage of the noisy quadratic model's interval for the best objective, on synthetic studies of known optimum.

    python benchmarks/bench_parametric_coverage.py                                   # 40 replications, N = 32, 64
    python benchmarks/bench_parametric_coverage.py --replications 5 --sizes 32       # a smoke run

A study of N trials is N draws of a minimised validation objective from a known distribution whose best (the
infimum of the objective without noise, what ``bootstrap`` estimates: :mod:`mtmoe.tuning.parametric`) is known;
per replication the interval of :func:`mtmoe.tuning.parametric.consonance_interval` (``bootstrap``'s, at
``--confidence``, on the best half of the trials, ``c`` at most ``--dims``) covers when it holds the truth. Also
its median width, how often it is unbounded, and how often no noisy quadratic fits (no interval).

Distributions: ``nq`` opda's ``NoisyQuadraticDistribution(a=0.40, b=0.70, c=2, o=0.003, convex)``, the model itself
(best 0.40); ``nq-c1`` the same with c = 1 and o = 0.001; ``lognormal`` 0.40 + 0.02 LogNormal(0, 0.5), not a noisy
quadratic (its CDF leaves 0.40 faster than any power: best 0.40, never approached closely). Prints a Markdown table
and writes it with a JSON copy to ``benchmarks/out/parametric_coverage.{md,json}`` (``--out DIR``: to DIR).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
from opda.parametric import NoisyQuadraticDistribution
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtmoe.files import write_atomic  # noqa: E402
from mtmoe.tuning.parametric import consonance_interval, tail_threshold  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
#: name -> (sampler of n draws, the true best)
DISTRIBUTIONS = {
    "nq": (lambda rng, n: NoisyQuadraticDistribution(0.40, 0.70, 2, 0.003, convex=True).sample(n, generator=rng),
           0.40),
    "nq-c1": (lambda rng, n: NoisyQuadraticDistribution(0.40, 0.70, 1, 0.001, convex=True).sample(n, generator=rng),
              0.40),
    "lognormal": (lambda rng, n: 0.40 + 0.02 * stats.lognorm(0.5).rvs(size=n, random_state=rng), 0.40),
}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% interval of a proportion k/n."""
    p, d = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(centre - half, 0.0), min(centre + half, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replications", type=int, default=40)
    parser.add_argument("--sizes", default="32,64", help="trials per study, comma-separated")
    parser.add_argument("--distributions", default=",".join(DISTRIBUTIONS))
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--dims", type=int, default=2, help="hyperparameters tuned: c is at most this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT, help="folder of parametric_coverage.{md,json} "
                        "(default: benchmarks/out)")
    args = parser.parse_args()
    rows = []
    start = time.perf_counter()
    for name in args.distributions.split(","):
        sample, truth = DISTRIBUTIONS[name]
        for n in (int(size) for size in args.sizes.split(",")):
            rng = np.random.default_rng([args.seed, n, list(DISTRIBUTIONS).index(name)])
            covered = unbounded = missing = 0
            widths = []
            for _ in range(args.replications):
                values = sample(rng, n)
                low, high = consonance_interval(values, args.dims, tail_threshold(values), args.confidence)
                missing += math.isnan(low)
                covered += low <= truth <= high
                unbounded += math.isinf(low) or math.isinf(high)
                if np.isfinite([low, high]).all():
                    widths.append(high - low)
            lo, hi = wilson(covered, args.replications)
            rows.append({"distribution": name, "n": n, "replications": args.replications, "covered": covered,
                         "coverage": covered / args.replications, "wilson_low": lo, "wilson_high": hi,
                         "unbounded": unbounded, "no_fit": missing,
                         "median_width": float(np.median(widths)) if widths else math.nan})
            print(rows[-1], flush=True)
    elapsed = time.perf_counter() - start
    lines = [f"{args.replications} replications, {100 * args.confidence:g}% intervals, c at most {args.dims}, seed "
             f"{args.seed}; {platform.machine()}, {platform.python_version()}, {elapsed:.0f} s", "",
             "| distribution | N | coverage % [Wilson 95%] | unbounded | no fit | median width ×10⁻² |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['distribution']} | {r['n']} | {100 * r['coverage']:.1f} [{100 * r['wilson_low']:.1f}, "
              f"{100 * r['wilson_high']:.1f}] | {r['unbounded']} | {r['no_fit']} | {100 * r['median_width']:.2f} |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(text, args.out / "parametric_coverage.md")
    write_atomic(json.dumps({"args": {**vars(args), "out": str(args.out)}, "rows": rows}, indent=1),
                 args.out / "parametric_coverage.json")


if __name__ == "__main__":
    main()
