"""Method-specific checks of the routers from the other papers (routing-methods.md §2-7): CompeteSMoE v1/v2,
SparseMixer, Expert Choice, USMoE. The registry suite (``test_gates_registry.py``) covers their shared contract.

Hand computations use ``math`` / NumPy from the papers' formulas, not the gate code.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from mtmoe.errors import UsageError
from mtmoe.gates import GateDims, RoutingInput, create_gate
from mtmoe.gates.sparsemixer import SparseMixerWeight, sampling_mask
from mtmoe.random import Stream
from mtmoe.mmoe import MMoE
from mtmoe.permutation import LocalSearch
from mtmoe.run import translate_shortcuts


def make(name: str, n: int, p: int = 3, k: int = 2, seed: int = 0, **hp):
    torch.manual_seed(seed)
    return create_gate(name, GateDims(in_features=p, n_experts=n, k=k, expert_shape=(4,)), **hp)


def set_router_(gate, weight, bias=None) -> None:
    with torch.no_grad():
        gate.router.weight.copy_(torch.as_tensor(weight, dtype=gate.router.weight.dtype))
        if bias is not None:
            gate.router.bias.copy_(torch.as_tensor(bias, dtype=gate.router.bias.dtype))


class Features(nn.Module):
    """A shared bottom that hands the batch's ``x`` to experts and gates."""

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["x"]


class LinearExperts(nn.Sequential):
    """n linear experts of 4 outputs on 3 features, ``[B, 3] -> [B, n, 4]`` (no random draws: the stream unused)."""

    def __init__(self, n: int) -> None:
        super().__init__(nn.Linear(3, n * 4), nn.Unflatten(1, (n, 4)))

    def forward(self, h: torch.Tensor, stream=None) -> torch.Tensor:
        return super().forward(h)


def support(weights: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row).flatten().tolist()) for row in weights]


# ==============================================================================================================
# CompeteSMoE
# ==============================================================================================================

# 2 samples, 4 experts, outputs of 3 elements with known norms and softplus means
OUTPUTS = torch.tensor([
    [[3.0, 0.0, 0.0], [0.0, 0.5, 0.0], [1.0, 2.0, 2.0], [0.0, 0.0, -4.0]],  # norms 3, 0.5, 3, 4
    [[0.1, 0.1, 0.1], [2.0, 2.0, 1.0], [-1.0, 0.0, 0.0], [0.5, 0.5, 0.5]],  # norms .17, 3, 1, .87
], dtype=torch.float64)
X2 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)


def competing(name: str, **hp):
    gate = make(name, 4, k=2, competition_prob=1.0, **hp).double().train()
    with torch.no_grad():  # the router prefers experts 0 and 1 for every sample: competition must overrule it
        gate.router.weight.zero_()
        if gate.router.bias is not None:
            gate.router.bias.copy_(torch.tensor([2.0, 1.0, 0.0, -1.0]))
        else:
            gate.router.weight[:2] = 3.0
    return gate


def test_competesmoe_v1_picks_the_top_experts_by_output_norm():
    gate = competing("competesmoe")
    out = gate(RoutingInput(X2, expert_outputs=OUTPUTS))
    assert out.stats["competition"].item() == 1.0
    # norms: sample 0 (3, 0.5, 3, 4) -> experts 3 and one of the tied 0/2; sample 1 (.17, 3, 1, .87) -> 1 and 2
    top0, top1 = support(out.weights)
    assert 3 in top0 and len(top0 & {0, 2}) == 1 and top1 == {1, 2}
    e = math.exp(4.0) + math.exp(3.0)
    assert out.weights[0, 3].item() == pytest.approx(math.exp(4.0) / e)  # softmax of the kept norms (eq. 1-2)
    e = math.exp(3.0) + math.exp(1.0)
    assert out.weights[1, 1].item() == pytest.approx(math.exp(3.0) / e)
    assert out.weights[1, 2].item() == pytest.approx(math.exp(1.0) / e)


def test_competesmoe_v2_picks_by_mean_softplus_with_linear_weights():
    gate = competing("competesmoe-v2")
    out = gate(RoutingInput(X2, expert_outputs=OUTPUTS))
    softplus = lambda v: math.log1p(math.exp(v))  # noqa: E731
    s = [[sum(softplus(v) for v in expert) / 3 for expert in sample] for sample in OUTPUTS.tolist()]
    for b in range(2):
        winners = sorted(range(4), key=lambda i: -s[b][i])[:2]
        assert support(out.weights[b:b + 1])[0] == set(winners)
        total = s[b][winners[0]] + s[b][winners[1]]
        for i in winners:  # TopK_0 then linear normalisation (§2.2 step 3)
            assert out.weights[b, i].item() == pytest.approx(s[b][i] / total, rel=1e-12)


