"""Adam over a :class:`~mtmoe.pack.stack.TrialStack`: every trial's parameters in one set of element-wise kernels.

The update of ``torch.optim.Adam`` (Kingma and Ba, Algorithm 1, with PyTorch's bias corrections; ``weight_decay``
0, no amsgrad) on the stacked parameters and gradients, each trial with its own learning rate, epsilon and step
count as ``[P, 1]`` device tensors broadcast over each parameter's ``[P, size]`` block: the number of kernels
depends on the model's parameters, not on P, nothing is read on the host, and the step can be captured in a CUDA
graph. The arithmetic is that of ``torch.optim.Adam(fused=True)``'s CPU kernel,
operation for operation (the coefficients in float64, cast once; the moments and the update in float32), so on a
CPU a trial follows ``fit``'s former optimiser bitwise; CUDA's fused kernel contracts some products into fused
multiply-adds, which element-wise kernels do not reproduce: there the two agree to float32 rounding (tested).

As ``torch.optim.Adam`` leaves a parameter whose gradient is ``None`` as it is, :meth:`PackedAdam.step` leaves the
parameters a trial did not use in the step (``skip``: local search's matrix once the permutation is frozen) with
their moments untouched.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mtmoe.pack.stack import TrialStack

BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults, which the unpacked runs use


class PackedAdam:
    """Adam on every trial of ``stack`` with per-trial ``lr``, ``eps`` and step count."""

    def __init__(self, stack: TrialStack) -> None:
        self.stack = stack
        self.exp_avg = torch.zeros_like(stack.flat)
        self.exp_avg_sq = torch.zeros_like(stack.flat)
        capacity, device = stack.capacity, stack.device
        self.steps = torch.zeros(capacity, 1, dtype=torch.float64, device=device)
        self.lr = torch.zeros(capacity, 1, dtype=torch.float64, device=device)
        self.eps = torch.zeros(capacity, 1, dtype=torch.float64, device=device)

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

    def state_dict(self) -> dict[str, Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": self.steps, "lr": self.lr,
                "eps": self.eps}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for name, tensor in self.state_dict().items():
            tensor.copy_(state[name])

    @torch.no_grad()
    def step(self, skip: dict[str, Tensor] | None = None) -> None:
        """One Adam step of every trial from the gradients in ``stack.flat_grad``; ``skip[name]`` (``[P]`` bool)
        names the trials that leave parameter ``name`` and its moments as they are."""
        self.steps.add_(1.0)
        beta1, beta2 = BETAS
        dtype = self.stack.flat.dtype
        step_size = (self.lr / (1 - torch.pow(beta1, self.steps))).to(dtype)  # [P, 1]: per-trial coefficients
        bias_correction2_sqrt = (1 - torch.pow(beta2, self.steps)).sqrt().to(dtype)
        eps = self.eps.to(dtype)
        for name in self.stack.blocks:
            param, grad, exp_avg, exp_avg_sq = self._blocks(name)
            kept = None
            if skip and name in skip:
                kept = skip[name].view(-1, 1), [t.clone() for t in (param, exp_avg, exp_avg_sq)]
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).add_(grad * (1 - beta2) * grad)
            denom = exp_avg_sq.sqrt().div_(bias_correction2_sqrt).add_(eps)
            param.sub_((step_size * exp_avg).div_(denom))
            if kept is not None:
                mask, saved = kept
                for tensor, old in zip((param, exp_avg, exp_avg_sq), saved):
                    tensor.copy_(torch.where(mask, old, tensor))
