"""Adam over a :class:`~mtmoe.pack.stack.TrialStack`, with each trial's own learning rate, epsilon and step count.

Each trial's parameters are updated by PyTorch's own fused Adam kernel (``torch._fused_adam_``), the kernel
``torch.optim.Adam(fused=True)`` runs for an unpacked trial: the same arithmetic element by element, so a packed
trial's parameters follow its unpacked run exactly (tested), with one kernel call per trial. As ``torch.optim.Adam`` skips a parameter whose gradient is ``None``, :meth:`PackedAdam.step` skips the
parameters a trial did not use in the step (``skip``): local search's matrix once the permutation is frozen.
"""
from __future__ import annotations

import torch

from mtmoe.pack.stack import TrialStack

BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults, which the unpacked runs use


class PackedAdam:
    """Adam (``weight_decay`` 0, no amsgrad) on every trial of ``stack`` with per-trial ``lr`` and ``eps``."""

    def __init__(self, stack: TrialStack) -> None:
        self.stack = stack
        self.names = list(stack.params)
        self.exp_avg = {name: torch.zeros_like(leaf, requires_grad=False) for name, leaf in stack.params.items()}
        self.exp_avg_sq = {name: torch.zeros_like(leaf, requires_grad=False) for name, leaf in stack.params.items()}
        self.steps = [torch.zeros((), dtype=torch.float32, device=stack.device) for _ in range(stack.capacity)]
        self.lr = [0.0] * stack.capacity
        self.eps = [0.0] * stack.capacity
        # per trial, its views of the parameters and moments, in ``names`` order (made once: they never move)
        self._views = [list(zip(*(tensors[name].detach().unbind(0) for name in self.names)))
                       for tensors in (stack.params, self.exp_avg, self.exp_avg_sq)]

    @torch.no_grad()
    def reset(self, slot: int, lr: float, eps: float) -> None:
        """A new trial in ``slot``: fresh moments and step count, its own hyperparameters."""
        for moments in (self.exp_avg, self.exp_avg_sq):
            for tensor in moments.values():
                tensor[slot].zero_()
        self.steps[slot].zero_()
        self.lr[slot], self.eps[slot] = float(lr), float(eps)

    @torch.no_grad()
    def take(self, other: PackedAdam, slots: list[int]) -> None:
        """The state of ``other``'s ``slots``, in that order (a pack shrunk to its running trials)."""
        for mine, theirs in ((self.exp_avg, other.exp_avg), (self.exp_avg_sq, other.exp_avg_sq)):
            for name, tensor in mine.items():
                tensor.copy_(theirs[name][slots])
        for new, old in enumerate(slots):
            self.steps[new].copy_(other.steps[old])
            self.lr[new], self.eps[new] = other.lr[old], other.eps[old]

    @torch.no_grad()
    def step(self, slots: list[int], skip: dict[int, list[str]] | None = None) -> None:
        """One Adam step of every trial in ``slots``; ``skip[slot]`` names parameters that trial leaves as they are."""
        leaves = [self.stack.params[name] for name in self.names]
        unused = {name for name, leaf in zip(self.names, leaves) if leaf.grad is None}  # no trial used it
        empty = (None,) * self.stack.capacity
        grads = list(zip(*(empty if leaf.grad is None else leaf.grad.unbind(0) for leaf in leaves)))
        torch._foreach_add_([self.steps[slot] for slot in slots], 1)
        params, exp_avgs, exp_avg_sqs = self._views
        for slot in slots:
            tensors = params[slot], grads[slot], exp_avgs[slot], exp_avg_sqs[slot]
            skipped = unused.union((skip or {}).get(slot, ()))
            if skipped:
                kept = [i for i, name in enumerate(self.names) if name not in skipped]
                tensors = tuple([group[i] for i in kept] for group in tensors)
            torch._fused_adam_(*(list(group) for group in tensors), [], [self.steps[slot]] * len(tensors[0]),
                               lr=self.lr[slot], beta1=BETAS[0], beta2=BETAS[1], weight_decay=0.0,
                               eps=self.eps[slot], amsgrad=False, maximize=False)
