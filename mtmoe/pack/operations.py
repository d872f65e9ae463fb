"""What a step of the engine dispatches: the ATen operations (each a kernel launch on a GPU) and the host reads
among them (each a synchronisation on a GPU), counted with a ``TorchDispatchMode``. The engine's contract (issue 21):
both counts of a training step and of an evaluation batch do not depend on the pack's size, and there is no host
read (``benchmarks/bench_packs.py --ops``, ``tests/test_engine_ops.py``)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtmoe.kernel_traffic import LISTENERS

#: Operations that read a device value on the host, or whose output's shape depends on values (a read too).
HOST_READS = frozenset({"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2",
                        "unique_consecutive", "equal", "is_nonzero"})


class Operations(TorchDispatchMode):
    """Counts the ATen operations dispatched inside the ``with`` block (``ops``), and those of :data:`HOST_READS`
    (``host_reads``, their names in ``reads``). Kernels that run outside ATen (numba, Triton) report themselves with
    :func:`mtmoe.kernel_traffic.fused_kernel`; this counter leaves them out, a subclass may count them (:meth:`kernel`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.host_reads, self.reads = 0, 0, []

    def __enter__(self):
        LISTENERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        LISTENERS.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops += 1
        if name in HOST_READS:
            self.host_reads += 1
            self.reads.append(name)
        out = func(*args, **(kwargs or {}))
        self.dispatched(func, args, kwargs or {}, out)
        return out

    def dispatched(self, func, args: tuple, kwargs: dict, out) -> None:
        """Called after each dispatched operation with its arguments and result (for subclasses)."""

    def kernel(self, name: str, read: int, written: int, flops: int = 0) -> None:
        """A kernel launched outside ATen that read and wrote these bytes (for subclasses)."""


def count(step: Callable[[], object]) -> Operations:
    """The operations of one call of ``step``."""
    counter = Operations()
    with counter:
        step()
    return counter


def phases(engine, batch: dict[str, torch.Tensor], eval_batch: dict[str, torch.Tensor]) -> dict[str, Operations]:
    """The operations of an engine's training step and evaluation batch by phase, after a warm-up step: ``train``
    (``window`` and ``after`` for a pack with local search: a step inside every trial's window, and one after it)
    and ``eval``. The engine's trials must have windows of at least 3 steps (E_perm x steps per epoch)."""
    out = {}
    engine.train_step(batch)  # warm-up: lazily built vmapped functions, kernels compiled
    if engine.template.local_search is None:
        out["train"] = count(lambda: engine.train_step(batch))
    else:
        out["window"] = count(lambda: engine.train_step(batch))
        for _, trial in engine.running:  # every trial past its window: the next steps are after it
            while trial.steps < trial.net.local_search.window_steps + 1:
                engine.train_step(batch)
        engine.train_step(batch)
        out["after"] = count(lambda: engine.train_step(batch))
    engine.prepare_evaluation()
    engine.eval_step(eval_batch)
    out["eval"] = count(lambda: engine.eval_step(eval_batch))
    return out
