"""Log-space Sinkhorn (COMET paper, eq. 8; comet-protocol.md §3.2) as one autograd function with compiled kernels.

``sinkhorn(U, tau, R)`` is ``exp`` of ``R`` rounds of ``L <- L - logsumexp_rows(L); L <- L - logsumexp_cols(L)``
from ``L = U / tau`` (it ends column-stochastic). Unrolled in autograd that is ~14 kernels per round, about as much as
a whole MovieLens training step at R = 150, so forward and backward are hand-written loops instead, in float64:

* CPU tensors: numba loops over the small ``[m, n, n]`` matrices (1.3 ms forward + backward at R = 150, n = 16, on
  a 2-core CPU; NumPy calls took 7-11 ms);
* CUDA tensors: two Triton kernels, one program per matrix, the whole recursion in registers (no host round trip,
  no synchronisation), when Triton is installed; otherwise the CPU loops on a host copy. The kernels also do the
  division by tau and the dtype conversions. CI runs them on CPU through Triton's interpreter (``TRITON_INTERPRET=1``).

Both save every round's row and column softmaxes for the backward pass, which is the exact vector-Jacobian
product of the recursion (the tests check both against autograd through the unrolled recursion). The same kernels
compute local search's entropy penalty and its gradient (:func:`sinkhorn_and_penalty`), so that a training step
inside the window adds one forward and one backward kernel for all of it.

Output entries below ``finfo.tiny / finfo.eps`` of the output dtype (~1e-31 in float32) are set to exactly 0 (the
gradient is the exact one of the unflushed output). They are far below the precision of their column, which sums
to 1, but at the window's start (tau = 1e-3) they are many: 489 of the 8,192 permuted gate weights of a MovieLens
batch were subnormal float32 numbers, which x86 CPUs process on a slow path.
"""
from __future__ import annotations

import math
import os

import numba
import numpy as np
import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

ENTROPY_EPS = 1e-6  # inside the entropy penalty's logs, log(x + 1e-6) (the official code's)


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


@numba.njit(cache=True)
def _entropy_cpu(p: np.ndarray, scale: float) -> tuple[float, np.ndarray]:
    """``scale * sum_b H(P_b)`` and its gradient w.r.t. ``p`` ``[m, n, n]`` (float64); ``H`` as in
    :func:`sinkhorn_and_penalty`."""
    m, n, _ = p.shape
    grad = np.empty_like(p)
    slope = np.empty(n)
    total = 0.0
    for b in range(m):
        for i in range(n):
            row_sum = 0.0
            for j in range(n):  # column entropy: -P log(P + 1e-6)
                x = p[b, i, j]
                log_x = math.log(x + ENTROPY_EPS)
                total -= x * log_x
                grad[b, i, j] = -(log_x + x / (x + ENTROPY_EPS))
                row_sum += x
            row_sum = row_sum if row_sum > 0 else 1.0
            dot = 0.0
            for j in range(n):  # row entropy of P / row sums, through the normalisation
                r = p[b, i, j] / row_sum
                log_r = math.log(r + ENTROPY_EPS)
                total -= r * log_r
                slope[j] = -(log_r + r / (r + ENTROPY_EPS))
                dot += slope[j] * r
            for j in range(n):
                grad[b, i, j] = scale * (grad[b, i, j] + (slope[j] - dot) / row_sum)
    return scale * total, grad


