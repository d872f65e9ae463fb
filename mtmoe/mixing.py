"""The dense experts' epilogue and the gates' weighted sum of their outputs (MMoE's mixing, ``z_t = sum_i g_t(x)_i
f_i(x)``: Ma et al., KDD'18; comet-protocol.md §1) as one autograd node, so that the backward produces the gradient
of the experts' matmul output in one pass.

Unfused, the backward of the mixing writes the gradient of ``h``, the experts' ``[*rows, n * units]`` output
(``bmm(weights^T, grad)``), and the epilogue's backward reads it and ``h`` again to write the gradient of ``y``
(:func:`mtmoe.epilogue.epilogue_backward`). Here one kernel reads ``h`` (its mask) and the small ``weights`` and
``grad`` and writes the gradient of ``y``: each element is ``sum_t weights[t, i] grad[t, u]`` (the tasks' products
accumulated in order, each after the first by a fused multiply-add, as a GEMM accumulates), rounded to the dtype as
the matmul's output is, then times the dropout scale where ``h > 0``, else 0, rounded again. In bfloat16 the products
of two bfloat16 values are exact in the float32 accumulator, so with two tasks (the recommenders') the gradient is
bitwise the unfused one; otherwise it is equal to the rounding of a T-term sum. The weights' gradient is torch's
``bmm(grad, h^T)`` as autograd computes it, the bias's torch's row sum (:mod:`mtmoe.epilogue`). Under TF32 matmuls
(``--model.matmul_precision high``) the T-term sum is in full float32, where the unfused ``bmm`` would round its
inputs to TF32.

The forward is the epilogue's kernel and torch's ``bmm``: bitwise the unfused forward. Only a gate that does not
read the experts' outputs (``Gate.needs_expert_outputs``) lets :class:`mtmoe.mmoe.MMoE` mix through here: the
gates then run before the experts' epilogue (after their matmul), and ``h`` has no reader but the mixing.

With ``sums`` (``--model.fused_mixing_sums``, off by default) the same pass also computes the mixing's two other
gradients: the expert bias's, the gradient of ``y`` summed over a trial's rows (row by row, in the accumulator of
the dtype), and the gates' weights', ``sum_u grad[t, u] h[i * U + u]``, where torch's ``sum`` and ``bmm`` would read
the gradient of ``y`` and ``h`` again. Their summation orders are not torch's (which differ between its CPU and GPU
kernels too), so they equal them to float rounding only; a trial's sums are its own, the same at any pack size.

Three implementations of the backward kernel, as for the epilogue: numba (CPU: float32, float64, bfloat16), Triton
(CUDA tensors, and CPU tensors under Triton's interpreter), torch operations (other dtypes and devices).
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from mtmoe.epilogue import _epilogue_kernel, _fused, epilogue_backward, leading
from mtmoe.host_threads import run_split
from mtmoe.kernel_traffic import fused_kernel
from mtmoe.random import _bfloat16_bits, _fma, dropout_scale, dropout_threshold
from mtmoe.triton_support import grid, tl, triton, use_triton


def mix(weights: Tensor, h: Tensor) -> Tensor:
    """``weights`` ``[*rows, T, n]`` times the experts' outputs ``h`` ``[*rows, n * units]``: ``[*rows, T, units]``,
    by one ``bmm`` over the rows (as ``torch.func.vmap`` batches MMoE's)."""
    tasks, n = weights.shape[-2:]
    units = h.shape[-1] // n
    out = torch.bmm(weights.reshape(-1, tasks, n), h.reshape(-1, n, units))
    return out.view(*weights.shape[:-1], units)


def mix_backward_reference(grad: Tensor, weights: Tensor, h: Tensor, p: float) -> Tensor:
    """The unfused backward: the mixing's gradient of ``h`` (``bmm(weights^T, grad)``), then the epilogue's."""
    tasks, n = weights.shape[-2:]
    grad_h = torch.bmm(weights.reshape(-1, tasks, n).transpose(1, 2), grad.reshape(-1, tasks, grad.shape[-1]))
    return epilogue_backward(grad_h.view(h.shape), h, p)


# ---- numba (CPU tensors) -------------------------------------------------------------------------------------------

@numba.njit(cache=True, nogil=True, inline="always")
def _mix_row(grad: np.ndarray, weights: np.ndarray, h: np.ndarray, out: np.ndarray, scale: np.float32, r: int,
             acc: np.ndarray) -> None:
    """Row ``r`` of ``out`` ``[R, n * U]`` from ``grad`` ``[R, T, U]``, ``weights`` ``[R, T, n]`` and ``h``
    (float32 or float64): where ``h > 0``, ``sum_t weights[t, i] grad[t, u]`` (fused multiply-adds after the first
    product) times ``scale``; else 0. Each expert's ``U`` columns at once (SIMD lanes), in ``acc`` (``U``)."""
    tasks, units, n = grad.shape[1], grad.shape[2], weights.shape[2]
    for i in range(n):
        w = weights[r, 0, i]
        for u in range(units):
            acc[u] = w * grad[r, 0, u]
        for t in range(1, tasks):
            w = weights[r, t, i]
            for u in range(units):
                acc[u] = _fma(w, grad[r, t, u], acc[u])
        h_row, out_row = h[r, i * units:(i + 1) * units], out[r, i * units:(i + 1) * units]
        for u in range(units):
            out_row[u] = acc[u] * scale if h_row[u] > 0 else 0


@numba.njit(cache=True, nogil=True)
def _mix_backward_cpu(grad: np.ndarray, weights: np.ndarray, h: np.ndarray, out: np.ndarray, scale: np.float32,
                      lo: int, hi: int) -> None:
    """Rows ``[lo, hi)`` of ``out`` (:func:`_mix_row`)."""
    acc = np.empty_like(grad[0, 0])
    for r in range(lo, hi):
        _mix_row(grad, weights, h, out, scale, r, acc)


@numba.njit(cache=True, nogil=True, inline="always")
def _mix_row_bfloat16(grad: np.ndarray, weights: np.ndarray, h: np.ndarray, out: np.ndarray, scale: np.float32,
                      r: int, w_bits: np.ndarray, g_bits: np.ndarray, acc: np.ndarray) -> None:
    """:func:`_mix_row` of bfloat16 bits: the sum in float32 (each product exact) rounded to bfloat16, the
    product with ``scale`` in float32 rounded again; ``grad``'s row widened into ``g_bits`` (``T * U``), the
    weights' into ``w_bits`` (``T * n``), ``acc`` float32 (``U``). A bfloat16 value is positive when its sign bit
    is clear and its bits are nonzero and at most +inf's (0x7F80)."""
    tasks, units, n = grad.shape[1], grad.shape[2], weights.shape[2]
    w, g = w_bits.view(np.float32), g_bits.view(np.float32)
    acc_bits = acc.view(np.uint32)
    for t in range(tasks):
        for i in range(n):
            w_bits[t * n + i] = np.uint32(weights[r, t, i]) << np.uint32(16)
        for u in range(units):
            g_bits[t * units + u] = np.uint32(grad[r, t, u]) << np.uint32(16)
    for i in range(n):
        for u in range(units):
            acc[u] = w[i] * g[u]
        for t in range(1, tasks):
            wt = w[t * n + i]
            for u in range(units):
                acc[u] = _fma(wt, g[t * units + u], acc[u])
        for u in range(units):
            acc_bits[u] = np.uint32(_bfloat16_bits(acc_bits[u])) << np.uint32(16)
        for u in range(units):
            acc[u] = acc[u] * scale
        h_row, out_row = h[r, i * units:(i + 1) * units], out[r, i * units:(i + 1) * units]
        for u in range(units):
            bits = h_row[u]
            positive = bits != np.uint16(0) and bits <= np.uint16(0x7F80)
            out_row[u] = _bfloat16_bits(acc_bits[u]) if positive else np.uint16(0)


@numba.njit(cache=True, nogil=True)
def _mix_backward_cpu_bfloat16(grad: np.ndarray, weights: np.ndarray, h: np.ndarray, out: np.ndarray,
                               scale: np.float32, lo: int, hi: int) -> None:
    """Rows ``[lo, hi)`` of ``out``, of bfloat16 bits (:func:`_mix_row_bfloat16`)."""
    tasks, units, n = grad.shape[1], grad.shape[2], weights.shape[2]
    w_bits, g_bits = np.empty(tasks * n, np.uint32), np.empty(tasks * units, np.uint32)
    acc = np.empty(units, np.float32)
    for r in range(lo, hi):
        _mix_row_bfloat16(grad, weights, h, out, scale, r, w_bits, g_bits, acc)


@numba.njit(cache=True, nogil=True)
def _mix_backward_sums_cpu(grad: np.ndarray, weights: np.ndarray, h: np.ndarray, out: np.ndarray,
                           bias_grad: np.ndarray, weights_grad: np.ndarray, scale: np.float32, group_rows: int,
                           lo: int, hi: int) -> None:
    """Groups ``[lo, hi)`` of ``group_rows`` rows each (a trial's): their rows of ``out`` (:func:`_mix_row`), and
    the mixing's two other gradients in the same pass: ``bias_grad[g]`` ``[n * U]`` the sum of group ``g``'s rows
    of ``out`` (row by row, in order, in the dtype), ``weights_grad`` ``[R, T, n]`` ``sum_u grad[t, u] h[i * U +
    u]`` (fused multiply-adds over ``u`` in order, after the first product)."""
    tasks, units, n = grad.shape[1], grad.shape[2], weights.shape[2]
    acc = np.empty_like(grad[0, 0])
    total = np.empty_like(out[0])
    for group in range(lo, hi):
        total[:] = 0
        for r in range(group * group_rows, (group + 1) * group_rows):
            _mix_row(grad, weights, h, out, scale, r, acc)
            for c in range(total.shape[0]):
                total[c] += out[r, c]
            for t in range(tasks):
                for i in range(n):
                    s = grad[r, t, 0] * h[r, i * units]
                    for u in range(1, units):
                        s = _fma(grad[r, t, u], h[r, i * units + u], s)
                    weights_grad[r, t, i] = s
        bias_grad[group] = total


@numba.njit(cache=True, nogil=True)
def _mix_backward_sums_cpu_bfloat16(grad: np.ndarray, weights: np.ndarray, h: np.ndarray, out: np.ndarray,
                                    bias_grad: np.ndarray, weights_grad: np.ndarray, scale: np.float32,
                                    group_rows: int, lo: int, hi: int) -> None:
    """:func:`_mix_backward_sums_cpu` of bfloat16 bits: the sums in float32 (each product exact; ``out``'s rounded
    values summed) rounded to bfloat16 at the end."""
    tasks, units, n = grad.shape[1], grad.shape[2], weights.shape[2]
    columns = h.shape[1]
    w_bits, g_bits = np.empty(tasks * n, np.uint32), np.empty(tasks * units, np.uint32)
    g = g_bits.view(np.float32)
    acc = np.empty(units, np.float32)
    wide_bits = np.empty(columns, np.uint32)
    wide = wide_bits.view(np.float32)
    total = np.empty(columns, np.float32)
    total_bits = total.view(np.uint32)
    cell = np.empty(1, np.float32)
    cell_bits = cell.view(np.uint32)
    for group in range(lo, hi):
        total[:] = 0
        for r in range(group * group_rows, (group + 1) * group_rows):
            _mix_row_bfloat16(grad, weights, h, out, scale, r, w_bits, g_bits, acc)
            for c in range(columns):
                wide_bits[c] = np.uint32(out[r, c]) << np.uint32(16)
            for c in range(columns):
                total[c] += wide[c]
            for c in range(columns):
                wide_bits[c] = np.uint32(h[r, c]) << np.uint32(16)
            for t in range(tasks):
                for i in range(n):
                    s = g[t * units] * wide[i * units]
                    for u in range(1, units):
                        s = _fma(g[t * units + u], wide[i * units + u], s)
                    cell[0] = s
                    weights_grad[r, t, i] = _bfloat16_bits(cell_bits[0])
        for c in range(columns):
            bias_grad[group, c] = _bfloat16_bits(total_bits[c])


# ---- Triton (CUDA tensors) -----------------------------------------------------------------------------------------

if triton is not None:
    from mtmoe.random import _rounded, _widened

    # the sizes are specialised (an int divisible by 16 or not): 128-bit loads and stores
    @triton.jit(do_not_specialize=["n", "tasks"])
    def _mix_backward_cuda(grad_ptr, weights_ptr, h_ptr, out_ptr, columns, units, n, tasks, scale,
                           BLOCK: tl.constexpr, FLOAT64: tl.constexpr, BFLOAT16: tl.constexpr):
        """Program ``(row, block)``: :func:`_mix_backward_cpu` on ``BLOCK`` columns of row ``row``. The rows are
        the grid's first dimension, the only one that may exceed 65,535 (a pack's ``P * B`` rows do)."""
        row = tl.program_id(0).to(tl.int64)
        # a row's columns in int32: a 64-bit division is emulated, some tens of instructions an element
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < columns
        expert = offsets // units
        unit = offsets - expert * units
        w_row, g_row = weights_ptr + row * tasks * n + expert, grad_ptr + row * tasks * units + unit
        acc = (_widened(tl.load(w_row, mask=inside, other=0.0), FLOAT64, BFLOAT16)
               * _widened(tl.load(g_row, mask=inside, other=0.0), FLOAT64, BFLOAT16))
        for t in range(1, tasks):
            w = _widened(tl.load(w_row + t * n, mask=inside, other=0.0), FLOAT64, BFLOAT16)
            g = _widened(tl.load(g_row + t * units, mask=inside, other=0.0), FLOAT64, BFLOAT16)
            acc = tl.fma(w, g, acc)
        acc = _widened(_rounded(acc, BFLOAT16), FLOAT64, BFLOAT16)
        h = _widened(tl.load(h_ptr + row * columns + offsets, mask=inside, other=0.0), FLOAT64, BFLOAT16)
        out = tl.where(h > 0, acc * scale, 0.0)
        tl.store(out_ptr + row * columns + offsets, _rounded(out, BFLOAT16).to(out_ptr.dtype.element_ty),
                 mask=inside)


    @triton.jit(do_not_specialize=["group_rows", "n", "tasks"])
    def _mix_backward_sums_cuda(grad_ptr, weights_ptr, h_ptr, out_ptr, bias_grad_ptr, weights_grad_ptr, group_rows,
                                n, tasks, scale, UNITS: tl.constexpr, UNITS_P2: tl.constexpr, EXPERTS: tl.constexpr,
                                BFLOAT16: tl.constexpr):
        """Program ``(block, group)``: :func:`_mix_backward_sums_cpu` on the ``EXPERTS`` experts of ``block`` (all
        their ``UNITS`` columns) over the ``group_rows`` rows of ``group``, in order: ``out`` as
        :func:`_mix_backward_cuda` computes it, ``bias_grad`` summed row by row in float32, ``weights_grad`` each
        a ``tl.sum`` of the products over the units (Triton's reduction order)."""
        group = tl.program_id(1).to(tl.int64)
        expert = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)[:, None]
        unit = tl.arange(0, UNITS_P2)[None, :]
        expert_inside, unit_inside = expert < n, unit < UNITS
        inside = expert_inside & unit_inside
        columns = n * UNITS
        column = expert * UNITS + unit
        total = tl.zeros([EXPERTS, UNITS_P2], tl.float32)
        for k in range(group_rows):
            row = group * group_rows + k
            w_row, g_row = weights_ptr + row * tasks * n + expert, grad_ptr + row * tasks * UNITS + unit
            h = _widened(tl.load(h_ptr + row * columns + column, mask=inside, other=0.0), False, BFLOAT16)
            g = _widened(tl.load(g_row, mask=unit_inside, other=0.0), False, BFLOAT16)
            acc = _widened(tl.load(w_row, mask=expert_inside, other=0.0), False, BFLOAT16) * g
            wg_row = weights_grad_ptr + row * tasks * n + tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
            wg_inside = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS) < n
            tl.store(wg_row, _rounded(tl.sum(g * h, axis=1), BFLOAT16).to(weights_grad_ptr.dtype.element_ty),
                     mask=wg_inside)
            for t in range(1, tasks):
                g = _widened(tl.load(g_row + t * UNITS, mask=unit_inside, other=0.0), False, BFLOAT16)
                acc = tl.fma(_widened(tl.load(w_row + t * n, mask=expert_inside, other=0.0), False, BFLOAT16), g,
                             acc)
                tl.store(wg_row + t * n, _rounded(tl.sum(g * h, axis=1), BFLOAT16).to(
                    weights_grad_ptr.dtype.element_ty), mask=wg_inside)
            acc = _widened(_rounded(acc, BFLOAT16), False, BFLOAT16)
            out = _rounded(tl.where(h > 0, acc * scale, 0.0), BFLOAT16)
            tl.store(out_ptr + row * columns + column, out.to(out_ptr.dtype.element_ty), mask=inside)
            total += _widened(out, False, BFLOAT16)
        tl.store(bias_grad_ptr + group * columns + column, _rounded(total, BFLOAT16).to(
            bias_grad_ptr.dtype.element_ty), mask=inside)


