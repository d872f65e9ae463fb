"""Issue 24's routers against their official code and their papers' equations: Top-k's sigmoid scores and
auxiliary-loss-free balancing against DeepSeek-V3's ``Gate`` (their forward ported verbatim) and Wang et al.'s
Algorithm 1 (written out in NumPy), ReMoE against the authors' Megatron router and coefficient update (ported).
The registry suite (``test_gates_registry.py``, ``test_engine.py``) covers their shared contract."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np
import pytest
import torch
from torch import nn

from mtmoe.gates import GateDims, RoutingInput, create_gate

linear = torch.nn.functional.linear  # DeepSeek-V3's ``linear`` for unquantised weights


@dataclass
class ModelArgs:
    dim: int
    n_activated_experts: int
    n_routed_experts: int
    score_func: str
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    route_scale: float = 1.0


class DeepSeekV3Gate(nn.Module):
    """deepseek-ai/DeepSeek-V3 ``inference/model.py`` class ``Gate``, commit 9b4e9788e4a3a731f7567338ed15d3ec549ce03b;
    ``__init__`` and ``forward`` verbatim (docstrings dropped)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dim = args.dim
        self.topk = args.n_activated_experts
        self.n_groups = args.n_expert_groups
        self.topk_groups = args.n_limited_groups
        self.score_func = args.score_func
        self.route_scale = args.route_scale
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        self.bias = nn.Parameter(torch.empty(args.n_routed_experts, dtype=torch.float32)) if self.dim == 7168 else None

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        scores = linear(x, self.weight)
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1, dtype=torch.float32)
        else:
            scores = scores.sigmoid()
        original_scores = scores
        if self.bias is not None:
            scores = scores + self.bias
        if self.n_groups > 1:
            scores = scores.view(x.size(0), self.n_groups, -1)
            if self.bias is None:
                group_scores = scores.amax(dim=-1)
            else:
                group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)
            indices = group_scores.topk(self.topk_groups, dim=-1)[1]
            mask = scores.new_ones(x.size(0), self.n_groups, dtype=bool).scatter_(1, indices, False)
            scores = scores.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(scores, self.topk, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        if self.score_func == "sigmoid":
            weights /= weights.sum(dim=-1, keepdim=True)
        weights *= self.route_scale
        return weights.type_as(x), indices


DIM, N, K, B = 7168, 8, 2, 64  # DeepSeek-V3's gate has its bias only at dim 7168


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_biased_selection_and_weights_equal_deepseek_v3(score: str) -> None:
    """Sigmoid scores normalised over the selection (DeepSeek-V3's sigmoid gate), softmax scores unnormalised (its
    softmax gate), both with the balancing bias; the bias changes some selections, and the weights stay unbiased."""
    torch.manual_seed(0)
    theirs = DeepSeekV3Gate(ModelArgs(DIM, K, N, score))
    nn.init.normal_(theirs.weight, std=DIM ** -0.5)
    with torch.no_grad():
        theirs.bias.copy_(torch.linspace(-0.3, 0.3, N) if score == "sigmoid" else torch.linspace(-0.1, 0.1, N))
    ours = create_gate("topk-lossfree", GateDims(DIM, N, k=K), score=score, normalize=score == "sigmoid").eval()
    with torch.no_grad():
        ours.logits.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.bias)
    x = torch.randn(B, DIM)
    weights, indices = theirs(x)
    expected = torch.zeros(B, N).scatter(1, indices, weights)
    got = ours(RoutingInput(x)).weights
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(got != 0, expected != 0)
    unbiased = linear(x, theirs.weight).topk(K, dim=-1).indices.sort(-1).values
    assert not torch.equal(unbiased, indices.sort(-1).values), "the bias changed no selection: the test is void"


