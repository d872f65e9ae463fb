"""A stand-in for :class:`mtmoe.pack.graphs.CapturedStep` on the CPU: what a replayed CUDA graph leaves of Python's
state (nothing changed), so that a test shows a step's later calls need no Python to run (:class:`ReplayStandIn`)."""
from __future__ import annotations

import torch


def containers_copied(value):
    """``value`` with its lists, tuples, dicts and sets copied, however nested; anything else (tensors) as it is."""
    if isinstance(value, dict):
        return {key: containers_copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return type(value)(containers_copied(item) for item in value)
    return value


class ReplayStandIn:
    """``CapturedStep``'s interface on the CPU: a key's first call (its capture) runs the step; later calls (its
    replays, until ``drop_graphs``) run its tensor operations again with the ``watched`` objects' attributes (and the
    containers in them) restored after it."""

    def __init__(self, step, watched) -> None:
        self.step, self.watched, self.keys = step, watched, set()

    def drop_graphs(self) -> None:
        self.keys.clear()

    def __call__(self, key, inputs: dict[str, torch.Tensor]) -> None:
        if key not in self.keys:
            self.keys.add(key)
            self.step(inputs)
            return
        saved = [(obj, {name: containers_copied(value) for name, value in vars(obj).items()}) for obj in self.watched]
        self.step(inputs)
        for obj, attributes in saved:
            vars(obj).clear()
            vars(obj).update(attributes)
