"""Top-k gate (Shazeer et al., 2017; comet-protocol.md §2.2): g(x) = softmax(KeepTopK(Wx + b, k)).

The mask is built from the top-k *indices*, so a selected logit that is exactly 0 is kept (the official code's
``== 0.0`` mask drops it). Noisy top-k adds ``eps * softplus(W_noise x)`` to the logits in training; it is off by
default because every official config sets ``jitter: false`` (the paper's Top-k is noiseless); its standard normal
noise comes from the gate's random stream (``RoutingInput.stream``).
"""
from __future__ import annotations

import torch

from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput, resolve_k, topk_softmax
from mtmoe.gates.registry import register_gate
from mtmoe.gates.softmax import keras_dense


@register_gate("topk")
class TopKGate(Gate):
    hyperparameters = ("k",)

    def __init__(self, dims: GateDims, k: int | None = None, noisy: bool = False) -> None:
        super().__init__(dims)
        self.k = resolve_k(k, dims)
        self.logits = keras_dense(dims.in_features, dims.n_experts)
        self.noise = keras_dense(dims.in_features, dims.n_experts, bias=False) if noisy else None

    def max_active(self) -> int:
        return self.k

    def forward(self, routing: RoutingInput) -> GateOutput:
        logits = self.logits(routing.x)
        if self.noise is not None and self.training:
            if routing.stream is None:
                raise ValueError("noisy TopKGate samples in training from RoutingInput.stream")
            noise = routing.stream.normal(logits.shape, logits.device).to(logits.dtype)
            logits = logits + noise * torch.nn.functional.softplus(self.noise(routing.x))
        weights, _ = topk_softmax(logits, self.k)
        return GateOutput(weights, self.zero(logits))
