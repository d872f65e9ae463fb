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


def use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` go to the Triton kernels: CUDA tensors, and every tensor under the
    interpreter."""
    return triton is not None and (device.type == "cuda" or INTERPRET)
