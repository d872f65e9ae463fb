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

As ``torch.optim.Adam`` leaves a parameter whose gradient is ``None`` as it is, :meth:`PackedAdam.step` leaves the
parameters a trial did not use in the step (``skip``: local search's matrix once the permutation is frozen) with
their moments untouched.
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from mtmoe.host_threads import run_split
from mtmoe.kernel_traffic import fused_kernel
from mtmoe.pack.stack import TrialStack
from mtmoe.random import _bfloat16_bits, _fma, _widen
from mtmoe.triton_support import tl, triton, use_triton

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


if triton is not None:
    from mtmoe.random import _rounded, _widened

    @triton.jit
    def _adam_cuda(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, half_ptr, half_grad_ptr, halves_ptr,
                   unit_start_ptr, unit_length_ptr, unit_trial_ptr, unit_skip_row_ptr, skip_ptr, step_size_ptr,
                   bias_correction2_sqrt_ptr, eps_ptr, capacity, lerp_weight, beta2, one_minus_beta2,
                   UNIT: tl.constexpr, HALF: tl.constexpr, HALF_GRAD: tl.constexpr):
        """Program ``u``: :func:`_adam_run` on work unit ``u``, the ``unit_length[u]`` elements from
        ``unit_start[u]`` of trial ``unit_trial[u]``, unless ``skip[unit_skip_row[u], trial]``; with ``HALF``, the
        new values also written to ``half`` (bfloat16) where ``halves[unit_skip_row[u]]``, and with ``HALF_GRAD``
        the gradient there read from ``half_grad`` (bfloat16, widened exactly)."""
        unit = tl.program_id(0)
        trial = tl.load(unit_trial_ptr + unit)
        row = tl.load(unit_skip_row_ptr + unit)
        if tl.load(skip_ptr + row * capacity + trial) == 0:
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
            m = tl.load(exp_avg_ptr + offsets, mask=inside)
            m = tl.fma(lerp_weight, g - m, m)
            v = tl.load(exp_avg_sq_ptr + offsets, mask=inside) * beta2 + g * one_minus_beta2 * g
            p = tl.load(param_ptr + offsets, mask=inside)
            p = p - tl.div_rn(s * m, tl.div_rn(tl.sqrt_rn(v), c) + e)
            tl.store(exp_avg_ptr + offsets, m, mask=inside)
            tl.store(exp_avg_sq_ptr + offsets, v, mask=inside)
            tl.store(param_ptr + offsets, p, mask=inside)
            if HALF:
                if tl.load(halves_ptr + row) != 0:
                    tl.store(half_ptr + offsets, _rounded(p, True), mask=inside)


_UNIT = 1024  # elements per program of the Triton kernel


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
        self._halves_on_device: tuple[np.ndarray, Tensor] | None = None  # the Triton kernel's block flags

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

    def _kernel_copies(self) -> bool:
        """Whether a step with ``copies`` runs a fused kernel that writes the copies (and may read their
        gradients in bfloat16)."""
        return self.half_names is not None and self.fused and self.stack.flat.dtype == torch.float32 \
            and (use_triton(self.stack.device) or self.stack.device.type == "cpu")

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
             copies: bool = False, gradients: bool = False) -> None:
        """One Adam step of every trial from the gradients in ``stack.flat_grad``; ``skip[name]`` (``[P]`` bool)
        names the trials that leave parameter ``name`` and its moments as they are; ``lr_scale`` (``[P]``) scales
        each trial's learning rate for this step (a schedule's). With ``copies``, the fused kernels also write the
        bfloat16 copies of :meth:`bfloat16_copies`' latest parameters, and with ``gradients`` too read those
        parameters' gradients from :meth:`bfloat16_gradients`' blocks (the same values as their float32 widening in
        ``flat_grad``)."""
        copies = copies and self._kernel_copies()
        self._step(skip, lr_scale, copies, copies and gradients)
        self._half_version = self.stack.flat._version if copies else None

    def _step(self, skip: dict[str, Tensor] | None, lr_scale: Tensor | None, copies: bool,
              gradients: bool) -> None:
        self.steps.add_(1.0)
        beta1, beta2 = BETAS
        dtype = self.stack.flat.dtype
        lr = self.lr if lr_scale is None else self.lr * lr_scale.view(-1, 1).double()
        step_size = (lr / (1 - torch.pow(beta1, self.steps))).to(dtype)  # [P, 1]: per-trial coefficients
        bias_correction2_sqrt = (1 - torch.pow(beta2, self.steps)).sqrt().to(dtype)
        eps = self.eps.to(dtype)
        skip = skip or {}
        if not self.fused or dtype != torch.float32:
            self._step_elementwise(skip, step_size, bias_correction2_sqrt, eps)
        elif use_triton(self.stack.device):
            self._step_triton(skip, step_size, bias_correction2_sqrt, eps, copies, gradients)
        elif self.stack.device.type == "cpu":
            self._step_cpu(skip, step_size, bias_correction2_sqrt, eps, copies, gradients)
        else:
            self._step_elementwise(skip, step_size, bias_correction2_sqrt, eps)

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

    def _report(self, name: str, halves: np.ndarray, gradients: bool) -> None:
        """The fused update's traffic, to the operation counters (:func:`mtmoe.kernel_traffic.fused_kernel`):
        parameters, gradients and both moments read, parameters and moments written, and the bfloat16 copies of
        the blocks flagged in ``halves`` written (with ``gradients``, their gradients read in bfloat16: 2 bytes
        an element where float32 reads 4)."""
        size = self.stack.flat.nbytes
        copied = sum(int(width) * self.stack.capacity for width, half in zip(self.widths, halves) if half)
        fused_kernel(name, 4 * size - (2 * copied if gradients else 0), 3 * size + 2 * copied)

    def _halves(self, copies: bool) -> np.ndarray:
        """Per block, in the flat order: whether the step writes its bfloat16 copy."""
        return np.array([copies and name in self.half_names for name in self.names], dtype=np.bool_)

    def _step_cpu(self, skip: dict[str, Tensor], step_size: Tensor, bias_correction2_sqrt: Tensor, eps: Tensor,
                  copies: bool, gradients: bool) -> None:
        """The same update by :func:`_adam_cpu`, over all blocks at once, on torch's threads."""
        skipped = np.zeros((len(self.names), self.stack.capacity), dtype=np.bool_)
        for row, name in enumerate(self.names):
            if name in skip:
                skipped[row] = skip[name].numpy()
        halves = self._halves(copies)
        half = self.half.view(torch.uint16).numpy() if copies else np.empty(0, np.uint16)
        half_grad = self.half_grad.view(torch.uint16).numpy() if gradients else np.empty(0, np.uint16)
        self._report("adam (numba)", halves, gradients)
        run_split(_adam_cpu, self.stack.flat.numel(), *(t.numpy() for t in self._flats()), half, half_grad, halves,
                  self.ends, self.widths, skipped,
                  *(t.view(-1).numpy() for t in (step_size, bias_correction2_sqrt, eps)))

    def _step_triton(self, skip: dict[str, Tensor], step_size: Tensor, bias_correction2_sqrt: Tensor, eps: Tensor,
                     copies: bool, gradients: bool) -> None:
        """The same update by :func:`_adam_cuda`, one program per work unit; ``skip`` is read on the device."""
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
        if copies and (self._halves_on_device is None or not np.array_equal(self._halves_on_device[0], halves)):
            self._halves_on_device = halves, torch.from_numpy(halves.astype(np.uint8)).to(device)
        lerp_weight, beta2, one_minus_beta2 = (float(x) for x in (_LERP_WEIGHT, _BETA2, _ONE_MINUS_BETA2))
        self._report("adam (triton)", halves, gradients)
        half, flags = (self.half, self._halves_on_device[1]) if copies else (self.stack.flat, self._skipped)  # unread
        half_grad = self.half_grad if gradients else self.stack.flat  # unread without gradients
        _adam_cuda[(len(self._units[0]),)](*self._flats(), half, half_grad, flags, *self._units, self._skipped,
                                          step_size, bias_correction2_sqrt, eps, capacity, lerp_weight, beta2,
                                          one_minus_beta2, UNIT=_UNIT, HALF=copies, HALF_GRAD=gradients,
                                          enable_fp_fusion=False)