if triton is not None:

    @triton.jit
    def _forward_cuda(u_ptr, rows_ptr, cols_ptr, out_ptr, penalty_ptr, d_penalty_ptr, inv_tau_hi, inv_tau_lo,
                      scale_hi, scale_lo, floor, iterations, n, BLOCK: tl.constexpr, ENTROPY: tl.constexpr,
                      EPS: tl.constexpr):
        """One program per matrix: :func:`_forward_cpu`'s recursion on ``u / tau`` (softmaxes stored as ``[m, R, n,
        n]``), the flushed output, and with ``ENTROPY`` :func:`_entropy_cpu`'s penalty (added to ``penalty_ptr``)
        and gradient."""
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK)[:, None]
        j = tl.arange(0, BLOCK)[None, :]
        inside = (i < n) & (j < n)
        offsets = i * n + j
        u = tl.load(u_ptr + b * n * n + offsets, mask=inside, other=0.0).to(tl.float64)
        log_p = tl.where(inside, u * inv_tau_hi + u * inv_tau_lo, -float("inf"))
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
        p = tl.where(inside & (cols >= floor), cols, 0.0)
        tl.store(out_ptr + b * n * n + offsets, p.to(out_ptr.dtype.element_ty), mask=inside)
        if ENTROPY:
            log_p = tl.log(p + EPS)
            entropy = -tl.sum(tl.sum(p * log_p, axis=1), axis=0)
            grad = -(log_p + p / (p + EPS))
            row_sum = tl.sum(p, axis=1)
            row_sum = tl.where(row_sum > 0, row_sum, 1.0)
            r = p / row_sum[:, None]
            log_r = tl.log(r + EPS)
            entropy -= tl.sum(tl.sum(r * log_r, axis=1), axis=0)
            slope = -(log_r + r / (r + EPS))
            grad += (slope - tl.sum(slope * r, axis=1)[:, None]) / row_sum[:, None]
            tl.store(d_penalty_ptr + b * n * n + offsets, grad * scale_hi + grad * scale_lo, mask=inside)
            tl.atomic_add(penalty_ptr, (entropy * scale_hi + entropy * scale_lo).to(penalty_ptr.dtype.element_ty))

    @triton.jit
    def _backward_cuda(g_ptr, g_penalty_ptr, d_penalty_ptr, rows_ptr, cols_ptr, out_ptr, inv_tau_hi, inv_tau_lo,
                       iterations, n, BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
        """One program per matrix: :func:`_backward_cpu`'s vector-Jacobian product of the output's gradient plus
        (with ``ENTROPY``) the penalty's, written to ``out_ptr`` as the gradient w.r.t. ``u``."""
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK)[:, None]
        j = tl.arange(0, BLOCK)[None, :]
        inside = (i < n) & (j < n)
        offsets = i * n + j
        g = tl.load(g_ptr + b * n * n + offsets, mask=inside, other=0.0).to(tl.float64)
        if ENTROPY:
            g_penalty = tl.load(g_penalty_ptr).to(tl.float64)
            g += g_penalty * tl.load(d_penalty_ptr + b * n * n + offsets, mask=inside, other=0.0)
        last = (b * iterations + iterations - 1) * n * n + offsets
        g = g * tl.load(cols_ptr + last, mask=inside, other=0.0)
        for k in range(iterations):
            saved = (b * iterations + iterations - 1 - k) * n * n + offsets
            g = g - tl.load(cols_ptr + saved, mask=inside, other=0.0) * tl.sum(g, axis=0)[None, :]
            g = g - tl.load(rows_ptr + saved, mask=inside, other=0.0) * tl.sum(g, axis=1)[:, None]
        tl.store(out_ptr + b * n * n + offsets, (g * inv_tau_hi + g * inv_tau_lo).to(out_ptr.dtype.element_ty),
                 mask=inside)


def _floor(dtype: torch.dtype) -> float:
    """Output entries below this are flushed to 0: products with them stay clear of subnormals down to ``eps``.

    float64 outputs are not flushed (0): their threshold, ~1e-292, is below what the float32 kernel argument holds.
    """
    if dtype == torch.float64:
        return 0.0
    info = torch.finfo(dtype)
    return info.tiny / info.eps


def _float32_pair(x: float) -> tuple[float, float]:
    """``x`` as ``hi + lo``, two float32 values (~48 bits together): Triton passes a Python float to a kernel as
    float32 (its annotations for float64 arguments pass wrong values before Triton 3.4), so the kernels compute
    ``v * hi + v * lo`` in float64."""
    hi = float(np.float32(x))
    return hi, float(np.float32(x - hi))


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs the kernels on CPU tensors


