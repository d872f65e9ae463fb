"""Kernels that run outside ATen (numba on the CPU, Triton on a GPU) report the bytes they read and write here, since
no ``TorchDispatchMode`` sees them. The operation counters of :mod:`mtmoe.pack.operations` listen while they are
active; with none listening, a report costs one empty loop."""
from __future__ import annotations

from typing import Protocol


class Listener(Protocol):
    def kernel(self, name: str, read: int, written: int, flops: int = 0) -> None: ...


#: The listeners active now, innermost last.
LISTENERS: list[Listener] = []


def fused_kernel(name: str, read: int, written: int, flops: int = 0) -> None:
    """Report a kernel that runs outside ATen, the bytes it reads and writes and the FLOPs of the matrix product it
    computes in place of one (counted as ``torch.utils.flop_counter`` counts that product), to the listeners
    active now."""
    for listener in LISTENERS:
        listener.kernel(name, read, written, flops)
