"""DSelect-k, per-example (Hazimeh et al., NeurIPS'21; comet-protocol.md §2.4).

k single-expert selectors, each a smooth-step over the m = ceil(log2 n) bits of the expert's binary code
(most-significant bit first), mixed by softmax(Ax + a) over the k selectors:

    r^(j)_i(x) = prod_t S(z^(j)_t)^{b_t(i)} (1 - S(z^(j)_t))^{1 - b_t(i)},   g(x) = sum_j sigma_j(x) r^(j)(x).

Training-only regularisers:

* entropy ``entropy_reg * reduce_b(-sum_j sum_i r log(r + 1e-6))`` where ``entropy_reduction`` is ``"mean"`` over
  the batch (COMET's copy; the paper's lambda grids refer to it; the default) or ``"sum"`` (the Google original);
  the two differ by exactly a factor B;
* for n != 2^m, the non-power-of-2 penalty ``zeta * sum_b sum_j 1 / (sum_i r + 1e-6)`` (batch-summed in both
  versions), which keeps each selector on reachable codes. Its optimum is the constant zeta*B*k.

``g`` is not renormalised: it lies on the simplex once selectors saturate on valid codes (exactly for n = 2^m).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from mtmoe.errors import SettingError
from mtmoe.gates.base import (
    Gate, GateDims, GateOutput, RoutingInput, check_gamma, check_non_negative, product, resolve_k,
)
from mtmoe.gates.registry import register_gate
from mtmoe.gates.smooth_step import smooth_step
from mtmoe.scalars import cast


def binary_codes(n: int) -> Tensor:
    """``[n, m]`` float matrix of the binary codes of 0..n-1, most-significant bit first (``np.binary_repr``)."""
    m = max(1, math.ceil(math.log2(n)))
    return torch.tensor([[(i >> (m - 1 - t)) & 1 for t in range(m)] for i in range(n)], dtype=torch.float32)


@register_gate("dselect")
class DSelectKGate(Gate):
    #: S1.3's MovieLens grids (comet-protocol.md §6); the space files give each dataset's.
    search_space = {"gamma": {"choice": [0.01, 0.1, 1, 5, 10]}, "entropy_reg": {"choice": [0.05, 0.1, 0.5, 1, 5, 10]}}
    scalar_names = ("gamma", "entropy_reg", "zeta")

    def __init__(
        self,
        dims: GateDims,
        k: int | None = None,
        gamma: float = 1.0,
        entropy_reg: float = 1.0,
        entropy_reduction: Literal["mean", "sum"] = "mean",
        zeta: float = 1.0,
    ) -> None:
        super().__init__(dims)
        self.k = resolve_k(k, dims)
        gamma = check_gamma(gamma)
        check_non_negative(entropy_reg=entropy_reg, zeta=zeta)
        if entropy_reduction not in ("mean", "sum"):
            raise SettingError("entropy_reduction", entropy_reduction, "must be mean or sum")
        self.entropy_reduction = entropy_reduction
        self.set_scalars(gamma=gamma, entropy_reg=entropy_reg, zeta=zeta)
        codes = binary_codes(dims.n_experts)
        self.m = codes.shape[1]
        self.power_of_two = dims.n_experts == 2**self.m
        self.register_buffer("codes", codes, persistent=False)
        self.selector_logits = nn.Linear(dims.in_features, self.k * self.m)  # z^(j) = Z_j x + c_j
        self.selector_mix = nn.Linear(dims.in_features, self.k)  # sigma = softmax(Ax + a)
        nn.init.uniform_(self.selector_logits.weight, -gamma / 100, gamma / 100)
        nn.init.uniform_(self.selector_logits.bias, -gamma / 100, gamma / 100)
        nn.init.uniform_(self.selector_mix.weight, -0.05, 0.05)
        nn.init.uniform_(self.selector_mix.bias, -0.05, 0.05)

    def max_active(self) -> int:
        return self.k

    def selector_outputs(self, x: Tensor) -> Tensor:
        """``r`` of shape ``[B, k, n]``: each selector's distribution over the n valid codes."""
        bits = smooth_step(self.selector_logits(x).view(-1, self.k, 1, self.m), self.gamma)  # [B, k, 1, m]
        return product(self.codes * bits + (1 - self.codes) * (1 - bits), dim=-1)

    def forward(self, routing: RoutingInput) -> GateOutput:
        r = self.selector_outputs(routing.x)
        sigma = self.selector_mix(routing.x).softmax(dim=-1)
        weights = torch.einsum("bk,bkn->bn", sigma, r)
        aux, stats = self.zero(weights), {}
        if self.training:
            entropy = -(r * torch.log(r + 1e-6)).sum(dim=(1, 2))
            entropy = entropy.mean() if self.entropy_reduction == "mean" else entropy.sum()
            aux = cast(self.entropy_reg, entropy) * entropy
            stats["entropy"] = entropy.detach()
            if not self.power_of_two:
                penalty = (1.0 / (r.sum(dim=-1) + 1e-6)).sum()
                aux = aux + cast(self.zeta, penalty) * penalty
                stats["non_power_of_2_penalty"] = penalty.detach()
        return GateOutput(weights, aux, stats)
