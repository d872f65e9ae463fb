"""The gate contract shared by every router in the suite.

A gate maps a :class:`RoutingInput` to per-sample expert weights ``[B, n]`` (on the simplex unless the gate says
otherwise, ``Gate.simplex``), plus an auxiliary loss and routing statistics, all returned from ``forward`` (no
globals, no side-channel losses). The routing input carries everything a router of the suite may need:

* ``x`` -- the routing features ``[B, p]`` (concatenated embeddings for recommenders, the flattened image for vision);
* ``sample_id`` -- a stable integer id per sample (user id, image index) for pre-assigned routing (Hash-r);
* ``expert_outputs`` -- the experts' outputs ``[B, n, ...]`` for routers that compete on responses (CompeteSMoE);
  MMoE computes experts densely before gating, so they are always available at no extra cost;
* ``stream`` -- in training, the gate's own random stream (:class:`mtmoe.random.Stream`): a router that samples
  draws from it, never from torch's global generator, so its draws depend on the trial alone (trial packs).

Batch-level routers (Expert Choice, USMoE) see the whole mini-batch through ``x``; a router that changes the
backward pass (SparseMixer) does so inside its own ``forward`` with a custom autograd function, and a router with
a trainable output scale (SparseMixer's omega) returns it as ``GateOutput.output_scale``, which the model applies
to that task's mixture of experts. Local search (the "+" variants) never touches a gate: it permutes the returned
weights (``mtmoe.permutation``); a gate whose weights are tied to the experts' identities (``permutable = False``,
CompeteSMoE) has no "+" variant.

Auxiliary losses are added only in training mode (comet-protocol.md §1): in ``eval()`` every gate returns a zero
auxiliary loss, so an evaluation loss is the pure task loss.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from mtmoe.errors import SettingError, UsageError
from mtmoe.random import Stream
from mtmoe.scalars import ScalarSettings


@dataclass(frozen=True)
class GateDims:
    """Sizes a gate is built for; filled in by the model from the data (users never type these)."""

    in_features: int
    n_experts: int
    n_ids: int = 0  # number of distinct stable sample ids (users, images); needed by pre-assigned routing
    k: int = 2  # the dataset's cardinality (S1.3), used by gates whose ``k`` is left unset
    expert_shape: tuple[int, ...] = ()  # one expert's output shape (``(units,)`` for dense experts); output scales


@dataclass
class RoutingInput:
    x: Tensor
    sample_id: Tensor | None = None
    expert_outputs: Tensor | None = None
    stream: Stream | None = None
    #: ``x`` as the gate's linear maps read it, one view per call of :meth:`linear` (``Gate.linear_reads``), from
    #: the bottom's output cast once for all its readers (:func:`mtmoe.shared_input.shared_input`); None: ``x``.
    linear_inputs: Iterator[Tensor] | None = None

    def linear(self, layer: nn.Module) -> Tensor:
        """``layer(x)`` for a linear map of the gate (at most ``Gate.linear_reads`` calls a forward pass): the same
        values and gradients, from :attr:`linear_inputs` when given."""
        return layer(self.x if self.linear_inputs is None else next(self.linear_inputs))


@dataclass
class GateOutput:
    weights: Tensor  # [B, n], non-negative; rows on the simplex for ``simplex`` gates (up to documented tolerance)
    aux_loss: Tensor  # scalar; exactly 0 in eval mode
    stats: dict[str, Tensor] = field(default_factory=dict)  # scalar diagnostics (entropy, penalties, ...)
    output_scale: Tensor | None = None  # ``expert_shape``: multiplies this task's mixture (SparseMixer's omega)


class Gate(ScalarSettings):
    """Base class of every router. Subclasses set the capability flags and implement ``forward``.

    ``max_active`` returns the number of non-zero weights the gate guarantees per sample once trained to
    saturation (``None`` for dense gates and for batch-level routers, whose samples get a varying number);
    ``active_per_batch`` returns the number of non-zero weights a batch-level router guarantees in a whole batch.
    The registry test suite checks both.

    Capability flags:

    * ``sparse``: weights have exact zeros (False: every expert gets weight, Softmax);
    * ``simplex``: every row sums to 1 (False: rows are non-negative with a documented sum, e.g. SparseMixer's
      ``pi_D``, Expert Choice's raw affinities, USMoE's unified scores); the class's value holds for its default
      arguments, and an instance may change it (Top-k's ``normalize``);
    * ``min_active``: the fewest non-zero weights a per-sample router gives a sample (0: ReMoE, whose ReLU may
      leave a sample with no expert);
    * ``batch_dependent``: in eval mode a sample's weights depend on the other samples of its batch (an instance
      may clear it, e.g. a batch-level router evaluated with its per-sample policy);
    * ``permutable``: local search (the "+" variant) may permute the weights across experts;
    * ``needs_sample_id`` / ``needs_expert_outputs``: which optional fields of :class:`RoutingInput` it reads;
    * ``linear_reads``: how many linear maps read ``x`` through :meth:`RoutingInput.linear` in a forward pass (and
      read ``x`` in no other way): the model then hands them its shared cast of ``x`` (:mod:`mtmoe.shared_input`).
    """

    sparse: ClassVar[bool] = True
    simplex: bool = True
    min_active: ClassVar[int] = 1
    permutable: ClassVar[bool] = True
    needs_sample_id: ClassVar[bool] = False
    needs_expert_outputs: ClassVar[bool] = False
    linear_reads: ClassVar[int] = 0
    batch_dependent: bool = False
    #: The hyperparameters ``tune`` searches for this gate (``__init__`` keyword arguments) and their default ranges,
    #: in the notation of the search-space files (:mod:`mtmoe.tuning.space`): ``{"gamma": {"choice": [0.1, 1, 10]},
    #: "trimmed_lasso_reg": {"log_uniform": [1e-4, 10.0]}, "aux_coef": 0.01}`` (a plain value is fixed). A
    #: dataset's space file overrides them; without a section for the gate, its study searches these and the
    #: learning rate.
    search_space: ClassVar[dict[str, Any]] = {}
    #: Float hyperparameters kept as float64 buffers of the same name (:mod:`mtmoe.scalars`) and used only in tensor
    #: arithmetic, so that the trials of a pack (``mtmoe.pack``) may each have their own; any other argument that
    #: differs between two trials puts them in separate packs.
    scalar_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, dims: GateDims) -> None:
        super().__init__()
        if dims.n_experts < 2:
            raise UsageError(f"n_experts must be >= 2, got {dims.n_experts}")
        self.dims = dims
        self.n_experts = dims.n_experts

    def max_active(self) -> int | None:
        return None

    def active_per_batch(self, batch_size: int) -> int | None:
        """Non-zero weights in a batch of ``batch_size`` for a batch-level router (training, and eval when
        ``batch_dependent``); ``None`` for per-sample routers."""
        return None

    def set_training_steps(self, total: int | None) -> None:
        """How many training forward passes the run plans (``None``: unbounded), for gates with a schedule in
        fractions of the run (CompeteSMoE v2's warm-up, which the engine tells through
        :meth:`mtmoe.schedules.Schedule.plan`)."""

    def forward(self, routing: RoutingInput) -> GateOutput:  # pragma: no cover - abstract
        raise NotImplementedError

    def zero(self, like: Tensor) -> Tensor:
        """A scalar zero on the right device/dtype, for gates without an auxiliary loss (or in eval)."""
        return like.new_zeros(())


def no_plus_variant(name: str) -> UsageError:
    """The error for a "+" (local search) on a gate that is not ``permutable``."""
    return UsageError(f"gate {name!r} has no local-search ('+') variant: its weights are tied to the experts' own "
                      "responses, and permuting them would hand them to other experts")


def resolve_k(k: int | None, dims: GateDims) -> int:
    """``k`` if given, else the dataset's default ``dims.k``; checked against ``1 <= k <= n``."""
    k = dims.k if k is None else k
    if not 1 <= k <= dims.n_experts:
        raise SettingError("k", k, f"must satisfy 1 <= k <= n_experts = {dims.n_experts}", ("n_experts",))
    return int(k)


