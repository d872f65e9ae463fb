"""Dropout on the MovieLens expert layer's activations: today's mask against the per-trial stream (issue 25).

    OMP_NUM_THREADS=1 python benchmarks/bench_random.py            # CPU, one thread
    OMP_NUM_THREADS=1 python benchmarks/bench_random.py --dtype bfloat16
    python benchmarks/bench_random.py --device cuda --repeats 50    # a GPU (the Triton kernel)

For ``h`` [512, 4096] (one trial) and a vmapped pack [8, 512, 4096], forward and backward (``torch.autograd.grad``
of the output with a given gradient, graph built outside the timing), with glibc keeping freed memory as the
trainers have it (``mtmoe.host_memory``), of

* today: ``h * dropout_mask(h, 0.5)`` (``mtmoe.experts``; under vmap with ``randomness="different"``);
* fused: :func:`mtmoe.random.dropout` (numba on CPU, Triton on CUDA);
* reference: :func:`mtmoe.random.dropout_reference` (torch operations).

Prints a Markdown table of milliseconds, median and least.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.func import vmap

from mtmoe.experts import dropout_mask
from mtmoe.host_memory import keep_freed_memory
from mtmoe.random import dropout, dropout_reference

SITE = 1
P = 0.5


def today(h, seed, step):
    return h * dropout_mask(h, P)


def fused(h, seed, step):
    return dropout(h, seed, SITE, step, P)


def reference(h, seed, step):
    return dropout_reference(h, seed, SITE, step, P)


def timing_ms(run, repeats: int, setup=lambda: None, device: str = "cpu") -> str:
    """Median and least wall time of ``run(setup())`` in milliseconds, after two warm-up calls (the least is the
    steadier figure on a shared machine)."""
    times = []
    for i in range(repeats + 2):
        state = setup()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(state)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return f"{1e3 * statistics.median(times):.2f} ({1e3 * min(times):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--pack", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    keep_freed_memory()  # as the trainers do
    device, dtype = args.device, getattr(torch, args.dtype)
    print(f"device {device}, {args.dtype}, torch threads {torch.get_num_threads()}, {args.repeats} repeats\n")
    print("| h | method | forward ms, median (least) | backward ms, median (least) |")
    print("|---|---|---|---|")
    for pack in (None, args.pack):
        shape = (512, 4096) if pack is None else (pack, 512, 4096)
        h = torch.rand(shape, device=device, dtype=dtype).requires_grad_()
        grad = torch.randn(shape, device=device, dtype=dtype)
        seed = torch.tensor(12345, device=device) if pack is None else torch.arange(pack, device=device) + 12345
        step = torch.tensor(7, device=device) if pack is None else torch.arange(pack, device=device) * 3
        for name, function in (("today", today), ("fused", fused), ("reference", reference)):
            call = function if pack is None else vmap(function, randomness="different")
            try:
                forward = timing_ms(lambda _: call(h, seed, step), args.repeats, device=device)
                backward = timing_ms(lambda out: torch.autograd.grad(out, h, grad), args.repeats,
                                     setup=lambda: call(h, seed, step), device=device)
            except RuntimeError as error:  # today's mask under vmap on some torch builds
                print(f"| {list(shape)} | {name} | failed: {str(error).splitlines()[0][:80]} | |")
                continue
            print(f"| {list(shape)} | {name} | {forward} | {backward} |")


if __name__ == "__main__":
    main()
