"""COMET's leaf reach ``v`` from the split map's output in one pass, and its backward in one (Section 3; Appendix A,
eq. (9); :mod:`mtmoe.gates.comet`).

Unfused, the reach is about twenty passes over ``[*rows, n-1 or n, k]`` tensors: the smooth step's clamps, cubic and
``where``s, the ``cat`` of ``[h, 1 - h, 1]``, the ``index_select`` along the leaves' paths, the products over depth,
and in the backward the products' gradients, ``index_select``'s backward (a zero-filled ``index_add``), ``1 - h``'s
and the smooth step's. Here the forward reads the split map's output ``t`` once and writes ``v`` once; the backward
reads ``t`` and the gradient of ``v`` once and writes the gradient of ``t`` once, recomputing ``h`` and the
products on the way.

Each value is computed as the plain operations compute it, rounding included (every operation rounded to the
dtype: a bfloat16 product or sum in float32, then rounded to nearest even; ``t**3`` as ``(t * t) * t``, as torch's
``pow`` computes it), and each gradient too: the product's backward as autograd's chain of ``mul``s, each edge's
gradient summed as ``index_add`` sums it (from +0, the leaves in order), ``h``'s as the sum of its two uses, the
clamps' ``minimum``/``maximum`` backward with its halved gradient at a tie. So values and gradients are bitwise
the plain path's (``tests/test_comet_reach.py``). The softmax, ``safe_log`` and the entropy stay torch operations
(their ``exp``/``log`` are not those of numba's or Triton's libm).

Three implementations: numba (CPU tensors), Triton (CUDA tensors, and CPU tensors under Triton's interpreter), and
the plain torch operations (other dtypes and devices).
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import types as numba_types
from numba.extending import intrinsic
from torch import Tensor
from torch.autograd.function import once_differentiable

from mtmoe.gates.base import product
from mtmoe.gates.smooth_step import coefficients, smooth_step
from mtmoe.host_threads import run_split
from mtmoe.kernel_traffic import fused_kernel
from mtmoe.plain_kernels import runs_fused
from mtmoe.random import _bfloat16_bits
from mtmoe.triton_support import grid, tl, triton, use_triton

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def reach_reference(t: Tensor, gamma: Tensor | float, paths: Tensor) -> Tensor:
    """The plain operations: ``t`` ``[*rows, (n-1) k]`` to the reach ``[*rows, n, k]`` (``paths`` from
    :func:`mtmoe.gates.comet.path_index`)."""
    n, depth = paths.shape
    h = smooth_step(t.unflatten(-1, (n - 1, -1)), gamma)  # [*rows, n-1, k]
    one = h.new_ones(()).expand(*h.shape[:-2], 1, h.shape[-1])
    edges = torch.cat([h, 1 - h, one], dim=-2)  # [*rows, 2(n-1)+1, k]
    return product(edges.index_select(-2, paths.flatten()).unflatten(-2, (n, depth)), dim=-2)


# ---- numba (CPU tensors) -------------------------------------------------------------------------------------------

@intrinsic
def _bits(typingctx, x):
    """The bits of a float32."""
    if x != numba_types.float32:
        return None
    return numba_types.uint32(x), lambda context, builder, signature, args: builder.bitcast(args[0], ir.IntType(32))


@intrinsic
def _float(typingctx, b):
    """The float32 of bits ``b``."""
    if b != numba_types.uint32:
        return None
    return numba_types.float32(b), lambda context, builder, signature, args: builder.bitcast(args[0], ir.FloatType())


@numba.njit(cache=True, inline="always")
def _round(x: np.float32, bfloat16: bool) -> np.float32:
    """``x`` as a tensor of the dtype stores it: rounded to bfloat16 (nearest even), or float32 as it is."""
    if bfloat16:
        return _float(np.uint32(np.uint32(_bfloat16_bits(_bits(x))) << np.uint32(16)))
    return x


@numba.njit(cache=True, inline="always")
def _load(a: np.ndarray, i: int, j: int, c: int, bfloat16: bool) -> np.float32:
    """``a[i, j, c]`` as float32 (bfloat16 given as uint16 bits, widened exactly)."""
    if bfloat16:
        return _float(np.uint32(np.uint32(a[i, j, c]) << np.uint32(16)))
    return np.float32(a[i, j, c])


@numba.njit(cache=True, inline="always")
def _store(a: np.ndarray, i: int, j: int, c: int, x: np.float32, bfloat16: bool) -> None:
    if bfloat16:
        a[i, j, c] = _bfloat16_bits(_bits(x))
    else:
        a[i, j, c] = x


@numba.njit(cache=True, inline="always")
def _step(t: np.float32, half: np.float32, cubed: np.float32, linear: np.float32,
          bfloat16: bool) -> tuple[np.float32, np.float32, np.float32]:
    """``S_gamma(t)`` as :func:`mtmoe.gates.smooth_step.smooth_step` computes it, with the clamps' outputs
    ``maximum(t, -half)`` and ``minimum(that, half)``."""
    low = t if not t < -half else -half  # torch.maximum (NaN stays NaN)
    inner = low if not low > half else half  # torch.minimum
    power = _round(_round(inner * inner, bfloat16) * inner, bfloat16)
    cubic = _round(_round(_round(cubed * power, bfloat16) + _round(linear * inner, bfloat16), bfloat16)
                   + np.float32(0.5), bfloat16)
    h = np.float32(0) if t <= -half else (np.float32(1) if t >= half else cubic)
    return h, low, inner


@numba.njit(cache=True, inline="always")
def _edges(t: np.ndarray, r: int, c: int, half: np.float32, cubed: np.float32, linear: np.float32, edges: np.ndarray,
           bfloat16: bool) -> None:
    """``edges`` = ``cat([h, 1 - h, 1])`` of row ``r``, tree ``c``."""
    m = t.shape[1]
    for q in range(m):
        h = _step(_load(t, r, q, c, bfloat16), half, cubed, linear, bfloat16)[0]
        edges[q] = h
        edges[m + q] = _round(np.float32(1) - h, bfloat16)
    edges[2 * m] = np.float32(1)


@numba.njit(cache=True, nogil=True)
def _trial(coefficients: np.ndarray, trial_paths: np.ndarray, trial: int):
    """A trial's smooth-step coefficients ``half, cubed, linear`` and its leaves' paths ``[n, depth]``."""
    return coefficients[trial, 0], coefficients[trial, 1], coefficients[trial, 2], trial_paths[trial]


@numba.njit(cache=True, nogil=True)
def _prefix(edges: np.ndarray, paths: np.ndarray, leaf: int, prefix: np.ndarray, bfloat16: bool) -> None:
    """``prefix[d]``: the product of the leaf's first ``d + 1`` edges, rounded after each factor as
    :func:`mtmoe.gates.base.product` multiplies them; ``prefix[depth - 1]`` is the leaf's reach."""
    prefix[0] = edges[paths[leaf, 0]]
    for d in range(1, paths.shape[1]):
        prefix[d] = _round(prefix[d - 1] * edges[paths[leaf, d]], bfloat16)