@pytest.mark.parametrize("name", ["competesmoe", "competesmoe-v2"])
def test_competition_runs_in_training_only_and_inference_uses_the_router(name):
    gate = competing(name)
    gate.eval()
    out = gate(RoutingInput(X2, expert_outputs=OUTPUTS))
    assert support(out.weights) == [{0, 1}, {0, 1}]  # the router's top-2, not the competition's
    assert out.aux_loss.item() == 0.0 and not out.stats
    assert int(gate.step) == 0  # evaluation does not advance the schedule


def test_competesmoe_v1_router_loss_is_mse_to_the_detached_competition_policy():
    gate = competing("competesmoe", router_loss_coef=0.3)
    outputs = OUTPUTS.clone().requires_grad_()
    out = gate(RoutingInput(X2, expert_outputs=outputs))
    logits = (X2 @ gate.router.weight.T + gate.router.bias).detach()
    router = torch.zeros(2, 4, dtype=torch.float64)
    router[:, :2] = logits[:, :2].softmax(-1)  # the router's top-2 (experts 0, 1) softmax
    expected = 0.3 * ((router - out.weights.detach()) ** 2).mean()
    assert out.aux_loss.item() == pytest.approx(expected.item(), rel=1e-12)
    (grad_outputs,) = torch.autograd.grad(out.aux_loss, outputs, retain_graph=True, allow_unused=True)
    assert grad_outputs is None  # target detached: the router loss has no path to the experts' outputs
    out.aux_loss.backward()
    assert (gate.router.bias.grad != 0).any()  # ... and it does train the router
    full = competing("competesmoe", router_loss_coef=0.3, distill="code")
    out = full(RoutingInput(X2, expert_outputs=OUTPUTS))  # the authors' code: full softmax of the router logits
    expected = 0.3 * ((logits.softmax(-1) - out.weights.detach()) ** 2).mean()
    assert out.aux_loss.item() == pytest.approx(expected.item(), rel=1e-12)


def test_competesmoe_v2_distillation_and_diversity_losses_by_hand():
    gate = competing("competesmoe-v2", distill_coef=0.5, winner_weight=0.2, diversity_coef=0.7)
    outputs = OUTPUTS.clone().requires_grad_()
    out = gate(RoutingInput(X2, expert_outputs=outputs))
    w_c = out.weights.detach().numpy()
    logits = (X2 @ gate.router.weight.T).detach().numpy()
    router = np.zeros((2, 4))
    for b in range(2):
        top = np.argsort(-logits[b])[:2]
        router[b, top] = np.exp(logits[b, top]) / np.exp(logits[b, top]).sum()
    winners = [np.flatnonzero(row) for row in w_c]
    distill = ((router - w_c) ** 2).mean() + 0.2 * np.mean([((w_c[b] - router[b])[winners[b]] ** 2).mean()
                                                             for b in range(2)])
    o = OUTPUTS.numpy()
    cosines = [o[b, i] @ o[b, j] / np.linalg.norm(o[b, i]) / np.linalg.norm(o[b, j]) for b, (i, j) in
               enumerate(winners)]
    diversity = np.mean(cosines)  # K = 2: the two off-diagonal entries are equal, mean over K(K-1) = 2
    assert out.stats["distill_loss"].item() == pytest.approx(distill, rel=1e-12)
    assert out.stats["diversity_loss"].item() == pytest.approx(diversity, rel=1e-12)
    assert out.aux_loss.item() == pytest.approx(0.5 * distill + 0.7 * diversity, rel=1e-12)
    # the diversity loss (and only it) reaches the winners' outputs
    (grad_outputs,) = torch.autograd.grad(out.aux_loss, outputs)
    for b in range(2):
        losers = sorted(set(range(4)) - set(winners[b]))
        assert (grad_outputs[b, losers] == 0).all() and (grad_outputs[b, winners[b]] != 0).any()