_BLOCK = 1024


def mix_backward(grad: Tensor, weights: Tensor, h: Tensor, p: float) -> Tensor:
    """The gradient of the experts' matmul output ``y`` (``[*rows, n * units]``, as ``h``) from the gradient of the
    mixture ``grad`` ``[*rows, T, units]``, the weights ``[*rows, T, n]`` (in ``h``'s dtype) and ``h``: what
    :func:`mix_backward_reference` computes, in one pass."""
    if not (_fused(h, "mixing") and grad.dtype == weights.dtype == h.dtype) or h.numel() == 0:
        return mix_backward_reference(grad, weights, h, p)
    tasks, n = weights.shape[-2:]
    units, columns = grad.shape[-1], h.shape[-1]
    grad, weights, h = (x.contiguous() for x in (grad, weights, h))
    rows = h.numel() // columns
    scale = dropout_scale(p)
    out = torch.empty_like(h)
    read = grad.nbytes + weights.nbytes + h.nbytes
    flops = 2 * rows * tasks * n * units  # the product bmm(weights^T, grad) in it
    if use_triton(h.device):
        fused_kernel("mix backward (triton)", read, out.nbytes, flops)
        _mix_backward_cuda[grid(rows, triton.cdiv(columns, _BLOCK))](
            grad, weights, h, out, columns, units, n, tasks, scale, BLOCK=_BLOCK,
            FLOAT64=h.dtype == torch.float64, BFLOAT16=h.dtype == torch.bfloat16)
        return out
    fused_kernel("mix backward (numba)", read, out.nbytes, flops)
    shaped = [x.view(rows, *shape) for x, shape in ((grad, (tasks, units)), (weights, (tasks, n)), (h, (columns,)),
                                                   (out, (columns,)))]
    if h.dtype == torch.bfloat16:
        run_split(_mix_backward_cpu_bfloat16, rows, *(x.view(torch.uint16).numpy() for x in shaped),
                  np.float32(scale), min_part=16)
    else:
        run_split(_mix_backward_cpu, rows, *(x.numpy() for x in shaped), np.float32(scale), min_part=16)
    return out


