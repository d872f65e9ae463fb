"""Host kernels (numba, ``nogil``) split over torch's intra-op threads, for CPU tensors.

A training step on a CPU runs torch's element-wise operations on ``torch.get_num_threads()`` threads; the numba
kernels of the engine (dropout's counter-based mask, the packed Adam update) are one pass each over tensors as large,
and :func:`run_split` gives them the same number of cores. The parts run on a pool of plain threads that block
while idle (numba's own parallel layer here is OpenMP, a second spinning pool beside torch's: slower on two cores,
see ``benchmarks/README.md``). A kernel's result must not depend on how its range is split: each element's value
is a function of its own position, so every split computes the same bits.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
MIN_PART = 1 << 15  # elements (or units) per part below which a split costs more than it gains


def _forget_pool() -> None:
    global _pool, _pool_size
    _pool, _pool_size = None, 0  # a forked child has no threads: it starts its own pool


os.register_at_fork(after_in_child=_forget_pool)


def run_split(kernel: Callable[..., None], n: int, *args, min_part: int = MIN_PART) -> None:
    """``kernel(*args, lo, hi)`` over ``[0, n)`` in up to ``torch.get_num_threads()`` contiguous parts, the first
    on the calling thread; returns when every part is done."""
    global _pool, _pool_size
    parts = max(1, min(torch.get_num_threads(), n // max(1, min_part)))
    if parts == 1:
        kernel(*args, 0, n)
        return
    if _pool_size < parts - 1:
        _pool, _pool_size = ThreadPoolExecutor(max_workers=parts - 1, thread_name_prefix="mtmoe-kernel"), parts - 1
    bounds = [n * i // parts for i in range(parts + 1)]
    futures = [_pool.submit(kernel, *args, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:])]
    kernel(*args, bounds[0], bounds[1])
    for future in futures:
        future.result()