@pytest.mark.parametrize("name", ["competesmoe", "competesmoe-v2"])
def test_competition_output_false_keeps_the_router_weights(name):
    gate = competing(name, competition_output=False)
    out = gate(RoutingInput(X2, expert_outputs=OUTPUTS))
    assert out.stats["competition"].item() == 1.0 and out.aux_loss.item() > 0
    assert support(out.weights) == [{0, 1}, {0, 1}]


@pytest.mark.parametrize("name", ["competesmoe", "competesmoe-v2"])
def test_competition_schedule_is_bernoulli_seeded_shared_and_checkpointed(name):
    def draws(gate, steps):
        x = RoutingInput(torch.randn(3, 3), expert_outputs=torch.randn(3, 5, 4))
        return [gate(x).stats["competition"].item() for _ in range(steps)]

    first = make(name, 5, competition_prob=0.2, seed=0, **({"warmup": 0.0} if name.endswith("v2") else {})).train()
    second = make(name, 5, competition_prob=0.2, seed=0, **({"warmup": 0.0} if name.endswith("v2") else {})).train()
    a = draws(first, 200)
    assert a == draws(second, 200)  # one coin per step for all task gates of a model (same run seed)
    assert abs(sum(a) - 40) < 4 * math.sqrt(200 * 0.2 * 0.8)  # Bernoulli(0.2): 40 +- 4 sd
    other = make(name, 5, competition_prob=0.2, seed=1).train()
    assert draws(other, 200) != a  # another run seed, another schedule
    resumed = make(name, 5, competition_prob=0.2, seed=9).train()
    state = make(name, 5, competition_prob=0.2, seed=0).train()
    draws(state, 80)
    resumed.load_state_dict(state.state_dict())  # seed and step travel with the checkpoint
    assert draws(resumed, 120) == a[80:]


def test_competesmoe_v2_warmup_is_a_fraction_of_the_planned_run():
    gate = make("competesmoe-v2", 5, competition_prob=1.0, warmup=0.05).train()
    gate.set_training_steps(200)  # 5% of 200 forward passes: 10 plain Top-K steps first
    x = RoutingInput(torch.randn(3, 3), expert_outputs=torch.randn(3, 5, 4))
    assert [gate(x).stats["competition"].item() for _ in range(12)] == [0.0] * 10 + [1.0] * 2


def test_competesmoe_has_no_local_search_variant():
    with pytest.raises(UsageError, match="no local-search"):
        translate_shortcuts(["--gate", "competesmoe-v2+"])
    gates = [make("competesmoe", 4) for _ in range(2)]
    with pytest.raises(UsageError, match="no local-search"):
        MMoE(nn.Identity(), nn.Identity(), gates, [nn.Identity(), nn.Identity()], LocalSearch(4, 2))
    translate_shortcuts(["--gate", "usmoe+"])  # the batch-level and SparseMixer routers have one


# ==============================================================================================================
# SparseMixer
# ==============================================================================================================


def sparsemixer_on_identity(**hp):
    """n = p = 3 and W = I, so the logits are x itself."""
    gate = make("sparsemixer", 3, p=3, balance_coef=0.0, **hp).double()
    set_router_(gate, np.eye(3))
    return gate


THETA = torch.tensor([[2.0, 1.9, -1.0]], dtype=torch.float64)


def test_sampling_mask_is_eq_9():
    # theta* = 2: kept iff 2 - theta <= 0.1 (2 + |theta|): 1.9 (0.1 <= 0.39), 1.7 (0.3 <= 0.37), 1.64 (0.36 <= 0.364);
    # masked: 1.6 (0.4 > 0.36) and -1 (3 > 0.3)
    logits = torch.tensor([[2.0, 1.9, -1.0, 1.7, 1.64, 1.6]], dtype=torch.float64)
    assert sampling_mask(logits, 0.1).tolist() == [[True, True, False, True, True, False]]
    assert sampling_mask(torch.zeros(1, 4), 0.1).all()  # equal logits: nothing masked
    removed = torch.tensor([[float("-inf"), 1.0, 0.95]])
    assert sampling_mask(removed, 0.1).tolist() == [[False, True, True]]


