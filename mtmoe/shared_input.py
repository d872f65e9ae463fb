"""The bottom's output as its readers' matmuls take it, made once, and their gradients summed in one pass.

In MMoE (Ma et al., KDD'18; comet-protocol.md §1) the bottom's output ``x`` is read by the experts' matmul and by
each gate's linear maps (COMET's split and leaf maps, Section 3: two per task). Under bf16 autocast each matmul casts
``x`` to bfloat16 itself, and autograd casts each reader's bfloat16 gradient back to float32 and adds them, one
``add`` after another: R casts forward, R casts and R - 1 adds backward, each a pass over ``[*rows, p]``. Here
:func:`shared_input` casts once and hands each reader its own view of the cast (so each gradient stays separate),
and the backward sums the R gradients in float32 in one pass: the same values, bitwise, as each is widened exactly
and the sum is taken in autograd's order (the last reader's gradient first, each partial sum rounded to float32).
Without autocast the views are of ``x`` itself, and the backward is the same sum of float32 gradients.

Three implementations of the backward's sum: numba (CPU), Triton (CUDA tensors, and CPU tensors under Triton's
interpreter; up to :data:`MAX_KERNEL_READERS` gradients) and torch operations (other dtypes, devices and counts).
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from mtmoe.host_threads import run_split
from mtmoe.kernel_traffic import fused_kernel
from mtmoe.plain_kernels import runs_fused
from mtmoe.random import _widen
from mtmoe.triton_support import grid, tl, triton, use_triton

#: The most gradients one launch of the Triton kernel sums (its pointer arguments); more go to torch operations.
MAX_KERNEL_READERS = 8
_CHUNK = 1024


def summed_reference(grads: list[Tensor], dtype: torch.dtype) -> Tensor:
    """``grads`` cast to ``dtype`` and added in order, each partial sum rounded to ``dtype``, as autograd sums the
    gradients of a tensor of that dtype (the unfused path)."""
    out = grads[0].to(dtype)
    for grad in grads[1:]:
        out = out + grad.to(dtype)
    return out


# ---- numba (CPU tensors) -------------------------------------------------------------------------------------------

@numba.njit(cache=True, nogil=True)
def _sum_cpu(grads, out: np.ndarray, lo: int, hi: int) -> None:
    """``out[lo:hi]`` (float32) = the sum of the float32 ``grads`` in order, in chunks (SIMD lanes)."""
    for start in range(lo, hi, _CHUNK):
        end = min(hi, start + _CHUNK)
        out[start:end] = grads[0][start:end]
        for t in range(1, len(grads)):
            g = grads[t]
            for j in range(start, end):
                out[j] = out[j] + g[j]


@numba.njit(cache=True, nogil=True)
def _sum_cpu_bfloat16(grads, out: np.ndarray, lo: int, hi: int) -> None:
    """:func:`_sum_cpu` of bfloat16 ``grads`` given as their uint16 bits, each widened exactly to float32; ``out``
    as uint32 bits."""
    acc = np.empty(_CHUNK, np.float32)
    acc_bits = acc.view(np.uint32)
    add_bits = np.empty(_CHUNK, np.uint32)
    add = add_bits.view(np.float32)
    for start in range(lo, hi, _CHUNK):
        m = min(hi, start + _CHUNK) - start
        _widen(grads[0][start:start + m], acc_bits)
        for t in range(1, len(grads)):
            _widen(grads[t][start:start + m], add_bits)
            for j in range(m):
                acc[j] = acc[j] + add[j]
        for j in range(m):
            out[start + j] = acc_bits[j]


# ---- Triton (CUDA tensors) -----------------------------------------------------------------------------------------

if triton is not None:
    from mtmoe.random import _widened

    # the sizes are specialised (an int divisible by 16 or not): 128-bit loads and stores
    @triton.jit
    def _sum_cuda(out_ptr, g0, g1, g2, g3, g4, g5, g6, g7, numel, COUNT: tl.constexpr, BLOCK: tl.constexpr,
                  BFLOAT16: tl.constexpr):
        """Program ``block``: the float32 sum of the first ``COUNT`` gradients ``g0, g1, ...`` in order, on
        ``BLOCK`` elements."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        acc = _widened(tl.load(g0 + offsets, mask=inside, other=0.0), False, BFLOAT16)
        if COUNT > 1:
            acc = acc + _widened(tl.load(g1 + offsets, mask=inside, other=0.0), False, BFLOAT16)
        if COUNT > 2:
            acc = acc + _widened(tl.load(g2 + offsets, mask=inside, other=0.0), False, BFLOAT16)
        if COUNT > 3:
            acc = acc + _widened(tl.load(g3 + offsets, mask=inside, other=0.0), False, BFLOAT16)
        if COUNT > 4:
            acc = acc + _widened(tl.load(g4 + offsets, mask=inside, other=0.0), False, BFLOAT16)
        if COUNT > 5:
            acc = acc + _widened(tl.load(g5 + offsets, mask=inside, other=0.0), False, BFLOAT16)
        if COUNT > 6:
            acc = acc + _widened(tl.load(g6 + offsets, mask=inside, other=0.0), False, BFLOAT16)
        if COUNT > 7:
            acc = acc + _widened(tl.load(g7 + offsets, mask=inside, other=0.0), False, BFLOAT16)
        tl.store(out_ptr + offsets, acc, mask=inside)


