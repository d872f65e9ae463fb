"""P modules of one structure as stacked tensors with a leading trial axis (horizontal fusion, as HFTA does).

Parameters live in one flat float32 tensor (``flat``), their gradients in another (``flat_grad``), parameter by
parameter: each named parameter is a contiguous leaf tensor ``[P, *shape]`` that aliases its block of ``flat``, with its
``.grad`` aliasing the same block of ``flat_grad``; a training step writes each gradient there in place, or, for an
optimiser that reads it where autograd computed it, leaves it there (:meth:`TrialStack.tracked`), and the optimiser
updates all trials with element-wise operations per parameter, each with per-trial ``[P, 1]`` coefficients
(:class:`mtmoe.pack.adam.PackedAdam`). Contiguous leaves are what ``vmap``'s rules
expect: an embedding table ``[P, V, D]`` is looked up as ``[P * V, D]`` without a copy. Every buffer (counters, a gate's
float64 settings, local search's state, ...) is one stacked tensor ``[P, *shape]``. A per-trial operation (a refill, a
best-weights snapshot) is one indexed copy per tensor.

A trial's own module, once loaded, holds views of its slot (parameters that do not require grad, and buffers), so
its own methods (statistics, checkpoints) see the packed state; :meth:`TrialStack.unload` gives it back tensors of
its own (the best weights, say), after which refilling the slot cannot change it.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn


#: Plain attributes of a module that may differ between the trials of a pack: the training flags, and a schedule's
#: own (:attr:`mtmoe.schedules.Schedule.host_attributes`: local search's host-side flags and E_perm, say).
PER_TRIAL_ATTRIBUTES = frozenset({"training"})


def structure(module: nn.Module) -> dict[str, object]:
    """The settings a module's code reads from plain attributes (``k``, a dropout rate, ``per_task``, ...), by
    qualified name: trials that differ in one compute differently with the same tensors, so they cannot share a
    pack. Tensors are not settings here (a trial's float settings are buffers: :mod:`mtmoe.scalars`)."""
    out = {}
    for prefix, sub in module.named_modules():
        for name, value in vars(sub).items():
            per_trial = PER_TRIAL_ATTRIBUTES | getattr(sub, "host_attributes", frozenset())
            if name.startswith("_") or name in per_trial:
                continue
            if isinstance(value, (bool, int, float, str, tuple, type(None))) or dataclasses.is_dataclass(value):
                out[f"{prefix}.{name}" if prefix else name] = value
    return out


def readable_in_place(gradient: Tensor, block: Tensor) -> bool:
    """Whether the optimiser's kernels read ``gradient`` where it lies for ``block`` (:meth:`TrialStack.tracked`
    with ``keep``): the block's shape and dtype, at most two dimensions a trial (any strides)."""
    return gradient.shape == block.shape and gradient.dtype == block.dtype and block.dim() <= 3


class _WriteGradient(torch.autograd.Function):
    """The identity on a parameter's stacked values, whose backward writes the gradient into ``grad`` (the
    parameter's block of ``flat_grad``, casting it to float32 on the way, or a bfloat16 block the optimiser reads),
    or, where ``kept`` is a dict and the optimiser reads the gradient where it lies (:func:`readable_in_place`),
    keeps it there as ``kept[name]``; either way it notes the parameter's name in ``written``. ``anchor``, a scalar
    leaf that requires grad, puts the node in the graph; it gets no gradient."""

    @staticmethod
    def forward(ctx, anchor: Tensor, value: Tensor, grad: Tensor, written: set[str], name: str,
                kept: dict[str, Tensor] | None) -> Tensor:
        ctx.grad, ctx.written, ctx.name, ctx.kept = grad, written, name, kept
        return value.view_as(value)

    @staticmethod
    def backward(ctx, upstream: Tensor) -> tuple[None, ...]:
        if ctx.kept is not None and readable_in_place(upstream, ctx.grad):
            ctx.kept[ctx.name] = upstream
        else:
            ctx.grad.copy_(upstream)
        ctx.written.add(ctx.name)
        return None, None, None, None, None, None


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


class TrialStack:
    """Stacked parameters and buffers of ``capacity`` slots, each loadable from a module of the same structure."""

    def __init__(self, example: nn.Module, capacity: int, device: torch.device | str) -> None:
        self.capacity, self.device = capacity, torch.device(device)
        parameters = dict(example.named_parameters())
        dtypes = {p.dtype for p in parameters.values()}
        if len(dtypes) > 1:
            raise ValueError(f"a pack stacks parameters of one dtype, got {sorted(map(str, dtypes))}")
        self.shapes = {name: tuple(p.shape) for name, p in parameters.items()}
        self.structure = structure(example)
        self.blocks: dict[str, slice] = {}  # each parameter's block of the flat tensors: P x its size
        start = 0
        for name, p in parameters.items():
            self.blocks[name] = slice(start, start + capacity * p.numel())
            start += capacity * p.numel()
        dtype = dtypes.pop() if dtypes else torch.float32
        self.flat = torch.zeros(start, dtype=dtype, device=self.device)
        self.flat_grad = torch.zeros_like(self.flat)
        self.params: dict[str, Tensor] = {}
        for name in self.shapes:
            leaf = self.block(self.flat, name).requires_grad_()
            leaf.grad = self.block(self.flat_grad, name)
            self.params[name] = leaf
        self.buffers = {name: torch.zeros(capacity, *b.shape, dtype=b.dtype, device=self.device)
                        for name, b in example.named_buffers()}
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)  # see _WriteGradient
        self._written: set[str] = set()
        self._gradients: dict[str, Tensor] = {}  # tracked's blocks in place of flat_grad's
        self.kept: dict[str, Tensor] = {}  # the gradients the last backward after tracked(keep=True) left in place

    def tracked(self, values: dict[str, Tensor] | None = None, gradients: dict[str, Tensor] | None = None,
                keep: bool = False) -> dict[str, Tensor]:
        """The parameters as a training step's forward takes them: each the identity of its stacked values (or of
        ``values[name]``, a bfloat16 copy, say), whose backward writes (copies) the gradient into its block of
        :attr:`flat_grad` (or into ``gradients[name]``, a bfloat16 block the optimiser reads, for a copy's
        gradient), where autograd's accumulation into the leaf's gradient would read the block, add and write it,
        after a pass zeroing it. The same values as zeroing and accumulating: a parameter's gradients are summed by
        autograd before they reach it. With ``keep`` (for an optimiser that reads them there: the fused
        :meth:`PackedAdam.step <mtmoe.pack.adam.PackedAdam.step>` with ``kept``), the gradients that
        :func:`readable_in_place` allows are not copied: the backward leaves each where autograd computed it (a
        linear layer's weight gradient, the transpose of its block's layout, say) in :attr:`kept`, and their blocks
        go unwritten. After the backward, :meth:`zero_unreached` zeroes the blocks no gradient reached."""
        values = values or {}
        self._gradients = gradients or {}
        self._written = set()
        self.kept = {}
        kept = self.kept if keep else None
        return {name: _WriteGradient.apply(self._anchor, values.get(name, leaf.detach()),
                                           self._gradients.get(name, leaf.grad), self._written, name, kept)
                for name, leaf in self.params.items()}

    def zero_unreached(self) -> None:
        """Zero the gradient blocks of the parameters the backward after :meth:`tracked` did not reach (decided on
        the host, from the graph: nothing is read from the device)."""
        for name, leaf in self.params.items():
            if name not in self._written:
                self._gradients.get(name, leaf.grad).zero_()

    def block(self, flat: Tensor, name: str) -> Tensor:
        """Parameter ``name``'s block of a flat tensor laid out as :attr:`flat` (its moments, say), ``[P, *shape]``."""
        return flat[self.blocks[name]].view(self.capacity, *self.shapes[name])

    def tensors(self) -> dict[str, Tensor]:
        """The trials' state by name: every parameter (detached) and buffer, ``[P, ...]`` each."""
        return {**{name: leaf.detach() for name, leaf in self.params.items()}, **self.buffers}

    @torch.no_grad()
    def load(self, slot: int, module: nn.Module) -> None:
        """Copy ``module``'s parameters and buffers into ``slot``, then make the module hold views of that slot."""
        if {n: tuple(p.shape) for n, p in module.named_parameters()} != self.shapes:
            raise ValueError("a module of another structure cannot share this pack")
        settings = structure(module)
        if settings != self.structure:
            differ = sorted(key for key in settings.keys() | self.structure.keys()
                            if settings.get(key) != self.structure.get(key))
            raise ValueError(f"a module with other settings cannot share this pack: {', '.join(differ)}")
        for name, param in module.named_parameters():
            row = self.params[name].detach()[slot]
            row.copy_(param)
            owner, leaf = _owner(module, name)
            owner._parameters[leaf] = nn.Parameter(row, requires_grad=False)
        for name, stacked in self.buffers.items():
            owner, leaf = _owner(module, name)
            stacked[slot].copy_(owner._buffers[leaf])
            owner._buffers[leaf] = stacked[slot]

    @torch.no_grad()
    def unload(self, slot: int, module: nn.Module, state: dict[str, Tensor] | None = None) -> None:
        """Give ``module`` tensors of its own again, with ``slot``'s values in ``state`` (default: the live stack)."""
        state = self.tensors() if state is None else state
        for name in self.params:
            owner, leaf = _owner(module, name)
            owner._parameters[leaf] = nn.Parameter(state[name][slot].clone(), requires_grad=True)
        for name in self.buffers:
            owner, leaf = _owner(module, name)
            owner._buffers[leaf] = state[name][slot].clone()

    @torch.no_grad()
    def snapshot(self, mask: Tensor, into: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """The state of the slots where ``mask [P]`` is true copied into a snapshot of the whole stack (created on
        first use): the best-weights store of early stopping, one ``where`` per tensor."""
        if into is None:
            return {name: tensor.clone() for name, tensor in self.tensors().items()}
        for name, tensor in self.tensors().items():
            keep = mask.view(-1, *(1,) * (tensor.dim() - 1))
            into[name].copy_(torch.where(keep, tensor, into[name]))
        return into

    @torch.no_grad()
    def restore(self, slot: int, snapshot: dict[str, Tensor]) -> None:
        for name, tensor in self.tensors().items():
            tensor[slot] = snapshot[name][slot]

    @torch.no_grad()
    def take(self, other: TrialStack, slots: list[int]) -> None:
        """The state of ``other``'s ``slots``, in that order (a pack shrunk to its running trials)."""
        index = torch.tensor(slots, device=self.device)
        for name, tensor in self.tensors().items():
            tensor.copy_(other.tensors()[name][index])
