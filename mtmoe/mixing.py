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

With ``sums`` (``--model.fused_mixing_sums``, off by default) ``h`` is never written (:class:`_MixedSums`): the
forward makes each row's ``h`` from ``y`` (the epilogue kernel's values, the same dropout mask) and mixes it at once
(:func:`mixed_forward`), keeping ``y`` for the backward; the backward makes it again and computes, in one pass, the
gradient of ``y`` (bitwise as above), the expert bias's (the gradient of ``y`` summed over a trial's rows, row by
row, in the accumulator of the dtype) and the gates' weights' (``sum_u grad[t, u] h[i * U + u]``)
(:func:`mix_backward_sums`). Without it ``h`` is written once and read three times (the forward's ``bmm``, the
backward's kernel, the weights' gradient's ``bmm``) and the gradient of ``y`` read by the bias's ``sum``; with it
``y`` is read twice in their place. Their summation orders are not torch's (which differ between its CPU and GPU
kernels too), so the mixture and the two gradients equal them to float rounding only; a trial's values are its own,
the same at any pack size.

Three implementations of each kernel, as for the epilogue: numba (CPU: float32, float64, bfloat16), Triton (CUDA
tensors, and CPU tensors under Triton's interpreter; the sums' kernels float32 and bfloat16), torch operations
(other dtypes and devices; with ``sums``, the path without it).
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from mtmoe.epilogue import _bias_relu, _epilogue_kernel, _fused, epilogue_backward, leading
from mtmoe.host_threads import run_split
from mtmoe.kernel_traffic import fused_kernel
from mtmoe.random import (
    _CHUNK, MAX_POSITIONS, _bfloat16_bits, _derive_keys, _fma, _narrow, _scale_chunk, _scratch, _stream, _widen,
    dropout_scale, dropout_threshold, stream_arguments, triton_lanes,
)
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
def _mix_row(grad: np.ndarray, weights: np.ndarray, h_row: np.ndarray, out: np.ndarray, scale: np.float32, r: int,
             acc: np.ndarray) -> None:
    """Row ``r`` of ``out`` ``[R, n * U]`` from ``grad`` ``[R, T, U]``, ``weights`` ``[R, T, n]`` and ``h_row``, the
    row's ``h`` (float32 or float64): where ``h > 0``, ``sum_t weights[t, i] grad[t, u]`` (fused multiply-adds after
    the first product) times ``scale``; else 0. Each expert's ``U`` columns at once (SIMD lanes), in ``acc``
    (``U``)."""
    tasks, units, n = grad.shape[1], grad.shape[2], weights.shape[2]
    for i in range(n):
        w = weights[r, 0, i]
        for u in range(units):
            acc[u] = w * grad[r, 0, u]
        for t in range(1, tasks):
            w = weights[r, t, i]
            for u in range(units):
                acc[u] = _fma(w, grad[r, t, u], acc[u])
        h_expert, out_row = h_row[i * units:(i + 1) * units], out[r, i * units:(i + 1) * units]
        for u in range(units):
            out_row[u] = acc[u] * scale if h_expert[u] > 0 else 0


@numba.njit(cache=True, nogil=True)
def _mix_backward_cpu(grad: np.ndarray, weights: np.ndarray, h: np.ndarray, out: np.ndarray, scale: np.float32,
                      lo: int, hi: int) -> None:
    """Rows ``[lo, hi)`` of ``out`` (:func:`_mix_row`)."""
    acc = np.empty_like(grad[0, 0])
    for r in range(lo, hi):
        _mix_row(grad, weights, h[r], out, scale, r, acc)


