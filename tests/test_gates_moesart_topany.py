"""MOESART and Top-any (DynMoE) against their authors' code on identical inputs and weights (issue 24). The registry
suite (``test_gates_registry.py``, ``test_engine.py``, ``test_engine_ops.py``) covers their shared contract.

* MOESART: the authors' TensorFlow gate ``SampleKSoftmaxUnbiasedWithTrimmedLassoGate`` (its ``_sampled_softmax``,
  ``biasness="small-random"``, and its trimmed-lasso loss), transcribed below op for op into torch (TensorFlow is not
  installed here); the code draws its sampled set and the unadjusted expert with ``np.random``, so the test hands it
  the set the gate drew and accepts the gate's row when it equals the code's for one choice of the unadjusted expert.
* Top-any: ``GAMoEGateT.forward``, the loss and weight lines of ``topanygating_opt`` and
  ``diverse_and_simple_gate_loss`` of github.com/LINs-lab/DynMoE at commit 49272326e794b24bbebe3a9c6df3c079b3dd887b
  (``DeepSpeed-0.9.5/deepspeed/moe/sharded_moe.py`` and ``loss.py``), verbatim but for the capacity bookkeeping and
  the all-reduce (dispatch, not routing), forward and backward.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from mtmoe.gates import GateDims, RoutingInput, create_gate
from mtmoe.random import Stream


def make(name: str, n: int, p: int, k: int = 2, **hp):
    torch.manual_seed(0)
    return create_gate(name, GateDims(in_features=p, n_experts=n, k=k), **hp).double()


# ==============================================================================================================
# MOESART
# ==============================================================================================================


def official_sampled_softmax(gate_logits: Tensor, g: Tensor, indices_mask: Tensor, random_indices_mask: Tensor | None,
                             k: int) -> Tensor:
    """``_sampled_softmax`` of the authors' TensorFlow gate with ``biasness="small-random"``; ``random_indices_mask``
    None is the deterministic (inference) branch. ``tf.where`` -> ``torch.where``, ``tf.math.log`` -> ``torch.log``."""
    gate_logits_with_neg_infs = torch.where(indices_mask == 0.0, -np.inf * torch.ones_like(gate_logits), gate_logits)
    adjusted_gate_logits = gate_logits_with_neg_infs + torch.log(indices_mask)
    if random_indices_mask is not None:
        adjusted_gate_logits = adjusted_gate_logits - torch.where(
            random_indices_mask > 0.0, torch.zeros_like(g), torch.log((k - 1) * (g + 1e-10)))
    else:
        adjusted_gate_logits = adjusted_gate_logits - torch.log(k * (g + 1e-10))
    return torch.softmax(torch.where(indices_mask == 0.0, -np.inf * torch.ones_like(adjusted_gate_logits),
                                     adjusted_gate_logits), dim=-1)


def official_trimmed_lasso(g: Tensor, k: int) -> Tensor:
    """``reduce_mean(reduce_sum(abs(g - g_topk), axis=1))`` with ``g_topk`` the top-k of ``g`` scattered (``_topk``)."""
    values, indices = torch.topk(g, k)
    g_topk = torch.zeros_like(g).scatter(1, indices, values)
    return torch.mean(torch.sum(torch.abs(g - g_topk), dim=1))


def moesart_case(train: bool, k: int = 3, seed: int = 5, **hp):
    gate = make("moesart", 6, 4, k=k, trimmed_lasso_reg=0.3, **hp).train(train)
    with torch.no_grad():
        gate.logits.bias.copy_(torch.tensor([0.5, -0.2, 0.1, 0.0, 0.3, -0.4]))
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    out = gate(RoutingInput(x, stream=Stream(torch.tensor(seed), torch.tensor(0))))
    return gate, x, out


def official_moesart(gate, x: Tensor, support: Tensor, j: Tensor | None, k: int) -> Tensor:
    gate_logits = x @ gate.logits.weight.T + gate.logits.bias
    g = torch.softmax(gate_logits, dim=1)
    random_mask = None if j is None else F.one_hot(j, g.shape[1]).to(g.dtype)
    return official_sampled_softmax(gate_logits, g, support.to(g.dtype), random_mask, k)


@pytest.mark.parametrize("k", [2, 3])
def test_moesart_training_weights_and_gradient_equal_the_authors_code(k):
    gate, x, out = moesart_case(train=True, k=k)
    support = out.weights != 0
    assert (support.sum(-1) == k).all()
    # the code's unadjusted expert j: the one (of the sampled set) for which its weights equal the gate's row
    j = torch.full((x.shape[0],), -1)
    for candidate in range(6):
        reference = official_moesart(gate, x, support, torch.full_like(j, candidate), k).detach()
        matches = support[:, candidate] & torch.isclose(reference, out.weights.detach(), rtol=1e-12, atol=0).all(-1)
        assert not (matches & (j >= 0)).any()  # one j per row
        j = torch.where(matches, candidate, j)
    assert (j >= 0).all()
    t = torch.randn(x.shape[0], 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out.weights * t).sum().backward()
    ours = gate.logits.weight.grad.clone(), gate.logits.bias.grad.clone()
    gate.zero_grad()
    (official_moesart(gate, x, support, j, k) * t).sum().backward()
    torch.testing.assert_close(ours[0], gate.logits.weight.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours[1], gate.logits.bias.grad, rtol=1e-12, atol=1e-14)
    g = (x @ gate.logits.weight.T + gate.logits.bias).softmax(-1).detach()
    assert out.aux_loss.item() == pytest.approx(0.3 * official_trimmed_lasso(g, k).item(), rel=1e-12)


def test_moesart_zero_biasness_adjusts_every_sampled_logit_as_the_authors_code():
    """``biasness="zero"`` (the PyTorch copy's default): in training every logit of the sampled set is adjusted by
    ``log(k g)``, the code's ``"zero"`` branch, which is its deterministic branch's formula on the sampled set."""
    gate, x, out = moesart_case(train=True, biasness="zero")
    support = out.weights != 0
    assert (support.sum(-1) == 3).all()
    torch.testing.assert_close(out.weights, official_moesart(gate, x, support, None, 3), rtol=1e-12, atol=0)
    assert torch.equal(support, moesart_case(train=True)[2].weights != 0)  # the same draw of S as "small-random"


def test_moesart_inference_equals_the_authors_deterministic_branch():
    gate, x, out = moesart_case(train=False)
    logits = x @ gate.logits.weight.T + gate.logits.bias
    top = torch.zeros_like(logits).scatter(1, logits.topk(3).indices, 1.0)
    torch.testing.assert_close(out.weights, official_moesart(gate, x, top, None, 3), rtol=1e-12, atol=0)
    assert out.aux_loss.item() == 0.0


def test_moesart_samples_k_experts_without_replacement_from_the_softmax():
    """k = 2 on one row repeated: P(i in S) = g_i + sum_{j != i} g_j g_i / (1 - g_j) (two successive draws), and the
    unadjusted expert is either sampled one with probability 1/2."""
    gate = make("moesart", 4, 4, k=2).train()
    with torch.no_grad():
        gate.logits.weight.copy_(torch.eye(4))
        gate.logits.bias.zero_()
    theta = torch.tensor([1.0, 0.5, 0.0, -1.0], dtype=torch.float64)
    out = gate(RoutingInput(theta.expand(40000, 4), stream=Stream(torch.tensor(3), torch.tensor(0))))
    g = theta.softmax(0).numpy()
    inclusion = g + np.array([sum(g[j] * g[i] / (1 - g[j]) for j in range(4) if j != i) for i in range(4)])
    np.testing.assert_allclose((out.weights != 0).double().mean(0).numpy(), inclusion, atol=0.01)
    # the unadjusted expert j of a row {a, b} has weight g_j / (g_j + 1) (the other logit becomes LSE(theta))
    w = out.weights.detach()
    heavier = w.argmax(-1)  # g_j / (1 + g_j) <= 1/2 <= 1 / (1 + g_j): the unadjusted expert j is the lighter one
    lighter = torch.where(w > 0, w, torch.ones_like(w)).argmin(-1)
    unadjusted_weight = w.gather(1, lighter.unsqueeze(1)).squeeze(1)
    assert torch.allclose(unadjusted_weight, torch.tensor(g, dtype=torch.float64)[lighter]
                          / (1 + torch.tensor(g, dtype=torch.float64)[lighter]), rtol=1e-9)
    pairs = {}
    for a, b in zip(heavier.tolist(), lighter.tolist()):
        key = (min(a, b), max(a, b))
        pairs.setdefault(key, []).append(b == key[0])
    for key, unadjusted_is_first in pairs.items():
        if len(unadjusted_is_first) > 2000:
            assert np.mean(unadjusted_is_first) == pytest.approx(0.5, abs=0.04), key


# ==============================================================================================================
# Top-any (DynMoE)
# ==============================================================================================================


class GAMoEGateBackward(torch.autograd.Function):  # sharded_moe.py, verbatim
    @staticmethod
    def forward(ctx: Any, scores: Tensor):
        signed_scores = torch.sign(scores)
        return signed_scores

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor):
        return grad_output


def gamoe_gate_forward(x, sim_matrix, gates, experts_mask, training):
    """``GAMoEGateT.forward`` (init_t = 1: ``logit_scale = 1``; fp32_gate off, the test runs in float64)."""
    logit_scale = 1.0
    logits = torch.sigmoid(torch.matmul(F.normalize(x, dim=1), F.normalize(sim_matrix, dim=0)) * logit_scale)
    logits = logits * experts_mask
    gates = torch.sigmoid(gates * logit_scale)
    if training:
        logits = F.relu(logits - gates)
        logits = GAMoEGateBackward.apply(logits)
        top_k = torch.sum(logits > 0, dim=1).to(torch.int)
    else:
        new_logits = F.relu(logits - gates)
        new_logits = GAMoEGateBackward.apply(new_logits)
        top_k = torch.sum(new_logits > 0, dim=1).to(torch.int)
        mask = (torch.sum(new_logits, dim=1) == 0).to(torch.int).repeat(logits.shape[1]).reshape(logits.shape[1], -1).T
        max_index = torch.argmax(logits, dim=1)
        one_hot = F.one_hot(max_index, num_classes=logits.shape[1])
        logits = mask * one_hot + new_logits
        top_k = torch.max(top_k, torch.ones(top_k.shape).to(top_k.device)).to(torch.int)
    return logits, top_k


def diverse_and_simple_gate_loss(gates, expert_mask):  # loss.py, verbatim
    sims = torch.matmul(F.normalize(gates, dim=0).T, F.normalize(gates, dim=0))
    targets = torch.eye(sims.shape[0]).to(sims.device)
    sim_mask = torch.matmul(expert_mask.unsqueeze(0).T, expert_mask.unsqueeze(0))
    sim_loss = torch.norm(sims * sim_mask - targets * sim_mask)
    simple_loss = torch.mean(torch.norm(gates, dim=0))
    return sim_loss + simple_loss


def topanygating_opt_routing(logits, K, gate_tensor, expert_mask):
    """``topanygating_opt``'s ``l_aux`` and gate lines; the combine weights summed over the capacity axis (each
    selected (sample, expert) has one location) are ``gates`` themselves."""
    gates = logits
    mask = gates.int()
    num_experts = int(gates.shape[1])
    non_zero_mask = torch.sum(gates, dim=1) > 0
    if non_zero_mask.sum() != 0:
        normalized_gates = gates[non_zero_mask]
        normalized_gates = normalized_gates / (torch.sum(normalized_gates, dim=1, keepdim=True))
        me = torch.mean(normalized_gates, dim=0)
        ce = torch.mean(mask[non_zero_mask].float(), dim=0)
        load_balance_loss = torch.mean(me * ce) * num_experts * num_experts
    else:
        load_balance_loss = 0
    efficiency_loss = torch.mean(gates)
    l_aux = diverse_and_simple_gate_loss(gate_tensor, expert_mask) + load_balance_loss + efficiency_loss
    gates = gates / torch.clamp(K, min=1).unsqueeze(1)  # the code divides in place
    return l_aux, gates


def topany_case(train: bool):
    gate = make("topany", 6, 5).train(train)
    with torch.no_grad():
        gate.thresholds.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0, 0.25, -0.05]))
    x = torch.randn(40, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return gate, x


@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
def test_topany_weights_loss_and_gradients_equal_the_authors_code(train):
    gate, x = topany_case(train)
    out = gate(RoutingInput(x))
    ones = torch.ones(6, dtype=torch.float64)
    t = torch.randn(40, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (out.weights * t).sum().add(out.aux_loss).backward()
    ours = gate.embeddings.grad.clone(), gate.thresholds.grad.clone()
    gate.zero_grad()
    logits, top_k = gamoe_gate_forward(x, gate.embeddings, gate.thresholds, ones, train)
    l_aux, weights = topanygating_opt_routing(logits, top_k, gate.embeddings, ones)
    if train:
        assert ((logits.detach().sum(1) == 0).any()), "the case must hold a sample above no threshold"
        # the code's ce is float32 (``mask.float()``, ``torch.eye``): float32 rounding in the loss and its gradient
        assert out.aux_loss.item() == pytest.approx(0.01 * l_aux.item(), rel=1e-7)
        loss = (weights * t).sum() + 0.01 * l_aux
    else:
        assert (top_k >= 1).all() and out.aux_loss.item() == 0.0
        loss = (weights * t).sum()
    torch.testing.assert_close(out.weights, weights, rtol=1e-12, atol=0)
    loss.backward()
    torch.testing.assert_close(ours[0], gate.embeddings.grad, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(ours[1], gate.thresholds.grad, rtol=1e-6, atol=1e-12)
    counts = (out.weights != 0).sum(-1)
    assert counts.min() != counts.max(), "the number of experts varies per sample"
