"""Log-space Sinkhorn (COMET paper, eq. 8; comet-protocol.md §3.2) for a batch of matrices, each with its own
temperature, iteration count and entropy-penalty scale, as one autograd function with compiled kernels.

Matrix ``b`` of ``log_sinkhorn(U, tau, R, scale)`` is ``exp`` of ``R[b]`` rounds of ``L <- L - logsumexp_rows(L);
L <- L - logsumexp_cols(L)`` from ``L = U[b] / tau[b]`` (it ends column-stochastic). Unrolled in autograd that is
~14 kernels per round, about as much as a whole MovieLens training step at R = 150, so forward and backward are
hand-written loops instead, in float64:

* CPU tensors: numba loops over the small ``[n, n]`` matrices (faster than NumPy calls: benchmarks/README.md,
  ``bench_local_search.py``);
* CUDA tensors: two Triton kernels, one program per matrix, the whole recursion in registers. Each program loads
  its matrix's tau, R and scale from device memory and loops R times, so a batch of matrices at different points
  of their schedules (local search's trials trained as one pack) is one launch, with no host read, no
  synchronisation and shapes that depend on ``max_iterations`` only: it can be captured in a CUDA graph. Without
  Triton, the CPU loops run on a host copy. CI runs the kernels on CPU through Triton's interpreter
  (``TRITON_INTERPRET=1``).

Both save every round's row and column softmaxes (``[M, max_iterations, n, n]``, the first ``R[b]`` rounds
written) for the backward pass, which is the exact vector-Jacobian product of the recursion (the tests check both
against autograd through the unrolled recursion). The same kernels compute local search's entropy penalty and its
gradient (§4.3), so that a training step inside the window adds one forward and one backward kernel for all of it.
Under ``torch.func.vmap`` the vmapped axis is folded into the matrix axis (still one launch).

Output entries below ``finfo.tiny / finfo.eps`` of the output dtype (~1e-31 in float32) are set to exactly 0 (the
gradient is the exact one of the unflushed output). They are far below the precision of their column, which sums
to 1, but at the window's start (tau = 1e-3) they are many: 489 of the 8,192 permuted gate weights of a MovieLens
batch were subnormal float32 numbers, which x86 CPUs process on a slow path.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from torch import Tensor

from mtmoe.triton_support import grid, tl, triton, use_triton

ENTROPY_EPS = 1e-6  # inside the entropy penalty's logs, log(x + 1e-6) (the official code's)
MAX_ITERATIONS = 150  # the schedule's last R (§4.3): the saved softmaxes have room for this many rounds


@numba.njit(cache=True)
def _exp(x: float) -> float:
    """``math.exp(x)``, 0 without calling it below -745.2, where it is 0: libm's underflow path costs ~10 times a
    plain exp, and at small tau most entries take it."""
    return 0.0 if x < -745.2 else math.exp(x)


@numba.njit(cache=True)
def _entropy_cpu(p: np.ndarray, scale: float, grad: np.ndarray) -> float:
    """``scale * H(p)`` of one ``[n, n]`` matrix (float64), its gradient w.r.t. ``p`` written to ``grad``; ``H`` as
    in :func:`log_sinkhorn`."""
    n = p.shape[0]
    slope = np.empty(n)
    total = 0.0
    for i in range(n):
        row_sum = 0.0
        for j in range(n):  # column entropy: -P log(P + 1e-6)
            x = p[i, j]
            log_x = math.log(x + ENTROPY_EPS)
            total -= x * log_x
            grad[i, j] = -(log_x + x / (x + ENTROPY_EPS))
            row_sum += x
        row_sum = row_sum if row_sum > 0 else 1.0
        dot = 0.0
        for j in range(n):  # row entropy of P / row sums, through the normalisation
            r = p[i, j] / row_sum
            log_r = math.log(r + ENTROPY_EPS)
            total -= r * log_r
            slope[j] = -(log_r + r / (r + ENTROPY_EPS))
            dot += slope[j] * r
        for j in range(n):
            grad[i, j] = scale * (grad[i, j] + (slope[j] - dot) / row_sum)
    return scale * total


@numba.njit(cache=True)
def _forward_cpu(u: np.ndarray, tau: np.ndarray, iterations: np.ndarray, scale: np.ndarray, floor: float,
                 p: np.ndarray, penalty: np.ndarray, rows: np.ndarray, cols: np.ndarray,
                 d_penalty: np.ndarray) -> None:
    """Matrix ``b``: ``iterations[b]`` row-then-column normalisations of ``u[b] / tau[b]`` (float64), each round's
    row and column softmaxes saved in ``rows[b, r]``, ``cols[b, r]``; the last column softmax flushed below ``floor``
    is ``p[b]``, with penalty ``scale[b] * H(p[b])`` and its gradient ``d_penalty[b]``. Outputs written in place."""
    m, n, _ = u.shape
    for b in range(m):
        log_p = u[b] / tau[b]
        for r in range(iterations[b]):
            for i in range(n):  # L[i, :] -= logsumexp(L[i, :])
                top = log_p[i, :].max()
                total = 0.0
                for j in range(n):
                    rows[b, r, i, j] = _exp(log_p[i, j] - top)
                    total += rows[b, r, i, j]
                shift = top + math.log(total)
                for j in range(n):
                    rows[b, r, i, j] /= total
                    log_p[i, j] -= shift
            for j in range(n):  # L[:, j] -= logsumexp(L[:, j])
                top = log_p[:, j].max()
                total = 0.0
                for i in range(n):
                    cols[b, r, i, j] = _exp(log_p[i, j] - top)
                    total += cols[b, r, i, j]
                shift = top + math.log(total)
                for i in range(n):
                    cols[b, r, i, j] /= total
                    log_p[i, j] -= shift
        last = cols[b, iterations[b] - 1]
        for i in range(n):
            for j in range(n):
                p[b, i, j] = last[i, j] if last[i, j] >= floor else 0.0
        penalty[b] = _entropy_cpu(p[b], scale[b], d_penalty[b])


@numba.njit(cache=True)
def _backward_cpu(g: np.ndarray, g_penalty: np.ndarray, d_penalty: np.ndarray, rows: np.ndarray, cols: np.ndarray,
                  tau: np.ndarray, iterations: np.ndarray) -> None:
    """Vector-Jacobian product of :func:`_forward_cpu` w.r.t. ``u``, in place in ``g`` = dLoss/dP (float64), for the
    penalties' gradients ``g_penalty`` ``[M]``."""
    m, n, _ = g.shape
    for b in range(m):
        last = iterations[b] - 1
        for i in range(n):  # d exp(L) / dL = exp(L)
            for j in range(n):
                g[b, i, j] = (g[b, i, j] + g_penalty[b] * d_penalty[b, i, j]) * cols[b, last, i, j]
        for r in range(last, -1, -1):
            for j in range(n):  # through L <- L - logsumexp over each column
                total = 0.0
                for i in range(n):
                    total += g[b, i, j]
                for i in range(n):
                    g[b, i, j] -= cols[b, r, i, j] * total
            for i in range(n):  # through L <- L - logsumexp over each row
                total = 0.0
                for j in range(n):
                    total += g[b, i, j]
                for j in range(n):
                    g[b, i, j] -= rows[b, r, i, j] * total
        g[b] /= tau[b]