def summed(grads: list[Tensor], dtype: torch.dtype) -> Tensor:
    """What :func:`summed_reference` computes, in one pass where a kernel takes the gradients: float32 or bfloat16
    gradients of one dtype and shape summed in float32, on the CPU or under Triton, at most
    :data:`MAX_KERNEL_READERS` of them."""
    device = grads[0].device
    if not (dtype == torch.float32 and grads[0].dtype in (torch.float32, torch.bfloat16)
            and 1 < len(grads) <= MAX_KERNEL_READERS and grads[0].numel() > 0
            and all(g.dtype == grads[0].dtype and g.shape == grads[0].shape for g in grads)
            and runs_fused("shared_input", device)):
        return summed_reference(grads, dtype)
    dtype = grads[0].dtype
    grads = [g.contiguous() for g in grads]
    out = torch.empty(grads[0].shape, dtype=torch.float32, device=device)
    numel, read = out.numel(), sum(g.nbytes for g in grads)
    if use_triton(device):
        fused_kernel("shared input backward (triton)", read, out.nbytes)
        pointers = grads + [grads[0]] * (MAX_KERNEL_READERS - len(grads))  # the unused ones are not read
        _sum_cuda[grid(triton.cdiv(numel, _CHUNK))](out, *pointers, numel, COUNT=len(grads), BLOCK=_CHUNK,
                                                     BFLOAT16=dtype == torch.bfloat16)
        return out
    fused_kernel("shared input backward (numba)", read, out.nbytes)
    if dtype == torch.bfloat16:
        run_split(_sum_cpu_bfloat16, numel, tuple(g.view(torch.uint16).view(-1).numpy() for g in grads),
                  out.view(torch.uint32).view(-1).numpy(), min_part=_CHUNK)
    else:
        run_split(_sum_cpu, numel, tuple(g.view(-1).numpy() for g in grads), out.view(-1).numpy(),
                  min_part=_CHUNK)
    return out


class _SharedInput(torch.autograd.Function):
    """``readers`` views of ``x`` cast to ``dtype`` (of ``x`` itself when it has that dtype); the backward sums
    their gradients in ``x``'s dtype (the last view's first) by :func:`summed`."""

    @staticmethod
    def forward(x: Tensor, dtype: torch.dtype, readers: int) -> tuple[Tensor, ...]:
        cast = x.to(dtype)
        return tuple(cast.view_as(cast) for _ in range(readers))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.dtype = inputs[0].dtype
        ctx.set_materialize_grads(False)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, None, None]:
        present = [g for g in reversed(grads) if g is not None]
        if not present:
            return None, None, None
        return summed(present, ctx.dtype), None, None

    @staticmethod
    def vmap(info, in_dims, x: Tensor, dtype: torch.dtype, readers: int) -> tuple[tuple[Tensor, ...], tuple]:
        dim = in_dims[0]
        out = _SharedInput.apply(x if dim is None else x.movedim(dim, 0), dtype, readers)
        return out, (None if dim is None else 0,) * readers


def shared_input(x: Tensor, readers: int) -> tuple[Tensor, ...]:
    """``readers`` views of ``x`` as a matmul under autocast reads it (cast once to autocast's dtype where autocast
    is on for ``x``'s device and casts its dtype, else ``x``'s values), one per reader: the same values, and the
    same gradient of ``x``, as each reader reading ``x``; the gradient in one pass (the module's docstring)."""
    device = x.device.type
    dtype = x.dtype
    if torch.is_autocast_enabled(device) and x.dtype == torch.float32:
        dtype = torch.get_autocast_dtype(device)
    return _SharedInput.apply(x, dtype, readers)
