"""The dense expert layer's epilogue in one pass: ``h = dropout(relu(y + bias))`` (Supplement S1.2: ``Dense(units)
-> ReLU -> Dropout(p)``), where ``y = x W^T`` is the matmul's output, and its backward in one pass.

Unfused, the bias add, the ReLU and the dropout each read and write the whole ``[P, B, n * units]`` activation, and
the backward again twice (the dropout's, then the ReLU's). Here the forward reads ``y`` once and writes ``h`` once;
the backward reads the gradient of ``h`` and ``h`` and writes the gradient of ``y``: ``h > 0`` is the ReLU's and
the dropout's mask together (a dropped element is 0, a kept one is ``relu(y + bias)`` times the scale, which is at
least 1), and the kept elements' gradient is the upstream gradient times :func:`mtmoe.random.dropout_scale`. The
bias gradient is torch's sum of the gradient of ``y`` over the rows, as the unfused add's backward computes it.

Each element is computed as the unfused operations compute it, rounding included: ``y + bias`` rounded to the dtype
(bfloat16 under autocast), the ReLU, then the product with the dropout multiplier (drawn from the trial's stream,
:mod:`mtmoe.random`: the same mask as :func:`mtmoe.random.dropout`) rounded again. So the fused forward is bitwise
the unfused one, and the backward too except that a dropped element whose ``relu(y + bias)`` was positive gets the
gradient ``+0`` where the unfused path has ``grad * 0`` (``-0`` for a negative gradient, NaN for an infinite one).

Three implementations: a numba kernel for CPU tensors (float32, float64 and bfloat16), a Triton kernel for CUDA
tensors (and for CPU tensors under Triton's interpreter), and torch operations (other dtypes and devices).
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from mtmoe.host_threads import run_split
from mtmoe.kernel_traffic import fused_kernel
from mtmoe.plain_kernels import runs_fused
from mtmoe.random import (
    _CHUNK, _bfloat16_bits, _chunks, _dropout_kernel, _narrow, _scale_chunk, _scratch, _unit_words, _widen,
    dropout_reference, dropout_scale, dropout_threshold, stream_arguments, triton_lanes,
)
from mtmoe.triton_support import grid, tl, triton, use_triton

_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def epilogue_reference(y: Tensor, bias: Tensor, seed: Tensor | None, step: Tensor | None, site: int,
                       p: float) -> Tensor:
    """The unfused operations: ``(y + bias)``, ReLU, and with ``p > 0`` :func:`mtmoe.random.dropout_reference`.
    ``bias`` is ``[*trials, N]`` and ``y`` ``[*trials, *rows, N]``."""
    trials = bias.shape[:-1]
    h = (y + bias.view(*trials, *(1,) * (y.dim() - bias.dim()), bias.shape[-1])).relu()
    return h if p == 0 else dropout_reference(h, seed.expand(trials), site, step.expand(trials), p)


# ---- numba (CPU tensors) -------------------------------------------------------------------------------------------

@numba.njit(cache=True, inline="always")
def _bias_relu(y: np.ndarray, bias: np.ndarray, out: np.ndarray, column: int) -> None:
    """``out = relu(y + bias[column:...])``, the bias's columns cycling from ``column``; NaN stays NaN, as torch's."""
    columns = bias.shape[0]
    for j in range(y.shape[0]):
        v = y[j] + bias[column]
        out[j] = 0 if v < 0 else v
        column += 1
        if column == columns:
            column = 0


@numba.njit(cache=True, inline="always")
def _unit(unit: int, n: int, dropout: bool, key: np.ndarray, words: np.ndarray, seeds: np.ndarray, steps: np.ndarray,
          iv0: int, iv1: int) -> tuple[int, int, int]:
    """Work unit ``unit`` of a ``[T, n]`` tensor: its trial, first element and length, and with ``dropout`` its
    stream's words in ``words`` (:func:`mtmoe.random._unit_words`)."""
    if dropout:
        return _unit_words(unit, n, key, words, seeds, steps, iv0, iv1)
    chunks = _chunks(n)
    start = (unit % chunks) * 2 * _CHUNK
    return unit // chunks, start, min(2 * _CHUNK, n - start)


