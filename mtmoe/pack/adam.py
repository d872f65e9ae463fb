"""Adam over a :class:`~mtmoe.pack.stack.TrialStack`, with each trial's own learning rate, epsilon and step count.

Each trial's row of parameters is updated by PyTorch's own fused Adam kernel (``torch._fused_adam_``), the kernel
``torch.optim.Adam(fused=True)`` runs for an unpacked trial: the same arithmetic element by element, so a packed
trial's parameters follow its unpacked run exactly (tested), with one kernel per trial instead of one per
parameter. As ``torch.optim.Adam`` skips a parameter whose gradient is ``None``, :meth:`PackedAdam.step` skips the
parameters a trial did not use in the step (``skip``): local search's matrix once the permutation is frozen.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mtmoe.pack.stack import TrialStack

BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults, which the unpacked runs use


class PackedAdam:
    """Adam (``weight_decay`` 0, no amsgrad) on every row of ``stack.values`` with per-trial ``lr`` and ``eps``."""

    def __init__(self, stack: TrialStack) -> None:
        self.stack = stack
        self.exp_avg = torch.zeros_like(stack.values)
        self.exp_avg_sq = torch.zeros_like(stack.values)
        self.steps = [torch.zeros((), dtype=torch.float32, device=stack.device) for _ in range(stack.capacity)]
        self.lr = [0.0] * stack.capacity
        self.eps = [0.0] * stack.capacity

    @torch.no_grad()
    def reset(self, slot: int, lr: float, eps: float) -> None:
        """A new trial in ``slot``: fresh moments and step count, its own hyperparameters."""
        self.exp_avg[slot].zero_()
        self.exp_avg_sq[slot].zero_()
        self.steps[slot].zero_()
        self.lr[slot], self.eps[slot] = float(lr), float(eps)

    def _segments(self, tensor: Tensor, slot: int, skipped: list[str]) -> list[Tensor]:
        row = tensor[slot]
        if not skipped:
            return [row]
        cuts = sorted(self.stack.segment(name) for name in skipped)
        pieces, start = [], 0
        for begin, end in cuts:
            if begin > start:
                pieces.append(row[start:begin])
            start = end
        if start < row.shape[0]:
            pieces.append(row[start:])
        return pieces

    @torch.no_grad()
    def step(self, slots: list[int], skip: dict[int, list[str]] | None = None) -> None:
        """One Adam step of every trial in ``slots``; ``skip[slot]`` names parameters that trial leaves as they are."""
        for slot in slots:
            skipped = (skip or {}).get(slot, [])
            params = self._segments(self.stack.values, slot, skipped)
            grads = self._segments(self.stack.grads, slot, skipped)
            exp_avgs = self._segments(self.exp_avg, slot, skipped)
            exp_avg_sqs = self._segments(self.exp_avg_sq, slot, skipped)
            self.steps[slot] += 1
            torch._fused_adam_(params, grads, exp_avgs, exp_avg_sqs, [], [self.steps[slot]] * len(params),
                               lr=self.lr[slot], beta1=BETAS[0], beta2=BETAS[1], weight_decay=0.0,
                               eps=self.eps[slot], amsgrad=False, maximize=False)
