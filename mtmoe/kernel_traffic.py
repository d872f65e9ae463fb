"""Kernels that run outside ATen (numba on the CPU, Triton on a GPU) report the bytes they read and write here, since
no ``TorchDispatchMode`` sees them. The operation counters of :mod:`mtmoe.pack.operations` listen while they are
active; with none listening, a report costs one empty loop."""
from __future__ import annotations

from typing import Protocol


class Listener(Protocol):
    def kernel(self, name: str, read: int, written: int) -> None: ...


#: The listeners active now, innermost last.
LISTENERS: list[Listener] = []


def fused_kernel(name: str, read: int, written: int) -> None:
    """Report a kernel that runs outside ATen, and the bytes it reads and writes, to the listeners active now."""
    for listener in LISTENERS:
        listener.kernel(name, read, written)
