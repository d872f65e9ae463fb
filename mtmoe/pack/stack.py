"""P modules of one structure as one set of stacked tensors with a leading trial axis (horizontal fusion).

Every parameter of every trial lives in one trial-major buffer ``values [P, N]``: trial p's parameters are row p,
in ``named_parameters()`` order, so that one row is one trial (an optimiser step, a best-weights snapshot, a refill
is one row operation). Each parameter is also a *stacked leaf* ``[P, *shape]``, a view of those rows, whose
``.grad`` is the matching view of ``grads [P, N]``: autograd accumulates into the view in place, so after a backward
pass ``grads`` holds every trial's gradients with no copy. Buffers are stacked one tensor ``[P, *shape]`` per name.

The P original modules stay alive and usable: after :meth:`TrialStack.load`, trial p's module holds views of row
p (parameters, which do not require grad) and of slot p of every stacked buffer, so its own methods (checkpoints,
statistics, local search's host-side schedule, evaluation with the plain code path) see and change the packed
state. Buffers listed in a module's ``host_buffers`` (:class:`mtmoe.counters.HostCounters`) are Python-side
counters, and the buffers under the prefixes given as ``own`` belong to submodules the pack runs per trial (local
search): both stay in each trial's module, unstacked (:meth:`TrialStack.own_buffers`).
"""
from __future__ import annotations

import math

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
        self.own_prefixes = own
        self.shapes = {name: tuple(p.shape) for name, p in example.named_parameters()}
        self.offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, shape in self.shapes.items():
            self.offsets[name] = (offset, offset + math.prod(shape))
            offset += math.prod(shape)
        dtype = next(example.parameters()).dtype
        self.values = torch.zeros(capacity, offset, dtype=dtype, device=self.device)
        self.grads = torch.zeros_like(self.values)
        self.params: dict[str, Tensor] = {}
        for name, shape in self.shapes.items():
            leaf = self._rows(self.values, name).requires_grad_()
            leaf.grad = self._rows(self.grads, name)
            self.params[name] = leaf
        self.buffers = {name: torch.zeros(capacity, *b.shape, dtype=b.dtype, device=self.device)
                        for name, b in example.named_buffers() if name not in host and not name.startswith(own)}

    def _rows(self, flat: Tensor, name: str) -> Tensor:
        start, end = self.offsets[name]
        return flat[:, start:end].view(flat.shape[0], *self.shapes[name])

    def segment(self, name: str) -> tuple[int, int]:
        """The columns of ``values`` that hold parameter ``name``."""
        return self.offsets[name]

    @torch.no_grad()
    def load(self, slot: int, module: nn.Module) -> None:
        """Copy ``module``'s parameters and buffers into ``slot``, then make the module hold views of that slot."""
        if {n: tuple(p.shape) for n, p in module.named_parameters()} != self.shapes:
            raise ValueError("a module of another structure cannot share this pack")
        for name, param in module.named_parameters():
            row = self._rows(self.values, name)[slot]
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
        self.grads.zero_()

    @torch.no_grad()
    def snapshot(self, slots: Tensor, into: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """Copy the parameters and buffers of ``slots`` (a long tensor) into a snapshot of the whole stack
        (created on first use): the best-weights store of early stopping."""
        if into is None:
            into = {"values": self.values.clone(), **{n: b.clone() for n, b in self.buffers.items()}}
        into["values"][slots] = self.values[slots]
        for name, stacked in self.buffers.items():
            into[name][slots] = stacked[slots]
        return into

    @torch.no_grad()
    def restore(self, slot: int, snapshot: dict[str, Tensor]) -> None:
        self.values[slot] = snapshot["values"][slot]
        for name, stacked in self.buffers.items():
            stacked[slot] = snapshot[name][slot]