@numba.njit(cache=True, nogil=True, inline="always")
def _mix_row_bfloat16(grad: np.ndarray, weights: np.ndarray, h_row: np.ndarray, out: np.ndarray, scale: np.float32,
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
        h_expert, out_row = h_row[i * units:(i + 1) * units], out[r, i * units:(i + 1) * units]
        for u in range(units):
            bits = h_expert[u]
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
        _mix_row_bfloat16(grad, weights, h[r], out, scale, r, w_bits, g_bits, acc)


# ---- numba, the mixing's sums (--model.fused_mixing_sums): h recomputed from y, never written ------------------

_ROW_CHUNK = 2 * _CHUNK - 2  # elements of a row's h made at once: even, and their words (one more where the first
# element is odd) fit the stream's scratch of _CHUNK words


@numba.njit(cache=True, inline="always")
def _scaled_from(values: np.ndarray, out: np.ndarray, words: np.ndarray, odd: int, threshold: np.uint32,
                 scale: np.float32) -> None:
    """:func:`mtmoe.random._scale_chunk` of elements whose first has an odd flat index where ``odd``: its bits are
    the upper half of ``words[0]``, the others' from ``words[1]`` on."""
    if odd:
        out[0] = values[0] * (scale * np.float32((words[0] >> np.uint32(16)) >= threshold))
        _scale_chunk(values[1:], out[1:], words[1:], threshold, scale)
    else:
        _scale_chunk(values, out, words, threshold, scale)


@numba.njit(cache=True, inline="always")
def _h_row(y_row: np.ndarray, bias_row: np.ndarray, h_row: np.ndarray, element: int, dropout: bool, key: np.ndarray,
           words: np.ndarray, threshold: np.uint32, scale: np.float32) -> None:
    """One row's ``h = dropout(relu(y + bias))`` (float32 or float64), the epilogue's values
    (:func:`mtmoe.epilogue._epilogue_cpu`): ``element`` is the flat index of the row's first element in its trial,
    the dropout stream's position; ``key`` holds the trial's key lanes."""
    columns = y_row.shape[0]
    for c in range(0, columns, _ROW_CHUNK):
        m = min(_ROW_CHUNK, columns - c)
        _bias_relu(y_row[c:c + m], bias_row, h_row[c:c + m], c)
        if dropout:
            odd = (element + c) & 1
            _stream(words, (m + odd + 1) // 2, (element + c) // 2, key[0], key[1])
            _scaled_from(h_row[c:c + m], h_row[c:c + m], words, odd, threshold, scale)


@numba.njit(cache=True, inline="always")
def _h_row_bfloat16(y_row: np.ndarray, bias_row: np.ndarray, h_row: np.ndarray, element: int, dropout: bool,
                    key: np.ndarray, words: np.ndarray, values: np.ndarray, threshold: np.uint32,
                    scale: np.float32) -> None:
    """:func:`_h_row` of bfloat16 bits (``bias_row`` widened to float32), as
    :func:`mtmoe.epilogue._epilogue_cpu_bfloat16` rounds: ``y + bias`` to bfloat16, then the dropout's product."""
    columns = y_row.shape[0]
    value_bits = values.view(np.uint32)
    for c in range(0, columns, _ROW_CHUNK):
        m = min(_ROW_CHUNK, columns - c)
        _widen(y_row[c:c + m], value_bits)
        _bias_relu(values[:m], bias_row, values[:m], c)  # the ReLU commutes with the rounding
        for j in range(m):
            value_bits[j] = np.uint32(_bfloat16_bits(value_bits[j])) << np.uint32(16)
        if dropout:
            odd = (element + c) & 1
            _stream(words, (m + odd + 1) // 2, (element + c) // 2, key[0], key[1])
            _scaled_from(values[:m], values[:m], words, odd, threshold, scale)
        _narrow(value_bits, h_row[c:c + m])


@numba.njit(cache=True, inline="always")
def _trial_key(key: np.ndarray, trial: int, seeds: np.ndarray, steps: np.ndarray, iv0: int, iv1: int) -> None:
    """``key`` (:func:`mtmoe.random._scratch`) made ``trial``'s where it is another trial's."""
    if trial != key[2]:
        _derive_keys(key, seeds[trial], steps[trial], iv0, iv1)
        key[2] = trial


@numba.njit(cache=True, inline="always")
def _bfloat16_scratch(columns: int) -> tuple:
    """A bfloat16 sums kernel's buffers: the stream's (:func:`mtmoe.random._scratch`: key, words, float32 values),
    a row's ``h`` bits, and that row widened to float32 (its bits, its values)."""
    key, words, values, _ = _scratch()
    wide_bits = np.empty(columns, np.uint32)
    return key, words, values, np.empty(columns, np.uint16), wide_bits, wide_bits.view(np.float32)


@numba.njit(cache=True, nogil=True)
def _mixed_forward_cpu(y: np.ndarray, bias: np.ndarray, weights: np.ndarray, out: np.ndarray, seeds: np.ndarray,
                       steps: np.ndarray, iv0: int, iv1: int, threshold: np.uint32, scale: np.float32, dropout: bool,
                       group_rows: int, lo: int, hi: int) -> None:
    """Rows ``[lo, hi)`` of the mixture ``out`` ``[R, T, U]`` (float32 or float64): each row's ``h`` made from ``y``
    ``[R, n * U]`` and its trial's ``bias`` (the trials' rows ``group_rows`` each, in order; :func:`_h_row`), then
    ``sum_i weights[t, i] h[i * U + u]``, the experts in order, fused multiply-adds after the first product, in the
    dtype (as a GEMM accumulates)."""
    tasks, units, n = out.shape[1], out.shape[2], weights.shape[2]
    key, words, _, _ = _scratch()
    h_row = np.empty_like(y[0])
    for r in range(lo, hi):
        trial = r // group_rows
        if dropout:
            _trial_key(key, trial, seeds, steps, iv0, iv1)
        _h_row(y[r], bias[trial], h_row, (r - trial * group_rows) * y.shape[1], dropout, key, words, threshold, scale)
        for t in range(tasks):
            w, acc = weights[r, t, 0], out[r, t]
            for u in range(units):
                acc[u] = w * h_row[u]
            for i in range(1, n):
                w = weights[r, t, i]
                for u in range(units):
                    acc[u] = _fma(w, h_row[i * units + u], acc[u])


@numba.njit(cache=True, nogil=True)
def _mixed_forward_cpu_bfloat16(y: np.ndarray, bias: np.ndarray, weights: np.ndarray, out: np.ndarray,
                                seeds: np.ndarray, steps: np.ndarray, iv0: int, iv1: int, threshold: np.uint32,
                                scale: np.float32, dropout: bool, group_rows: int, lo: int, hi: int) -> None:
    """:func:`_mixed_forward_cpu` of bfloat16 bits (``bias`` widened to float32): each product exact in the float32
    accumulator, the sum rounded to bfloat16."""
    tasks, units, n = out.shape[1], out.shape[2], weights.shape[2]
    columns = y.shape[1]
    key, words, values, h_row, wide_bits, wide = _bfloat16_scratch(columns)
    acc = np.empty(units, np.float32)
    acc_bits = acc.view(np.uint32)
    w = np.empty(1, np.uint32)
    w_value = w.view(np.float32)
    for r in range(lo, hi):
        trial = r // group_rows
        if dropout:
            _trial_key(key, trial, seeds, steps, iv0, iv1)
        _h_row_bfloat16(y[r], bias[trial], h_row, (r - trial * group_rows) * columns, dropout, key, words, values,
                        threshold, scale)
        _widen(h_row, wide_bits)
        for t in range(tasks):
            w[0] = np.uint32(weights[r, t, 0]) << np.uint32(16)
            for u in range(units):
                acc[u] = w_value[0] * wide[u]
            for i in range(1, n):
                w[0] = np.uint32(weights[r, t, i]) << np.uint32(16)
                for u in range(units):
                    acc[u] = _fma(w_value[0], wide[i * units + u], acc[u])
            for u in range(units):
                out[r, t, u] = _bfloat16_bits(acc_bits[u])


@numba.njit(cache=True, nogil=True)
def _mix_backward_sums_cpu(grad: np.ndarray, weights: np.ndarray, y: np.ndarray, bias: np.ndarray, out: np.ndarray,
                           bias_grad: np.ndarray, weights_grad: np.ndarray, seeds: np.ndarray, steps: np.ndarray,
                           iv0: int, iv1: int, threshold: np.uint32, scale: np.float32, dropout: bool,
                           group_rows: int, lo: int, hi: int) -> None:
    """Groups ``[lo, hi)`` of ``group_rows`` rows each (a trial's, with its ``bias`` and stream): each row's ``h``
    made again from ``y`` (:func:`_h_row`), then its row of ``out`` (:func:`_mix_row`), and the mixing's two other
    gradients in the same pass: ``bias_grad[g]`` ``[n * U]`` the sum of group ``g``'s rows of ``out`` (row by row,
    in order, in the dtype), ``weights_grad`` ``[R, T, n]`` ``sum_u grad[t, u] h[i * U + u]`` (fused multiply-adds
    over ``u`` in order, after the first product)."""
    tasks, units, n = grad.shape[1], grad.shape[2], weights.shape[2]
    key, words, _, _ = _scratch()
    acc = np.empty_like(grad[0, 0])
    total = np.empty_like(out[0])
    h_row = np.empty_like(y[0])
    for group in range(lo, hi):
        total[:] = 0
        if dropout:
            _trial_key(key, group, seeds, steps, iv0, iv1)
        for r in range(group * group_rows, (group + 1) * group_rows):
            _h_row(y[r], bias[group], h_row, (r - group * group_rows) * y.shape[1], dropout, key, words, threshold,
                   scale)
            _mix_row(grad, weights, h_row, out, scale, r, acc)
            for c in range(total.shape[0]):
                total[c] += out[r, c]
            for t in range(tasks):
                for i in range(n):
                    s = grad[r, t, 0] * h_row[i * units]
                    for u in range(1, units):
                        s = _fma(grad[r, t, u], h_row[i * units + u], s)
                    weights_grad[r, t, i] = s
        bias_grad[group] = total


@numba.njit(cache=True, nogil=True)
def _mix_backward_sums_cpu_bfloat16(grad: np.ndarray, weights: np.ndarray, y: np.ndarray, bias: np.ndarray,
                                    out: np.ndarray, bias_grad: np.ndarray, weights_grad: np.ndarray,
                                    seeds: np.ndarray, steps: np.ndarray, iv0: int, iv1: int, threshold: np.uint32,
                                    scale: np.float32, dropout: bool, group_rows: int, lo: int, hi: int) -> None:
    """:func:`_mix_backward_sums_cpu` of bfloat16 bits (``bias`` widened to float32; ``h`` by
    :func:`_h_row_bfloat16`): the sums in float32 (each product exact; ``out``'s rounded values summed) rounded to
    bfloat16 at the end."""
    tasks, units, n = grad.shape[1], grad.shape[2], weights.shape[2]
    columns = y.shape[1]
    key, words, values, h_row, wide_bits, wide = _bfloat16_scratch(columns)
    w_bits, g_bits = np.empty(tasks * n, np.uint32), np.empty(tasks * units, np.uint32)
    g = g_bits.view(np.float32)
    acc = np.empty(units, np.float32)
    total = np.empty(columns, np.float32)
    total_bits = total.view(np.uint32)
    cell = np.empty(1, np.float32)
    cell_bits = cell.view(np.uint32)
    for group in range(lo, hi):
        total[:] = 0
        if dropout:
            _trial_key(key, group, seeds, steps, iv0, iv1)
        for r in range(group * group_rows, (group + 1) * group_rows):
            _h_row_bfloat16(y[r], bias[group], h_row, (r - group * group_rows) * columns, dropout, key, words, values,
                            threshold, scale)
            _mix_row_bfloat16(grad, weights, h_row, out, scale, r, w_bits, g_bits, acc)
            for c in range(columns):
                wide_bits[c] = np.uint32(out[r, c]) << np.uint32(16)
            for c in range(columns):
                total[c] += wide[c]
            _widen(h_row, wide_bits)
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
    from mtmoe.random import _keep_multiplier, _rounded, _widened

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


    @triton.jit
    def _expert_outputs(y_ptrs, bias_ptrs, inside, seed_ptr, step_ptr, trial, element, iv0, iv1, threshold, scale,
                        DROPOUT: tl.constexpr, BFLOAT16: tl.constexpr):
        """``h = dropout(relu(y + bias))`` of the elements at ``y_ptrs`` (float32, or bfloat16 widened) as
        ``_epilogue_cuda`` computes and stores it, widened again: ``element`` their flat indices in trial ``trial``
        (the dropout stream's positions)."""
        y = _widened(tl.load(y_ptrs, mask=inside, other=0.0), False, BFLOAT16)
        b = _widened(tl.load(bias_ptrs, mask=inside, other=0.0), False, BFLOAT16)
        v = _widened(_rounded(y + b, BFLOAT16), False, BFLOAT16)
        v = tl.where(v < 0, 0.0, v)
        if DROPOUT:
            v = v * _keep_multiplier(seed_ptr, step_ptr, trial, element, iv0, iv1, threshold, scale)
        return _widened(_rounded(v, BFLOAT16), False, BFLOAT16)

    @triton.jit(do_not_specialize=["group_rows", "n", "tasks", "iv0", "iv1", "threshold"])
    def _mixed_forward_cuda(y_ptr, bias_ptr, weights_ptr, out_ptr, seed_ptr, step_ptr, group_rows, n, tasks, iv0, iv1,
                            threshold, scale, UNITS: tl.constexpr, BLOCK: tl.constexpr, TASKS: tl.constexpr,
                            DROPOUT: tl.constexpr, BFLOAT16: tl.constexpr):
        """Program ``(row, block)``: :func:`_mixed_forward_cpu` on ``BLOCK`` units of row ``row``, every task
        (``TASKS``, a power of two, at least ``tasks``). The rows are the grid's first dimension."""
        row = tl.program_id(0).to(tl.int64)
        trial = row // group_rows
        unit = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        task = tl.arange(0, TASKS)
        unit_inside, task_inside = unit < UNITS, task < tasks
        columns = n * UNITS
        y_row, bias_row = y_ptr + row * columns, bias_ptr + trial * columns
        first = (row - trial * group_rows) * columns
        w_row = weights_ptr + row * tasks * n + task * n
        h = _expert_outputs(y_row + unit, bias_row + unit, unit_inside, seed_ptr, step_ptr, trial, first + unit, iv0,
                            iv1, threshold, scale, DROPOUT, BFLOAT16)
        acc = _widened(tl.load(w_row, mask=task_inside, other=0.0), False, BFLOAT16)[:, None] * h[None, :]
        for i in range(1, n):
            column = i * UNITS + unit
            h = _expert_outputs(y_row + column, bias_row + column, unit_inside, seed_ptr, step_ptr, trial,
                                first + column, iv0, iv1, threshold, scale, DROPOUT, BFLOAT16)
            w = _widened(tl.load(w_row + i, mask=task_inside, other=0.0), False, BFLOAT16)
            acc = tl.fma(w[:, None], h[None, :], acc)
        tl.store(out_ptr + row * tasks * UNITS + task[:, None] * UNITS + unit[None, :],
                 _rounded(acc, BFLOAT16).to(out_ptr.dtype.element_ty), mask=task_inside[:, None] & unit_inside[None, :])

    @triton.jit(do_not_specialize=["group_rows", "n", "tasks", "iv0", "iv1", "threshold"])
    def _mix_backward_sums_cuda(grad_ptr, weights_ptr, y_ptr, bias_ptr, out_ptr, bias_grad_ptr, weights_grad_ptr,
                                seed_ptr, step_ptr, group_rows, n, tasks, iv0, iv1, threshold, scale,
                                UNITS: tl.constexpr, UNITS_P2: tl.constexpr, EXPERTS: tl.constexpr,
                                DROPOUT: tl.constexpr, BFLOAT16: tl.constexpr):
        """Program ``(block, group)``: :func:`_mix_backward_sums_cpu` on the ``EXPERTS`` experts of ``block`` (all
        their ``UNITS`` columns) over the ``group_rows`` rows of ``group`` (a trial, with its bias and stream), in
        order: ``h`` made again from ``y`` (:func:`_expert_outputs`), ``out`` as :func:`_mix_backward_cuda` computes
        it, ``bias_grad`` summed row by row in float32, ``weights_grad`` each a ``tl.sum`` of the products over the
        units (Triton's reduction order)."""
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
            element = (row - group * group_rows) * columns + column  # in the trial: the dropout stream's position
            h = _expert_outputs(y_ptr + row * columns + column, bias_ptr + group * columns + column, inside, seed_ptr,
                                step_ptr, group, element, iv0, iv1, threshold, scale, DROPOUT, BFLOAT16)
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


def sums_fused(y: Tensor, bias: Tensor) -> bool:
    """Whether ``--model.fused_mixing_sums``' kernels (:func:`mixed_forward`, :func:`mix_backward_sums`) take ``y``
    ``[*trials, *rows, N]`` and ``bias`` ``[*trials, N]``: a dtype they compute on that device (Triton: float32 and
    bfloat16; numba: float64 too), ``bias`` in it, neither the epilogue nor the mixing named by
    ``MTMOE_PLAIN_KERNELS``, a trial's elements within the dropout stream's positions (on a GPU, below 2^31: the
    kernels index a trial's columns in 32 bits)."""
    per_trial = y.numel() // max(1, math.prod(bias.shape[:-1]))
    on_gpu = use_triton(y.device)
    return (y.dtype in ((torch.float32, torch.bfloat16) if on_gpu else _SUMS_DTYPES) and bias.dtype == y.dtype
            and y.numel() > 0 and _fused(y, "epilogue") and _fused(y, "mixing")
            and per_trial < (2**31 if on_gpu else 2 * MAX_POSITIONS))


def _streams(y: Tensor, bias: Tensor, seed: Tensor | None, step: Tensor | None, site: int,
             p: float) -> tuple[int, Tensor, Tensor, int, int, int, float]:
    """What the sums' kernels take of the trials of ``bias`` ``[*trials, N]``: their number, each one's seed and
    step (zeros without dropout: not read), the site's initial key lanes, the dropout's threshold and scale."""
    trials = bias.shape[:-1]
    seeds, steps, iv0, iv1 = stream_arguments(seed if p > 0 else None, step, trials, site, y.device)
    return math.prod(trials), seeds, steps, iv0, iv1, dropout_threshold(p), dropout_scale(p)


def mixed_forward(y: Tensor, bias: Tensor, weights: Tensor, seed: Tensor | None, step: Tensor | None, site: int,
                  p: float) -> Tensor:
    """``mix(weights, h)`` for ``h = dropout(relu(y + bias))`` in one pass that never writes ``h``: ``y``
    ``[*trials, *rows, n * units]``, ``bias`` ``[*trials, n * units]``, ``weights`` ``[*trials, *rows, T, n]`` in
    ``y``'s dtype; returns ``[*trials, *rows, T, units]``. Each row's ``h`` is the epilogue kernel's, bitwise (the
    same mask); the weighted sum runs over the experts in order, fused multiply-adds after the first product, in the
    accumulator of the dtype (float32 for bfloat16), rounded to the dtype: ``mix``'s values to the rounding of an
    n-term sum, not bitwise a GEMM's (another order). A trial's rows are its own: the same at any pack size. Only
    where :func:`sums_fused`."""
    tasks, n = weights.shape[-2:]
    columns = y.shape[-1]
    units = columns // n
    count, seeds, steps, iv0, iv1, threshold, scale = _streams(y, bias, seed, step, site, p)
    y, bias, weights = (x.detach().contiguous() for x in (y, bias, weights))
    rows = y.numel() // columns
    out = torch.empty(*weights.shape[:-1], units, dtype=y.dtype, device=y.device)
    read = y.nbytes + bias.nbytes + weights.nbytes + (16 * count if p > 0 else 0)
    flops = 2 * rows * tasks * n * units  # the product mix(weights, h) in it
    if use_triton(y.device):
        fused_kernel("mixed forward (triton)", read, out.nbytes, flops)
        block = min(triton.next_power_of_2(units), _BLOCK)
        _mixed_forward_cuda[grid(rows, triton.cdiv(units, block))](
            y, bias, weights, out, seeds, steps, rows // count, n, tasks, *triton_lanes(iv0, iv1), threshold, scale,
            UNITS=units, BLOCK=block, TASKS=triton.next_power_of_2(tasks), DROPOUT=p > 0,
            BFLOAT16=y.dtype == torch.bfloat16, num_warps=max(1, min(8, block // 128)), enable_fp_fusion=False)
        return out
    fused_kernel("mixed forward (numba)", read, out.nbytes, flops)
    arguments = (seeds.numpy(), steps.numpy(), iv0, iv1, np.uint32(threshold), np.float32(scale), p > 0, rows // count)
    y, weights, out_rows = y.view(rows, columns), weights.view(rows, tasks, n), out.view(rows, tasks, units)
    if y.dtype == torch.bfloat16:
        run_split(_mixed_forward_cpu_bfloat16, rows, y.view(torch.uint16).numpy(),
                  bias.float().view(count, columns).numpy(),
                  *(x.view(torch.uint16).numpy() for x in (weights, out_rows)), *arguments, min_part=16)
    else:
        run_split(_mixed_forward_cpu, rows, y.numpy(), bias.view(count, columns).numpy(), weights.numpy(),
                  out_rows.numpy(), *arguments, min_part=16)
    return out


def mix_backward_sums(grad: Tensor, weights: Tensor, y: Tensor, bias: Tensor, seed: Tensor | None,
                      step: Tensor | None, site: int, p: float) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`mixed_forward` from the mixture's gradient ``grad`` ``[*trials, *rows, T, units]``, in
    one pass that makes each row's ``h`` again from ``y`` (the forward's, bitwise): the gradient of ``y``
    (:func:`mix_backward`'s of that ``h``, bitwise), the bias's ``[*trials, N]`` (a trial's rows of it summed row
    by row, in order, in the dtype's accumulator) and the weights' ``[*rows, T, n]`` (``bmm(grad, h^T)`` as a sum
    over the units, in order on the CPU, Triton's ``tl.sum`` on a GPU), in ``y``'s dtype. The two sums equal
    torch's ``sum`` and ``bmm`` to float rounding, not bitwise; a trial's are its own, the same at any pack size.
    Only where :func:`sums_fused`."""
    tasks, n = weights.shape[-2:]
    units, columns = grad.shape[-1], y.shape[-1]
    count, seeds, steps, iv0, iv1, threshold, scale = _streams(y, bias, seed, step, site, p)
    grad, weights, y, bias = (x.detach().contiguous() for x in (grad, weights, y, bias))
    rows = y.numel() // columns
    out = torch.empty_like(y)
    bias_grad = torch.empty(count, columns, dtype=y.dtype, device=y.device)
    weights_grad = torch.empty(weights.shape, dtype=y.dtype, device=y.device)
    read = grad.nbytes + weights.nbytes + y.nbytes + bias.nbytes + (16 * count if p > 0 else 0)
    written = out.nbytes + bias_grad.nbytes + weights_grad.nbytes
    flops = 4 * rows * tasks * n * units  # the products bmm(weights^T, grad) and bmm(grad, h^T) in it
    if use_triton(y.device):
        fused_kernel("mix backward (triton)", read, written, flops)
        units_p2 = triton.next_power_of_2(units)
        experts = min(triton.next_power_of_2(n), max(1, _BLOCK // units_p2))
        _mix_backward_sums_cuda[grid(triton.cdiv(n, experts), count)](
            grad, weights, y, bias, out, bias_grad, weights_grad, seeds, steps, rows // count, n, tasks,
            *triton_lanes(iv0, iv1), threshold, scale, UNITS=units, UNITS_P2=units_p2, EXPERTS=experts,
            DROPOUT=p > 0, BFLOAT16=y.dtype == torch.bfloat16, enable_fp_fusion=False)
        return out, bias_grad.view(bias.shape), weights_grad
    fused_kernel("mix backward (numba)", read, written, flops)
    shaped = [grad.view(rows, tasks, units), weights.view(rows, tasks, n), y.view(rows, columns)]
    outputs = [out.view(rows, columns), bias_grad, weights_grad.view(rows, tasks, n)]
    arguments = (seeds.numpy(), steps.numpy(), iv0, iv1, np.uint32(threshold), np.float32(scale), p > 0, rows // count)
    if y.dtype == torch.bfloat16:
        bits = [x.view(torch.uint16).numpy() for x in shaped]
        run_split(_mix_backward_sums_cpu_bfloat16, count, *bits, bias.float().view(count, columns).numpy(),
                  *(x.view(torch.uint16).numpy() for x in outputs), *arguments, min_part=1)
    else:
        run_split(_mix_backward_sums_cpu, count, *(x.numpy() for x in shaped), bias.view(count, columns).numpy(),
                  *(x.numpy() for x in outputs), *arguments, min_part=1)
    return out, bias_grad.view(bias.shape), weights_grad


def mix_weights_gradient(grad: Tensor, h: Tensor, weights: Tensor) -> Tensor:
    """The gradient of the mixing's weights ``[*rows, T, n]``, ``bmm(grad, h^T)`` per row, in ``h``'s dtype."""
    tasks, n = weights.shape[-2:]
    return torch.bmm(grad.reshape(-1, tasks, grad.shape[-1]),
                     h.reshape(-1, n, h.shape[-1] // n).transpose(1, 2)).view(weights.shape)


class _MixedEpilogue(torch.autograd.Function):
    """``(mix(weights, h), h)`` for ``h = epilogue(y, bias)``: the forward by the epilogue's kernel and ``bmm`` (the
    weights cast to ``h``'s dtype, as autocast casts them for the unfused ``bmm``); ``h`` is returned for the
    backward to keep, not differentiable. The backward by :func:`mix_backward` and ``bmm``. Under
    ``torch.func.vmap`` the rule below runs it once for all trials (the vmapped dimension leads every tensor)."""

    @staticmethod
    def forward(y: Tensor, bias: Tensor, weights: Tensor, seed: Tensor | None, step: Tensor | None, site: int,
                p: float) -> tuple[Tensor, Tensor]:
        h = _epilogue_kernel(y, bias, seed, step, site, p)
        return mix(weights.to(h.dtype), h), h

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        y, bias, weights, _, _, _, ctx.p = inputs
        _, h = output
        ctx.mark_non_differentiable(h)
        ctx.set_materialize_grads(False)
        ctx.weights_dtype = weights.dtype
        ctx.rows = tuple(range(bias.dim() - 1, y.dim() - 1))
        ctx.save_for_backward(h, weights.detach().to(h.dtype))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor | None, _) -> tuple[Tensor | None, ...]:
        if grad is None:
            return (None,) * 7
        h, weights = ctx.saved_tensors
        grad_y = mix_backward(grad, weights, h, ctx.p)
        grad_bias = grad_y.sum(ctx.rows) if ctx.needs_input_grad[1] else None
        grad_weights = mix_weights_gradient(grad, h, weights).to(ctx.weights_dtype) if ctx.needs_input_grad[2] \
            else None
        return grad_y, grad_bias, grad_weights, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, y: Tensor, bias: Tensor, weights: Tensor, seed: Tensor | None, step: Tensor | None,
             site: int, p: float) -> tuple[tuple[Tensor, Tensor], tuple[int, int]]:
        y, bias, weights, seed, step = leading(info.batch_size, (y, bias, weights, seed, step), in_dims)
        return _MixedEpilogue.apply(y, bias, weights, seed, step, site, p), (0, 0)


class _MixedSums(torch.autograd.Function):
    """``mix(weights, epilogue(y, bias))`` with ``--model.fused_mixing_sums``: the forward by :func:`mixed_forward`
    (``h`` never written; ``y`` kept for the backward in its place), the backward by :func:`mix_backward_sums`
    (``h`` made again from ``y``; the three gradients in one pass). Under ``torch.func.vmap`` the rule below runs it
    once for all trials."""

    @staticmethod
    def forward(y: Tensor, bias: Tensor, weights: Tensor, seed: Tensor | None, step: Tensor | None, site: int,
                p: float) -> Tensor:
        return mixed_forward(y, bias, weights.to(y.dtype), seed, step, site, p)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        y, bias, weights, seed, step, ctx.site, ctx.p = inputs
        ctx.set_materialize_grads(False)
        ctx.weights_dtype = weights.dtype
        ctx.save_for_backward(y, bias, weights.detach().to(y.dtype), seed, step)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor | None) -> tuple[Tensor | None, ...]:
        if grad is None:
            return (None,) * 7
        y, bias, weights, seed, step = ctx.saved_tensors
        grad_y, grad_bias, grad_weights = mix_backward_sums(grad, weights, y, bias, seed, step, ctx.site, ctx.p)
        grad_bias = grad_bias if ctx.needs_input_grad[1] else None
        grad_weights = grad_weights.to(ctx.weights_dtype) if ctx.needs_input_grad[2] else None
        return grad_y, grad_bias, grad_weights, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, y: Tensor, bias: Tensor, weights: Tensor, seed: Tensor | None, step: Tensor | None,
             site: int, p: float) -> tuple[Tensor, int]:
        y, bias, weights, seed, step = leading(info.batch_size, (y, bias, weights, seed, step), in_dims)
        return _MixedSums.apply(y, bias, weights, seed, step, site, p), 0


def mixed_experts(y: Tensor, bias: Tensor, weights: Tensor, p: float = 0.0, seed: Tensor | None = None,
                  step: Tensor | None = None, site: int = 0, sums: bool = False) -> Tensor:
    """``mix(weights, dropout(relu(y + bias)))``, :func:`mtmoe.epilogue.bias_relu_dropout`'s experts' outputs
    weighted by the gates: ``y`` ``[*rows, n * units]``, ``bias`` ``[n * units]`` (per trial under
    ``torch.func.vmap``), ``weights`` ``[*rows, T, n]``; returns ``[*rows, T, units]``. Its backward writes the
    gradient of ``y`` in one pass (the module's docstring). With ``sums`` (where :func:`sums_fused`; otherwise as
    without), ``h`` is never written: the forward mixes each row's ``h`` as it makes it, the backward makes it again
    and writes the bias's and the weights' gradients in the same pass, all in the kernels' own summation orders
    (:func:`mixed_forward`, :func:`mix_backward_sums`: not bitwise torch's ``bmm`` and ``sum``)."""
    dropout_threshold(p)
    if p > 0 and (seed is None or step is None or seed.dtype != torch.int64 or step.dtype != torch.int64):
        raise TypeError("dropout draws from a stream: seed and step must be int64 tensors")
    if p == 0:
        seed = step = None
    if sums and sums_fused(y, bias):
        return _MixedSums.apply(y, bias, weights, seed, step, site, p)
    return _MixedEpilogue.apply(y, bias, weights, seed, step, site, p)[0]