_SUMS_DTYPES = (torch.float32, torch.float64, torch.bfloat16)  # numba's; Triton's: float32 and bfloat16


def mix_backward_sums(grad: Tensor, weights: Tensor, h: Tensor, p: float,
                      groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`mix_backward`'s gradient of ``y`` and, in the same pass, the mixing's two other gradients: the
    bias's, the sum of the gradient of ``y`` over each of ``groups`` equal groups of rows (a trial's rows in a
    pack; ``[groups, n * units]``), and the weights' (``bmm(grad, h^T)``, ``[*rows, T, n]``), in ``h``'s dtype.
    The gradient of ``y`` is :func:`mix_backward`'s bitwise; the two sums are in the kernel's order (row by row;
    over the units), so they equal torch's ``sum`` and ``bmm`` to float rounding, not bitwise. A trial's sums do
    not depend on the others or on their number. Torch operations where no kernel runs."""
    tasks, n = weights.shape[-2:]
    units, columns = grad.shape[-1], h.shape[-1]
    rows = h.numel() // columns
    triton_dtypes = (torch.float32, torch.bfloat16)
    if not (_fused(h, "mixing") and grad.dtype == weights.dtype == h.dtype and h.numel()) or h.dtype not in (
            triton_dtypes if use_triton(h.device) else _SUMS_DTYPES):
        grad_y = mix_backward(grad, weights, h, p)
        return grad_y, grad_y.view(groups, -1, columns).sum(1), mix_weights_gradient(grad, h, weights)
    grad, weights, h = (x.contiguous() for x in (grad, weights, h))
    scale = dropout_scale(p)
    out = torch.empty_like(h)
    bias_grad = torch.empty(groups, columns, dtype=h.dtype, device=h.device)
    weights_grad = torch.empty(weights.shape, dtype=h.dtype, device=h.device)
    read = grad.nbytes + weights.nbytes + h.nbytes
    written = out.nbytes + bias_grad.nbytes + weights_grad.nbytes
    flops = 4 * rows * tasks * n * units  # the products bmm(weights^T, grad) and bmm(grad, h^T) in it
    if use_triton(h.device):
        fused_kernel("mix backward (triton)", read, written, flops)
        units_p2 = triton.next_power_of_2(units)
        experts = min(triton.next_power_of_2(n), max(1, _BLOCK // units_p2))
        _mix_backward_sums_cuda[grid(triton.cdiv(n, experts), groups)](
            grad, weights, h, out, bias_grad, weights_grad, rows // groups, n, tasks, scale, UNITS=units,
            UNITS_P2=units_p2, EXPERTS=experts, BFLOAT16=h.dtype == torch.bfloat16)
        return out, bias_grad, weights_grad
    fused_kernel("mix backward (numba)", read, written, flops)
    shaped = [x.view(rows, *shape) for x, shape in ((grad, (tasks, units)), (weights, (tasks, n)), (h, (columns,)),
                                                   (out, (columns,)))] + [bias_grad, weights_grad.view(rows, tasks, n)]
    if h.dtype == torch.bfloat16:
        run_split(_mix_backward_sums_cpu_bfloat16, groups, *(x.view(torch.uint16).numpy() for x in shaped),
                  np.float32(scale), rows // groups, min_part=1)
    else:
        run_split(_mix_backward_sums_cpu, groups, *(x.numpy() for x in shaped), np.float32(scale), rows // groups,
                  min_part=1)
    return out, bias_grad, weights_grad


def mix_weights_gradient(grad: Tensor, h: Tensor, weights: Tensor) -> Tensor:
    """The gradient of the mixing's weights ``[*rows, T, n]``, ``bmm(grad, h^T)`` per row, in ``h``'s dtype."""
    tasks, n = weights.shape[-2:]
    return torch.bmm(grad.reshape(-1, tasks, grad.shape[-1]),
                     h.reshape(-1, n, h.shape[-1] // n).transpose(1, 2)).view(weights.shape)


class _MixedEpilogue(torch.autograd.Function):
    """``(mix(weights, h), h)`` for ``h = epilogue(y, bias)``: the forward by the epilogue's kernel and ``bmm`` (the
    weights cast to ``h``'s dtype, as autocast casts them for the unfused ``bmm``); ``h`` is returned for the
    backward to keep, not differentiable. The backward by :func:`mix_backward` and ``bmm``, or with ``sums`` by
    :func:`mix_backward_sums`. Under ``torch.func.vmap`` the rule below runs it once for all trials (the vmapped
    dimension leads every tensor)."""

    @staticmethod
    def forward(y: Tensor, bias: Tensor, weights: Tensor, seed: Tensor | None, step: Tensor | None, site: int,
                p: float, sums: bool) -> tuple[Tensor, Tensor]:
        h = _epilogue_kernel(y, bias, seed, step, site, p)
        return mix(weights.to(h.dtype), h), h

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        y, bias, weights, _, _, _, ctx.p, ctx.sums = inputs
        _, h = output
        ctx.mark_non_differentiable(h)
        ctx.set_materialize_grads(False)
        ctx.weights_dtype = weights.dtype
        ctx.rows = tuple(range(bias.dim() - 1, y.dim() - 1))
        ctx.bias_shape = bias.shape
        ctx.save_for_backward(h, weights.detach().to(h.dtype))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor | None, _) -> tuple[Tensor | None, ...]:
        if grad is None:
            return (None,) * 8
        h, weights = ctx.saved_tensors
        if ctx.sums:
            grad_y, grad_bias, grad_weights = mix_backward_sums(grad, weights, h, ctx.p, ctx.bias_shape[:-1].numel())
            grad_bias = grad_bias.view(ctx.bias_shape)
        else:
            grad_y = mix_backward(grad, weights, h, ctx.p)
            grad_bias = grad_y.sum(ctx.rows) if ctx.needs_input_grad[1] else None
            grad_weights = mix_weights_gradient(grad, h, weights) if ctx.needs_input_grad[2] else None
        grad_bias = grad_bias if ctx.needs_input_grad[1] else None
        grad_weights = grad_weights.to(ctx.weights_dtype) if ctx.needs_input_grad[2] else None
        return grad_y, grad_bias, grad_weights, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, y: Tensor, bias: Tensor, weights: Tensor, seed: Tensor | None, step: Tensor | None,
             site: int, p: float, sums: bool) -> tuple[tuple[Tensor, Tensor], tuple[int, int]]:
        y, bias, weights, seed, step = leading(info.batch_size, (y, bias, weights, seed, step), in_dims)
        return _MixedEpilogue.apply(y, bias, weights, seed, step, site, p, sums), (0, 0)


def mixed_experts(y: Tensor, bias: Tensor, weights: Tensor, p: float = 0.0, seed: Tensor | None = None,
                  step: Tensor | None = None, site: int = 0, sums: bool = False) -> Tensor:
    """``mix(weights, dropout(relu(y + bias)))``, :func:`mtmoe.epilogue.bias_relu_dropout`'s experts' outputs
    weighted by the gates: ``y`` ``[*rows, n * units]``, ``bias`` ``[n * units]`` (per trial under
    ``torch.func.vmap``), ``weights`` ``[*rows, T, n]``; returns ``[*rows, T, units]``. Its backward writes the
    gradient of ``y`` in one pass (the module's docstring); with ``sums``, the bias's and the weights' gradients
    in that pass too, in its own summation order (:func:`mix_backward_sums`: not bitwise torch's)."""
    dropout_threshold(p)
    if p > 0 and (seed is None or step is None or seed.dtype != torch.int64 or step.dtype != torch.int64):
        raise TypeError("dropout draws from a stream: seed and step must be int64 tensors")
    if p == 0:
        seed = step = None
    return _MixedEpilogue.apply(y, bias, weights, seed, step, site, p, sums)[0]