@numba.njit(cache=True, nogil=True)
def _reach_cpu(t: np.ndarray, coefficients: np.ndarray, trial_paths: np.ndarray, v: np.ndarray, bfloat16: bool,
               lo: int, hi: int) -> None:
    """``v[r]`` ``[n, k]`` of rows ``[lo, hi)`` of ``t`` ``[R, n-1, k]``; trial ``r // (R / T)`` has the smooth
    step's ``coefficients[trial]`` (``[T, 3]``, float32) and its leaves' paths ``trial_paths[trial]``."""
    rows, m, k = t.shape
    _, n, depth = trial_paths.shape
    per_trial = rows // coefficients.shape[0]
    edges = np.empty(2 * m + 1, np.float32)
    prefix = np.empty(depth, np.float32)
    for r in range(lo, hi):
        half, cubed, linear, paths = _trial(coefficients, trial_paths, r // per_trial)
        for c in range(k):
            _edges(t, r, c, half, cubed, linear, edges, bfloat16)
            for leaf in range(n):
                _prefix(edges, paths, leaf, prefix, bfloat16)
                _store(v, r, leaf, c, prefix[depth - 1], bfloat16)


@numba.njit(cache=True, nogil=True)
def _reach_backward_cpu(t: np.ndarray, coefficients: np.ndarray, trial_paths: np.ndarray, grad: np.ndarray,
                        out: np.ndarray, bfloat16: bool, lo: int, hi: int) -> None:
    """The gradient of ``t`` (``out``, ``[R, n-1, k]``) from that of ``v`` (``grad``, ``[R, n, k]``, any strides) on
    rows ``[lo, hi)``, as autograd computes it through the plain operations."""
    rows, m, k = t.shape
    _, n, depth = trial_paths.shape
    per_trial = rows // coefficients.shape[0]
    edges = np.empty(2 * m + 1, np.float32)
    prefix = np.empty(depth, np.float32)
    edge_grads = np.empty((n, depth), np.float32)
    sums = np.empty(2 * m + 1, np.float32)
    for r in range(lo, hi):
        half, cubed, linear, paths = _trial(coefficients, trial_paths, r // per_trial)
        for c in range(k):
            _edges(t, r, c, half, cubed, linear, edges, bfloat16)
            for leaf in range(n):  # product(): out_d = out_{d-1} * f_d; backward mul by mul from the last factor
                _prefix(edges, paths, leaf, prefix, bfloat16)
                g = _load(grad, r, leaf, c, bfloat16)
                for d in range(depth - 1, 0, -1):
                    edge_grads[leaf, d] = _round(g * prefix[d - 1], bfloat16)
                    g = _round(g * edges[paths[leaf, d]], bfloat16)
                edge_grads[leaf, 0] = g
            sums[:] = np.float32(0)  # index_select's backward: index_add into zeros, in the index's order
            for leaf in range(n):
                for d in range(depth):
                    e = paths[leaf, d]
                    sums[e] = _round(sums[e] + edge_grads[leaf, d], bfloat16)
            for q in range(m):
                tq = _load(t, r, q, c, bfloat16)
                _, low, inner = _step(tq, half, cubed, linear, bfloat16)
                g = _round(sums[q] + -sums[m + q], bfloat16)  # cat's h, and 1 - h's (rsub: neg)
                g = np.float32(0) if tq <= -half else g  # the two where's
                g = np.float32(0) if tq >= half else g
                square = _round(inner * inner, bfloat16)  # pow's backward: grad * (3 * inner**2)
                g = _round(_round(_round(g * cubed, bfloat16) * _round(square * np.float32(3), bfloat16), bfloat16)
                           + _round(g * linear, bfloat16), bfloat16)
                g = np.float32(0) if low > half else (_round(g / np.float32(2), bfloat16) if low == half else g)
                g = np.float32(0) if tq < -half else (_round(g / np.float32(2), bfloat16) if tq == -half else g)
                _store(out, r, q, c, g, bfloat16)


# ---- Triton (CUDA tensors) -----------------------------------------------------------------------------------------

if triton is not None:
    from mtmoe.random import _rounded, _widened

    @triton.jit
    def _r(x, BFLOAT16: tl.constexpr):
        """``x`` rounded as the dtype stores it, in float32."""
        return _widened(_rounded(x, BFLOAT16), False, BFLOAT16)

    @triton.jit
    def _step_cuda(t, half, cubed, linear, BFLOAT16: tl.constexpr):
        """:func:`_step`: ``h``, the ``maximum`` and the ``minimum``."""
        low = tl.where(t < -half, -half, t)
        inner = tl.where(low > half, half, low)
        power = _r(_r(inner * inner, BFLOAT16) * inner, BFLOAT16)
        cubic = _r(_r(_r(cubed * power, BFLOAT16) + _r(linear * inner, BFLOAT16), BFLOAT16) + 0.5, BFLOAT16)
        h = tl.where(t <= -half, 0.0, tl.where(t >= half, 1.0, cubic))
        return h, low, inner

    @triton.jit
    def _edge_cuda(t_ptr, row, c, e, inside, half, cubed, linear, K, N: tl.constexpr, BFLOAT16: tl.constexpr):
        """Edges ``e`` (``[BLOCK, NP]``, indices into ``cat([h, 1 - h, 1])``) of rows ``row``, trees ``c``
        (``[BLOCK]``): ``[BLOCK, NP]``."""
        split = e < 2 * (N - 1)
        q = tl.where(e < N - 1, e, tl.where(split, e - (N - 1), 0))
        t = _widened(tl.load(t_ptr + row[:, None] * ((N - 1) * K) + q * K + c[:, None],
                             mask=inside[:, None] & split, other=0.0), False, BFLOAT16)
        h = _step_cuda(t, half[:, None], cubed[:, None], linear[:, None], BFLOAT16)[0]
        return tl.where(e < N - 1, h, tl.where(split, _r(1.0 - h, BFLOAT16), 1.0))

    @triton.jit
    def _path_cuda(paths, leaf, d, inside, N: tl.constexpr, DEPTH: tl.constexpr):
        """Edge ``d`` of each leaf's path (``[BLOCK, NP]``), ``paths`` each column's trial's (``[BLOCK]`` pointers);
        the constant edge past the last leaf."""
        return tl.load(paths[:, None] + leaf[None, :] * DEPTH + d, mask=inside[:, None] & (leaf < N)[None, :],
                       other=2 * (N - 1))

    @triton.jit
    def _prefix_cuda(t_ptr, paths, row, c, leaf, inside, half, cubed, linear, K, upto, N: tl.constexpr,
                     DEPTH: tl.constexpr, BFLOAT16: tl.constexpr):
        """The product of each leaf's first ``upto + 1`` edges (at least one), left to right: ``[BLOCK, NP]``."""
        out = _edge_cuda(t_ptr, row, c, _path_cuda(paths, leaf, 0, inside, N, DEPTH), inside, half, cubed, linear, K,
                         N, BFLOAT16)
        for d in range(1, DEPTH):
            e = _path_cuda(paths, leaf, d, inside, N, DEPTH)
            product = _r(out * _edge_cuda(t_ptr, row, c, e, inside, half, cubed, linear, K, N, BFLOAT16), BFLOAT16)
            out = tl.where(d <= upto, product, out)
        return out

    @triton.jit
    def _columns(coefficients_ptr, paths_ptr, paths_stride, columns, per_trial, K, BLOCK: tl.constexpr):
        """This program's columns (row, tree): rows, trees, which are inside, their trials' coefficients and
        their trials' paths (pointers)."""
        column = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = column < columns
        trial = column // per_trial
        half = tl.load(coefficients_ptr + trial * 3, mask=inside, other=1.0)
        cubed = tl.load(coefficients_ptr + trial * 3 + 1, mask=inside, other=0.0)
        linear = tl.load(coefficients_ptr + trial * 3 + 2, mask=inside, other=0.0)
        return column // K, column % K, inside, half, cubed, linear, paths_ptr + trial * paths_stride

    @triton.jit(do_not_specialize=["paths_stride", "columns", "per_trial", "K"])
    def _reach_cuda(t_ptr, coefficients_ptr, paths_ptr, v_ptr, paths_stride, columns, per_trial, K, N: tl.constexpr,
                    DEPTH: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr, BFLOAT16: tl.constexpr):
        """Program ``block``: :func:`_reach_cpu` on ``BLOCK`` columns (row, tree), the leaves along a second axis."""
        row, c, inside, half, cubed, linear, paths = _columns(coefficients_ptr, paths_ptr, paths_stride, columns,
                                                              per_trial, K, BLOCK)
        leaf = tl.arange(0, NP)
        v = _prefix_cuda(t_ptr, paths, row, c, leaf, inside, half, cubed, linear, K, DEPTH - 1, N, DEPTH,
                         BFLOAT16)
        tl.store(v_ptr + row[:, None] * (N * K) + leaf[None, :] * K + c[:, None],
                 _rounded(v, BFLOAT16).to(v_ptr.dtype.element_ty), mask=inside[:, None] & (leaf < N)[None, :])

    @triton.jit(do_not_specialize=["paths_stride", "columns", "per_trial", "stride_row", "stride_leaf",
                                   "stride_tree", "K"])
    def _reach_backward_cuda(t_ptr, coefficients_ptr, paths_ptr, grad_ptr, out_ptr, paths_stride, columns, per_trial,
                             stride_row, stride_leaf, stride_tree, K, N: tl.constexpr, DEPTH: tl.constexpr,
                             NP: tl.constexpr, QP: tl.constexpr, BLOCK: tl.constexpr, BFLOAT16: tl.constexpr):
        """Program ``block``: :func:`_reach_backward_cpu` on ``BLOCK`` columns, the depths last to first. In a
        tree each edge lies at one depth, so its sum runs over the leaves in order as ``index_add``'s; a table
        that is no tree's (an empty slot's zeros) gets its sums in another order."""
        row, c, inside, half, cubed, linear, paths = _columns(coefficients_ptr, paths_ptr, paths_stride, columns,
                                                              per_trial, K, BLOCK)
        leaf = tl.arange(0, NP)
        node = tl.arange(0, QP)
        g = _widened(tl.load(grad_ptr + row[:, None] * stride_row + leaf[None, :] * stride_leaf
                             + c[:, None] * stride_tree, mask=inside[:, None] & (leaf < N)[None, :], other=0.0),
                     False, BFLOAT16)
        left = tl.zeros((BLOCK, QP), tl.float32)  # the sums of the edges h (left) and 1 - h (right) of each node
        right = tl.zeros((BLOCK, QP), tl.float32)
        for back in range(DEPTH):
            d = DEPTH - 1 - back  # out_d = out_{d-1} * f_d: f_d's gradient g * out_{d-1}, out_{d-1}'s g * f_d
            e = _path_cuda(paths, leaf, d, inside, N, DEPTH)
            prefix = _prefix_cuda(t_ptr, paths, row, c, leaf, inside, half, cubed, linear, K, d - 1, N, DEPTH,
                                  BFLOAT16)
            edge_grad = tl.where(d > 0, _r(g * prefix, BFLOAT16), g)
            g = tl.where(d > 0, _r(g * _edge_cuda(t_ptr, row, c, e, inside, half, cubed, linear, K, N, BFLOAT16),
                                   BFLOAT16), g)
            for j in range(N):
                column = tl.sum(tl.where((leaf == j)[None, :], edge_grad, 0.0), axis=1)[:, None]  # exact
                ej = tl.load(paths + j * DEPTH + d, mask=inside, other=2 * (N - 1))[:, None]
                left = tl.where(node[None, :] == ej, _r(left + column, BFLOAT16), left)
                right = tl.where(node[None, :] + (N - 1) == ej, _r(right + column, BFLOAT16), right)
        nodes = inside[:, None] & (node < N - 1)[None, :]
        offsets = row[:, None] * ((N - 1) * K) + node[None, :] * K + c[:, None]
        t = _widened(tl.load(t_ptr + offsets, mask=nodes, other=0.0), False, BFLOAT16)
        half, cubed, linear = half[:, None], cubed[:, None], linear[:, None]
        _, low, inner = _step_cuda(t, half, cubed, linear, BFLOAT16)
        g = _r(left + -right, BFLOAT16)
        g = tl.where(t <= -half, 0.0, g)
        g = tl.where(t >= half, 0.0, g)
        square = _r(inner * inner, BFLOAT16)
        g = _r(_r(_r(g * cubed, BFLOAT16) * _r(square * 3.0, BFLOAT16), BFLOAT16) + _r(g * linear, BFLOAT16),
               BFLOAT16)
        g = tl.where(low > half, 0.0, tl.where(low == half, _r(g * 0.5, BFLOAT16), g))  # exact, as CUDA's g / 2
        g = tl.where(t < -half, 0.0, tl.where(t == -half, _r(g * 0.5, BFLOAT16), g))  # (not Triton's approximate /)
        tl.store(out_ptr + offsets, _rounded(g, BFLOAT16).to(out_ptr.dtype.element_ty), mask=nodes)


_BLOCK = 64  # columns (row, tree) per Triton program


def _trial_paths(paths: Tensor, coefficients: Tensor) -> Tensor:
    """``paths`` as ``[T, n, depth]``, one per trial of the coefficients ``[*trials, 3]``: a pack's stacked buffer
    (each trial's own, as ``index_select`` under vmap reads them), or one ``[n, depth]`` for all (stride 0)."""
    trials = coefficients.numel() // 3
    return paths.expand(trials, *paths.shape) if paths.dim() == 2 else paths.reshape(trials, *paths.shape[-2:])


def _arrays(t: Tensor, coefficients: Tensor, n: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """``t`` as ``[R, n-1, k]`` numpy (bfloat16 as uint16 bits) and the coefficients as float32 ``[T, 3]``."""
    bfloat16 = t.dtype == torch.bfloat16
    rows = t.view(-1, n - 1, t.shape[-1] // (n - 1))
    return ((rows.view(torch.uint16) if bfloat16 else rows).numpy(), coefficients.float().view(-1, 3).numpy(),
            bfloat16)


def _reach_kernel(t: Tensor, coefficients: Tensor, paths: Tensor) -> Tensor:
    """The reach ``[*rows, n, k]`` of ``t`` ``[*trials, *rows', (n-1) k]`` (contiguous), each trial with its
    ``coefficients`` (``[*trials, 3]``, ``t``'s dtype) and ``paths`` (:func:`_trial_paths`)."""
    n, depth = paths.shape[-2:]
    k = t.shape[-1] // (n - 1)
    v = torch.empty(*t.shape[:-1], n, k, dtype=t.dtype, device=t.device)
    read = t.nbytes + coefficients.nbytes + paths.nbytes
    if use_triton(t.device):
        fused_kernel("comet reach (triton)", read, v.nbytes)
        columns, paths = t.numel() // (n - 1), _trial_paths(paths, coefficients)
        _reach_cuda[grid(triton.cdiv(columns, _BLOCK))](
            t, coefficients.float(), paths, v, paths.stride(0), columns, columns // coefficients[..., 0].numel(), k,
            N=n, DEPTH=depth, NP=triton.next_power_of_2(n), BLOCK=_BLOCK, BFLOAT16=t.dtype == torch.bfloat16,
            enable_fp_fusion=False)
        return v
    fused_kernel("comet reach (numba)", read, v.nbytes)
    rows, coefficient_array, bfloat16 = _arrays(t, coefficients, n)
    out = v.view(-1, n, k)
    run_split(_reach_cpu, rows.shape[0], rows, coefficient_array, _trial_paths(paths, coefficients).numpy(),
              (out.view(torch.uint16) if bfloat16 else out).numpy(), bfloat16, min_part=64)
    return v


def _reach_backward(t: Tensor, coefficients: Tensor, paths: Tensor, grad: Tensor) -> Tensor:
    """The gradient of ``t`` from that of the reach ``grad`` (``[*rows, n, k]``, any strides)."""
    n, depth = paths.shape[-2:]
    k = t.shape[-1] // (n - 1)
    grad = grad.reshape(-1, n, k)  # a view where the rows' dimensions allow (a transposed gradient's do)
    out = torch.empty_like(t)
    read = t.nbytes + coefficients.nbytes + paths.nbytes + grad.nbytes
    if use_triton(t.device):
        fused_kernel("comet reach backward (triton)", read, out.nbytes)
        columns, paths = t.numel() // (n - 1), _trial_paths(paths, coefficients)
        _reach_backward_cuda[grid(triton.cdiv(columns, _BLOCK))](
            t, coefficients.float(), paths, grad, out, paths.stride(0), columns,
            columns // coefficients[..., 0].numel(), *grad.stride(), k, N=n, DEPTH=depth,
            NP=triton.next_power_of_2(n), QP=triton.next_power_of_2(n - 1), BLOCK=_BLOCK,
            BFLOAT16=t.dtype == torch.bfloat16,
            enable_fp_fusion=False)
        return out
    fused_kernel("comet reach backward (numba)", read, out.nbytes)
    rows, coefficient_array, bfloat16 = _arrays(t, coefficients, n)
    result = out.view(-1, n - 1, k)
    run_split(_reach_backward_cpu, rows.shape[0], rows, coefficient_array,
              _trial_paths(paths, coefficients).numpy(), (grad.view(torch.uint16) if bfloat16 else grad).numpy(),
              (result.view(torch.uint16) if bfloat16 else result).numpy(), bfloat16, min_part=64)
    return out


class _Reach(torch.autograd.Function):
    """``reach_reference(t, gamma, paths)`` from ``t`` and the smooth step's coefficients (``[*trials, 3]``) by
    :func:`_reach_kernel`, the backward by :func:`_reach_backward`. Under ``torch.func.vmap`` the rule below runs
    the kernel once for all trials, and regular autograd records it (as :class:`mtmoe.epilogue._Epilogue`)."""

    @staticmethod
    def forward(t: Tensor, coefficients: Tensor, paths: Tensor) -> Tensor:
        return _reach_kernel(t, coefficients, paths)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        t, coefficients, paths = inputs
        ctx.save_for_backward(t, coefficients, paths)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None]:
        t, coefficients, paths = ctx.saved_tensors
        return _reach_backward(t, coefficients, paths, grad), None, None

    @staticmethod
    def vmap(info, in_dims, t: Tensor, coefficients: Tensor, paths: Tensor) -> tuple[Tensor, int]:
        t_dim, c_dim, paths_dim = in_dims
        if paths_dim is not None:  # a pack's stacked buffers: each trial's own (an empty slot's may be zeros)
            paths = paths.movedim(paths_dim, 0).contiguous()
        t = t.expand(info.batch_size, *t.shape) if t_dim is None else t.movedim(t_dim, 0)
        coefficients = (coefficients.expand(info.batch_size, *coefficients.shape) if c_dim is None
                        else coefficients.movedim(c_dim, 0))
        return _Reach.apply(t.contiguous(), coefficients.contiguous(), paths), 0


def fused(t: Tensor) -> bool:
    """Whether the reach of ``t`` goes to a kernel: float32 or bfloat16, on CUDA (Triton) or the CPU (numba), unless
    ``MTMOE_PLAIN_KERNELS`` names ``reach``."""
    return t.dtype in _KERNEL_DTYPES and runs_fused("reach", t.device) and t.numel() > 0


def reach(t: Tensor, gamma: Tensor | float, paths: Tensor) -> Tensor:
    """:func:`reach_reference`'s values and gradient, by one kernel each way where :func:`fused`."""
    if not fused(t):
        return reach_reference(t, gamma, paths)
    half, cubed, linear = coefficients(t, gamma)
    return _Reach.apply(t.contiguous(), torch.stack([half, cubed, linear], dim=-1), paths)