if triton is not None:

    @triton.jit
    def _load_iterations(iterations_ptr, b, max_iterations):
        """Matrix ``b``'s R, clamped to the saved buffers' ``[1, max_iterations]`` (checked on the host for CPU
        tensors; a CUDA tensor is not read there)."""
        return tl.minimum(tl.maximum(tl.load(iterations_ptr + b).to(tl.int32), 1), max_iterations)

    @triton.jit
    def _forward_cuda(u_ptr, tau_ptr, iterations_ptr, scale_ptr, p_ptr, penalty_ptr, rows_ptr, cols_ptr,
                      d_penalty_ptr, floor, n, max_iterations, BLOCK: tl.constexpr, EPS: tl.constexpr):
        """One program per matrix: :func:`_forward_cpu`'s recursion, flushed output, penalty and its gradient."""
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)[:, None]
        j = tl.arange(0, BLOCK)[None, :]
        inside = (i < n) & (j < n)
        offsets = i * n + j
        u = tl.load(u_ptr + b * n * n + offsets, mask=inside, other=0.0).to(tl.float64)
        log_p = tl.where(inside, u / tl.load(tau_ptr + b), -float("inf"))
        cols = tl.zeros((BLOCK, BLOCK), dtype=tl.float64)
        for r in range(_load_iterations(iterations_ptr, b, max_iterations)):
            saved = (b * max_iterations + r) * n * n + offsets
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
        tl.store(p_ptr + b * n * n + offsets, p.to(p_ptr.dtype.element_ty), mask=inside)
        scale = tl.load(scale_ptr + b)
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
        tl.store(d_penalty_ptr + b * n * n + offsets, scale * grad, mask=inside)
        tl.store(penalty_ptr + b, (scale * entropy).to(penalty_ptr.dtype.element_ty))

    @triton.jit
    def _backward_cuda(g_ptr, g_penalty_ptr, d_penalty_ptr, rows_ptr, cols_ptr, tau_ptr, iterations_ptr, out_ptr, n,
                       max_iterations, BLOCK: tl.constexpr):
        """One program per matrix: :func:`_backward_cpu`, written to ``out_ptr`` as the gradient w.r.t. ``u``."""
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)[:, None]
        j = tl.arange(0, BLOCK)[None, :]
        inside = (i < n) & (j < n)
        offsets = i * n + j
        g = tl.load(g_ptr + b * n * n + offsets, mask=inside, other=0.0).to(tl.float64)
        g_penalty = tl.load(g_penalty_ptr + b).to(tl.float64)
        g += g_penalty * tl.load(d_penalty_ptr + b * n * n + offsets, mask=inside, other=0.0)
        iterations = _load_iterations(iterations_ptr, b, max_iterations)
        last = (b * max_iterations + iterations - 1) * n * n + offsets
        g = g * tl.load(cols_ptr + last, mask=inside, other=0.0)
        for k in range(iterations):
            saved = (b * max_iterations + iterations - 1 - k) * n * n + offsets
            g = g - tl.load(cols_ptr + saved, mask=inside, other=0.0) * tl.sum(g, axis=0)[None, :]
            g = g - tl.load(rows_ptr + saved, mask=inside, other=0.0) * tl.sum(g, axis=1)[:, None]
        tl.store(out_ptr + b * n * n + offsets, (g / tl.load(tau_ptr + b)).to(out_ptr.dtype.element_ty), mask=inside)


