"""Float settings of a module kept as 0-d float64 buffers, so that the trials of a pack may each have their own.

A gate's ``gamma``, local search's ``zeta``, ...: a trial computes with them in float64 tensors (a derived
coefficient such as ``-2 / gamma**3`` included) and casts once to the dtype of the tensor they meet, as a Python
float would be cast. Stacked along a leading trial axis (:mod:`mtmoe.pack.stack`) the same code runs per trial
under ``torch.func.vmap``, and a packed trial computes bitwise what it computes alone. They are configuration, not
state: non-persistent (not in checkpoints, which carry the settings), and ``.to()``, ``.half()``, ... move them to
another device but keep them float64.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn


class ScalarSettings(nn.Module):
    #: The names of this module's float settings (set with :meth:`set_scalars`).
    scalar_names: ClassVar[tuple[str, ...]] = ()

    def set_scalars(self, **values: float) -> None:
        for name, value in values.items():
            if name not in self.scalar_names:
                raise AttributeError(f"{type(self).__name__}.scalar_names does not list {name!r}")
            self.register_buffer(name, torch.tensor(float(value), dtype=torch.float64), persistent=False)

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers[name] for name in self.scalar_names if name in self._buffers}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            self._buffers[name] = value.to(self._buffers[name].device)
        return self


def cast(value: Tensor, like: Tensor) -> Tensor:
    """A float64 setting (or a coefficient computed from it) in ``like``'s dtype: the one cast."""
    return value.to(like.dtype)