def test_sigmoid_gate_is_the_unnormalised_sigmoid_of_the_top_k_logits() -> None:
    """Nguyen et al.'s gate with top-k: ``sigmoid(w_i x + b_i)`` for the k largest logits, 0 elsewhere."""
    torch.manual_seed(1)
    gate = create_gate("topk-sigmoid", GateDims(5, N, k=3)).eval()
    x = torch.randn(B, 5)
    w, b = gate.logits.weight.detach().double().numpy(), np.linspace(-1, 1, N)
    with torch.no_grad():
        gate.logits.bias.copy_(torch.from_numpy(b))
    logits = x.double().numpy() @ w.T + b
    expected = np.zeros_like(logits)
    for row, top in enumerate(np.argsort(-logits, axis=1)[:, :3]):
        expected[row, top] = 1 / (1 + np.exp(-logits[row, top]))
    np.testing.assert_allclose(gate(RoutingInput(x)).weights.detach().double().numpy(), expected, rtol=1e-6, atol=0)
    assert not gate.simplex


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_bias_follows_algorithm_1_in_training_only(score: str) -> None:
    """Wang et al., Algorithm 1: select on ``s + b``, then ``b_i += u sign(mean c - c_i)`` from the batch's loads;
    five training steps from a random bias, each checked, then evaluation leaves the bias as it is."""
    torch.manual_seed(2)
    u = 0.01
    gate = create_gate("topk-lossfree", GateDims(6, N, k=K), score=score, bias_rate=u).train()
    with torch.no_grad():
        gate.logits.bias.normal_()
    w = gate.logits.weight.detach().double().numpy()
    c = gate.logits.bias.detach().double().numpy()
    bias = np.zeros(N)
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        x = torch.randn(B, 6, generator=generator)
        logits = x.double().numpy() @ w.T + c
        s = 1 / (1 + np.exp(-logits)) if score == "sigmoid" else np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        chosen = np.argsort(-(s + bias), axis=1, kind="stable")[:, :K]
        load = np.bincount(chosen.ravel(), minlength=N)
        out = gate(RoutingInput(x))
        assert np.array_equal(np.sort(out.weights.detach().numpy().nonzero()[1].reshape(B, K), 1), np.sort(chosen, 1))
        bias = bias + u * np.sign(load.mean() - load)
        np.testing.assert_allclose(gate.expert_bias.double().numpy(), bias, rtol=0, atol=1e-6)
        assert out.stats["max_violation"].item() == pytest.approx(load.max() / load.mean() - 1)
        assert out.aux_loss.item() == 0.0  # no balance loss
    assert np.abs(bias).max() > 0
    before = gate.expert_bias.clone()
    gate.eval()(RoutingInput(torch.randn(B, 6)))
    assert torch.equal(gate.expert_bias, before)


# --------------------------------------------------------------------------------------------------------------
# ReMoE: thu-ml/ReMoE, commit 463c6af38ffaa841941ea834470ee09f8d515652
# --------------------------------------------------------------------------------------------------------------


def switch_load_balancing_loss_func(probs, tokens_per_expert, topk, moe_aux_loss_coeff, sequence_partition_group=None):
    """``megatron/core/transformer/moe/moe_utils.py``, verbatim but the distributed branch (no group here)."""
    num_sub_sequence = 1
    num_tokens = probs.shape[0] * num_sub_sequence
    num_experts = probs.shape[1]
    aggregated_probs_per_expert = probs.sum(dim=0)
    aux_loss = torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (num_tokens * num_tokens * topk)
    )
    return aux_loss


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """``moe_utils.py``, verbatim (the main loss's backward scale is 1 here, its default)."""

    main_loss_backward_scale: torch.Tensor = torch.tensor(1.0)

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        aux_loss_backward_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        scaled_aux_loss_grad = torch.ones_like(aux_loss) * aux_loss_backward_scale
        return grad_output, scaled_aux_loss_grad


class Config:
    moe_relu_l1_reg_coeff_multiplier = 1.2

    def __init__(self, topk: int, num_moe_experts: int) -> None:
        self.moe_router_topk, self.num_moe_experts = topk, num_moe_experts
        self.moe_relu_l1_reg_coeff = torch.tensor(1e-8, dtype=torch.float32)  # gpt_model.py: its init, float32
        self.moe_relu_sparsity = torch.zeros(1, dtype=torch.float32)
        self.num_layers = 1


