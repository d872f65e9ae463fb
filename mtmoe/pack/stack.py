"""P modules of one structure as one set of stacked tensors with a leading trial axis (horizontal fusion).

Every parameter is one *stacked leaf* ``[P, *shape]`` (contiguous, so autograd writes its gradient once, in the
parameter's own layout) and every buffer one stacked tensor ``[P, *shape]``; :meth:`TrialStack.tensors` lists both,
and a per-trial operation (a best-weights snapshot, a refill) is one indexed copy per tensor.

The P original modules stay alive and usable: after :meth:`TrialStack.load`, trial p's module holds views of row
p (parameters, which do not require grad) and of slot p of every stacked buffer, so its own methods (checkpoints,
statistics, local search's host-side schedule, evaluation with the plain code path) see and change the packed
state. Buffers listed in a module's ``host_buffers`` (:class:`mtmoe.counters.HostCounters`) are Python-side
counters, and the buffers under the prefixes given as ``own`` belong to submodules the pack runs per trial (local
search): both stay in each trial's module, unstacked (:meth:`TrialStack.own_buffers`).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def host_buffer_names(module: nn.Module) -> set[str]:
    """Qualified names of the buffers modules keep on the host as Python-side counters."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, sub in module.named_modules() for name in getattr(sub, "host_buffers", ())}


class TrialStack:
    """Stacked parameters and buffers of ``capacity`` slots, each loadable from a module of the same structure."""

    def __init__(self, example: nn.Module, capacity: int, device: torch.device | str, own: tuple[str, ...] = ()) -> None:
        self.capacity, self.device = capacity, torch.device(device)
        host = host_buffer_names(example)
        self.shapes = {name: tuple(p.shape) for name, p in example.named_parameters()}
        self.params = {name: torch.zeros(capacity, *p.shape, dtype=p.dtype, device=self.device).requires_grad_()
                       for name, p in example.named_parameters()}
        self.buffers = {name: torch.zeros(capacity, *b.shape, dtype=b.dtype, device=self.device)
                        for name, b in example.named_buffers() if name not in host and not name.startswith(own)}

    def tensors(self) -> dict[str, Tensor]:
        """Every stacked parameter (detached) and buffer, by name."""
        return {**{name: leaf.detach() for name, leaf in self.params.items()}, **self.buffers}

    @torch.no_grad()
    def load(self, slot: int, module: nn.Module) -> None:
        """Copy ``module``'s parameters and buffers into ``slot``, then make the module hold views of that slot."""
        if {n: tuple(p.shape) for n, p in module.named_parameters()} != self.shapes:
            raise ValueError("a module of another structure cannot share this pack")
        for name, param in module.named_parameters():
            row = self.params[name].detach()[slot]
            row.copy_(param)
            owner, leaf = _owner(module, name)
            owner._parameters[leaf] = nn.Parameter(row, requires_grad=False)
        for name, stacked in self.buffers.items():
            owner, leaf = _owner(module, name)
            stacked[slot].copy_(owner._buffers[leaf])
            owner._buffers[leaf] = stacked[slot]

    def own_buffers(self, module: nn.Module) -> dict[str, Tensor]:
        """The buffers of a trial's module that are not stacked (host counters, per-trial submodules' state)."""
        return {name: b for name, b in module.named_buffers() if name not in self.buffers}

    def zero_grad(self) -> None:
        for leaf in self.params.values():
            leaf.grad = None

    @torch.no_grad()
    def snapshot(self, slots: Tensor, into: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """Copy the parameters and buffers of ``slots`` (a long tensor) into a snapshot of the whole stack
        (created on first use): the best-weights store of early stopping."""
        if into is None:
            into = {name: tensor.clone() for name, tensor in self.tensors().items()}
        for name, tensor in self.tensors().items():
            into[name][slots] = tensor[slots]
        return into

    @torch.no_grad()
    def restore(self, slot: int, snapshot: dict[str, Tensor]) -> None:
        for name, tensor in self.tensors().items():
            tensor[slot] = snapshot[name][slot]
