"""MOESART: sampling-based k-sparse routing (Ibrahim, Chen, Mazumder et al., "MOESART: An Effective Sampling-based
Router for Sparse Mixture of Experts", arXiv 2312), as the authors' TensorFlow gate
``SampleKSoftmaxUnbiasedWithTrimmedLassoGate`` computes it (``biasness="small-random"``, ``replace=False``,
``tau = 1``, no jitter: their MOESART settings in the TensorFlow code; a PyTorch copy of the class defaults to
``biasness="zero"``, which ``biasness="zero"`` here gives: every logit of ``S`` adjusted by ``log(k (g_i + 1e-10))``
in training too). The paper's text was not available here; the formulas below are
the code's, whose docstring states the same algorithm.

With router logits ``o = W x + b`` and the softmax ``g = softmax(o)``:

* training: a set ``S`` of ``k`` experts is drawn from ``g`` without replacement; one ``j`` of ``S``, uniformly at
  random, keeps its logit and the others are adjusted to ``o_i - log((k - 1) (g_i + 1e-10))``; the weights are the
  softmax of the adjusted logits over ``S`` (zero outside). The adjustment makes the sparse weights a small-bias
  estimate of ``g``;
* inference: ``S`` is the top-k of ``o`` and every logit of ``S`` is adjusted by ``log(k (g_i + 1e-10))``;
* trimmed-lasso penalty (training only): ``trimmed_lasso_reg * mean_b sum_{i not in topk(g_b)} g_bi``, pushing
  ``g``'s mass into its top k so that sampling and the top-k inference agree.

Adaptations to per-sample routing with one gate per task [A] (routing-methods.md): token becomes sample; each task
gate has its own router and penalty, and the penalties add up over the tasks. ``S`` is drawn by Gumbel-top-k on
``o`` (Kool et al., 2019: the top k of ``o`` plus Gumbel noise is a sample of k without replacement from ``g``, the
same distribution as the code's k successive renormalised draws), and ``j`` by a uniform coin, both from the gate's
own random stream (``RoutingInput.stream``), so a trial draws the same alone or in a pack. The code's
routing-consistency metric needs a per-sample state of the whole training set and is left out.
"""
from __future__ import annotations

import torch

from mtmoe.errors import SettingError
from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput, check_non_negative, resolve_k
from mtmoe.gates.registry import register_gate
from mtmoe.gates.softmax import keras_dense
from mtmoe.scalars import cast

EPSILON = 1e-10  # the code's ``g + 1e-10`` inside the logarithm
BIASNESS = ("small-random", "zero")  # the code's options that keep the weights' bias small ("large": none, left out)


@register_gate("moesart")
class MOESARTGate(Gate):
    #: The authors' own sweep in their GLUE scripts (trimmed_lasso_regs: 1e-4 .. 10), log-uniform.
    search_space = {"trimmed_lasso_reg": {"log_uniform": [1.0e-4, 10.0]}}
    scalar_names = ("trimmed_lasso_reg",)

    def __init__(self, dims: GateDims, k: int | None = None, trimmed_lasso_reg: float = 0.01,
                 biasness: str = "small-random") -> None:
        super().__init__(dims)
        if biasness not in BIASNESS:
            raise SettingError("biasness", biasness, f"must be one of {', '.join(BIASNESS)}")
        self.k, self.biasness = resolve_k(k, dims), biasness
        check_non_negative(trimmed_lasso_reg=trimmed_lasso_reg)
        self.set_scalars(trimmed_lasso_reg=trimmed_lasso_reg)
        self.logits = keras_dense(dims.in_features, dims.n_experts)

    def max_active(self) -> int:
        return self.k

    def forward(self, routing: RoutingInput) -> GateOutput:
        logits = self.logits(routing.x)
        g = logits.softmax(dim=-1)
        top_values, top_index = g.topk(self.k, dim=-1)
        if self.training:
            if routing.stream is None:
                raise ValueError("MOESARTGate samples in training from RoutingInput.stream")
            gumbel = routing.stream.child(0).gumbel(logits.shape, logits.device, logits.dtype)
            _, chosen = (logits.detach() + gumbel).topk(self.k, dim=-1)  # S, without replacement
        if self.training and self.biasness == "small-random":
            coin = routing.stream.child(1).uniform(chosen.shape[:-1] + (1,), logits.device)
            kept = (coin * self.k).long()  # the position in S of the unadjusted logit j
            adjusted = torch.arange(self.k, device=logits.device) != kept
            scale = self.k - 1
        else:  # inference, or biasness="zero" in training: every logit of S adjusted by log(k g)
            if not self.training:
                chosen = logits.topk(self.k, dim=-1).indices
            adjusted = torch.ones_like(chosen, dtype=torch.bool)
            scale = self.k
        adjustment = torch.log(scale * (g.gather(-1, chosen) + EPSILON)) if scale > 0 else torch.zeros_like(
            chosen, dtype=logits.dtype)  # k = 1 in training: S = {j}, nothing adjusted
        selected = logits.gather(-1, chosen) - torch.where(adjusted, adjustment, torch.zeros_like(adjustment))
        weights = torch.zeros_like(logits).scatter(-1, chosen, selected.softmax(dim=-1))
        aux, stats = self.zero(logits), {}
        if self.training:
            g_topk = torch.zeros_like(g).scatter(-1, top_index, top_values)
            trimmed = (g - g_topk).abs().sum(dim=-1).mean()  # the mass outside the top k, as the code sums it
            aux = cast(self.trimmed_lasso_reg, trimmed) * trimmed
            stats["trimmed_lasso"] = trimmed.detach()
        return GateOutput(weights, aux, stats)
