"""Expert Choice routing (Zhou et al., NeurIPS'22; routing-methods.md §2): experts pick samples, not the reverse.

Per task gate, ``S = softmax(W x + b)`` over the experts for every sample of the batch; each expert ``i`` takes the
``C = clamp(floor(B k / N), 1, B)`` samples with the highest ``S[:, i]`` and ``W[b, i] = S[b, i]`` for those (raw
affinities, not renormalised, as the paper), 0 elsewhere. ``k`` is the capacity factor, the average number of
experts per sample (the paper's c; EC-CF2 is k = 2; default: the dataset's k). Load is balanced by construction, so
there is no auxiliary loss.

Adaptations to per-sample routing with one gate per task [A]:

* "tokens in the batch" become the samples of the mini-batch; the router is the Top-k gate's (Keras Dense).
* ``C`` is clamped to at least 1 (for ``B k < N`` the formula gives 0) and at most ``B``; with ``B = 1`` every
  expert takes the single sample and routing is dense.
* A sample may be picked by no expert: its task tower then sees an all-zero input (MMoE has no residual path; the
  ``zero_expert_fraction`` routing statistic logs how often). Rows are therefore not on the simplex; each row sums
  to at most 1 (a subset of a softmax row).
* Inference: with ``eval_policy="batch"`` (default, the method's own) a sample's experts depend on the other samples
  of its evaluation batch, so results depend on the eval batch size and on the batch composition (the eval loaders
  of this suite are fixed, seeded permutations cut in order; the last batch is partial, with its own capacity).
  ``eval_policy="sample"`` is batch-independent: each sample takes its top-``round(k)`` experts by ``S`` with their
  raw affinities (token-choice fallback, routing-methods.md §2 policy (b)); training is batch-level either way.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from mtmoe.errors import SettingError
from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput, resolve_budget
from mtmoe.gates.registry import register_gate
from mtmoe.gates.softmax import keras_dense


def check_eval_policy(eval_policy: str) -> str:
    if eval_policy not in ("batch", "sample"):
        raise SettingError("eval_policy", eval_policy, "must be batch or sample")
    return eval_policy


@register_gate("expertchoice")
class ExpertChoiceGate(Gate):
    simplex = False
    batch_dependent = True
    search_space = {"k": {"choice": [1, 2]}}  # capacity factor: EC-CF1 and EC-CF2

    def __init__(self, dims: GateDims, k: float | None = None, eval_policy: Literal["batch", "sample"] = "batch") -> None:
        super().__init__(dims)
        self.k = resolve_budget(k, dims)
        self.batch_dependent = check_eval_policy(eval_policy) == "batch"
        self.router = keras_dense(dims.in_features, dims.n_experts)

    def capacity(self, batch_size: int) -> int:
        """Samples per expert: ``floor(B k / N)``, at least 1 and at most ``B``."""
        return min(batch_size, max(1, math.floor(batch_size * self.k / self.n_experts)))

    def max_active(self) -> int | None:
        return None if self.batch_dependent else max(1, round(self.k))

    def active_per_batch(self, batch_size: int) -> int:
        return self.n_experts * self.capacity(batch_size)

    def forward(self, routing: RoutingInput) -> GateOutput:
        affinity = self.router(routing.x).softmax(dim=-1)
        if self.training or self.batch_dependent:
            values, index = affinity.topk(self.capacity(affinity.shape[0]), dim=0)  # [C, N]: each expert's picks
            weights = torch.zeros_like(affinity).scatter(0, index, values)
        else:
            values, index = affinity.topk(self.max_active(), dim=-1)
            weights = torch.zeros_like(affinity).scatter(-1, index, values)
        return GateOutput(weights, self.zero(affinity))
