"""Which fused kernels run as their torch operations instead: ``MTMOE_PLAIN_KERNELS``.

Each fused kernel of the suite (numba on the CPU, Triton for CUDA tensors) is tested against a torch-operations
reference that computes the same values (bitwise, or where its docstring says, to the rounding of a sum in another
order). ``MTMOE_PLAIN_KERNELS``, a comma-separated list of the names in :data:`NAMES` (or ``all``), makes the named
kernels run as that reference: slower (more memory traffic, more launches), the same values. The names in
:data:`CAPTURES` are CUDA graphs, not kernels: ``eval_graphs`` dispatches the evaluation batches eagerly instead of
replaying their graphs (the same kernels). It is an escape hatch for a GPU on which a kernel or a capture fails its
check (``benchmarks/gpu_check.py``'s preflight trains the study this way rather than not at all) or a kernel will not
compile (a GPU architecture Triton's kernels were not checked on), and for a machine where numba misbehaves. Read
from the environment once, at the first dispatch; an unknown name is a :class:`~mtmoe.errors.UsageError` (the CLI
checks it before any work: one line, exit 2).
"""
from __future__ import annotations

import functools
import os
import sys

import torch

from mtmoe.errors import UsageError
from mtmoe.triton_support import use_triton

ENVIRONMENT = "MTMOE_PLAIN_KERNELS"
#: The kernels ``MTMOE_PLAIN_KERNELS`` can name, and the torch operations each runs as instead.
KERNELS = {
    "adam": "the packed Adam update (mtmoe.pack.adam): the element-wise update, block by block",
    "dropout": "the counter-based dropout (mtmoe.random): its reference in torch integer operations",
    "epilogue": "the experts' and towers' bias add, ReLU and dropout (mtmoe.epilogue): add, relu, dropout",
    "mixing": "the mixing's backward (mtmoe.mixing): bmm, then the epilogue's backward; where "
              "--model.fused_mixing_sums is on, the forward by the epilogue and bmm, the weights' and bias's "
              "gradients by bmm and sum",
    "reach": "COMET's reach of its trees (mtmoe.gates.reach): the smooth step, index_select and product",
    "shared_input": "the sum of the bottom's readers' gradients (mtmoe.shared_input): casts and adds",
}
#: The captures it can name: each replayed CUDA graph dispatched eagerly instead (GPU only).
CAPTURES = {
    "eval_graphs": "the CUDA graphs of the evaluation batches (mtmoe.pack.engine): each batch dispatched eagerly",
}
#: Every name ``MTMOE_PLAIN_KERNELS`` takes.
NAMES = {**KERNELS, **CAPTURES}


def parse(text: str) -> frozenset[str]:
    """The names a ``MTMOE_PLAIN_KERNELS`` value gives (``all``: every one of :data:`NAMES`; empty: none)."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    if names == {"all"}:
        return frozenset(NAMES)
    unknown = sorted(names - set(NAMES))
    if unknown:
        raise UsageError(f"{ENVIRONMENT}={text!r}: unknown kernel {unknown[0]!r}; give a comma-separated list of "
                         f"{', '.join(sorted(NAMES))}, or all")
    return frozenset(names)


@functools.cache
def plain_kernels() -> frozenset[str]:
    """The kernels the environment's ``MTMOE_PLAIN_KERNELS`` names (read once)."""
    return parse(os.environ.get(ENVIRONMENT, ""))


def announce() -> None:
    """For a command, before any work: refuse a bad ``MTMOE_PLAIN_KERNELS`` (a :class:`~mtmoe.errors.UsageError`)
    and say on stderr which kernels it names, so that a slower run says why."""
    names = plain_kernels()
    if names:
        print(f"note: {ENVIRONMENT}: {', '.join(sorted(names))} run as torch operations (the same values, slower)",
              file=sys.stderr, flush=True)


def runs_fused(kernel: str, device: torch.device) -> bool:
    """Whether ``kernel`` (a name of :data:`KERNELS`) runs as its fused kernel for tensors on ``device``: Triton's
    for CUDA tensors (and every tensor under Triton's interpreter), numba's on the CPU, unless
    ``MTMOE_PLAIN_KERNELS`` names it."""
    return kernel not in plain_kernels() and (use_triton(device) or device.type == "cpu")
