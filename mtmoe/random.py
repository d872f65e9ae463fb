"""Counter-based random streams: a trial's every random draw in training is a pure function of its seed, the draw
site, its own training step and the element's position (issue 25), computed on the device for all trials of a pack
at once, so that a trial draws the same alone and in any pack (provisional pure-torch generator)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MIX = 0x45D9F3B
_LOW32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * _MIX) & _LOW32
    x = (((x >> 16) ^ x) * _MIX) & _LOW32
    return (x >> 16) ^ x


def bits(seed: Tensor, site: int, step: Tensor, numel: int) -> Tensor:
    """32 random bits (int64) per position 0..numel-1."""
    key = _mix32(_mix32(seed & _LOW32) ^ ((seed >> 32) & _LOW32) ^ site)
    key = _mix32(key ^ (step & _LOW32))
    position = torch.arange(numel, device=seed.device)
    return _mix32(_mix32((position + key) & _LOW32) ^ 0x9E3779B9)


@dataclass(frozen=True)
class Stream:
    seed: Tensor
    step: Tensor
    site: int = 0

    def child(self, index: int) -> Stream:
        return Stream(self.seed, self.step, (self.site * 64 + index + 1) & _LOW32)

    def uniform_open(self, shape, device) -> Tensor:
        numel = 1
        for s in shape:
            numel *= s
        return ((bits(self.seed, self.site, self.step, numel).double() + 0.5) / 2.0**32).view(shape)

    def normal(self, shape, device) -> Tensor:
        u1 = self.child(0).uniform_open(shape, device)
        u2 = self.child(1).uniform_open(shape, device)
        return (-2 * u1.log()).sqrt() * torch.cos(2 * torch.pi * u2)

    def dropout(self, h: Tensor, p: float) -> Tensor:
        keep = (bits(self.seed, self.site, self.step, h.numel()) & 0xFFFF) >= round(p * 65536)
        return h * (keep.view(h.shape).to(h.dtype) * (1.0 / (1.0 - p)))