def resolve_budget(k: float | None, dims: GateDims) -> float:
    """A batch-level router's average number of experts per sample: ``k`` if given, else ``dims.k``; ``0 < k <= n``."""
    k = dims.k if k is None else k
    if not 0 < k <= dims.n_experts:
        raise SettingError("k", k, f"must satisfy 0 < k <= n_experts = {dims.n_experts}", ("n_experts",))
    return float(k)


def check_probability(name: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise SettingError(name, value, "must be in [0, 1]")
    return float(value)


def check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if not value >= 0:
            raise SettingError(name, value, "must be >= 0")


def topk_softmax(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``softmax(TopK_{-inf}(logits, k))`` as dense ``[B, n]`` weights, and the selected indices ``[B, k]``."""
    top_values, top_index = logits.topk(k, dim=-1)
    return torch.zeros_like(logits).scatter(-1, top_index, top_values.softmax(dim=-1)), top_index


def product(x: Tensor, dim: int) -> Tensor:
    """The product over ``dim`` (a handful of factors: a tree's depth, a code's bits) by explicit multiplication, left
    to right as ``torch.prod`` reduces. ``prod``'s backward tests for zeros (``nonzero``: a host synchronisation
    and a data-dependent shape, and in a pack a path chosen by every trial's values); a product's backward is the
    product of the other factors, with no test."""
    factors = x.unbind(dim)
    out = factors[0]
    for factor in factors[1:]:
        out = out * factor
    return out


def check_gamma(gamma: float) -> float:
    if not gamma > 0:
        raise SettingError("gamma", gamma, "must be > 0")
    return float(gamma)


def safe_log(v: Tensor, eps: float) -> Tensor:
    """``log(v + eps)`` for ``v > 0`` and ``finfo.min`` where ``v <= 0``, with a finite gradient everywhere.

    The double ``where`` keeps NaN/inf gradients out of the masked branch (comet-protocol.md §9.4).
    """
    positive = v > 0
    safe_v = torch.where(positive, v, 1.0)  # scalars, not filled tensors: the same values, no pass writing them
    return torch.where(positive, torch.log(safe_v + eps), torch.finfo(v.dtype).min)