def _floor(dtype: torch.dtype) -> float:
    """Output entries below this are flushed to 0: products with them stay clear of subnormals down to ``eps``.

    float64 outputs are not flushed (0): their threshold, ~1e-292, is below what the float32 kernel argument holds.
    """
    if dtype == torch.float64:
        return 0.0
    info = torch.finfo(dtype)
    return info.tiny / info.eps


def _block(n: int) -> int:
    """The kernels' tile: n x n padded to a power of two, at least 16."""
    return max(16, triton.next_power_of_2(n))


def _check_iterations(iterations: Tensor, max_iterations: int) -> None:
    """R must fill 1 to ``max_iterations`` rounds of the saved buffers (``iterations`` on the host, read through NumPy:
    no tensor operation, so a training step's count of them shows no host read)."""
    values = iterations.numpy()
    low, high = int(values.min()), int(values.max())
    if low < 1 or high > max_iterations:
        raise ValueError(f"Sinkhorn iterations must be in [1, {max_iterations}], got {low}..{high}")


class LogSinkhorn(torch.autograd.Function):
    """``(P, penalty, rows, cols, d_penalty)``: :func:`log_sinkhorn`'s outputs, then the saved softmaxes and the
    penalties' gradients w.r.t. ``P`` (outputs so that ``setup_context`` can save them; not differentiable)."""

    @staticmethod
    def forward(u: Tensor, tau: Tensor, iterations: Tensor, entropy_scale: Tensor,
                max_iterations: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        m, n, _ = u.shape
        u, tau, iterations, entropy_scale = (x.detach().contiguous() for x in (u, tau, iterations, entropy_scale))
        if use_triton(u.device):
            if not u.is_cuda:  # the interpreter; a host read of a CUDA tensor would synchronise: its kernels clamp R
                _check_iterations(iterations, max_iterations)
            rows = torch.empty(m, max_iterations, n, n, dtype=torch.float64, device=u.device)
            cols, p = torch.empty_like(rows), torch.empty_like(u)
            d_penalty = torch.empty(m, n, n, dtype=torch.float64, device=u.device)
            penalty = u.new_empty(m)
            _forward_cuda[grid(m)](u, tau, iterations, entropy_scale, p, penalty, rows, cols, d_penalty,
                                   _floor(u.dtype), n, max_iterations, BLOCK=_block(n), EPS=ENTROPY_EPS)
            return p, penalty, rows, cols, d_penalty
        iterations = iterations.cpu()
        _check_iterations(iterations, max_iterations)
        rows = torch.empty(m, max_iterations, n, n, dtype=torch.float64)
        cols = torch.empty_like(rows)
        p, d_penalty = torch.empty(m, n, n, dtype=torch.float64), torch.empty(m, n, n, dtype=torch.float64)
        penalty = torch.empty(m, dtype=torch.float64)
        _forward_cpu(u.cpu().double().numpy(), tau.cpu().numpy(), iterations.numpy(), entropy_scale.cpu().numpy(),
                     _floor(u.dtype), p.numpy(), penalty.numpy(), rows.numpy(), cols.numpy(), d_penalty.numpy())
        return p.to(u.device, u.dtype), penalty.to(u.device, u.dtype), rows, cols, d_penalty

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        u, tau, iterations, _, _ = inputs
        _, _, rows, cols, d_penalty = output
        ctx.mark_non_differentiable(rows, cols, d_penalty)
        ctx.set_materialize_grads(False)  # no zero gradients for the large saved buffers
        ctx.save_for_backward(rows, cols, d_penalty, tau, iterations)
        ctx.dtype, ctx.device = u.dtype, u.device

    @staticmethod
    def backward(ctx, grad: Tensor | None, grad_penalty: Tensor | None, *_) -> tuple[Tensor | None, ...]:
        rows, cols, d_penalty, tau, iterations = (x.detach().contiguous() for x in ctx.saved_tensors)
        m, max_iterations, n, _ = rows.shape
        if grad is None:  # only the penalty is used
            grad = torch.zeros(m, n, n, dtype=ctx.dtype, device=ctx.device)
        if grad_penalty is None:  # only P is used
            grad_penalty = torch.zeros(m, dtype=ctx.dtype, device=ctx.device)
        if use_triton(grad.device):
            out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
            _backward_cuda[grid(m)](grad.contiguous(), grad_penalty.contiguous(), d_penalty, rows, cols, tau,
                                    iterations, out, n, max_iterations, BLOCK=_block(n))
            return out, None, None, None, None
        g = grad.detach().to("cpu", torch.float64, copy=True, memory_format=torch.contiguous_format)
        g_penalty = grad_penalty.detach().to("cpu", torch.float64).contiguous()
        _backward_cpu(g.numpy(), g_penalty.numpy(), d_penalty.numpy(), rows.numpy(), cols.numpy(), tau.cpu().numpy(),
                      iterations.cpu().numpy())
        return g.to(grad.device, grad.dtype), None, None, None, None

    @staticmethod
    def vmap(info, in_dims: tuple, u: Tensor, tau: Tensor, iterations: Tensor, entropy_scale: Tensor,
             max_iterations: int) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
        """Folds the vmapped axis into the matrix axis: ``[B, M, ...]`` inputs are ``B * M`` matrices, one launch."""

        def folded(x: Tensor, dim: int | None) -> Tensor:
            x = x.movedim(dim, 0) if dim is not None else x.expand(info.batch_size, *x.shape)
            return x.flatten(0, 1)

        outputs = LogSinkhorn.apply(*map(folded, (u, tau, iterations, entropy_scale), in_dims[:4]), max_iterations)
        return tuple(x.unflatten(0, (info.batch_size, -1)) for x in outputs), (0,) * len(outputs)


def log_sinkhorn(u: Tensor, tau: Tensor, iterations: Tensor, entropy_scale: Tensor,
                 max_iterations: int = MAX_ITERATIONS) -> tuple[Tensor, Tensor]:
    """Soft permutation matrices ``P`` ``[M, n, n]`` (eq. 8) and entropy penalties ``[M]`` (§4.3), in ``u``'s dtype.

    Matrix ``b`` is ``iterations[b]`` log-space rounds on ``u[b] / tau[b]``, its penalty ``entropy_scale[b] *
    H(P_b)``: the column entropy of ``P_b`` plus the row entropy of ``P_b`` normalised by its row sums, with
    ``log(x + 1e-6)`` (the official code's). ``tau`` and ``entropy_scale`` are float64 ``[M]`` and ``iterations``
    int64 ``[M]``, on ``u``'s device; the gradient flows to ``u`` only. R must be in ``[1, max_iterations]``, the
    room of the saved softmaxes: a ValueError otherwise, except on CUDA, where checking would synchronise and the
    kernels clamp R into that range instead.
    """
    p, penalty, *_ = LogSinkhorn.apply(u, tau, iterations, entropy_scale, max_iterations)
    return p, penalty


def _per_matrix(value: Tensor | float, m: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-d tensor or Python number as ``[m]`` tensor (a Python number is filled on the device, not copied)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype).expand(m)
    return torch.full((m,), value, dtype=dtype, device=device)


def sinkhorn_and_penalty(u: Tensor, tau: Tensor | float, iterations: Tensor | int, zeta: Tensor | float,
                         max_iterations: int = MAX_ITERATIONS) -> tuple[Tensor, Tensor]:
    """One trial's ``P = sinkhorn(u, tau, R)`` ``[m, n, n]`` and its entropy penalty ``zeta * mean_b H(P_b)``
    (§4.3, ``H`` as in :func:`log_sinkhorn`), in one call; ``tau``, ``R`` and ``zeta`` are 0-d tensors on ``u``'s
    device or Python numbers.

    Under ``torch.func.vmap`` over trials (``u`` ``[P, m, n, n]``, ``tau``, ``R``, ``zeta`` ``[P]``) all trials'
    matrices go to the kernels as one batch.
    """
    m = u.shape[0]
    scale = _per_matrix(zeta, m, torch.float64, u.device) / m
    p, penalty = log_sinkhorn(u, _per_matrix(tau, m, torch.float64, u.device),
                              _per_matrix(iterations, m, torch.int64, u.device), scale, max_iterations)
    return p, penalty.sum()


def sinkhorn(u: Tensor, tau: Tensor | float, iterations: Tensor | int, max_iterations: int = MAX_ITERATIONS) -> Tensor:
    """Soft permutation matrices ``[m, n, n]`` from ``u`` ``[m, n, n]`` (eq. 8): ``R`` log-space rounds at ``tau``."""
    return sinkhorn_and_penalty(u, tau, iterations, 0.0, max_iterations)[0]
