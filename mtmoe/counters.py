"""Scalar counters that Python reads every training step stay on the CPU when their module moves to a GPU.

Schedules (local search's window position, CompeteSMoE's competition coin and warm-up) branch on step counters in
Python. As buffers they are checkpointed with the model; on a GPU each ``int(counter)`` would wait for the device to
finish its queued work. A module lists them in ``host_buffers``; ``.to()``, ``.cuda()`` and ``.double()`` move
every other tensor as usual and leave these where they are (CPU ``long`` scalars; loading a checkpoint copies into
them).
"""
from __future__ import annotations

from typing import ClassVar

from torch import nn


class HostCounters(nn.Module):
    host_buffers: ClassVar[tuple[str, ...]] = ()

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers[name] for name in self.host_buffers}
        super()._apply(fn, recurse)
        self._buffers.update(kept)
        return self