class ReLURouter(nn.Module):
    """``megatron/core/transformer/moe/router.py`` ``ReLURouter.l1_reg_load_balancing`` / ``apply_l1_reg`` and
    ``Router.gating``, verbatim but tensor parallelism and the loss tracker; ``step`` is ``training.py``'s update
    after each training step (lines 1476-1506), for one layer and one micro-batch."""

    def __init__(self, config: Config, weight: torch.Tensor) -> None:
        super().__init__()
        self.config, self.topk = config, config.moe_router_topk
        self.weight = nn.Parameter(weight.clone())

    def gating(self, input):
        return torch.nn.functional.linear(input, self.weight)

    def l1_reg_load_balancing(self, logits: torch.Tensor):
        probs = torch.relu(logits)
        routing_map = probs > 0
        if self.training and torch.is_grad_enabled():
            num_local_tokens_per_expert = routing_map.sum(dim=0)
            probs = self.apply_l1_reg(probs, num_local_tokens_per_expert, activation=probs)
            sparsity = 1 - routing_map.sum().float() / routing_map.numel()
            self.config.moe_relu_sparsity += sparsity
        return probs, routing_map

    def apply_l1_reg(self, probs, num_local_tokens_per_expert, activation):
        l1_reg_coeff = self.config.moe_relu_l1_reg_coeff.item()
        l1_reg = switch_load_balancing_loss_func(probs, num_local_tokens_per_expert, self.topk, l1_reg_coeff)
        activation = MoEAuxLossAutoScaler.apply(activation, l1_reg)
        return activation

    def forward(self, input):
        config = self.config
        config.moe_relu_sparsity.zero_()
        scores, _ = self.l1_reg_load_balancing(self.gating(input))
        return scores

    def step(self) -> None:
        config = self.config
        config.moe_relu_sparsity /= config.num_layers * 1
        target_sparsity = 1 - config.moe_router_topk / config.num_moe_experts
        if config.moe_relu_sparsity < target_sparsity:
            config.moe_relu_l1_reg_coeff *= config.moe_relu_l1_reg_coeff_multiplier
        else:
            config.moe_relu_l1_reg_coeff /= config.moe_relu_l1_reg_coeff_multiplier


def test_remoe_forward_backward_and_lambda_equal_the_official_router() -> None:
    """40 training steps on the same inputs and weights (no optimiser, so the sparsity stays on one side of its
    target and lambda climbs from 1e-8 to ~1e-5), then 20 on zero inputs, every ReLU off (lambda falls): weights, the
    router's and the inputs' gradients (the L1 term's included) and lambda after every step equal the official code's;
    evaluation adds no loss and leaves lambda alone."""
    torch.manual_seed(4)
    n, k, p = 8, 2, 12
    gate = create_gate("remoe", GateDims(p, n, k=k)).train()
    official = ReLURouter(Config(k, n), gate.router.weight.detach()).train()
    generator = torch.Generator().manual_seed(5)
    for step in range(60):
        x = torch.randn(B, p, generator=generator) * (step < 40)  # then zero inputs: every ReLU off
        g = torch.randn(B, n, generator=generator)
        x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = gate(RoutingInput(x_ours))
        ((out.weights * g).sum() + out.aux_loss).backward()
        scores = official(x_theirs)
        (scores * g).sum().backward()
        official.step()
        assert torch.equal(out.weights, scores)
        torch.testing.assert_close(gate.router.weight.grad, official.weight.grad, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-6, atol=1e-9)
        assert torch.equal(gate.l1_coef, official.config.moe_relu_l1_reg_coeff), step
        gate.router.weight.grad = official.weight.grad = None
        if step == 39:
            assert gate.l1_coef > 1e-6
    assert gate.l1_coef < 1e-6 and out.stats["sparsity"] > 1 - k / n
    before = gate.l1_coef.clone()
    evaluated = gate.eval()(RoutingInput(torch.randn(B, p)))
    assert evaluated.aux_loss.item() == 0.0 and torch.equal(gate.l1_coef, before)


def test_remoe_plain_l1_is_the_papers_mean_l1_norm() -> None:
    """``load_balance=False``: ``lambda (1/T) sum_t ||ReLU(x_t W)||_1`` (no ``f_e`` weighting), from NumPy."""
    torch.manual_seed(6)
    gate = create_gate("remoe", GateDims(7, 5, k=2), l1_init=0.5, load_balance=False).train()
    x = torch.randn(B, 7)
    relu = np.maximum(x.double().numpy() @ gate.router.weight.detach().double().numpy().T, 0)
    assert gate(RoutingInput(x)).aux_loss.item() == pytest.approx(0.5 * relu.sum(1).mean(), rel=1e-6)