@numba.njit(cache=True, nogil=True)
def _epilogue_cpu(y: np.ndarray, bias: np.ndarray, out: np.ndarray, seeds: np.ndarray, steps: np.ndarray, iv0: int,
                  iv1: int, threshold: np.uint32, scale: np.float32, dropout: bool, lo: int, hi: int) -> None:
    """The epilogue of the work units ``[lo, hi)`` (chunks of ``2 * _CHUNK`` elements of one trial) of ``y``
    ``[T, n]`` (float32 or float64) with ``bias`` ``[T, N]``, into ``out``."""
    n = y.shape[1]
    columns = bias.shape[1]
    key, words, _, _ = _scratch()
    for unit in range(lo, hi):
        t, start, m = _unit(unit, n, dropout, key, words, seeds, steps, iv0, iv1)
        out_chunk = out[t, start:start + m]
        _bias_relu(y[t, start:start + m], bias[t], out_chunk, start % columns)
        if dropout:
            _scale_chunk(out_chunk, out_chunk, words, threshold, scale)


@numba.njit(cache=True, nogil=True)
def _epilogue_cpu_bfloat16(y: np.ndarray, bias: np.ndarray, out: np.ndarray, seeds: np.ndarray, steps: np.ndarray,
                           iv0: int, iv1: int, threshold: np.uint32, scale: np.float32, dropout: bool, lo: int,
                           hi: int) -> None:
    """:func:`_epilogue_cpu` of bfloat16 ``y`` and ``out`` given as their uint16 bits, ``bias`` widened to float32:
    ``y + bias`` in float32 rounded to bfloat16 (as torch's bfloat16 add), the ReLU, the product with the dropout
    multiplier in float32 rounded again (as :func:`mtmoe.random.dropout`)."""
    n = y.shape[1]
    columns = bias.shape[1]
    key, words, values, value_bits = _scratch()
    for unit in range(lo, hi):
        t, start, m = _unit(unit, n, dropout, key, words, seeds, steps, iv0, iv1)
        _widen(y[t, start:start + m], value_bits)
        _bias_relu(values[:m], bias[t], values[:m], start % columns)  # the ReLU commutes with the rounding
        for j in range(m):
            value_bits[j] = np.uint32(_bfloat16_bits(value_bits[j])) << np.uint32(16)
        if dropout:
            _scale_chunk(values[:m], values[:m], words, threshold, scale)
        _narrow(value_bits, out[t, start:start + m])


@numba.njit(cache=True, nogil=True)
def _epilogue_backward_cpu(grad: np.ndarray, h: np.ndarray, out: np.ndarray, scale: np.float32, lo: int,
                           hi: int) -> None:
    """``out = grad * scale`` where ``h > 0``, else 0, on the flat elements ``[lo, hi)`` (float32 or float64)."""
    for i in range(lo, hi):
        out[i] = grad[i] * scale if h[i] > 0 else 0


@numba.njit(cache=True, nogil=True)
def _epilogue_backward_cpu_bfloat16(grad: np.ndarray, h: np.ndarray, out: np.ndarray, scale: np.float32, lo: int,
                                    hi: int) -> None:
    """:func:`_epilogue_backward_cpu` of bfloat16 bits: the product in float32, rounded to bfloat16. A bfloat16
    value is positive when its sign bit is clear and its bits are nonzero and at most +inf's (0x7F80)."""
    _, _, values, value_bits = _scratch()
    for start in range(lo, hi, 2 * _CHUNK):
        m = min(2 * _CHUNK, hi - start)
        _widen(grad[start:start + m], value_bits)
        for j in range(m):
            bits = h[start + j]
            positive = bits != np.uint16(0) and bits <= np.uint16(0x7F80)
            values[j] = values[j] * scale if positive else np.float32(0)
        _narrow(value_bits, out[start:start + m])


# ---- Triton (CUDA tensors) -----------------------------------------------------------------------------------------