def test_sparsemixer_gradient_equals_the_hand_computed_estimator():
    """theta = (2, 1.9, -1): mask keeps experts 0, 1 with pi = (e^.1, 1) / (e^.1 + 1) = (0.52498, 0.47502).

    Loss L = sum_i t_i w_i with t = (1, -2, 5). For a sampled D the weight is c pi_D and the router gradient is
    dL/dtheta = 2 t_D pi_D (e_D - pi) (SM §3.3-4.2, authors' SparseMixerCore), W = I so dL/dW = outer(., x):
      D = 0 (argmax, Euler, c = 1):     2 * 1 * pi0 * (1 - pi0, -pi1, 0) = (0.49875, -0.49875, 0)
      D = 1 (mid-point, c = 1/2):       2 * -2 * pi1 * (-pi0, 1 - pi1, 0) = (0.99750, -0.99750, 0)
    """
    pi0 = math.exp(0.1) / (math.exp(0.1) + 1)
    pi1 = 1 - pi0
    expected = {0: (pi0, 2 * 1 * pi0 * np.array([1 - pi0, -pi1, 0.0])),
                1: (pi1 / 2, 2 * -2 * pi1 * np.array([-pi0, 1 - pi1, 0.0]))}
    assert expected[0][1] == pytest.approx([0.498752, -0.498752, 0], abs=1e-6)
    assert expected[1][1] == pytest.approx([0.997504, -0.997504, 0], abs=1e-6)
    t = torch.tensor([[1.0, -2.0, 5.0]], dtype=torch.float64)
    seen = set()
    for seed in range(40):
        gate = sparsemixer_on_identity(midpoint_prob=1.0).train()
        out = gate(RoutingInput(THETA, stream=Stream(torch.tensor(seed), torch.tensor(0))))
        chosen = int(out.weights.argmax())
        assert chosen in (0, 1)  # expert 2 is masked: never sampled
        (out.weights * t).sum().backward()
        weight, grad_theta = expected[chosen]
        assert out.weights[0, chosen].item() == pytest.approx(weight, rel=1e-12)
        np.testing.assert_allclose(gate.router.weight.grad.numpy(), np.outer(grad_theta, THETA[0].numpy()),
                                   rtol=1e-12, atol=1e-15)
        seen.add(chosen)
    assert seen == {0, 1}


def test_sparsemixer_weight_function_doubles_the_gradient_and_scales_the_forward():
    p = torch.tensor([0.3, 0.6], requires_grad=True)
    scale = torch.tensor([1.0, 0.5])
    out = SparseMixerWeight.apply(p, scale)
    assert out.tolist() == pytest.approx([0.3, 0.3])  # mid-point forward is half the Euler value
    out.backward(torch.tensor([1.0, 1.0]))
    assert p.grad.tolist() == [2.0, 2.0]  # twice dL/d(c pi), whatever c (ordinary autograd: 1.0 and 0.5)


@pytest.mark.parametrize("midpoint_prob, halved", [(1.0, 1.0), (0.0, 0.0), (0.5, 0.5)])
def test_sparsemixer_midpoint_only_off_the_argmax_with_its_probability(midpoint_prob, halved):
    gate = sparsemixer_on_identity(midpoint_prob=midpoint_prob).train()
    x = THETA.expand(4000, 3)
    w = gate(RoutingInput(x, stream=Stream(torch.tensor(0), torch.tensor(0)))).weights.detach()
    pi0 = math.exp(0.1) / (math.exp(0.1) + 1)
    on_argmax = w[:, 0] > 0
    assert torch.allclose(w[on_argmax, 0], torch.tensor(pi0, dtype=torch.float64))  # Euler on the argmax, always
    off = w[~on_argmax, 1]
    assert (w[:, 2] == 0).all()
    fraction_halved = (off < 0.3).double().mean().item()  # pi1 / 2 = 0.2375 vs pi1 = 0.475
    assert fraction_halved == pytest.approx(halved, abs=0.05)
    assert on_argmax.double().mean().item() == pytest.approx(pi0, abs=0.03)  # D ~ masked softmax


def test_sparsemixer_eval_takes_the_masked_argmax_at_full_weight():
    gate = sparsemixer_on_identity().eval()
    out = gate(RoutingInput(THETA))
    pi0 = math.exp(0.1) / (math.exp(0.1) + 1)
    assert out.weights[0].tolist() == pytest.approx([pi0, 0.0, 0.0])
    assert out.aux_loss.item() == 0.0


