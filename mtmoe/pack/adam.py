"""Adam over a :class:`~mtmoe.pack.stack.TrialStack`: every trial's parameters in one set of element-wise kernels.

The update of ``torch.optim.Adam`` (Kingma and Ba, Algorithm 1, with PyTorch's bias corrections; ``weight_decay``
0, no amsgrad) on the stacked parameters and gradients, each trial with its own learning rate, epsilon and step
count as ``[P, 1]`` tensors: the number of kernels depends on the model's parameters, not on P, and nothing is read
on the host. The arithmetic is that of ``torch.optim.Adam(fused=True)``, operation for operation (the coefficients
in float64, cast once; the moments and the update in float32); where the fused kernels contract products into fused
multiply-adds differently, the two agree to float32 rounding (tested). Three implementations of one formula:

* element-wise torch operations on each parameter's ``[P, size]`` block (``fused=False``, and for float64): about
  ten kernels per parameter;
* on a CPU, one numba kernel (:func:`_adam_cpu`, split over torch's threads by
  :func:`mtmoe.host_threads.run_split`): one pass over the parameters, gradients and moments. Its square root is
  correctly rounded, as the fused kernel's (``torch.sqrt`` on x86 CPUs is MKL's, within one ulp), and its lerp is
  the fused multiply-add of torch's vectorised ``lerp`` at every position, so a trial's values do not depend on
  where its block lies or how the range is split;
* on a GPU, one Triton kernel (:func:`_adam_cuda`) over work units of at most ``_UNIT`` elements of one trial's
  block, which a CUDA graph captures as one launch. Its operations are the element-wise path's, each rounded as
  there (the lerp's fused multiply-add as CUDA's ``lerp``, the square root and divisions IEEE, no other contraction:
  ``enable_fp_fusion=False``).

The fused kernels also read a parameter's gradient where autograd left it (``kept``: a linear layer's weight
gradient, the transpose of its block's layout; an embedding's), instead of from a copy in the flat gradient: one
more kernel per such block (:func:`_adam_kept_cpu`, which gathers each row before :func:`_adam_run`;
:func:`_adam_kept_cuda`, which loads a tile through the gradient's own strides), the same arithmetic per element, so
the same bits.

As ``torch.optim.Adam`` leaves a parameter whose gradient is ``None`` as it is, :meth:`PackedAdam.step` leaves the
parameters a trial did not use in the step (``skip``: local search's matrix once the permutation is frozen) with
their moments untouched.
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from mtmoe.host_threads import MIN_PART, run_split
from mtmoe.kernel_traffic import fused_kernel
from mtmoe.pack.stack import TrialStack
from mtmoe.plain_kernels import runs_fused
from mtmoe.random import _bfloat16_bits, _fma, _widen
from mtmoe.triton_support import grid, tl, triton, use_triton

BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults, which the unpacked runs use


_LERP_WEIGHT = np.float32(1 - BETAS[0])  # torch casts the Python scalars to the parameters' float32
_BETA2, _ONE_MINUS_BETA2 = np.float32(BETAS[1]), np.float32(1 - BETAS[1])


@numba.njit(cache=True, nogil=True, error_model="numpy")  # IEEE division: eps = 0 may divide by zero
def _adam_run(param: np.ndarray, grad: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, half: np.ndarray,
              s: np.float32, c: np.float32, e: np.float32) -> None:
    """The update of one trial's contiguous run of elements (step size ``s``, ``sqrt`` of the second bias
    correction ``c``, epsilon ``e``), each new value also written to ``half`` as its bfloat16 bits (rounded to
    nearest even, as autocast's cast rounds) unless ``half`` is empty. A loop from 0 over slices is what LLVM
    turns into SIMD lanes (a loop from ``i`` over the whole arrays stays scalar, 8x slower); every lane rounds as
    the scalar code does."""
    copies = half.shape[0] != 0
    bits = param.view(np.uint32)
    for j in range(param.shape[0]):
        g = grad[j]
        m = _fma(_LERP_WEIGHT, g - exp_avg[j], exp_avg[j])
        exp_avg[j] = m
        v = exp_avg_sq[j] * _BETA2 + g * _ONE_MINUS_BETA2 * g
        exp_avg_sq[j] = v
        param[j] = param[j] - s * m / (np.sqrt(v) / c + e)
        if copies:
            half[j] = _bfloat16_bits(bits[j])


_WIDENED = 1024  # elements of a bfloat16 gradient widened at a time by _adam_cpu


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _adam_cpu(param: np.ndarray, grad: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, half: np.ndarray,
              half_grad: np.ndarray, halves: np.ndarray, ends: np.ndarray, widths: np.ndarray, skip: np.ndarray,
              step_size: np.ndarray, bias_correction2_sqrt: np.ndarray, eps: np.ndarray, lo: int, hi: int) -> None:
    """:meth:`PackedAdam.step`'s element-wise update of the flat float32 tensors' elements ``[lo, hi)``. Block
    ``b`` ends at ``ends[b]`` and holds P rows of ``widths[b]`` (trial ``t``'s row), left alone where
    ``skip[b, t]``, its new values also written to ``half`` (bfloat16 bits, laid out as ``param``) where
    ``halves[b]``, and there its gradient read from ``half_grad`` (bfloat16 bits, widened exactly) instead of
    ``grad`` unless ``half_grad`` is empty; the per-trial coefficients are ``[P]`` float32."""
    widened = np.empty(_WIDENED, np.uint32)
    widened_grad = widened.view(np.float32)
    block = 0
    i = lo
    while i < hi:
        while ends[block] <= i:
            block += 1
        width = widths[block]
        start = ends[block] - width * skip.shape[1]
        trial = (i - start) // width
        end = min(hi, start + (trial + 1) * width)
        if not skip[block, trial] and halves[block] and half_grad.shape[0] != 0:
            for a in range(i, end, _WIDENED):
                b = min(end, a + _WIDENED)
                _widen(half_grad[a:b], widened)
                _adam_run(param[a:b], widened_grad[:b - a], exp_avg[a:b], exp_avg_sq[a:b], half[a:b],
                          step_size[trial], bias_correction2_sqrt[trial], eps[trial])
        elif not skip[block, trial]:
            _adam_run(param[i:end], grad[i:end], exp_avg[i:end], exp_avg_sq[i:end], half[i:end] if halves[block]
                      else half[:0], step_size[trial], bias_correction2_sqrt[trial], eps[trial])
        i = end


_GATHERED_ROWS = 16  # rows of a block gathered at a time by _adam_kept_cpu


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _adam_kept_cpu(param: np.ndarray, grad: np.ndarray, grad_bits: np.ndarray, transposed: bool,
                   exp_avg: np.ndarray, exp_avg_sq: np.ndarray, half: np.ndarray, skip: np.ndarray,
                   step_size: np.ndarray, bias_correction2_sqrt: np.ndarray, eps: np.ndarray, lo: int, hi: int) -> None:
    """:func:`_adam_run` on rows ``[lo, hi)`` of one block of P x R rows of C elements (``param``, the moments and
    ``half``, its bfloat16 copy's bits or empty: the block's flat elements), its gradient read where autograd left
    it: ``grad`` ``[P, R, C]`` float32 (``[P, C, R]`` if ``transposed``: a linear layer's weight gradient as it
    lies), or the bits ``grad_bits`` of a bfloat16 one (widened exactly), the other empty; trial ``t`` left alone
    where ``skip[t]``. Up to :data:`_GATHERED_ROWS` rows of a trial are gathered into a contiguous buffer first
    (along the gradient's contiguous axis), so each element's arithmetic is :func:`_adam_cpu`'s."""
    bits = grad_bits.shape[0] != 0
    rows, cols = (grad_bits.shape[1], grad_bits.shape[2]) if bits else (grad.shape[1], grad.shape[2])
    if transposed:
        rows, cols = cols, rows
    gathered = np.empty((_GATHERED_ROWS, cols), np.uint32)
    values = gathered.view(np.float32)
    i = lo
    while i < hi:
        trial, row = i // rows, i % rows
        count = min(hi - i, _GATHERED_ROWS, rows - row)
        if not skip[trial]:
            if transposed:
                for j in range(cols):
                    for k in range(count):
                        if bits:
                            gathered[k, j] = np.uint32(grad_bits[trial, j, row + k]) << np.uint32(16)
                        else:
                            values[k, j] = grad[trial, j, row + k]
            else:
                for k in range(count):
                    for j in range(cols):
                        if bits:
                            gathered[k, j] = np.uint32(grad_bits[trial, row + k, j]) << np.uint32(16)
                        else:
                            values[k, j] = grad[trial, row + k, j]
            for k in range(count):
                a, b = (i + k) * cols, (i + k + 1) * cols
                _adam_run(param[a:b], values[k], exp_avg[a:b], exp_avg_sq[a:b],
                          half[a:b] if half.shape[0] != 0 else half, step_size[trial], bias_correction2_sqrt[trial],
                          eps[trial])
        i += count


if triton is not None:
    from mtmoe.random import _rounded, _widened

    @triton.jit
    def _adam_update(param_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, inside, g, s, c, e, lerp_weight, beta2,
                     one_minus_beta2):
        """:func:`_adam_run`'s update of the elements at ``offsets`` from their gradient ``g``: the moments and
        parameters loaded, updated and stored; returns the new parameters."""
        m = tl.load(exp_avg_ptr + offsets, mask=inside)
        m = tl.fma(lerp_weight, g - m, m)
        v = tl.load(exp_avg_sq_ptr + offsets, mask=inside) * beta2 + g * one_minus_beta2 * g
        p = tl.load(param_ptr + offsets, mask=inside)
        p = p - tl.div_rn(s * m, tl.div_rn(tl.sqrt_rn(v), c) + e)
        tl.store(exp_avg_ptr + offsets, m, mask=inside)
        tl.store(exp_avg_sq_ptr + offsets, v, mask=inside)
        tl.store(param_ptr + offsets, p, mask=inside)
        return p

    @triton.jit
    def _adam_cuda(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, half_ptr, half_grad_ptr, halves_ptr,
                   unit_start_ptr, unit_length_ptr, unit_trial_ptr, unit_skip_row_ptr, skip_ptr, kept_ptr,
                   step_size_ptr, bias_correction2_sqrt_ptr, eps_ptr, capacity, lerp_weight, beta2, one_minus_beta2,
                   UNIT: tl.constexpr, HALF: tl.constexpr, HALF_GRAD: tl.constexpr):
        """Program ``u``: :func:`_adam_run` on work unit ``u``, the ``unit_length[u]`` elements from
        ``unit_start[u]`` of trial ``unit_trial[u]``, unless ``skip[unit_skip_row[u], trial]`` or
        ``kept[unit_skip_row[u]]`` (a block :func:`_adam_kept_cuda` updates); with ``HALF``, the new values also
        written to ``half`` (bfloat16) where ``halves[unit_skip_row[u]]``, and with ``HALF_GRAD`` the gradient
        there read from ``half_grad`` (bfloat16, widened exactly)."""
        unit = tl.program_id(0)
        trial = tl.load(unit_trial_ptr + unit)
        row = tl.load(unit_skip_row_ptr + unit)
        if (tl.load(skip_ptr + row * capacity + trial) == 0) & (tl.load(kept_ptr + row) == 0):
            s = tl.load(step_size_ptr + trial)
            c = tl.load(bias_correction2_sqrt_ptr + trial)
            e = tl.load(eps_ptr + trial)
            lanes = tl.arange(0, UNIT)
            inside = lanes < tl.load(unit_length_ptr + unit)
            offsets = tl.load(unit_start_ptr + unit) + lanes
            if HALF_GRAD:
                if tl.load(halves_ptr + row) != 0:
                    g = _widened(tl.load(half_grad_ptr + offsets, mask=inside), False, True)
                else:
                    g = tl.load(grad_ptr + offsets, mask=inside)
            else:
                g = tl.load(grad_ptr + offsets, mask=inside)
            p = _adam_update(param_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, inside, g, s, c, e, lerp_weight,
                             beta2, one_minus_beta2)
            if HALF:
                if tl.load(halves_ptr + row) != 0:
                    tl.store(half_ptr + offsets, _rounded(p, True), mask=inside)

    @triton.jit
    def _adam_kept_cuda(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, half_ptr, skip_ptr, step_size_ptr,
                        bias_correction2_sqrt_ptr, eps_ptr, rows, cols, trial_stride, row_stride, col_stride,
                        lerp_weight, beta2, one_minus_beta2, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                        HALF: tl.constexpr, HALF_GRAD: tl.constexpr):
        """Program ``(tile, trial)``: :func:`_adam_kept_cpu` on tile ``tile`` (row-major over the tiles) of
        ``BLOCK_R x BLOCK_C`` elements of trial ``trial``'s ``rows x cols`` block (``param``, the moments and with
        ``HALF`` its bfloat16 copy, laid out as the block), its gradient read with its own strides (bfloat16 with
        ``HALF_GRAD``, widened exactly): a transposed gradient is read along its contiguous axis, the tile turned in
        the kernel."""
        trial = tl.program_id(1)
        if tl.load(skip_ptr + trial) == 0:
            s = tl.load(step_size_ptr + trial)
            c = tl.load(bias_correction2_sqrt_ptr + trial)
            e = tl.load(eps_ptr + trial)
            col_tiles = tl.cdiv(cols, BLOCK_C)
            r = tl.program_id(0) // col_tiles * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
            k = tl.program_id(0) % col_tiles * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
            inside = (r < rows) & (k < cols)
            wide = trial.to(tl.int64)
            offsets = wide * rows * cols + r * cols + k
            g = _widened(tl.load(grad_ptr + wide * trial_stride + r * row_stride + k * col_stride, mask=inside),
                         False, HALF_GRAD)
            p = _adam_update(param_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, inside, g, s, c, e, lerp_weight,
                             beta2, one_minus_beta2)
            if HALF:
                tl.store(half_ptr + offsets, _rounded(p, True), mask=inside)


_UNIT = 1024  # elements per program of the Triton kernels
_TILE_ROWS = 32  # rows of _adam_kept_cuda's tile of a block with more than one row


class PackedAdam:
    """Adam on every trial of ``stack`` with per-trial ``lr``, ``eps`` and step count.

    ``fused`` (default): one kernel for all parameters of all trials, numba on a CPU and Triton on a GPU, for float32
    stacks; ``fused=False`` runs the element-wise torch operations, block by block (float64 always does).
    """

    def __init__(self, stack: TrialStack, fused: bool = True) -> None:
        self.stack, self.fused = stack, fused
        self.exp_avg = torch.zeros_like(stack.flat)
        self.exp_avg_sq = torch.zeros_like(stack.flat)
        capacity, device = stack.capacity, stack.device
        self.steps = torch.zeros(capacity, 1, dtype=torch.float64, device=device)
        self.lr = torch.zeros(capacity, 1, dtype=torch.float64, device=device)
        self.eps = torch.zeros(capacity, 1, dtype=torch.float64, device=device)
        names = sorted(stack.blocks, key=lambda name: stack.blocks[name].start)
        blocks = [stack.blocks[name] for name in names]
        if blocks and ([b.start for b in blocks] != [0] + [b.stop for b in blocks[:-1]]
                       or blocks[-1].stop != stack.flat.numel()):
            raise ValueError("the stack's blocks do not tile its flat tensors")
        self.names = names  # the blocks in the flat tensors' order; each ends at ends[b] with P rows of widths[b]
        self.ends = np.array([b.stop for b in blocks], dtype=np.int64)
        self.widths = np.array([(b.stop - b.start) // capacity for b in blocks], dtype=np.int64)
        self._units: tuple[Tensor, ...] | None = None  # the Triton kernel's work units, built on first use
        self._skipped: Tensor | None = None
        self.half: Tensor | None = None  # bfloat16 copies of the parameters half_names (bfloat16_copies)
        self.half_names: frozenset[str] | None = None
        self.half_grad: Tensor | None = None  # the copies' gradients in bfloat16 (bfloat16_gradients)
        self._half_version: int | None = None  # stack.flat's version counter when the copies were last written
        self._device_flags: dict[str, tuple[np.ndarray, Tensor]] = {}  # the Triton kernel's block flags, by kind
        self._views: dict[tuple[str, object], tuple] = {}  # _block_views', and the CPU's arrays of them

    def _blocks(self, name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Parameter ``name``'s values, gradients and moments as ``[P, size]``."""
        stack = self.stack
        return tuple(flat[stack.blocks[name]].view(stack.capacity, -1)
                     for flat in (stack.flat, stack.flat_grad, self.exp_avg, self.exp_avg_sq))

    @torch.no_grad()
    def reset(self, slot: int, lr: float, eps: float) -> None:
        """A new trial in ``slot``: fresh moments and step count, its own hyperparameters."""
        for name in self.stack.blocks:
            for moments in self._blocks(name)[2:]:
                moments[slot].zero_()
        self.steps[slot] = 0.0
        self.lr[slot], self.eps[slot] = float(lr), float(eps)

    @torch.no_grad()
    def take(self, other: PackedAdam, slots: list[int]) -> None:
        """The state of ``other``'s ``slots``, in that order (a pack shrunk to its running trials)."""
        index = torch.tensor(slots, device=self.stack.device)
        for name in self.stack.blocks:
            for mine, theirs in zip(self._blocks(name)[2:], other._blocks(name)[2:]):
                mine.copy_(theirs[index])
        for mine, theirs in ((self.steps, other.steps), (self.lr, other.lr), (self.eps, other.eps)):
            mine.copy_(theirs[index])

    def slot_state(self, slot: int, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """``slot``'s rows of :meth:`state_dict` (or of ``state``, a copy of it): its moments by parameter, its step
        count, learning rate and epsilon (views)."""
        state = self.state_dict() if state is None else state
        rows = {f"{kind}.{name}": self.stack.block(state[kind], name)[slot]
                for kind in ("exp_avg", "exp_avg_sq") for name in self.stack.blocks}
        return rows | {name: state[name][slot] for name in ("steps", "lr", "eps")}

    @torch.no_grad()
    def load_slot(self, slot: int, rows: dict[str, Tensor]) -> None:
        """A trial's :meth:`slot_state` into ``slot`` (a checkpointed trial continuing there)."""
        for name, tensor in self.slot_state(slot).items():
            tensor.copy_(rows[name])

    def state_dict(self) -> dict[str, Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": self.steps, "lr": self.lr,
                "eps": self.eps}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for name, tensor in self.state_dict().items():
            tensor.copy_(state[name])

    @torch.no_grad()
    def bfloat16_copies(self, names: frozenset[str]) -> dict[str, Tensor]:
        """bfloat16 copies of the parameters ``names`` (``[P, *shape]`` each), rounded as autocast's cast rounds:
        the fused step (:meth:`step` with ``copies=True``) writes them in its pass over the parameters, so a step
        under autocast reads 2 bytes a parameter instead of casting 4 into 2. They are cast again here (one copy)
        when the parameters changed otherwise since: a load, a restore, a checkpoint, the element-wise update,
        anything that moves ``stack.flat``'s version counter, or a step that did not write them."""
        flat = self.stack.flat
        if self.half is None:
            self.half = torch.empty(flat.shape, dtype=torch.bfloat16, device=flat.device)
        if self.half_names != names or self._half_version != flat._version:
            for name in names:
                self.stack.block(self.half, name).copy_(self.stack.params[name])
            self.half_names, self._half_version = names, flat._version
        return {name: self.stack.block(self.half, name) for name in names}

    def reads_kept(self) -> bool:
        """Whether :meth:`step` runs the fused kernels, which read gradients where autograd left them (``kept``):
        ``fused``, float32 parameters, a device with a kernel, ``MTMOE_PLAIN_KERNELS`` not naming ``adam``."""
        return self.fused and self.stack.flat.dtype == torch.float32 and runs_fused("adam", self.stack.device)

    def _kernel_copies(self) -> bool:
        """Whether a step with ``copies`` runs a fused kernel that writes the copies (and may read their
        gradients in bfloat16)."""
        return self.half_names is not None and self.reads_kept()

    def bfloat16_gradients(self) -> dict[str, Tensor]:
        """Where a step with ``copies=True, gradients=True`` reads the gradients of :meth:`bfloat16_copies`'
        parameters: bfloat16 blocks (``[P, *shape]``) laid out as the parameters, for a backward whose gradients
        of those parameters are the bfloat16 copies' (a training step under autocast) to write, widened exactly in
        the fused kernel's pass, in place of a float32 copy in ``stack.flat_grad`` read at 4 bytes. Empty where
        the step would not run a fused kernel (the element-wise update reads ``flat_grad``)."""
        if not self._kernel_copies():
            return {}
        if self.half_grad is None:
            self.half_grad = torch.zeros(self.stack.flat.shape, dtype=torch.bfloat16, device=self.stack.device)
        return {name: self.stack.block(self.half_grad, name) for name in self.half_names}

    @torch.no_grad()
    def step(self, skip: dict[str, Tensor] | None = None, lr_scale: Tensor | None = None,
             copies: bool = False, gradients: bool = False, kept: dict[str, Tensor] | None = None) -> None:
        """One Adam step of every trial from the gradients in ``stack.flat_grad``; ``skip[name]`` (``[P]`` bool)
        names the trials that leave parameter ``name`` and its moments as they are; ``lr_scale`` (``[P]``) scales
        each trial's learning rate for this step (a schedule's). With ``copies``, the fused kernels also write the
        bfloat16 copies of :meth:`bfloat16_copies`' latest parameters, and with ``gradients`` too read those
        parameters' gradients from :meth:`bfloat16_gradients`' blocks (the same values as their float32 widening in
        ``flat_grad``). ``kept[name]`` (``[P, *shape]``, any strides, the dtype of the block it stands for: see
        :meth:`TrialStack.tracked <mtmoe.pack.stack.TrialStack.tracked>`) is parameter ``name``'s gradient read
        where it lies instead of from its block, by a kernel of its own (fused kernels only: :meth:`reads_kept`)."""
        kept = kept or {}
        if kept and not self.reads_kept():
            raise ValueError("gradients read where they lie need the fused kernels (fused=True, float32 parameters)")
        copies = copies and self._kernel_copies()
        self._step(skip, lr_scale, copies, copies and gradients, kept)
        self._half_version = self.stack.flat._version if copies else None

    def _step(self, skip: dict[str, Tensor] | None, lr_scale: Tensor | None, copies: bool,
              gradients: bool, kept: dict[str, Tensor]) -> None:
        self.steps.add_(1.0)
        beta1, beta2 = BETAS
        dtype = self.stack.flat.dtype
        lr = self.lr if lr_scale is None else self.lr * lr_scale.view(-1, 1).double()
        step_size = (lr / (1 - torch.pow(beta1, self.steps))).to(dtype)  # [P, 1]: per-trial coefficients
        bias_correction2_sqrt = (1 - torch.pow(beta2, self.steps)).sqrt().to(dtype)
        eps = self.eps.to(dtype)
        skip = skip or {}
        if not self.reads_kept():
            self._step_elementwise(skip, step_size, bias_correction2_sqrt, eps)
        elif use_triton(self.stack.device):
            self._step_triton(skip, step_size, bias_correction2_sqrt, eps, copies, gradients, kept)
        else:
            self._step_cpu(skip, step_size, bias_correction2_sqrt, eps, copies, gradients, kept)

    def _step_elementwise(self, skip: dict[str, Tensor], step_size: Tensor, bias_correction2_sqrt: Tensor,
                          eps: Tensor) -> None:
        """The update in element-wise torch operations, block by block (any device; captured in CUDA graphs)."""
        beta1, beta2 = BETAS
        for name in self.stack.blocks:
            param, grad, exp_avg, exp_avg_sq = self._blocks(name)
            kept = None
            if name in skip:
                kept = skip[name].view(-1, 1), [t.clone() for t in (param, exp_avg, exp_avg_sq)]
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).add_(grad * (1 - beta2) * grad)
            denom = exp_avg_sq.sqrt().div_(bias_correction2_sqrt).add_(eps)
            param.sub_((step_size * exp_avg).div_(denom))
            if kept is not None:
                mask, saved = kept
                for tensor, old in zip((param, exp_avg, exp_avg_sq), saved):
                    tensor.copy_(torch.where(mask, old, tensor))

    def _flats(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        stack = self.stack
        return stack.flat.detach(), stack.flat_grad, self.exp_avg, self.exp_avg_sq

    def _report(self, name: str, blocks: np.ndarray, halves: np.ndarray, half_gradients: np.ndarray) -> None:
        """The fused update's traffic over the blocks flagged in ``blocks``, to the operation counters
        (:func:`mtmoe.kernel_traffic.fused_kernel`): parameters, gradients and both moments read, parameters and
        moments written, the bfloat16 copies of the blocks flagged in ``halves`` written, and the gradients of
        those flagged in ``half_gradients`` read in bfloat16 (2 bytes an element where float32 reads 4)."""
        elements = self.widths * self.stack.capacity * blocks
        fused_kernel(name, int((16 * elements - 2 * elements * half_gradients).sum()),
                     int((12 * elements + 2 * elements * halves).sum()))

    def _halves(self, copies: bool) -> np.ndarray:
        """Per block, in the flat order: whether the step writes its bfloat16 copy."""
        return np.array([copies and name in self.half_names for name in self.names], dtype=np.bool_)

    def _kept_blocks(self, kept: dict[str, Tensor]) -> list[tuple[int, str, Tensor, int, int, tuple[int, ...]]]:
        """The blocks whose gradients ``kept`` holds, in the flat order: row, name, the gradient, and as
        ``[P, R, C]``: R, C and its strides (from its shape and strides alone: nothing dispatched)."""
        out = []
        for row, name in enumerate(self.names):
            if name in kept:
                gradient = kept[name]
                shape, strides = list(gradient.shape), list(gradient.stride())
                while len(shape) < 3:
                    shape.insert(1, 1)
                    strides.insert(1, 0)
                out.append((row, name, gradient, shape[1], shape[2], tuple(strides)))
        return out

    def _block_views(self, name: str, half: Tensor | None) -> tuple:
        """Parameter ``name``'s blocks of the parameters, both moments and ``half`` (or the parameters' again), and
        its row of the Triton kernel's skip flags: views made once (each a dispatched operation)."""
        key = (name, half is not None)
        if key not in self._views:
            block = self.stack.blocks[name]
            param, _, exp_avg, exp_avg_sq = (t[block] for t in self._flats())
            self._views[key] = (param, exp_avg, exp_avg_sq, param if half is None else half[block],
                                self._skipped[self.names.index(name)] if self._skipped is not None else None)
        return self._views[key]

    def _step_cpu(self, skip: dict[str, Tensor], step_size: Tensor, bias_correction2_sqrt: Tensor, eps: Tensor,
                  copies: bool, gradients: bool, kept: dict[str, Tensor]) -> None:
        """The same update by :func:`_adam_cpu`, over all blocks at once, on torch's threads, but the blocks whose
        gradients ``kept`` holds, each updated by :func:`_adam_kept_cpu`."""
        skipped = np.zeros((len(self.names), self.stack.capacity), dtype=np.bool_)
        for row, name in enumerate(self.names):
            if name in skip:
                skipped[row] = skip[name].numpy()
        halves = self._halves(copies)
        half = self.half.view(torch.uint16).numpy() if copies else np.empty(0, np.uint16)
        half_grad = self.half_grad.view(torch.uint16).numpy() if gradients else np.empty(0, np.uint16)
        coefficients = [t.view(-1).numpy() for t in (step_size, bias_correction2_sqrt, eps)]
        in_flat = np.array([name not in kept for name in self.names], dtype=np.bool_)
        self._report("adam (numba)", in_flat, halves, halves & gradients)
        main_skip = skipped | ~in_flat[:, None]  # the kept blocks are updated below
        run_split(_adam_cpu, self.stack.flat.numel(), *(t.numpy() for t in self._flats()), half, half_grad, halves,
                  self.ends, self.widths, main_skip, *coefficients)
        for row, name, gradient, rows, cols, _ in self._kept_blocks(kept):
            bfloat16 = gradient.dtype == torch.bfloat16
            values = (gradient.view(torch.uint16) if bfloat16 else gradient).numpy().reshape(-1, rows, cols)
            transposed = values.strides[1] < values.strides[2]  # read as it lies: [P, C, R]
            values = values.transpose(0, 2, 1) if transposed else values
            empty = np.empty((0, 0, 0), values.dtype)
            if (name, "numpy") not in self._views:  # .numpy() dispatches a detach: made once too
                self._views[name, "numpy"] = tuple(t.numpy() for t in self._block_views(name, None)[:3])
            param, exp_avg, exp_avg_sq = self._views[name, "numpy"]
            self._report("adam (numba)", np.arange(len(self.names)) == row, halves, np.full(len(self.names), bfloat16))
            run_split(_adam_kept_cpu, self.stack.capacity * rows, param, empty if bfloat16 else values,
                      values if bfloat16 else empty, transposed, exp_avg, exp_avg_sq,
                      half[self.stack.blocks[name]] if halves[row] else np.empty(0, np.uint16), skipped[row],
                      *coefficients, min_part=max(1, MIN_PART // cols))

    def _step_triton(self, skip: dict[str, Tensor], step_size: Tensor, bias_correction2_sqrt: Tensor, eps: Tensor,
                     copies: bool, gradients: bool, kept: dict[str, Tensor]) -> None:
        """The same update by :func:`_adam_cuda`, one program per work unit, but the blocks whose gradients
        ``kept`` holds, each updated by :func:`_adam_kept_cuda`; ``skip`` is read on the device."""
        capacity, device = self.stack.capacity, self.stack.device
        if self._units is None:
            starts, lengths, trials, rows = [], [], [], []
            for row, (end, width) in enumerate(zip(self.ends, self.widths)):
                chunks = -(-width // _UNIT)
                trial, chunk = np.divmod(np.arange(capacity * chunks), chunks)
                starts.append(end - width * capacity + trial * width + chunk * _UNIT)
                lengths.append(np.minimum(_UNIT, width - chunk * _UNIT))
                trials.append(trial)
                rows.append(np.full(capacity * chunks, row))
            self._units = tuple(torch.from_numpy(np.concatenate(values).astype(dtype)).to(device)
                                for values, dtype in ((starts, np.int64), (lengths, np.int32),
                                                      (trials, np.int32), (rows, np.int32)))
            self._skipped = torch.zeros(len(self.names), capacity, dtype=torch.uint8, device=device)
        if not len(self._units[0]):
            return
        self._skipped.zero_()
        for row, name in enumerate(self.names):
            if name in skip:
                self._skipped[row].copy_(skip[name])
        halves = self._halves(copies)
        in_flat = np.array([name not in kept for name in self.names], dtype=np.bool_)
        lerp_weight, beta2, one_minus_beta2 = (float(x) for x in (_LERP_WEIGHT, _BETA2, _ONE_MINUS_BETA2))
        self._report("adam (triton)", in_flat, halves, halves & gradients)
        half, flags = (self.half, self._on_device("halves", halves)) if copies else (self.stack.flat, self._skipped)
        half_grad = self.half_grad if gradients else self.stack.flat  # unread without gradients
        _adam_cuda[grid(len(self._units[0]))](*self._flats(), half, half_grad, flags, *self._units, self._skipped,
                                             self._on_device("kept", ~in_flat), step_size, bias_correction2_sqrt, eps,
                                             capacity, lerp_weight, beta2, one_minus_beta2, UNIT=_UNIT, HALF=copies,
                                             HALF_GRAD=gradients, enable_fp_fusion=False)
        for row, name, gradient, rows, cols, strides in self._kept_blocks(kept):
            tile_rows = 1 if rows == 1 else _TILE_ROWS
            tile_cols = _UNIT // tile_rows
            bfloat16 = gradient.dtype == torch.bfloat16
            self._report("adam (triton)", np.arange(len(self.names)) == row, halves, np.full(len(self.names), bfloat16))
            views = self._block_views(name, self.half if halves[row] else None)
            param, exp_avg, exp_avg_sq, block_half, skipped = views
            _adam_kept_cuda[grid(-(-rows // tile_rows) * -(-cols // tile_cols), capacity)](
                param, gradient, exp_avg, exp_avg_sq, block_half, skipped,
                step_size, bias_correction2_sqrt, eps, rows, cols, *strides, lerp_weight, beta2,
                one_minus_beta2, BLOCK_R=tile_rows, BLOCK_C=tile_cols, HALF=bool(halves[row]), HALF_GRAD=bfloat16,
                enable_fp_fusion=False)

    def _on_device(self, kind: str, flags: np.ndarray) -> Tensor:
        """Per-block flags as a uint8 tensor on the device, copied there again only when they change (not in a
        captured step, whose flags are those of its warm-up calls)."""
        cached = self._device_flags.get(kind)
        if cached is None or not np.array_equal(cached[0], flags):
            cached = self._device_flags[kind] = flags, torch.from_numpy(flags.astype(np.uint8)).to(self.stack.device)
        return cached[1]
