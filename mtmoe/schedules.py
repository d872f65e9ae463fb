"""Per-trial schedules: the interface through which the training engine drives everything in a model that changes
with training progress (local search's window, CompeteSMoE v2's warm-up, a temperature anneal, a learning-rate
warm-up) without knowing any of them by name.

A schedule is a module that also subclasses :class:`Schedule`. Its state is its buffers: the engine stacks them
with a leading trial axis like every other buffer (:class:`mtmoe.pack.stack.TrialStack`), checkpoints hold them
(``state_dict``), and :func:`schedules` finds every schedule of a net by walking its modules (as
``nn.Module.apply``). The engine calls the hooks below for the whole pack at once; ``state`` is then the schedule's
buffers by their names inside the module, each ``[P, *shape]`` (one trial alone, ``fit``, is a pack of one). The
device hooks (:meth:`~Schedule.on_step`, :meth:`~Schedule.on_epoch_end`, :meth:`~Schedule.frozen_parameters`,
:meth:`~Schedule.lr_scale`) run tensor operations only, in place, whatever P: no host read in a step, and the step
stays capturable in a CUDA graph. The host hooks (:meth:`~Schedule.plan`, :meth:`~Schedule.before_step`,
:meth:`~Schedule.before_evaluation`) run between steps, with each trial's host-side step count.
"""
from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

#: Each live trial of a pack by slot: its own schedule module (the trial's net holds views of its slot's state;
#: host attributes set by :meth:`Schedule.plan` are its own) and the training steps it has run.
Trials = dict[int, tuple["Schedule", int]]


class Schedule:
    """A per-trial schedule (a mixin for an ``nn.Module``): every hook does nothing unless overridden.

    ``host_attributes`` names plain attributes that may differ between the trials of one pack (set by
    :meth:`plan` or the hooks); any other plain attribute is a setting that splits packs.
    """

    host_attributes: ClassVar[frozenset[str]] = frozenset()

    def plan(self, steps_per_epoch: int, total_steps: int | None) -> None:
        """On one trial's own module, on the host, before its first training step: the run's length in training
        steps per epoch and in all (``None``: until early stopping), to fill the buffers that count in steps. The
        engine also calls it on the pack's template (meta tensors, ``total_steps`` ``None``) for its host flags."""

    def flags(self) -> tuple:
        """The host-side settings the training step's computation depends on (a CUDA graph is captured per value)."""
        return ()

    def before_step(self, state: dict[str, Tensor], trials: Trials) -> None:
        """On the pack's template module, on the host, before a training step: set its host flags, and run any
        host-side computation on ``state`` (local search's rounding)."""

    def before_evaluation(self, state: dict[str, Tensor], trials: Trials | None) -> None:
        """As :meth:`before_step`, before evaluating; ``trials`` is ``None`` when ``state`` is a snapshot (the
        best weights) rather than the live trials'."""

    def frozen_parameters(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """After the forward pass: the module's parameters (by local name) that a trial's optimiser step leaves as
        they are, with their moments, as ``[P]`` bool masks (as ``torch.optim.Adam`` skips a ``None`` gradient)."""
        return {}

    def lr_scale(self, state: dict[str, Tensor]) -> Tensor | None:
        """A factor ``[P]`` on each trial's learning rate for this step's update (``None``: 1)."""
        return None

    def on_step(self, state: dict[str, Tensor]) -> None:
        """After every training step's update, in place on the device."""

    def on_epoch_end(self, state: dict[str, Tensor]) -> None:
        """After every training epoch (its validation and best-weights snapshot included), in place on the device."""


def schedules(module: nn.Module) -> list[tuple[str, Schedule]]:
    """Every schedule in ``module`` with its qualified name, in ``named_modules`` order."""
    return [(name, sub) for name, sub in module.named_modules() if isinstance(sub, Schedule)]


def local_state(prefix: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The entries of ``tensors`` (qualified names) under the module ``prefix``, by their names inside it."""
    if not prefix:
        return dict(tensors)
    return {name[len(prefix) + 1:]: t for name, t in tensors.items() if name.startswith(prefix + ".")}
