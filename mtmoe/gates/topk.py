"""Top-k gate (Shazeer et al., 2017; comet-protocol.md §2.2): g(x) = softmax(KeepTopK(Wx + b, k)), and its options.

The mask is built from the top-k *indices*, so a selected logit that is exactly 0 is kept (the official code's
``== 0.0`` mask drops it). Noisy top-k adds ``eps * softplus(W_noise x)`` to the logits in training; it is off by
default because every official config sets ``jitter: false`` (the paper's Top-k is noiseless); its standard normal
noise comes from the gate's random stream (``RoutingInput.stream``).

Options (each also registered with its own defaults, so that the registry suite, the search spaces and
``compare_gates.py`` cover it):

* ``score="sigmoid"`` -- sigmoid gating (Nguyen, Ho and Rinaldo, NeurIPS 2024, "Sigmoid Gating is More Sample
  Efficient than Softmax Gating": the mixture ``sum_i sigmoid(beta_1i^T x + beta_0i) f_i(x)``): the scores are
  ``s_i = sigmoid(w_i x + b_i)`` instead of a softmax, and the k largest are kept (top-k is this suite's addition).
  ``normalize`` divides the kept scores by their sum (DeepSeek-V3's gate). ``topk-sigmoid`` leaves them unnormalised
  by default, as the paper's gate whose sample efficiency it proves (each expert's weight is independent of the
  others' scores; normalising brings back the softmax-like coupling): its rows are not on the simplex. Normalised,
  the weights are computed as ``softmax(logsigmoid(theta))`` over the kept logits (the same ratio, finite where
  every kept sigmoid underflows). ``normalize=False`` with softmax scores keeps the full softmax's values of the
  selected experts (DeepSeek-V3's softmax gate);
* ``balance=True`` -- auxiliary-loss-free load balancing (Wang et al., arXiv 2408.15664, §3 and Algorithm 1;
  DeepSeek-V3 §2.1.2): an expert-wise bias ``b`` enters the selection only, ``TopK(s_i + b_i)``, while the weights
  stay the unbiased scores; after each training step ``b_i += u * sign(mean_j c_j - c_i)`` with ``c_i`` the number
  of (sample, choice) pairs of the batch routed to expert ``i`` and ``u = bias_rate`` (0.001, the paper's). No
  balance loss. ``topk-lossfree`` is Top-k (softmax scores) with it; ``--model.gate.score sigmoid
  --model.gate.normalize true`` on it is DeepSeek-V3's gate (one group, ``route_scale`` 1).

Adaptations to per-sample routing with one gate per task [A]: token becomes sample, each task gate has its own
scores and its own bias, updated from that gate's load over the mini-batch (the paper's batch is a batch of tokens
of one layer). The update runs in the training forward pass, after the selection it follows (the bias enters no
gradient, so updating it there equals updating it after the optimiser's step); it is an in-place tensor operation,
so it reads nothing on the host and runs per trial in a pack. The bias is a persistent buffer (checkpointed) and is
used in evaluation too, as at inference in DeepSeek-V3.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from mtmoe.errors import SettingError
from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput, check_non_negative, resolve_k, topk_softmax
from mtmoe.gates.registry import register_gate
from mtmoe.gates.softmax import keras_dense
from mtmoe.scalars import cast

SCORES = ("softmax", "sigmoid")


@register_gate("topk")
class TopKGate(Gate):
    scalar_names = ("bias_rate",)

    def __init__(self, dims: GateDims, k: int | None = None, noisy: bool = False,
                 score: Literal["softmax", "sigmoid"] = "softmax", normalize: bool = True, balance: bool = False,
                 bias_rate: float = 1e-3) -> None:
        super().__init__(dims)
        if score not in SCORES:
            raise SettingError("score", score, f"must be one of {', '.join(SCORES)}")
        check_non_negative(bias_rate=bias_rate)
        self.k = resolve_k(k, dims)
        self.score, self.normalize, self.simplex = score, bool(normalize), bool(normalize)
        self.logits = keras_dense(dims.in_features, dims.n_experts)
        self.noise = keras_dense(dims.in_features, dims.n_experts, bias=False) if noisy else None
        self.register_buffer("expert_bias", torch.zeros(dims.n_experts) if balance else None)
        if balance:
            self.set_scalars(bias_rate=bias_rate)

    def max_active(self) -> int:
        return self.k

    def forward(self, routing: RoutingInput) -> GateOutput:
        logits = self.logits(routing.x)
        if self.noise is not None and self.training:
            if routing.stream is None:
                raise ValueError("noisy TopKGate samples in training from RoutingInput.stream")
            noise = routing.stream.normal(logits.shape, logits.device).to(logits.dtype)
            logits = logits + noise * torch.nn.functional.softplus(self.noise(routing.x))
        if self.expert_bias is None and self.score == "softmax" and self.normalize:
            weights, _ = topk_softmax(logits, self.k)
            return GateOutput(weights, self.zero(logits))
        scores = logits.sigmoid() if self.score == "sigmoid" else logits.softmax(dim=-1)
        selection = logits if self.expert_bias is None else scores + self.expert_bias
        index = selection.topk(self.k, dim=-1).indices
        if not self.normalize:
            kept = scores.gather(-1, index)
        elif self.score == "sigmoid":
            kept = torch.nn.functional.logsigmoid(logits.gather(-1, index)).softmax(dim=-1)
        else:
            kept = logits.gather(-1, index).softmax(dim=-1)
        weights = torch.zeros_like(logits).scatter(-1, index, kept)
        stats = {}
        if self.expert_bias is not None and self.training:
            stats["max_violation"] = self.update_bias_(index)
        return GateOutput(weights, self.zero(logits), stats)

    @torch.no_grad()
    def update_bias_(self, index: Tensor) -> Tensor:
        """Algorithm 1's step on this batch's selections ``[B, k]``; returns its MaxVio, ``max_i c_i / mean c - 1``."""
        bias = self.expert_bias
        chosen = index.flatten()
        load = torch.zeros_like(bias).scatter_add(0, chosen, torch.ones_like(chosen, dtype=bias.dtype))
        mean = load.mean()
        bias.add_(cast(self.bias_rate, bias) * (mean - load).sign())
        return load.max() / mean - 1


@register_gate("topk-sigmoid")
class SigmoidTopKGate(TopKGate):
    """Sigmoid gating with top-k (Nguyen et al., 2024): Top-k with ``score="sigmoid"``, unnormalised as in the paper."""

    simplex = False

    def __init__(self, dims: GateDims, k: int | None = None, noisy: bool = False,
                 score: Literal["softmax", "sigmoid"] = "sigmoid", normalize: bool = False, balance: bool = False,
                 bias_rate: float = 1e-3) -> None:
        super().__init__(dims, k, noisy, score, normalize, balance, bias_rate)


@register_gate("topk-lossfree")
class LossFreeTopKGate(TopKGate):
    """Top-k with auxiliary-loss-free load balancing (Wang et al., 2024): Top-k with ``balance=True``."""

    search_space = {"bias_rate": {"choice": [1.0e-4, 1.0e-3, 1.0e-2]}}  # u: Wang et al.'s update-rate study

    def __init__(self, dims: GateDims, k: int | None = None, noisy: bool = False,
                 score: Literal["softmax", "sigmoid"] = "softmax", normalize: bool = True, balance: bool = True,
                 bias_rate: float = 1e-3) -> None:
        super().__init__(dims, k, noisy, score, normalize, balance, bias_rate)
