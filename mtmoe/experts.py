"""Experts, shared bottoms and task towers as plain ``nn.Module``s (Supplement S1.2).

All n experts run as one batched operation: for dense experts a single ``Linear(p, n * units)`` whose output is
viewed as ``[B, n, units]``. That is the same function as n separate ``Dense(units)`` layers, at the cost of one
matmul. Computing every expert and multiplying by the gate's dense weights is exact for every gate: zero weights
give zero gradient to unselected experts (comet-protocol.md §1).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def dropout_mask(like: Tensor, p: float) -> Tensor:
    """Inverted-dropout multiplier for ``like``: ``1/(1-p)`` with probability 1 - p, else 0.

    Each 64-bit random draw yields four 16-bit uniforms, compared with ``p`` quantised to 1/65536 (exact for
    p = 0.5). On CPU, ``nn.Dropout``'s ``bernoulli_`` on the MovieLens expert layer ([512, 4096]) costs more than
    the layer's matmul; this mask costs a few percent of it.
    """
    n = like.numel()
    bits = torch.randint(-(2**63), 2**63 - 1, (-(-n // 4),), device=like.device).view(torch.int16)[:n]
    keep = bits.view(like.shape) >= round(p * 65536) - 32768
    return keep.to(like.dtype).mul_(1.0 / (1.0 - p))


class DenseExperts(nn.Module):
    """n experts, each ``Dense(units) -> ReLU -> Dropout(p)``; ``[B, in] -> [B, n, units]``.

    Dropout multiplies by a bit-sampled mask (:func:`dropout_mask`): the semantics of ``nn.Dropout``, at a
    fraction of its cost on CPU.
    """

    def __init__(self, in_features: int, units: int, n_experts: int, dropout: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.in_features, self.n_experts, self.units, self.dropout = in_features, n_experts, units, dropout
        self.linear = nn.Linear(in_features, n_experts * units)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x).relu_()
        if self.training and self.dropout > 0:
            h = h * dropout_mask(h, self.dropout)
        return h.view(-1, self.n_experts, self.units)

    @torch.no_grad()
    def keras_init_(self) -> None:
        """Glorot-uniform per expert (fan-in p, fan-out units), zero bias."""
        bound = math.sqrt(6.0 / (self.in_features + self.units))
        self.linear.weight.uniform_(-bound, bound)
        self.linear.bias.zero_()


class EmbeddingBottom(nn.Module):
    """Recommender shared bottom: user and item embeddings, concatenated; experts and gates both read it."""

    def __init__(self, n_users: int, n_items: int, dim: int) -> None:
        super().__init__()
        self.user = nn.Embedding(n_users, dim)
        self.item = nn.Embedding(n_items, dim)
        self.out_features = 2 * dim

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return torch.cat([self.user(batch["user"]), self.item(batch["item"])], dim=-1)

    @torch.no_grad()
    def keras_init_(self) -> None:
        """Keras' Embedding default, U(-0.05, 0.05)."""
        self.user.weight.uniform_(-0.05, 0.05)
        self.item.weight.uniform_(-0.05, 0.05)


class Tower(nn.Sequential):
    """Task tower ``Dense(units) -> ReLU -> Dense(out)`` (S1.2); outputs a logit or a raw regression value."""

    def __init__(self, in_features: int, units: int, out_features: int) -> None:
        super().__init__(nn.Linear(in_features, units), nn.ReLU(), nn.Linear(units, out_features))

    @torch.no_grad()
    def keras_init_(self) -> None:
        """Glorot-uniform kernels, zero biases."""
        for layer in (self[0], self[2]):
            nn.init.xavier_uniform_(layer.weight)
            layer.bias.zero_()
