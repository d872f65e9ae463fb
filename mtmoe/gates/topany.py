"""Top-any gating of DynMoE (Guo et al., "Dynamic Mixture of Experts: An Auto-Tuning Approach for Efficient
Transformer Models", ICLR 2025, arXiv 2405.14297), as the authors' DeepSpeed implementation computes it
(github.com/LINs-lab/DynMoE, commit 49272326, ``DeepSpeed-0.9.5/deepspeed/moe/sharded_moe.py``: ``GAMoEGateT``,
``topanygating_opt``; ``deepspeed/moe/loss.py``: ``diverse_and_simple_gate_loss``).

Each expert ``e`` has a gate embedding ``w_e`` (a column of ``W``, orthogonal at initialisation) and a trainable
threshold ``G_e`` (zero at initialisation):

* scores ``s = sigmoid(<x / |x|, w_e / |w_e|>)`` (the cosine similarity), threshold ``sigmoid(G_e)``;
* activation ``a_e = sign(relu(s_e - sigmoid(G_e)))`` in {0, 1} with a straight-through gradient (the sign passes
  its gradient unchanged, so only experts above their threshold pass one to ``s`` and ``G``);
* weights ``a / max(K, 1)`` with ``K = sum_e a_e`` the sample's number of experts: equal weights on the selected
  experts, and a sample's number of experts varies (``max_active`` is ``None``: no fixed count is guaranteed);
* a sample above no threshold: in training it gets no expert (the code drops the token; here the task tower gets
  an all-zero input, logged as ``zero_expert_fraction``), in inference it goes to the expert of highest score with
  weight 1, as the code does. Rows therefore sum to 1, or to 0 for such a training sample (``simplex = False``);
* auxiliary loss (training only), ``aux_coef`` (the code's ``router_aux_loss_coef``, 0.01) times the sum of
  the diversity loss ``|W_n^T W_n - I|_F`` (``W_n`` the unit-norm embeddings), the simplicity loss ``mean_e |w_e|``,
  the load balance ``n^2 mean_e(me_e ce_e)`` over the samples with at least one expert (``me`` the mean of
  ``a / K``, ``ce`` the mean of ``a``, no gradient) and the efficiency loss ``mean(a)``.

Left out: the adaptive training process that adds and removes experts during training: it changes the
model's shape mid-run, while the trials of a pack (``mtmoe.pack``) share one shape and the suite compares gates
at a fixed ``n``; its expert mask is therefore all ones. The code's score temperature is fixed at 1 (not trained)
and is left out too.

Adaptations to per-sample routing with one gate per task [A] (routing-methods.md): token becomes sample; each task
gate has its own embeddings and thresholds, and its auxiliary losses add up over the tasks. The load balance is
over the samples with an expert, written with masks (the code selects those rows: a data-dependent shape).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput, check_non_negative
from mtmoe.gates.registry import register_gate
from mtmoe.scalars import cast


class StraightThroughSign(torch.autograd.Function):
    """``sign`` forward, the identity backward (the code's ``GAMoEGateBackward``); torch operations with a separate
    ``setup_context``, so ``torch.func.vmap`` derives its batching rule (trial packs)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(scores: Tensor) -> Tensor:
        return torch.sign(scores)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def diversity_and_simplicity(embeddings: Tensor) -> Tensor:
    """``|W_n^T W_n - I|_F + mean_e |w_e|`` for the embeddings ``W`` ``[p, n]`` (one column per expert).

    The diversity term is computed in float64 and cast back. At the orthogonal initialisation ``W_n^T W_n - I`` is
    float32 rounding, and the norm's gradient ``M / |M|`` is a unit-size direction: in float32 it is the rounding
    noise of the matmul kernel (which differs between a trial alone and in a pack), in float64 it is the float32
    weights' own departure from orthogonality, the same for every kernel."""
    unit = F.normalize(embeddings.double(), dim=0)
    similarity = unit.T @ unit
    identity = torch.eye(similarity.shape[0], dtype=similarity.dtype, device=similarity.device)
    diversity = torch.linalg.matrix_norm(similarity - identity).to(embeddings.dtype)
    return diversity + embeddings.norm(dim=0).mean()


@register_gate("topany")
class TopAnyGate(Gate):
    simplex = False
    search_space = {"aux_coef": 0.01}  # the code's router_aux_loss_coef in every released config, untuned
    scalar_names = ("aux_coef",)

    def __init__(self, dims: GateDims, aux_coef: float = 0.01) -> None:
        super().__init__(dims)
        check_non_negative(aux_coef=aux_coef)
        self.set_scalars(aux_coef=aux_coef)
        embeddings = nn.init.orthogonal_(torch.empty(dims.n_experts, dims.in_features))  # the code's sim_matrix
        self.embeddings = nn.Parameter(embeddings.T.contiguous())
        self.thresholds = nn.Parameter(torch.zeros(dims.n_experts))

    def forward(self, routing: RoutingInput) -> GateOutput:
        scores = torch.sigmoid(F.normalize(routing.x, dim=1) @ F.normalize(self.embeddings, dim=0))
        active = StraightThroughSign.apply(F.relu(scores - torch.sigmoid(self.thresholds)))
        count = active.detach().sum(dim=-1, keepdim=True)
        if not self.training:  # a sample above no threshold goes to its best expert
            best = F.one_hot(scores.argmax(dim=-1), self.n_experts).to(active.dtype)
            active = active + (count == 0).to(active.dtype) * best
            count = count.clamp_min(1)
        weights = active / count.clamp_min(1)
        aux, stats = self.zero(scores), {}
        if self.training:
            routed = (count > 0).to(active.dtype)  # [B, 1]
            samples = routed.sum().clamp_min(1)
            share = active / torch.where(count > 0, active.sum(dim=-1, keepdim=True), torch.ones_like(count))
            me = (share * routed).sum(dim=0) / samples
            ce = (active.detach() * routed).sum(dim=0) / samples
            balance = (me * ce).mean() * self.n_experts**2
            efficiency = active.mean()
            regulariser = diversity_and_simplicity(self.embeddings)
            aux = cast(self.aux_coef, scores) * (regulariser + balance + efficiency)
            stats = {"diversity_simplicity": regulariser.detach(), "balance_loss": balance.detach(),
                     "efficiency_loss": efficiency.detach()}
        return GateOutput(weights, aux, stats)
