"""Log-space Sinkhorn (COMET paper, eq. 8; comet-protocol.md §3.2) as one autograd function with compiled kernels.

``sinkhorn(U, tau, R)`` is ``exp`` of ``R`` rounds of ``L <- L - logsumexp_rows(L); L <- L - logsumexp_cols(L)``
from ``L = U / tau`` (it ends column-stochastic). Unrolled in autograd that is ~14 kernels per round, about as much as
a whole MovieLens training step at R = 150, so forward and backward are hand-written loops instead, in float64:

* CPU tensors: numba loops over the small ``[m, n, n]`` matrices (1.3 ms forward + backward at R = 150, n = 16, on
  a 2-core CPU; NumPy calls took 7-11 ms);
* CUDA tensors: two Triton kernels, one program per matrix, the whole recursion in registers (no host round trip,
  no synchronisation), when Triton is installed; otherwise the CPU loops on a host copy.

Both save every round's row and column softmaxes for the backward pass, which is the exact vector-Jacobian
product of the recursion (the tests check both against autograd through the unrolled recursion).

Output entries below ``finfo.tiny / finfo.eps`` of the output dtype (~1e-31 in float32) are set to exactly 0 (the
gradient is the exact one of the unflushed output). They are far below the precision of their column, which sums
to 1, but at the window's start (tau = 1e-3) they are many: 489 of the 8,192 permuted gate weights of a MovieLens
batch were subnormal float32 numbers, which x86 CPUs process on a slow path. The start-of-window cells of the
overhead benchmark (``benchmarks/README.md``) were the slow ones on CPU before this flush; its effect there has not
been re-measured on a quiet machine.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None


@numba.njit(cache=True)
def _forward_cpu(log_p: np.ndarray, iterations: int) -> tuple[np.ndarray, np.ndarray]:
    """``iterations`` row-then-column normalisations of ``log_p`` ``[m, n, n]`` (float64, in place).

    Returns every round's row and column softmaxes ``[R, m, n, n]``; the last column softmax is the output.
    """
    m, n, _ = log_p.shape
    rows = np.empty((iterations, m, n, n))
    cols = np.empty((iterations, m, n, n))
    for r in range(iterations):
        for b in range(m):
            for i in range(n):  # L[i, :] -= logsumexp(L[i, :])
                top = log_p[b, i, :].max()
                total = 0.0
                for j in range(n):
                    rows[r, b, i, j] = math.exp(log_p[b, i, j] - top)
                    total += rows[r, b, i, j]
                shift = top + math.log(total)
                for j in range(n):
                    rows[r, b, i, j] /= total
                    log_p[b, i, j] -= shift
            for j in range(n):  # L[:, j] -= logsumexp(L[:, j])
                top = log_p[b, :, j].max()
                total = 0.0
                for i in range(n):
                    cols[r, b, i, j] = math.exp(log_p[b, i, j] - top)
                    total += cols[r, b, i, j]
                shift = top + math.log(total)
                for i in range(n):
                    cols[r, b, i, j] /= total
                    log_p[b, i, j] -= shift
    return rows, cols


@numba.njit(cache=True)
def _backward_cpu(g: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Vector-Jacobian product of :func:`_forward_cpu`'s output w.r.t. its input, for ``g`` = dLoss/dOutput."""
    iterations, m, n, _ = rows.shape
    g = g * cols[iterations - 1]  # d exp(L) / dL = exp(L)
    for r in range(iterations - 1, -1, -1):
        for b in range(m):
            for j in range(n):  # through L <- L - logsumexp over each column
                total = 0.0
                for i in range(n):
                    total += g[b, i, j]
                for i in range(n):
                    g[b, i, j] -= cols[r, b, i, j] * total
            for i in range(n):  # through L <- L - logsumexp over each row
                total = 0.0
                for j in range(n):
                    total += g[b, i, j]
                for j in range(n):
                    g[b, i, j] -= rows[r, b, i, j] * total
    return g