def test_sparsemixer_top2_extension_repeats_the_masked_choice_without_the_first():
    gate = sparsemixer_on_identity(top_k=2).eval()
    x = torch.tensor([[2.0, 1.9, 1.8], [2.0, 1.0, 1.9]], dtype=torch.float64)
    w = gate(RoutingInput(x)).weights.detach()
    # sample 0: all kept, pi = softmax(2, 1.9, 1.8) -> expert 0; then against 1.9 both 1.9 and 1.8 kept -> expert 1
    p = np.exp([2.0, 1.9, 1.8]) / np.exp([2.0, 1.9, 1.8]).sum()
    q = np.exp(1.9) / (np.exp(1.9) + np.exp(1.8))
    np.testing.assert_allclose(w[0].numpy(), [p[0], q, 0.0], rtol=1e-12)
    # sample 1: 1.0 is masked in round 1 (1.0 > 0.1 * 3); round 2 against 1.9: 1.0 still masked (0.9 > 0.29)
    p = np.exp(2.0) / (np.exp(2.0) + np.exp(1.9))
    np.testing.assert_allclose(w[1].numpy(), [p, 0.0, 1.0], rtol=1e-12)  # weights not renormalised


def test_sparsemixer_balance_loss_counts_sampled_experts_against_the_masked_softmax():
    gate = make("sparsemixer", 3, p=3, balance_coef=0.01).double().train()
    set_router_(gate, np.eye(3))
    x = torch.tensor([[2.0, 1.9, -1.0], [0.0, 5.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    out = gate(RoutingInput(x, stream=Stream(torch.tensor(3), torch.tensor(0))))
    chosen = out.weights.argmax(-1)
    pi = np.array([[math.exp(0.1) / (math.exp(0.1) + 1), 1 / (math.exp(0.1) + 1), 0.0], [0, 1, 0], [1 / 3] * 3])
    f = np.bincount(chosen.numpy(), minlength=3) / 3
    assert out.stats["balance_loss"].item() == pytest.approx(3 * (f * pi.mean(0)).sum(), rel=1e-12)
    assert out.aux_loss.item() == pytest.approx(0.01 * out.stats["balance_loss"].item(), rel=1e-12)
    assert out.stats["unmasked_experts"].item() == pytest.approx((2 + 1 + 3) / 3)


def test_sparsemixer_output_scale_multiplies_the_task_mixture_in_mmoe():
    """MMoE applies omega element-wise to its task's mixture; without ``output_scale`` there is no omega."""
    torch.manual_seed(0)
    experts = LinearExperts(3)
    gates = [make("sparsemixer", 3, p=3) for _ in range(2)]
    with torch.no_grad():
        gates[0].omega.copy_(torch.tensor([1.0, 2.0, -1.0, 0.5]))
    model = MMoE(Features(), experts, gates, [nn.Identity(), nn.Identity()]).eval()
    x = torch.randn(5, 3)
    output = model({"x": x})
    expert_outputs = experts(x)
    for t in range(2):
        mixture = torch.einsum("bn,bnd->bd", output.gates[t].weights, expert_outputs)
        torch.testing.assert_close(output.predictions[t], mixture * gates[t].omega)
    plain = make("sparsemixer", 3, p=3, output_scale=False)
    assert plain.omega is None and plain.eval()(RoutingInput(torch.randn(2, 3))).output_scale is None
    with pytest.raises(UsageError, match="expert_shape"):
        create_gate("sparsemixer", GateDims(in_features=3, n_experts=3))
    with pytest.raises(UsageError, match="top_k"):
        make("sparsemixer", 3, top_k=3)


# ==============================================================================================================
# Expert Choice
# ==============================================================================================================


@pytest.mark.parametrize("b, n, k, capacity", [(16, 8, 2, 4), (10, 4, 1, 2), (3, 8, 2, 1), (1, 5, 2, 1), (7, 3, 3, 7)])
def test_expert_choice_each_expert_takes_exactly_its_capacity(b, n, k, capacity):
    """C = clamp(floor(B k / N), 1, B); each expert's column holds its C highest affinities, raw."""
    gate = make("expertchoice", n, p=3, k=k).double().train()
    x = torch.randn(b, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(b * n))
    assert gate.capacity(b) == capacity
    w = gate(RoutingInput(x)).weights.detach()
    affinity = (x @ gate.router.weight.T + gate.router.bias).softmax(-1).detach()
    assert ((w != 0).sum(0) == capacity).all()
    for i in range(n):
        chosen = set(torch.nonzero(w[:, i]).flatten().tolist())
        assert chosen == set(affinity[:, i].argsort(descending=True)[:capacity].tolist())
        assert torch.equal(w[list(chosen), i], affinity[list(chosen), i])
    assert (w.sum(-1) <= 1 + 1e-12).all()


def test_expert_choice_can_leave_a_sample_without_experts_and_eval_policy_sample_cannot():
    gate = make("expertchoice", 4, p=2, k=1).double()
    set_router_(gate, [[3.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], [0.0] * 4)
    x = torch.tensor([[5.0, 0.0], [4.0, 0.0], [3.0, 0.0], [2.0, 0.0], [1.0, 0.0], [-0.5, 0.0], [-1.0, 0.0],
                      [-2.0, 0.0]], dtype=torch.float64)
    w = gate.eval()(RoutingInput(x)).weights
    # C = floor(8 * 1 / 4) = 2: expert 0 (affinity rising with x) takes samples 0, 1; experts 1-3 (falling) all
    # take 6, 7; samples 2-5 get no expert at all
    assert support(w) == [{0}, {0}, set(), set(), set(), set(), {1, 2, 3}, {1, 2, 3}]
    per_sample = make("expertchoice", 4, p=2, k=1, eval_policy="sample").double().eval()
    per_sample.load_state_dict(gate.state_dict())
    w = per_sample(RoutingInput(x)).weights
    assert ((w != 0).sum(-1) == 1).all()
    affinity = (x @ gate.router.weight.T + gate.router.bias).softmax(-1)
    torch.testing.assert_close(w.max(-1).values, affinity.max(-1).values)  # raw top-1 affinity, not renormalised
    assert not per_sample.batch_dependent and gate.batch_dependent
    per_sample.train()  # training stays batch-level under either policy
    assert ((per_sample(RoutingInput(x)).weights != 0).sum(0) == 2).all()


# ==============================================================================================================
# USMoE
# ==============================================================================================================


def usmoe_reference(logits: np.ndarray, alpha: float, k: float, rescale: bool) -> np.ndarray:
    b, n = logits.shape
    s_t = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    s_e = np.exp(logits) / np.exp(logits).sum(0, keepdims=True) * (b / n if rescale else 1.0)
    u = (alpha * s_e + (1 - alpha) * s_t).ravel()
    top = np.argsort(-u, kind="stable")[: int(math.floor(k * b))]
    w = np.zeros_like(u)
    w[top] = u[top]
    return w.reshape(b, n)


@pytest.mark.parametrize("alpha, k, rescale", [(0.5, 1.5, False), (0.3, 2, True), (0.0, 1, False), (1.0, 2, False)])
def test_usmoe_selects_the_top_pairs_of_the_unified_score(alpha, k, rescale):
    b, n = 10, 4
    gate = make("usmoe", n, p=3, k=k, alpha=alpha, rescale_expert_choice=rescale).double().train()
    x = torch.randn(b, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    logits = (x @ gate.router.weight.T + gate.router.bias).detach().numpy()
    w = gate(RoutingInput(x)).weights.detach()
    assert int((w != 0).sum()) == math.floor(k * b) == gate.active_per_batch(b)
    np.testing.assert_allclose(w.numpy(), usmoe_reference(logits, alpha, k, rescale), rtol=1e-12, atol=0)
    if alpha == 0.0:  # token choice over the batch: the budget goes to the most confident (sample, expert) pairs
        assert int((w != 0).sum(0).max()) <= b
    if alpha == 1.0:  # expert choice scores: every column sums to 1 before selection
        assert (w.sum(0) <= 1 + 1e-12).all()


def test_usmoe_eval_policy_sample_is_the_batch_of_one_case():
    gate = make("usmoe", 5, p=3, k=2.5, alpha=0.4).double().eval()
    x = torch.randn(6, 3, dtype=torch.float64)
    per_sample = make("usmoe", 5, p=3, k=2.5, alpha=0.4, eval_policy="sample").double().eval()
    per_sample.load_state_dict(gate.state_dict())
    w = per_sample(RoutingInput(x)).weights
    one_by_one = torch.cat([gate(RoutingInput(x[b:b + 1])).weights for b in range(6)])
    torch.testing.assert_close(w, one_by_one)  # s_e = 1 for a batch of one
    assert ((w != 0).sum(-1) == 2).all() and per_sample.max_active() == 2  # floor(k) experts
    s_t = (x @ gate.router.weight.T + gate.router.bias).softmax(-1)
    torch.testing.assert_close(w.max(-1).values, 0.4 + 0.6 * s_t.max(-1).values)
    assert (w.sum(-1) > 1).all()  # raw unified scores: rows are not on the simplex
