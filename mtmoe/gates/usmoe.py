"""USMoE: unified competitive routing over (sample, expert) pairs (``004_2a4ea5ed619b4adb.txt`` §3.2, Algorithm 1;
routing-methods.md §6).

Per task gate, with router logits ``theta = W x + b`` for the ``B`` samples of the batch:

    s_t = softmax(theta) over experts (token choice),  s_e = softmax(theta) over the samples (expert choice),
    U = alpha s_e + (1 - alpha) s_t                                                                    (eq. 5)

and the ``floor(k B)`` highest entries of ``U`` over all ``B x N`` pairs are selected; a selected pair's weight is
its raw ``U`` value (not renormalised, as Algorithm 1). ``alpha = 0`` is token choice and ``alpha = 1`` expert choice
in the paper's terms; alpha = 0.5 is its recommendation, (0.3, 0.7) its robust range (§4.5.2). ``k`` is the average
number of experts per sample ("Topk = 2 / 1.5", default: the dataset's k); there is no auxiliary loss.

Adaptations to per-sample routing with one gate per task [A] (routing-methods.md §6.2):

* There are no sequences, so only the paper's "Batch" variant exists: ``s_e`` normalises over the mini-batch.
* ``s_e`` entries are O(1/B) and ``s_t`` entries O(1/N), so for B >> N the token-choice term dominates ``U``;
  ``rescale_expert_choice=True`` multiplies ``s_e`` by B / N (not in the paper) to put both on one scale.
* A sample may win no pair (an all-zero tower input; logged as ``zero_expert_fraction``) or several; rows are
  non-negative but not on the simplex, and may sum to more than 1.
* Inference: ``eval_policy="batch"`` (default) uses the same mechanism, as the paper does, so predictions depend on
  the eval batch (size, composition, the partial last batch). ``eval_policy="sample"`` routes each sample as a
  batch of one, where ``s_e = 1`` (B / N = 1 / N rescaled): its top-``max(1, floor(k))`` experts by ``s_t`` with
  weights ``alpha s_e + (1 - alpha) s_t``; batch-independent, and the method's own degenerate case.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput, check_probability, resolve_budget
from mtmoe.gates.expert_choice import check_eval_policy
from mtmoe.gates.registry import register_gate
from mtmoe.gates.softmax import keras_dense
from mtmoe.scalars import cast


@register_gate("usmoe")
class USMoEGate(Gate):
    simplex = False
    batch_dependent = True
    #: alpha robust in (0.3, 0.7), 0.5 recommended (§3.2, §4.5.2); s_e x B/N is not in the paper
    #: (routing-methods.md §6.2).
    search_space = {"alpha": {"choice": [0.3, 0.5, 0.7]}, "rescale_expert_choice": {"choice": [False, True]}}
    scalar_names = ("alpha",)

    def __init__(
        self,
        dims: GateDims,
        k: float | None = None,
        alpha: float = 0.5,
        rescale_expert_choice: bool = False,
        eval_policy: Literal["batch", "sample"] = "batch",
    ) -> None:
        super().__init__(dims)
        self.k = resolve_budget(k, dims)
        self.set_scalars(alpha=check_probability("alpha", alpha))
        self.rescale_expert_choice = bool(rescale_expert_choice)
        self.batch_dependent = check_eval_policy(eval_policy) == "batch"
        self.router = keras_dense(dims.in_features, dims.n_experts)

    def budget(self, batch_size: int) -> int:
        """Selected pairs: ``floor(k B)``, at least 1 and at most ``B N``."""
        return min(batch_size * self.n_experts, max(1, math.floor(self.k * batch_size)))

    def max_active(self) -> int | None:
        return None if self.batch_dependent else self.budget(1)

    def active_per_batch(self, batch_size: int) -> int:
        return self.budget(batch_size)

    def expert_choice_scale(self, batch_size: int) -> float:
        return batch_size / self.n_experts if self.rescale_expert_choice else 1.0

    def forward(self, routing: RoutingInput) -> GateOutput:
        logits = self.router(routing.x)
        token_choice = logits.softmax(dim=-1)
        b = logits.shape[0]
        if self.training or self.batch_dependent:
            expert_choice = logits.softmax(dim=0) * self.expert_choice_scale(b)
            alpha, rest = cast(self.alpha, logits), cast(1 - self.alpha, logits)
            unified = (alpha * expert_choice + rest * token_choice).flatten()
            values, index = unified.topk(self.budget(b))
            weights = torch.zeros_like(unified).scatter(0, index, values).view_as(logits)
        else:
            alpha, rest = cast(self.alpha, logits), cast(1 - self.alpha, logits)
            unified = alpha * self.expert_choice_scale(1) + rest * token_choice
            values, index = unified.topk(self.max_active(), dim=-1)
            weights = torch.zeros_like(unified).scatter(-1, index, values)
        return GateOutput(weights, self.zero(logits))
