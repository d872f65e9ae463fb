"""Triton for the GPU kernels of :mod:`mtmoe.random`, :mod:`mtmoe.sinkhorn` and :mod:`mtmoe.pack.adam`.

``triton`` and ``tl`` are None where Triton is missing (it ships with CUDA builds of torch). The kernels run for
CUDA tensors, and under Triton's interpreter (``TRITON_INTERPRET=1``, read at import) for CPU tensors too: how CI
tests them without a GPU, against the CPU code they mirror (the tests switch :data:`INTERPRET` off to run that).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# The GPU paths' supported range, oldest to newest: torch and Triton of the lent GPUs' image (torch 2.11, Triton 3.6)
# to those of the CI machine, where tests/test_triton_compile.py compiles every kernel for sm_80 and sm_90 and the
# interpreter runs them (torch 2.15, Triton 3.9; a VM capped at torch 2.14.1 gets Triton 3.8, whose interpreter rounds
# tl.fma twice: mtmoe.random fuses it there). The oldest are CI's too: torch 2.11 is pyproject.toml's lower bound
# (.ci/run tests it), and tests/test_triton_compile.py compiles every kernel for sm_90 with Triton 3.6 as well.
# benchmarks/gpu_check.py prints the range beside the versions in use.
SUPPORTED_VERSIONS = {"torch": ("2.11", "2.15"), "triton": ("3.6", "3.9")}


def use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` go to the Triton kernels: CUDA tensors, and every tensor under the
    interpreter."""
    return triton is not None and (device.type == "cuda" or INTERPRET)


#: CUDA's limits on a launch grid's dimensions x, y and z. Triton's interpreter does not check them.
GRID_LIMITS = (2**31 - 1, 65_535, 65_535)


def grid(*dims: int) -> tuple[int, ...]:
    """A kernel's launch grid, checked against :data:`GRID_LIMITS` wherever it runs, the interpreter included: a
    dimension past its limit is a ``ValueError`` naming it, where the GPU answers "invalid argument". Put what can
    grow with a pack's rows in x."""
    for axis, size, limit in zip("xyz", dims, GRID_LIMITS):
        if size > limit:
            raise ValueError(f"a kernel's launch grid has {size} programs along {axis}, past CUDA's limit of {limit}")
    return dims