if triton is not None:

    @triton.jit
    def _forward_cuda(log_p_ptr, rows_ptr, cols_ptr, out_ptr, floor, iterations, n, BLOCK: tl.constexpr):
        """One program per matrix: the same recursion as :func:`_forward_cpu`, softmaxes stored as ``[m, R, n, n]``."""
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK)[:, None]
        j = tl.arange(0, BLOCK)[None, :]
        inside = (i < n) & (j < n)
        offsets = i * n + j
        log_p = tl.load(log_p_ptr + b * n * n + offsets, mask=inside, other=-float("inf"))
        cols = tl.zeros((BLOCK, BLOCK), dtype=tl.float64)
        for r in range(iterations):
            saved = (b * iterations + r) * n * n + offsets
            top = tl.max(log_p, axis=1)
            top = tl.where(top == -float("inf"), 0.0, top)  # padding rows
            e = tl.exp(log_p - top[:, None])
            total = tl.sum(e, axis=1)
            total = tl.where(total > 0, total, 1.0)
            tl.store(rows_ptr + saved, e / total[:, None], mask=inside)
            log_p = log_p - (top + tl.log(total))[:, None]
            top = tl.max(log_p, axis=0)
            top = tl.where(top == -float("inf"), 0.0, top)  # padding columns
            e = tl.exp(log_p - top[None, :])
            total = tl.sum(e, axis=0)
            total = tl.where(total > 0, total, 1.0)
            cols = e / total[None, :]
            tl.store(cols_ptr + saved, cols, mask=inside)
            log_p = log_p - (top + tl.log(total))[None, :]
        cols = tl.where(cols < floor, 0.0, cols)
        tl.store(out_ptr + b * n * n + offsets, cols.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _backward_cuda(g_ptr, rows_ptr, cols_ptr, iterations, n, BLOCK: tl.constexpr):
        """One program per matrix: the same vector-Jacobian product as :func:`_backward_cpu`, in place in ``g``."""
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK)[:, None]
        j = tl.arange(0, BLOCK)[None, :]
        inside = (i < n) & (j < n)
        offsets = i * n + j
        g = tl.load(g_ptr + b * n * n + offsets, mask=inside, other=0.0)
        last = (b * iterations + iterations - 1) * n * n + offsets
        g = g * tl.load(cols_ptr + last, mask=inside, other=0.0)
        for k in range(iterations):
            saved = (b * iterations + iterations - 1 - k) * n * n + offsets
            g = g - tl.load(cols_ptr + saved, mask=inside, other=0.0) * tl.sum(g, axis=0)[None, :]
            g = g - tl.load(rows_ptr + saved, mask=inside, other=0.0) * tl.sum(g, axis=1)[:, None]
        tl.store(g_ptr + b * n * n + offsets, g, mask=inside)


def _floor(dtype: torch.dtype) -> float:
    """Output entries below this are flushed to 0: products with them stay clear of subnormals down to ``eps``."""
    info = torch.finfo(dtype)
    return info.tiny / info.eps


class LogSinkhorn(torch.autograd.Function):
    """``sinkhorn(u, tau, iterations)`` with the hand-written forward and backward of this module."""

    @staticmethod
    def forward(ctx, u: Tensor, tau: float, iterations: int) -> Tensor:
        if iterations < 1:
            raise ValueError(f"Sinkhorn needs at least one iteration, got {iterations}")
        ctx.tau, ctx.on_gpu = tau, u.is_cuda and triton is not None
        if ctx.on_gpu:
            m, n, _ = u.shape
            log_p = u.detach().double() / tau
            rows = torch.empty(m, iterations, n, n, dtype=torch.float64, device=u.device)
            cols = torch.empty_like(rows)
            out = torch.empty_like(u)
            block = max(16, triton.next_power_of_2(n))
            _forward_cuda[(m,)](log_p, rows, cols, out, _floor(u.dtype), iterations, n, BLOCK=block)
            ctx.save_for_backward(rows, cols)
            return out
        rows, cols = _forward_cpu(u.detach().cpu().double().numpy() / tau, iterations)
        ctx.rows, ctx.cols = rows, cols
        out = cols[-1].copy()
        out[out < _floor(u.dtype)] = 0.0
        return torch.from_numpy(out).to(device=u.device, dtype=u.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        if ctx.on_gpu:
            rows, cols = ctx.saved_tensors
            m, iterations, n, _ = rows.shape
            g = grad.to(torch.float64, memory_format=torch.contiguous_format, copy=True)  # the kernel works in place
            block = max(16, triton.next_power_of_2(n))
            _backward_cuda[(m,)](g, rows, cols, iterations, n, BLOCK=block)
            return (g / ctx.tau).to(grad.dtype), None, None
        g = _backward_cpu(grad.detach().cpu().double().numpy(), ctx.rows, ctx.cols)
        return torch.from_numpy(g / ctx.tau).to(device=grad.device, dtype=grad.dtype), None, None


def sinkhorn(u: Tensor, tau: float, iterations: int) -> Tensor:
    """Soft permutation matrices ``[m, n, n]`` from ``u`` ``[m, n, n]`` (eq. 8): ``R`` log-space rounds at ``tau``."""
    return LogSinkhorn.apply(u, tau, iterations)
