"""A step's device cost measured without the device: its matmul FLOPs (``torch.utils.flop_counter``), the bytes its
kernels read and write and its kernel launches (:class:`Traffic`, a :class:`~mtmoe.pack.operations.Operations`
counter), the time they project on an H100 (:func:`projected_ms`) and the floor no implementation of the
architecture can go below (:func:`floor_bytes`). ``benchmarks/bench_packs.py --roofline`` prints them; the
definitions are in ``benchmarks/README.md``.

The projection is a roofline: ``max(FLOPs / the matrix rate of the precision, bytes / BANDWIDTH)``, with no launch
cost (a CUDA graph replays the step) and no overlap loss. Every kernel is assumed to run at the peak rate of what
bounds it, so a projection is a lower bound of the step's time on the device, not a prediction.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from mtmoe.pack.operations import Operations

#: H100 SXM5 dense matrix rates in FLOP/s (NVIDIA H100 Tensor Core GPU datasheet: FP32 67 TFLOPS on the CUDA cores;
#: TF32 989 and BF16 1,979 TFLOPS "with sparsity", halved for dense matrices), by precision.
H100_FLOPS = {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12}
#: Device-memory bandwidth in bytes/s: the device-to-device copy rate measured on the lent H100 (issue 31).
BANDWIDTH = 3.0e12
#: Operations that launch no kernel and move nothing: allocations without a write, and views that ATen's schema
#: does not mark as views.
NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
                       "lift_fresh"})
#: Operations that write their first argument without reading it.
WRITE_ONLY = frozenset({"copy_", "fill_", "zero_"})


def tensor_bytes(tensor: Tensor) -> int:
    """The bytes of the distinct elements a kernel addresses in ``tensor`` (an expanded dimension, of stride 0,
    counts once)."""
    elements = math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride != 0)
    return elements * tensor.element_size()


def _tensors(value) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


class Traffic(Operations):
    """Counts, beside the operations, the bytes each dispatched operation reads (its tensor arguments) and writes (its
    tensor results) and the kernels it launches: views and allocations move nothing and launch nothing. Kernels
    that run outside ATen report their own traffic (:func:`mtmoe.kernel_traffic.fused_kernel`), and ``flops`` sums
    the FLOPs of the matrix products they compute (which ``FlopCounterMode`` does not see). ``by_kernel``: bytes by
    operation name."""

    def __init__(self) -> None:
        super().__init__()
        self.read, self.written, self.launches, self.flops = 0, 0, 0, 0
        self.by_kernel: Counter[str] = Counter()

    def dispatched(self, func, args: tuple, kwargs: dict, out) -> None:
        name = func.overloadpacket.__name__
        if func.is_view or name in NO_KERNEL:
            return
        inputs = _tensors(list(args) + list(kwargs.values()))
        if name in WRITE_ONLY:
            inputs = inputs[1:]
        self.kernel(name, sum(map(tensor_bytes, inputs)), sum(map(tensor_bytes, _tensors(out))))

    def kernel(self, name: str, read: int, written: int, flops: int = 0) -> None:
        self.read, self.written, self.launches = self.read + read, self.written + written, self.launches + 1
        self.flops += flops
        self.by_kernel[name] += read + written

    @property
    def bytes(self) -> int:
        return self.read + self.written


@dataclass
class Cost:
    """What one call of a step costs: matmul FLOPs, bytes read and written, kernel launches, bytes by kernel."""

    flops: int
    bytes: int
    launches: int
    by_kernel: dict[str, int] = field(default_factory=dict)

    def extrapolated(self, other: Cost, steps: int) -> Cost:
        """``self + steps * (other - self)``: the cost at P + steps from the costs at P (self) and P + 1 (other)."""
        kernels = set(self.by_kernel) | set(other.by_kernel)
        return Cost(*(a + steps * (b - a) for a, b in ((self.flops, other.flops), (self.bytes, other.bytes),
                                                       (self.launches, other.launches))),
                    {k: self.by_kernel.get(k, 0) + steps * (other.by_kernel.get(k, 0) - self.by_kernel.get(k, 0))
                     for k in kernels})


def measure(step: Callable[[], object]) -> Cost:
    """The cost of one call of ``step``."""
    flops, traffic = FlopCounterMode(display=False), Traffic()
    with flops, traffic:
        step()
    return Cost(flops.get_total_flops() + traffic.flops, traffic.bytes, traffic.launches, dict(traffic.by_kernel))


def projected_ms(flops: float, nbytes: float, precision: str) -> float:
    """The H100 roofline time of a step in milliseconds: the slower of its matrix arithmetic at the precision's rate
    (``fp32``, ``tf32``, ``bf16``) and its memory traffic at :data:`BANDWIDTH`."""
    return 1000 * max(flops / H100_FLOPS[precision], nbytes / BANDWIDTH)


def floor_bytes(parameters: int, batch: int, activations: int, training: bool) -> int:
    """The traffic no implementation avoids. Training: every float32 parameter, its gradient and Adam's two moments
    read once and written once (32 bytes a parameter), the batch read once, and the activations the backward pass
    needs (``activations`` bytes) written once and read once. Evaluation: the parameters and the batch read once."""
    if training:
        return 32 * parameters + batch + 2 * activations
    return 4 * parameters + batch
