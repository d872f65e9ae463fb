"""The forward pass and loss of a pack: P trials of one model structure computed as one, by ``torch.func.vmap`` over
the plain modules' own code (:class:`mtmoe.mmoe.MMoE` and the registered gates), so a new gate packs without being
written twice.

A training step of the pack is, with a leading trial axis on every tensor:

1. ``vmap(MMoE.route)``: bottom, experts, task gates, each trial with its own parameters and its own batch (or, in
   evaluation, one batch shared by all trials), random draws (dropout, SparseMixer's sampling) independent per trial;
2. local search ("+" gates), per trial, by each trial's own :class:`mtmoe.permutation.LocalSearch` (its host-side
   schedule, window and rounding are per trial; its matrix is the trial's row of the stacked parameter);
3. ``vmap(MMoE.mix)`` and the multi-task loss (:func:`mtmoe.losses.multitask_loss`) with each trial's task weights.

Per-trial hyperparameters. Learning rate and Adam's epsilon live in :class:`~mtmoe.pack.adam.PackedAdam`; task
weights (alpha) are a ``[P, T]`` tensor; E_perm and zeta belong to each trial's own local search. A gate's
``scalar_hyperparameters`` (floats it uses only in tensor arithmetic, e.g. COMET's gamma) become ``[P]`` tensors set
on the gates inside the vmapped call; every other gate argument is structural: trials that differ in it cannot
share a pack (:func:`structure_key`).
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from mtmoe.lit.module import MultiTaskMoE
from mtmoe.losses import multitask_loss
from mtmoe.pack.stack import TrialStack

LOG_WEIGHTS = "local_search.log_weights"


class _Stages(nn.Module):
    """The template the stacked tensors are substituted into: ``route`` or ``mix`` + loss of :class:`MMoE`."""

    def __init__(self, net: nn.Module, tasks) -> None:
        super().__init__()
        self.net, self.tasks = net, tasks

    def forward(self, stage: str, *args):
        if stage == "route":
            (batch,) = args
            expert_outputs, gate_outputs = self.net.route(batch)
            weights = torch.stack([g.weights for g in gate_outputs], dim=1)  # [B, T, n]
            aux = torch.stack([g.aux_loss for g in gate_outputs]).sum()
            ones = expert_outputs.new_ones(expert_outputs.shape[2:])  # x * 1 is x exactly: no scale, same result
            scales = torch.stack([ones if g.output_scale is None else g.output_scale for g in gate_outputs])
            return expert_outputs, weights, aux, scales
        expert_outputs, weights, scales, batch, task_weights = args
        predictions = self.net.mix(expert_outputs, weights, list(scales))
        loss, task_losses, _ = multitask_loss(self.tasks, task_weights, predictions, batch)
        return loss, torch.stack(task_losses)


class PackedModel:
    """P slots, each holding one trial's :class:`MultiTaskMoE` (its tensors views of the stack), and the pack's step.

    Args:
        example: a module of the pack's structure (its values are not used).
        capacity: P, the number of slots.
        device: where the stacked tensors live.
    """

    def __init__(self, example: MultiTaskMoE, capacity: int, device: torch.device | str) -> None:
        self.info, self.capacity = example.info, capacity
        self.stack = TrialStack(example.net, capacity, device, own=("local_search.",))
        self.template = _Stages(copy.deepcopy(example.net).to("meta"), example.info.tasks)
        self.scalar_names = tuple(type(example.net.gates[0]).scalar_hyperparameters)
        device = self.stack.device
        self.scalars = {name: torch.zeros(capacity, device=device) for name in self.scalar_names}
        self.task_weights = torch.zeros(capacity, len(example.info.tasks), device=device)
        self.modules: list[MultiTaskMoE | None] = [None] * capacity
        self.has_local_search = example.net.local_search is not None
        self._functions = {}

    def load(self, slot: int, module: MultiTaskMoE) -> None:
        """Put a trial's freshly built module into ``slot``: the stack takes its values, it keeps views."""
        self.stack.load(slot, module.net)
        for name in self.scalar_names:
            self.scalars[name][slot] = float(getattr(module.net.gates[0], name))
        self.task_weights[slot] = torch.tensor(module.weights, dtype=self.task_weights.dtype)
        self.modules[slot] = module

    @contextlib.contextmanager
    def _gate_scalars(self, values: dict[str, Tensor]) -> Iterator[None]:
        gates = self.template.net.gates
        saved = {name: getattr(gates[0], name) for name in values}
        for gate in gates:
            for name, value in values.items():
                setattr(gate, name, value)
        try:
            yield
        finally:
            for gate in gates:
                for name, value in saved.items():
                    setattr(gate, name, value)

    def _substituted(self, params: dict[str, Tensor], buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        return {**{f"net.{k}": v for k, v in params.items()}, **{f"net.{k}": v for k, v in buffers.items()}}

    def _route(self, params, buffers, scalars, batch):
        with self._gate_scalars(scalars):
            return functional_call(self.template, self._substituted(params, buffers), ("route", batch))

    def _mix(self, params, buffers, expert_outputs, weights, scales, batch, task_weights):
        return functional_call(self.template, self._substituted(params, buffers),
                               ("mix", expert_outputs, weights, scales, batch, task_weights))

    def _local_search(self, weights: Tensor) -> tuple[Tensor, Tensor]:
        """Each trial's own local search on its weights ``[B, T, n]``: permuted weights and penalties ``[P]``.

        The trials whose permutation is rounded (after their window, or in evaluation) share one gather; each other
        trial runs its own :class:`LocalSearch` on its row of the stacked matrix (a step of its own schedule)."""
        searches = {slot: module.net.local_search for slot, module in enumerate(self.modules) if module is not None}
        rounding = {slot for slot, search in searches.items() if search.permutes_by_rounding()}
        for slot in rounding:
            searches[slot].hard()  # rounds the latest soft matrix if this pass needs it (cached after the window)
        shape = next(iter(searches.values())).rounded_index.shape  # [m, n]: m = 1 when the gates share one
        identity = torch.arange(shape[-1], device=weights.device).expand(shape)
        index = torch.stack([searches[slot].rounded_index if slot in rounding else identity
                             for slot in range(self.capacity)])  # [P, m, n]
        gathered = weights.gather(-1, index.unsqueeze(1).expand(weights.shape))
        zero = weights.new_zeros(())
        permuted, penalties = list(gathered.unbind(0)), [zero] * self.capacity
        leaf = self.stack.params[LOG_WEIGHTS]
        for slot, search in searches.items():
            if slot not in rounding:
                permuted[slot], penalty = functional_call(search, {"log_weights": leaf[slot]}, (weights[slot],))
                penalties[slot] = zero if penalty is None else penalty
        return torch.stack(permuted), torch.stack(penalties)

    def losses(self, batch: dict[str, Tensor], shared_batch: bool, training: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Every trial's task loss ``[P]`` (``sum_t w_t L_t``), per-task losses ``[P, T]`` and auxiliary loss ``[P]``
        (gate regularisers and local search's penalty; zero in evaluation) on ``batch``: ``[P, B, ...]`` tensors,
        or, with ``shared_batch``, one ``[B, ...]`` batch every trial sees."""
        self.template.train(training)
        if self.has_local_search:
            for module in self.modules:
                if module is not None:
                    module.net.local_search.train(training)
        params, buffers = self.stack.params, self.stack.buffers
        expert_outputs, weights, aux, scales = self._vmapped("route", shared_batch)(params, buffers, self.scalars, batch)
        if self.has_local_search:
            weights, penalties = self._local_search(weights)
            aux = aux + penalties
        loss, task_losses = self._vmapped("mix", shared_batch)(params, buffers, expert_outputs, weights, scales, batch,
                                                               self.task_weights)
        return loss, task_losses, aux

    def _vmapped(self, stage: str, shared_batch: bool):
        """``vmap`` of a stage over the trials. (``torch.compile`` of it was measured slower on a 2-core CPU.)"""
        key = (stage, shared_batch)
        if key not in self._functions:
            batch_dim = None if shared_batch else 0
            in_dims = (0, 0, 0, batch_dim) if stage == "route" else (0, 0, 0, 0, 0, batch_dim, 0)
            self._functions[key] = vmap(self._route if stage == "route" else self._mix, in_dims=in_dims,
                                        randomness="different")
        return self._functions[key]

    def unused_parameters(self) -> dict[int, list[str]]:
        """Per slot, the parameters its last training step did not use (a frozen permutation's matrix): Adam leaves
        them as ``torch.optim.Adam`` leaves a parameter without gradient."""
        if not self.has_local_search:
            return {}
        return {slot: [LOG_WEIGHTS] for slot, module in enumerate(self.modules)
                if module is not None and module.net.local_search.frozen}
