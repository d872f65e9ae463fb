"""COMET: k differentiable trees with a joint softmax (Ibrahim et al., KDD'23, Section 3; comet-protocol.md §2.5).

The k trees are vectorised as one "super-tree" in heap order: node q has children 2q+1 and 2q+2, nodes q < n-1
split and the n nodes q >= n-1 are leaves. Experts are numbered left to right (in-order), so for n = 5 the leaf
nodes 7, 8, 4, 5, 6 are experts 0..4. Heap indexing with n-1 split nodes is exactly Appendix C's collapsed tree
for n that is not a power of 2 (2^d - n leaves at depth d-1, 2n - 2^d at depth d), with no extra regulariser.

* split node q: ``h_q(x) = S_gamma(W_q x + c_q)`` in [0, 1]^k; left child gets reach ``v h_q``, right ``v (1 - h_q)``;
  kernel and bias ~ U(-gamma/100, gamma/100) (``split_bias=False`` drops the bias, as COMET-BERT does);
* leaf l: ``alpha_l(x) = beta_l x + d_l`` in R^k, kernel and bias ~ U(-0.05, 0.05);
* prediction, eq. (3), in log space (Section 3.5): ``s_{j,l} = alpha_{j,l} + log v_{j,l}`` (``log(v + 1e-8)`` for
  v > 0, ``finfo.min`` for v = 0), one softmax over all k*n scores jointly, then a sum over trees. Unreached
  leaves get weight exactly 0, so once every tree's reach is one-hot (saturation) ``||g||_0 <= k`` (Prop. 3.1);
* training-only entropy regulariser on the leaf-reach probabilities:
  ``entropy_reg * mean_b sum_j -sum_l v_{j,l} log(v_{j,l} + 1e-6)``.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from mtmoe.gates.base import (
    Gate, GateDims, GateOutput, RoutingInput, check_gamma, check_non_negative, resolve_k, safe_log,
)
from mtmoe.gates.reach import reach
from mtmoe.gates.registry import register_gate
from mtmoe.scalars import cast


def leaf_paths(n: int) -> list[list[tuple[int, bool]]]:
    """For each expert (leaf in left-to-right order): the root-to-leaf path as ``(split node, went_left)`` pairs."""
    paths: list[list[tuple[int, bool]]] = []

    def visit(node: int, path: list[tuple[int, bool]]) -> None:
        if node >= n - 1:
            paths.append(path)
            return
        visit(2 * node + 1, path + [(node, True)])
        visit(2 * node + 2, path + [(node, False)])

    visit(0, [])
    return paths


def path_index(n: int) -> Tensor:
    """``[n, depth]`` indices into ``cat([h, 1 - h, 1])`` (length 2(n-1)+1) whose product is each leaf's reach."""
    paths = leaf_paths(n)
    depth = max(len(p) for p in paths)
    pad = 2 * (n - 1)  # index of the constant 1 used to pad shallower leaves
    index = [[q if left else (n - 1) + q for q, left in p] + [pad] * (depth - len(p)) for p in paths]
    return torch.tensor(index, dtype=torch.long)


@register_gate("comet")
class COMETGate(Gate):
    #: S1.3's MovieLens grids (comet-protocol.md §6); the space files give each dataset's.
    search_space = {"gamma": {"choice": [0.01, 0.1, 1, 5, 10]}, "entropy_reg": {"choice": [0.05, 0.1, 0.5, 1, 5, 10]}}
    scalar_names = ("gamma", "entropy_reg")
    linear_reads = 2  # split and leaf

    def __init__(
        self,
        dims: GateDims,
        k: int | None = None,
        gamma: float = 1.0,
        entropy_reg: float = 1.0,
        split_bias: bool = True,
    ) -> None:
        super().__init__(dims)
        self.k = resolve_k(k, dims)
        gamma = check_gamma(gamma)
        check_non_negative(entropy_reg=entropy_reg)
        self.set_scalars(gamma=gamma, entropy_reg=entropy_reg)
        n, p = dims.n_experts, dims.in_features
        self.split = nn.Linear(p, (n - 1) * self.k, bias=split_bias)
        self.leaf = nn.Linear(p, n * self.k)
        nn.init.uniform_(self.split.weight, -gamma / 100, gamma / 100)
        if split_bias:
            nn.init.uniform_(self.split.bias, -gamma / 100, gamma / 100)
        nn.init.uniform_(self.leaf.weight, -0.05, 0.05)
        nn.init.uniform_(self.leaf.bias, -0.05, 0.05)
        self.register_buffer("paths", path_index(n), persistent=False)

    def max_active(self) -> int:
        return self.k

    def reach(self, x: Tensor) -> Tensor:
        """Leaf-reach probabilities ``v`` of shape ``[B, k, n]`` (each tree's row sums to 1)."""
        return self.reach_of_splits(self.split(x))

    def reach_of_splits(self, split: Tensor) -> Tensor:
        """:meth:`reach` from the split map's output ``W_q x + c_q`` ``[B, (n-1) k]``."""
        return reach(split, self.gamma, self.paths).transpose(-1, -2)  # [B, n, k] by one kernel (mtmoe.gates.reach)

    def forward(self, routing: RoutingInput) -> GateOutput:
        v = self.reach_of_splits(routing.linear(self.split))
        alpha = routing.linear(self.leaf).view(-1, self.n_experts, self.k).transpose(1, 2)  # [B, k, n]
        scores = alpha + safe_log(v, 1e-8)
        joint = scores.flatten(1).softmax(dim=-1).view_as(scores)  # one softmax over k*n (Section 3.5)
        weights = joint.sum(dim=1)
        aux, stats = self.zero(weights), {}
        if self.training:
            entropy = -(v * torch.log(v + 1e-6)).sum(dim=(1, 2)).mean()
            aux = cast(self.entropy_reg, entropy) * entropy
            stats["entropy"] = entropy.detach()
        return GateOutput(weights, aux, stats)
