"""The gate contract shared by every router in the suite.

A gate maps a :class:`RoutingInput` to per-sample expert weights ``[B, n]`` on the simplex, plus an auxiliary
loss and routing statistics, all returned from ``forward`` (no globals, no side-channel losses). The routing input
carries everything a router of the suite may need:

* ``x`` -- the routing features ``[B, p]`` (concatenated embeddings for recommenders, the flattened image for vision);
* ``sample_id`` -- a stable integer id per sample (user id, image index) for pre-assigned routing (Hash-r);
* ``expert_outputs`` -- the experts' outputs ``[B, n, ...]`` for routers that compete on responses (CompeteSMoE);
  MMoE computes experts densely before gating, so they are always available at no extra cost.

Batch-level routers (Expert Choice, USMoE) see the whole mini-batch through ``x``; a router that changes the
backward pass (SparseMixer) does so inside its own ``forward`` with a custom autograd function. Local search
(the "+" variants) never touches a gate: it permutes the returned weights (``mtmoe.permutation``).

Auxiliary losses are added only in training mode (comet-protocol.md §1): in ``eval()`` every gate returns a zero
auxiliary loss, so an evaluation loss is the pure task loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from mtmoe.errors import UsageError


@dataclass(frozen=True)
class GateDims:
    """Sizes a gate is built for; filled in by the model from the data (users never type these)."""

    in_features: int
    n_experts: int
    n_ids: int = 0  # number of distinct stable sample ids (users, images); needed by pre-assigned routing
    k: int = 2  # the dataset's cardinality (S1.3), used by gates whose ``k`` is left unset


@dataclass
class RoutingInput:
    x: Tensor
    sample_id: Tensor | None = None
    expert_outputs: Tensor | None = None


@dataclass
class GateOutput:
    weights: Tensor  # [B, n], non-negative, rows on the simplex (up to the gate's documented tolerance)
    aux_loss: Tensor  # scalar; exactly 0 in eval mode
    stats: dict[str, Tensor] = field(default_factory=dict)  # scalar diagnostics (entropy, penalties, ...)


class Gate(nn.Module):
    """Base class of every router. Subclasses set the capability flags and implement ``forward``.

    ``max_active`` returns the number of non-zero weights the gate guarantees per sample once trained to
    saturation (``None`` for dense gates); the registry test suite checks it.
    """

    sparse: ClassVar[bool] = True
    needs_sample_id: ClassVar[bool] = False
    needs_expert_outputs: ClassVar[bool] = False
    batch_dependent: ClassVar[bool] = False
    #: Hyperparameters a search space may tune for this gate (names of ``__init__`` keyword arguments).
    hyperparameters: ClassVar[tuple[str, ...]] = ()

    def __init__(self, dims: GateDims) -> None:
        super().__init__()
        if dims.n_experts < 2:
            raise UsageError(f"n_experts must be >= 2, got {dims.n_experts}")
        self.dims = dims
        self.n_experts = dims.n_experts

    def max_active(self) -> int | None:
        return None

    def forward(self, routing: RoutingInput) -> GateOutput:  # pragma: no cover - abstract
        raise NotImplementedError

    def zero(self, like: Tensor) -> Tensor:
        """A scalar zero on the right device/dtype, for gates without an auxiliary loss (or in eval)."""
        return like.new_zeros(())


def resolve_k(k: int | None, dims: GateDims) -> int:
    """``k`` if given, else the dataset's default ``dims.k``; checked against ``1 <= k <= n``."""
    k = dims.k if k is None else k
    if not 1 <= k <= dims.n_experts:
        raise UsageError(f"k must satisfy 1 <= k <= n_experts, got k={k} with n_experts={dims.n_experts}")
    return int(k)


def check_gamma(gamma: float) -> float:
    if not gamma > 0:
        raise UsageError(f"gamma must be > 0, got {gamma}")
    return float(gamma)


def safe_log(v: Tensor, eps: float) -> Tensor:
    """``log(v + eps)`` for ``v > 0`` and ``finfo.min`` where ``v <= 0``, with a finite gradient everywhere.

    The double ``where`` keeps NaN/inf gradients out of the masked branch (comet-protocol.md §9.4).
    """
    positive = v > 0
    safe_v = torch.where(positive, v, torch.ones_like(v))
    return torch.where(positive, torch.log(safe_v + eps), torch.full_like(v, torch.finfo(v.dtype).min))
