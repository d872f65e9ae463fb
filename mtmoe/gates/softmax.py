"""Dense MMoE gate (Ma et al., KDD'18): g(x) = softmax(Wx + b) (comet-protocol.md §2.1)."""
from __future__ import annotations

from torch import nn

from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput
from mtmoe.gates.registry import register_gate


def keras_dense(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    """A Linear layer with Keras' Dense defaults (Glorot-uniform kernel, zero bias), as the official gates use."""
    layer = nn.Linear(in_features, out_features, bias=bias)
    nn.init.xavier_uniform_(layer.weight)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


@register_gate("softmax")
class SoftmaxGate(Gate):
    """Dense softmax gate; ``use_bias`` as in the official configs (true). Every expert is used (n/s = n)."""

    sparse = False

    def __init__(self, dims: GateDims, use_bias: bool = True) -> None:
        super().__init__(dims)
        self.logits = keras_dense(dims.in_features, dims.n_experts, bias=use_bias)

    def forward(self, routing: RoutingInput) -> GateOutput:
        return GateOutput(self.logits(routing.x).softmax(dim=-1), self.zero(routing.x))
