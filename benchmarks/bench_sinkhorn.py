"""Batched Sinkhorn (``mtmoe.sinkhorn``): forward + backward with the entropy penalty, per call.

    OMP_NUM_THREADS=1 python benchmarks/bench_sinkhorn.py [--n 16] [--batch 8] [--iterations 150] [--device cuda]

Cells: one matrix; ``--batch`` matrices in one ``log_sinkhorn`` call; the same matrices as that many one-matrix
calls (how a pack's trials ran before); a vmapped pack of ``--batch`` trials of one matrix each (how a pack calls
it now). Each matrix has its own tau (1e-3 .. 1e-7) and R = ``--iterations``. The cells are timed interleaved, one
call each per round, so that all see the same machine load; reported: median and minimum over the rounds, and
each cell's median over the single calls' (a step costs more at small tau: the one-matrix cell is at tau = 1e-3).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtmoe.sinkhorn import log_sinkhorn, sinkhorn_and_penalty


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    device, m = torch.device(args.device), args.batch
    generator = torch.Generator().manual_seed(0)
    u = ((torch.rand(m, args.n, args.n, generator=generator) - 0.5) * 0.1).to(device).requires_grad_()
    upstream = torch.randn(m, args.n, args.n, generator=generator).to(device)
    tau = torch.logspace(-3, -7, m, dtype=torch.float64, device=device)
    iterations = torch.full((m,), args.iterations, device=device)
    scale = torch.full((m,), 1e-4, dtype=torch.float64, device=device)

    def one_matrix() -> None:
        p, penalty = log_sinkhorn(u[:1], tau[:1], iterations[:1], scale[:1])
        ((p * upstream[:1]).sum() + penalty.sum()).backward()

    def one_call() -> None:
        p, penalty = log_sinkhorn(u, tau, iterations, scale)
        ((p * upstream).sum() + penalty.sum()).backward()

    def single_calls() -> None:
        for b in range(m):
            p, penalty = log_sinkhorn(u[b:b + 1], tau[b:b + 1], iterations[b:b + 1], scale[b:b + 1])
            ((p * upstream[b:b + 1]).sum() + penalty.sum()).backward()

    def vmapped_pack() -> None:
        p, penalty = torch.func.vmap(sinkhorn_and_penalty)(u.unsqueeze(1), tau, iterations, scale)
        ((p * upstream.unsqueeze(1)).sum() + penalty.sum()).backward()

    cells = {"1 matrix": one_matrix, f"{m} in one call": one_call, f"{m} single calls": single_calls,
             f"vmap, {m} trials": vmapped_pack}
    times: dict[str, list[float]] = {name: [] for name in cells}
    for round_ in range(args.repeats + 10):
        for name, cell in cells.items():
            start = time.perf_counter()
            cell()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if round_ >= 10:  # the first rounds compile and warm up
                times[name].append(time.perf_counter() - start)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"n = {args.n}, R = {args.iterations}, {where}, torch {torch.__version__}; {args.repeats} rounds\n")
    print(f"| cell | median (ms) | min (ms) | median / {m} single calls |")
    print("|---|---|---|---|")
    single_calls_median = statistics.median(times[f"{m} single calls"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1e3:.3f} | {min(values) * 1e3:.3f} | {median / single_calls_median:.2f} |")


if __name__ == "__main__":
    main()
