"""The precision of float32 matrix products, a run's setting (``--model.matmul_precision``).

``highest``: float32 products in float32 (IEEE). ``high``: on Ampere and later GPUs, TensorFloat-32 tensor cores
(10-bit mantissa inputs, float32 accumulation), which TensorFlow uses for float32 matmuls there by default since
2.4 and so the official code's behaviour on those GPUs; torch's ``set_float32_matmul_precision("high")`` (which
sets oneDNN's CPU matmuls to TF32 too, where a CPU computes it; on an AVX-512/AMX-BF16 CPU without TF32 the
products are unchanged). It is independent of ``--trainer.precision bf16-mixed`` (autocast), whose matmuls run in bfloat16 either way.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

MatmulPrecision = Literal["highest", "high"]


@contextmanager
def matmul_precision(precision: MatmulPrecision) -> Iterator[None]:
    """Float32 matmuls in ``precision`` inside the block; the previous setting back after it."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