def _use_triton(u: Tensor) -> bool:
    """Triton kernels for CUDA tensors, and for every tensor under the interpreter (how CI tests them on CPU)."""
    return triton is not None and (u.is_cuda or INTERPRET)


class LogSinkhorn(torch.autograd.Function):
    """``(P, penalty)`` of :func:`sinkhorn_and_penalty` with the hand-written forward and backward of this module."""

    @staticmethod
    def forward(ctx, u: Tensor, tau: float, iterations: int, zeta: float) -> tuple[Tensor, Tensor]:
        if iterations < 1:
            raise ValueError(f"Sinkhorn needs at least one iteration, got {iterations}")
        m, n, _ = u.shape
        ctx.tau, ctx.entropy, ctx.triton = tau, zeta > 0, _use_triton(u)
        scale = zeta / m
        if ctx.triton:
            u = u.detach().contiguous()
            rows = torch.empty(m, iterations, n, n, dtype=torch.float64, device=u.device)
            cols = torch.empty_like(rows)
            d_penalty = torch.empty(m, n, n, dtype=torch.float64, device=u.device) if ctx.entropy else cols
            out, penalty = torch.empty_like(u), u.new_zeros(())
            _forward_cuda[(m,)](u, rows, cols, out, penalty, d_penalty, *_float32_pair(1.0 / tau),
                                *_float32_pair(scale), _floor(u.dtype), iterations, n,
                                BLOCK=max(16, triton.next_power_of_2(n)), ENTROPY=ctx.entropy, EPS=ENTROPY_EPS)
            ctx.save_for_backward(rows, cols, d_penalty)
            return out, penalty
        rows, cols = _forward_cpu(u.detach().cpu().double().numpy() / tau, iterations)
        p = cols[-1].copy()
        p[p < _floor(u.dtype)] = 0.0
        penalty, ctx.d_penalty = _entropy_cpu(p, scale) if ctx.entropy else (0.0, None)
        ctx.rows, ctx.cols = rows, cols
        return (torch.from_numpy(p).to(device=u.device, dtype=u.dtype),
                torch.tensor(penalty, dtype=u.dtype, device=u.device))

    @staticmethod
    def backward(ctx, grad: Tensor, grad_penalty: Tensor) -> tuple[Tensor, None, None, None]:
        if ctx.triton:
            rows, cols, d_penalty = ctx.saved_tensors
            m, iterations, n, _ = rows.shape
            out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
            _backward_cuda[(m,)](grad.contiguous(), grad_penalty, d_penalty, rows, cols, out,
                                 *_float32_pair(1.0 / ctx.tau), iterations, n,
                                 BLOCK=max(16, triton.next_power_of_2(n)), ENTROPY=ctx.entropy)
            return out, None, None, None
        g = grad.detach().cpu().double().numpy()
        if ctx.entropy:
            g = g + float(grad_penalty) * ctx.d_penalty
        g = _backward_cpu(g, ctx.rows, ctx.cols)
        return torch.from_numpy(g / ctx.tau).to(device=grad.device, dtype=grad.dtype), None, None, None


def sinkhorn(u: Tensor, tau: float, iterations: int) -> Tensor:
    """Soft permutation matrices ``[m, n, n]`` from ``u`` ``[m, n, n]`` (eq. 8): ``R`` log-space rounds at ``tau``."""
    return LogSinkhorn.apply(u, tau, iterations, 0.0)[0]


def sinkhorn_and_penalty(u: Tensor, tau: float, iterations: int, zeta: float) -> tuple[Tensor, Tensor]:
    """``P = sinkhorn(u, tau, R)`` and local search's entropy penalty ``zeta * mean_b H(P_b)`` (§4.3), in one call.

    ``H(P)`` is the column entropy of ``P`` plus the row entropy of ``P`` normalised by its row sums, with
    ``log(x + 1e-6)`` (the official code's). The penalty and its gradient are computed by the same kernels as ``P``
    (they add ~35 small tensor operations to a training step otherwise); ``zeta = 0`` skips them.
    """
    return LogSinkhorn.apply(u, tau, iterations, zeta)