if triton is not None:
    from mtmoe.random import _keep_multiplier, _rounded, _widened

    # the sizes are specialised (an int divisible by 16 or not): 128-bit loads and stores
    @triton.jit(do_not_specialize=["iv0", "iv1", "threshold"])
    def _epilogue_cuda(y_ptr, bias_ptr, out_ptr, seed_ptr, step_ptr, n, columns, iv0, iv1, threshold, scale,
                       BLOCK: tl.constexpr, DROPOUT: tl.constexpr, FLOAT64: tl.constexpr, BFLOAT16: tl.constexpr):
        """Program ``(block, trial)``: :func:`_epilogue_cpu` on ``BLOCK`` elements of trial ``trial``."""
        trial = tl.program_id(1).to(tl.int64)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        y = _widened(tl.load(y_ptr + trial * n + offsets, mask=inside, other=0.0), FLOAT64, BFLOAT16)
        column = offsets.to(tl.int32) % columns  # 32-bit (a 64-bit modulo is emulated): a trial's n < 2^31
        b = _widened(tl.load(bias_ptr + trial * columns + column, mask=inside, other=0.0), FLOAT64,
                     BFLOAT16)
        v = _widened(_rounded(y + b, BFLOAT16), FLOAT64, BFLOAT16)
        v = tl.where(v < 0, 0.0, v)
        if DROPOUT:
            v = v * _keep_multiplier(seed_ptr, step_ptr, trial, offsets, iv0, iv1, threshold, scale)
        tl.store(out_ptr + trial * n + offsets, _rounded(v, BFLOAT16).to(out_ptr.dtype.element_ty), mask=inside)

    # the sizes are specialised (an int divisible by 16 or not): 128-bit loads and stores
    @triton.jit
    def _epilogue_backward_cuda(grad_ptr, h_ptr, out_ptr, numel, scale, BLOCK: tl.constexpr, FLOAT64: tl.constexpr,
                                BFLOAT16: tl.constexpr):
        """Program ``block``: :func:`_epilogue_backward_cpu` on ``BLOCK`` elements."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        g = _widened(tl.load(grad_ptr + offsets, mask=inside, other=0.0), FLOAT64, BFLOAT16)
        h = _widened(tl.load(h_ptr + offsets, mask=inside, other=0.0), FLOAT64, BFLOAT16)
        out = tl.where(h > 0, g * scale, 0.0)
        tl.store(out_ptr + offsets, _rounded(out, BFLOAT16).to(out_ptr.dtype.element_ty), mask=inside)


_BLOCK = 1024


def _fused(tensor: Tensor, kernel: str = "epilogue") -> bool:
    """Whether ``tensor`` goes to ``kernel``'s kernel: a dtype they compute, on CUDA (Triton) or the CPU (numba),
    unless ``MTMOE_PLAIN_KERNELS`` names it (:mod:`mtmoe.plain_kernels`)."""
    return tensor.dtype in _KERNEL_DTYPES and runs_fused(kernel, tensor.device)


def _epilogue_kernel(y: Tensor, bias: Tensor, seed: Tensor | None, step: Tensor | None, site: int,
                     p: float) -> Tensor:
    """:func:`epilogue_reference`'s output, by the Triton kernel, the numba kernel or the reference (whose dropout
    is the dropout kernel where one runs: :func:`mtmoe.random.dropout_reference` in torch operations reads and
    writes a ``[*rows, N]`` tensor some tens of times)."""
    trials = bias.shape[:-1]
    if y.shape[:len(trials)] != trials or y.shape[-1] != bias.shape[-1]:
        raise ValueError(f"y {tuple(y.shape)} is not [*trials, *rows, N] for a bias {tuple(bias.shape)}")
    count, n, columns = math.prod(trials), math.prod(y.shape[len(trials):]), bias.shape[-1]
    wide = use_triton(y.device) and n >= 2**31  # the Triton kernel indexes a trial's columns in 32 bits
    if not _fused(y) or bias.dtype != y.dtype or y.numel() == 0 or wide:
        if p == 0:
            return epilogue_reference(y, bias, seed, step, site, p)
        h = epilogue_reference(y, bias, None, None, site, 0.0)
        return _dropout_kernel(h, seed.expand(trials), step.expand(trials), site, p)
    y, bias = y.detach().contiguous(), bias.detach().contiguous()
    dropout = p > 0
    seeds, steps, iv0, iv1 = stream_arguments(seed if dropout else None, step, trials, site, y.device)
    threshold, scale = dropout_threshold(p), dropout_scale(p)
    out = torch.empty_like(y)
    read = y.nbytes + bias.nbytes + (16 * count if dropout else 0)
    if use_triton(y.device):
        fused_kernel("epilogue (triton)", read, out.nbytes)
        _epilogue_cuda[grid(triton.cdiv(n, _BLOCK), count)](
            y, bias, out, seeds, steps, n, columns, *triton_lanes(iv0, iv1), threshold, scale, BLOCK=_BLOCK,
            DROPOUT=dropout, FLOAT64=y.dtype == torch.float64, BFLOAT16=y.dtype == torch.bfloat16)
        return out
    arguments = (seeds.numpy(), steps.numpy(), iv0, iv1, np.uint32(threshold), np.float32(scale), dropout)
    units = count * _chunks(n)
    fused_kernel("epilogue (numba)", read, out.nbytes)
    if y.dtype == torch.bfloat16:
        y_bits, out_bits = (x.view(torch.uint16).view(count, n).numpy() for x in (y, out))
        run_split(_epilogue_cpu_bfloat16, units, y_bits, bias.float().view(count, columns).numpy(), out_bits,
                  *arguments, min_part=16)
    else:
        run_split(_epilogue_cpu, units, y.view(count, n).numpy(), bias.view(count, columns).numpy(),
                  out.view(count, n).numpy(), *arguments, min_part=16)
    return out


def epilogue_backward(grad: Tensor, h: Tensor, p: float) -> Tensor:
    """The gradient of ``y`` from the gradient of ``h`` and ``h``: ``grad * dropout_scale(p)`` where ``h > 0``,
    else 0, rounded to the dtype."""
    scale = dropout_scale(p)
    grad = grad.contiguous()
    if grad.dtype != h.dtype or not _fused(grad) or grad.numel() == 0:
        return torch.where(h > 0, grad * scale, 0).to(grad.dtype)
    out = torch.empty_like(grad)
    if use_triton(grad.device):
        fused_kernel("epilogue backward (triton)", grad.nbytes + h.nbytes, out.nbytes)
        _epilogue_backward_cuda[grid(triton.cdiv(grad.numel(), _BLOCK))](
            grad, h, out, grad.numel(), scale, BLOCK=_BLOCK, FLOAT64=grad.dtype == torch.float64,
            BFLOAT16=grad.dtype == torch.bfloat16)
        return out
    fused_kernel("epilogue backward (numba)", grad.nbytes + h.nbytes, out.nbytes)
    if grad.dtype == torch.bfloat16:
        run_split(_epilogue_backward_cpu_bfloat16, grad.numel(),
                  *(x.view(torch.uint16).view(-1).numpy() for x in (grad, h, out)), np.float32(scale))
    else:
        run_split(_epilogue_backward_cpu, grad.numel(), *(x.view(-1).numpy() for x in (grad, h, out)),
                  np.float32(scale))
    return out


class _Epilogue(torch.autograd.Function):
    """``epilogue_reference(y, bias, seed, step, site, p)`` by :func:`_epilogue_kernel`; the backward is
    :func:`epilogue_backward` and the bias's gradient the sum over the rows. Under ``torch.func.vmap`` the rule
    below runs the kernel once for all trials (the vmapped dimension leads every tensor), and regular autograd
    records it, as :class:`mtmoe.random._FusedDropout` does."""

    @staticmethod
    def forward(y: Tensor, bias: Tensor, seed: Tensor | None, step: Tensor | None, site: int, p: float) -> Tensor:
        return _epilogue_kernel(y, bias, seed, step, site, p)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        y, bias, _, _, _, ctx.p = inputs
        ctx.rows = tuple(range(bias.dim() - 1, y.dim() - 1))
        ctx.save_for_backward(output)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        (h,) = ctx.saved_tensors
        grad_y = epilogue_backward(grad, h, ctx.p)
        grad_bias = grad_y.sum(ctx.rows) if ctx.needs_input_grad[1] else None
        return grad_y, grad_bias, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, y: Tensor, bias: Tensor, seed: Tensor | None, step: Tensor | None, site: int,
             p: float) -> tuple[Tensor, int]:
        y, bias, seed, step = leading(info.batch_size, (y, bias, seed, step), in_dims)
        return _Epilogue.apply(y, bias, seed, step, site, p), 0


def leading(batch_size: int, tensors: tuple[Tensor | None, ...], in_dims: tuple[int | None, ...]
            ) -> list[Tensor | None]:
    """A vmap rule's tensors ``(y, bias, ..., seed, step)`` with the vmapped dimension first (expanded to
    ``batch_size`` where one is not batched); the stream's seed and step, the last two, one per trial (``bias``'s
    leading dimensions) when given."""
    out = [x if x is None else x.expand(batch_size, *x.shape) if dim is None else x.movedim(dim, 0)
           for x, dim in zip(tensors, in_dims)]
    if out[-2] is not None:
        out[-2:] = (x.expand(out[1].shape[:-1]) for x in out[-2:])
    return out


def bias_relu_dropout(y: Tensor, bias: Tensor, p: float = 0.0, seed: Tensor | None = None,
                      step: Tensor | None = None, site: int = 0) -> Tensor:
    """``dropout(relu(y + bias))`` in one pass (and its backward in one): ``y`` is ``[*rows, N]`` and ``bias``
    ``[N]`` (per trial under ``torch.func.vmap``); with ``p > 0`` the dropout mask is that of
    :func:`mtmoe.random.dropout` from the stream ``(seed, site, step)`` (int64 0-d tensors), with ``p = 0`` there is
    no dropout. Bitwise the unfused operations (the module's docstring says where the backward differs in the sign
    of zero)."""
    dropout_threshold(p)
    if p > 0 and (seed is None or step is None or seed.dtype != torch.int64 or step.dtype != torch.int64):
        raise TypeError("dropout draws from a stream: seed and step must be int64 tensors")
    if p == 0:
        seed = step = None
    return _Epilogue.apply(y, bias, seed, step, site, p)
