"""Paper-specific gate checks (COMET, KDD'23: eq. (3), Prop. 3.1, Appendices A and C; comet-protocol.md §2, §9).

Hand computations are float64 NumPy references written from the formulas, not from the gate code. They use the
documented parameter layouts: COMET split unit ``q * k + j`` is split node ``q`` of tree ``j`` and leaf unit
``i * k + j`` is expert ``i`` of tree ``j``; DSelect-k selector unit ``j * m + t`` is bit ``t`` (MSB first) of
selector ``j``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mtmoe.gates import GateDims, RoutingInput, create_gate
from mtmoe.gates.dselect_k import binary_codes
from mtmoe.gates.smooth_step import smooth_step
from mtmoe.random import Stream


def np_smooth_step(t: np.ndarray, gamma: float) -> np.ndarray:
    cubic = -2.0 / gamma**3 * t**3 + 1.5 / gamma * t + 0.5
    return np.where(t <= -gamma / 2, 0.0, np.where(t >= gamma / 2, 1.0, cubic))


def set_linear_(layer: torch.nn.Linear, weight, bias=None) -> None:
    with torch.no_grad():
        layer.weight.copy_(torch.as_tensor(weight, dtype=layer.weight.dtype))
        if bias is not None:
            layer.bias.copy_(torch.as_tensor(bias, dtype=layer.bias.dtype))


def t64(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float64))


# ==============================================================================================================
# smooth-step (Appendix A, eq. (9))
# ==============================================================================================================

GAMMAS = [0.1, 1.0, 3.0]


@pytest.mark.parametrize("gamma", GAMMAS)
def test_smooth_step_exact_zero_and_one_outside(gamma):
    half = gamma / 2
    t = torch.tensor([-1e6, -10 * gamma, -half - 1e-3, -half, half, half + 1e-3, 10 * gamma, 1e6])
    s = smooth_step(t, gamma)
    assert torch.equal(s[:4], torch.zeros(4))
    assert torch.equal(s[4:], torch.ones(4))
    assert smooth_step(torch.tensor(0.0), gamma).item() == 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smooth_step_and_safe_log_with_scalar_branches_equal_filled_tensors(dtype):
    """``torch.where`` with scalar branches (no pass writing a filled tensor) computes what it computed with
    ``zeros_like``/``ones_like``/``full_like`` branches: values and gradients bitwise, in float32 and bfloat16."""
    from mtmoe.gates.base import safe_log
    from mtmoe.scalars import cast

    def filled_smooth_step(t, gamma):
        gamma = torch.tensor(gamma, dtype=torch.float64)
        half = cast(gamma / 2.0, t)
        inner = torch.minimum(torch.maximum(t, -half), half)
        cubic = cast(-2.0 / gamma**3, t) * inner**3 + cast(1.5 / gamma, t) * inner + 0.5
        return torch.where(t <= -half, torch.zeros_like(t), torch.where(t >= half, torch.ones_like(t), cubic))

    def filled_safe_log(v, eps):
        positive = v > 0
        safe_v = torch.where(positive, v, torch.ones_like(v))
        return torch.where(positive, torch.log(safe_v + eps), torch.full_like(v, torch.finfo(v.dtype).min))

    t = (torch.randn(999, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)
    for ours, theirs in ((lambda x: smooth_step(x, 1.0), lambda x: filled_smooth_step(x, 1.0)),
                         (lambda x: safe_log(x, 1e-8), lambda x: filled_safe_log(x, 1e-8))):
        results = []
        for f in (ours, theirs):
            x = t.clone().requires_grad_()
            out = f(x)
            (out.float() * torch.linspace(-1, 1, 999)).sum().backward()
            results.append((out.detach(), x.grad))
        assert results[0][0].dtype == dtype
        for a, b in zip(*results):
            assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("gamma", GAMMAS)
def test_smooth_step_matches_formula_inside_and_is_monotone(gamma):
    t = torch.linspace(-gamma, gamma, 2001, dtype=torch.float64)
    s = smooth_step(t, gamma)
    np.testing.assert_allclose(s.numpy(), np_smooth_step(t.numpy(), gamma), rtol=0, atol=1e-15)
    assert (s.diff() >= 0).all()
    inner = (t.abs() < gamma / 2 - 1e-9)
    assert (s[inner].diff() > 0).all()  # strictly increasing inside


@pytest.mark.parametrize("gamma", GAMMAS)
def test_smooth_step_is_c1_at_the_boundaries(gamma):
    half = gamma / 2
    for eps in (1e-3, 1e-5, 1e-7):
        t = torch.tensor([-half + eps * gamma, half - eps * gamma], dtype=torch.float64, requires_grad=True)
        s = smooth_step(t, gamma)
        (grad,) = torch.autograd.grad(s.sum(), t)
        # value continuity: inside values approach 0 and 1
        assert abs(s[0].item()) < 10 * eps and abs(s[1].item() - 1) < 10 * eps
        # derivative from inside approaches 0, matching the flat outside (S'(+-(gamma/2 - d)) = 6 d / gamma^2 - ...)
        assert (grad.abs() < 10 * eps / gamma).all(), grad
        assert (grad > 0).all()
    # numeric derivative straddling the boundary is ~0 as well
    h = 1e-6 * gamma
    for b in (-half, half):
        tt = torch.tensor([b - h, b + h], dtype=torch.float64)
        ss = smooth_step(tt, gamma)
        assert abs((ss[1] - ss[0]).item() / (2 * h)) < 10 * h / gamma**2  # O(h) for a C^1 join, O(1) for a kink
    # and the derivative at 0 is the cubic's 3 / (2 gamma)
    t0 = torch.zeros((), dtype=torch.float64, requires_grad=True)
    (g0,) = torch.autograd.grad(smooth_step(t0, gamma), t0)
    assert g0.item() == pytest.approx(1.5 / gamma)


@pytest.mark.parametrize("dtype,big", [(torch.float32, 1e20), (torch.float16, 300.0), (torch.bfloat16, 1e20)])
def test_smooth_step_gradient_finite_for_huge_inputs(dtype, big):
    """Regression: the unused cubic branch overflowed (t**3) and torch.where turned 0 * inf into NaN gradients."""
    t = torch.tensor([-big, big, 0.25], dtype=dtype, requires_grad=True)
    s = smooth_step(t, 1.0)
    s.sum().backward()
    assert torch.isfinite(t.grad).all(), t.grad
    assert t.grad[0].item() == 0.0 and t.grad[1].item() == 0.0
    assert s[0].item() == 0.0 and s[1].item() == 1.0


# ==============================================================================================================
# COMET (Section 3, eq. (3), Prop. 3.1, Appendix C)
# ==============================================================================================================


def comet(n: int, k: int, p: int = 2, seed: int = 0, **hp):
    torch.manual_seed(seed)
    return create_gate("comet", GateDims(in_features=p, n_experts=n, k=k), **hp)


def comet_depths(n: int) -> list[int]:
    """Leaf depths read off the gate itself: with every split at h = 0.5 and equal leaf logits, g_i = 2^-depth_i."""
    gate = comet(n, k=1).eval().double()
    with torch.no_grad():
        for p in gate.parameters():
            p.zero_()
    g = gate(RoutingInput(torch.randn(3, 2, dtype=torch.float64))).weights
    depths = -torch.log2(g)
    assert torch.allclose(depths, depths.round(), atol=1e-9)
    assert torch.equal(depths[0], depths[1])
    return [int(d) for d in depths[0].round()]


def test_comet_leaf_depths_n5_in_order():
    # In-order (left-to-right) numbering of heap leaves: nodes 7, 8, 4, 5, 6 are experts 0..4 (comet-protocol.md
    # §2.5, checked there against the official layer). §9.1 #18 claims [2, 2, 2, 3, 3], which contradicts its own
    # §2.5 numbering; we follow §2.5.
    assert comet_depths(5) == [3, 3, 2, 2, 2]
    assert comet_depths(3) == [2, 2, 1]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8, 9, 16])
def test_comet_depth_profile_matches_appendix_c(n):
    depths = comet_depths(n)
    d = math.ceil(math.log2(n))
    if n == 2**d:
        assert depths == [d] * n
    else:  # 2^d - n leaves at depth d - 1 and 2n - 2^d at depth d
        assert depths.count(d - 1) == 2**d - n
        assert depths.count(d) == 2 * n - 2**d
        assert sorted(depths, reverse=True) == depths  # deepest leaves on the left (heap order)
    assert sum(2.0**-x for x in depths) == 1.0


@pytest.mark.parametrize("direction,expert", [(+10.0, 0), (-10.0, 4)])
def test_comet_leaf_order_all_left_all_right(direction, expert):
    gate = comet(5, k=2).eval()
    with torch.no_grad():
        gate.split.weight.zero_()
        gate.split.bias.fill_(direction)  # h = 1 routes left, h = 0 routes right
    w = gate(RoutingInput(torch.randn(4, 2))).weights
    one_hot = torch.nn.functional.one_hot(torch.full((4,), expert), 5).float()
    torch.testing.assert_close(w, one_hot)
    assert torch.equal(w != 0, one_hot != 0)  # exact zeros on every other expert


def test_comet_leaf_order_mixed_path():
    # n = 5: root left (node 1), node 1 right -> leaf node 4 = expert 2; root right (node 2), node 2 left -> leaf
    # node 5 = expert 3. Split unit q * k + j with k = 1.
    gate = comet(5, k=1).eval()
    with torch.no_grad():
        gate.split.weight.zero_()
        gate.split.bias.copy_(torch.tensor([10.0, -10.0, 0.0, 0.0]))
    assert gate(RoutingInput(torch.randn(2, 2))).weights.argmax(-1).tolist() == [2, 2]
    with torch.no_grad():
        gate.split.bias.copy_(torch.tensor([-10.0, 0.0, 10.0, 0.0]))
    assert gate(RoutingInput(torch.randn(2, 2))).weights.argmax(-1).tolist() == [3, 3]


# hand-set parameters, p = 2, n = 3, k = 2; split logits stay inside the soft region for gamma = 1
X_HAND = np.array([[0.3, -0.2], [1.0, 0.5], [-0.7, 0.4], [0.0, 0.0]])
WS_HAND = np.array([[0.2, -0.1], [0.05, 0.3], [-0.25, 0.1], [0.1, 0.1]])  # units: (q0,j0) (q0,j1) (q1,j0) (q1,j1)
BS_HAND = np.array([0.05, -0.1, 0.02, 0.15])
WL_HAND = np.array([[0.5, -0.3], [0.1, 0.2], [-0.4, 0.6], [0.3, 0.3], [0.0, -0.5], [0.7, 0.1]])  # (i, j) -> i*2+j
BL_HAND = np.array([0.1, -0.2, 0.3, 0.0, -0.1, 0.2])


def comet_reference_n3_k2(x, ws, bs, wl, bl, gamma, entropy_reg):
    """Eq. (3) for n = 3 by hand: in-order leaves are (root L, node1 L), (root L, node1 R), (root R)."""
    t = (x @ ws.T + bs).reshape(-1, 2, 2)  # [B, node, tree]
    h = np_smooth_step(t, gamma)
    h0, h1 = h[:, 0, :], h[:, 1, :]  # [B, tree]
    v = np.stack([h0 * h1, h0 * (1 - h1), 1 - h0], axis=1)  # [B, expert, tree]
    alpha = (x @ wl.T + bl).reshape(-1, 3, 2)  # [B, expert, tree]
    num = (np.exp(alpha) * v).sum(axis=2)  # sum over trees
    g = num / num.sum(axis=1, keepdims=True)
    entropy = -(v * np.log(v + 1e-6)).sum(axis=(1, 2))  # per sample: sum over trees and leaves
    return g, v, entropy_reg * entropy.mean()


@pytest.mark.parametrize("gamma", [1.0, 2.0])
def test_comet_matches_hand_computation(gamma):
    gate = comet(3, k=2, entropy_reg=0.3, gamma=gamma).double()
    set_linear_(gate.split, WS_HAND, BS_HAND)
    set_linear_(gate.leaf, WL_HAND, BL_HAND)
    g_ref, v_ref, aux_ref = comet_reference_n3_k2(X_HAND, WS_HAND, BS_HAND, WL_HAND, BL_HAND, gamma, 0.3)
    assert (v_ref > 0).all() and (v_ref < 1).all()  # soft regime: every leaf reached
    gate.train()
    out = gate(RoutingInput(t64(X_HAND)))
    np.testing.assert_allclose(out.weights.detach().numpy(), g_ref, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(gate.reach(t64(X_HAND)).detach().numpy(), v_ref.transpose(0, 2, 1), atol=1e-12)
    # entropy regulariser: lambda * mean_b sum_j -sum_l v log(v + 1e-6), training only
    assert out.aux_loss.item() == pytest.approx(aux_ref, rel=1e-10)
    assert out.stats["entropy"].item() == pytest.approx(aux_ref / 0.3, rel=1e-10)
    gate.eval()
    out_eval = gate(RoutingInput(t64(X_HAND)))
    assert out_eval.aux_loss.item() == 0.0
    torch.testing.assert_close(out_eval.weights, out.weights.detach())


@pytest.mark.parametrize("n,k", [(5, 2), (5, 3), (8, 3), (9, 4), (3, 3)])
def test_comet_proposition_3_1(n, k):
    """One-hot reach for every tree => g on the simplex, ||g||_0 <= k, g = softmax of the selected leaf logits."""
    gate = comet(n, k, p=3, seed=n * 10 + k).eval().double()
    with torch.no_grad():
        gate.split.weight.normal_(0, 1e6)  # huge split logits: hard routing, varying with x
        gate.split.bias.normal_(0, 1e6)
        gate.leaf.weight.normal_(0, 1.0)
        gate.leaf.bias.normal_(0, 1.0)
    x = torch.randn(32, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
    v = gate.reach(x)  # [B, k, n]
    assert ((v == 0) | (v == 1)).all() and torch.equal(v.sum(-1), torch.ones_like(v.sum(-1)))  # precondition
    selected = v.argmax(-1)  # [B, k]: the expert picked by each tree
    alpha = (x @ gate.leaf.weight.T + gate.leaf.bias).view(-1, n, k)  # [B, expert, tree]
    expected = torch.zeros(32, n, dtype=torch.float64)
    for b in range(32):
        logits = torch.stack([alpha[b, selected[b, j], j] for j in range(k)])
        expected[b].index_add_(0, selected[b], logits.softmax(0))
    g = gate(RoutingInput(x)).weights.detach()
    torch.testing.assert_close(g, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g.sum(-1), torch.ones(32, dtype=torch.float64))
    active = (g != 0).sum(-1)
    assert (active <= k).all()
    # exact zeros: the support is exactly the set of experts the trees picked
    for b in range(32):
        assert set(torch.nonzero(g[b]).flatten().tolist()) == set(selected[b].tolist())
    assert len({tuple(s) for s in selected.tolist()}) > 1  # routing really depends on x


def test_comet_exact_zeros_once_saturated_from_default_init():
    gate = comet(8, k=2, p=4).eval()
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    assert (gate(RoutingInput(x)).weights > 0).all()  # dense at initialisation (dense-to-sparse training)
    with torch.no_grad():
        gate.split.weight.mul_(1e6)
        gate.split.bias.mul_(1e6)
    v = gate.reach(x)
    assert ((v == 0) | (v == 1)).all()
    w = gate(RoutingInput(x)).weights
    assert ((w == 0).sum(-1) >= 8 - 2).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(16), atol=1e-6, rtol=0)


def test_comet_safe_log_keeps_gradients_finite_with_unreachable_leaves():
    """Root saturated (right subtree unreachable, v = 0 there) while the splits below stay soft: log(0) must not
    leak 0 * inf = NaN into the soft splits' gradients (comet-protocol.md §9.4, double where)."""
    gate = comet(5, k=2, p=2, entropy_reg=1.0).train()
    with torch.no_grad():
        gate.split.bias[:2] = 10.0  # node 0 of both trees: h = 1, everything goes left
    x = torch.randn(6, 2)
    v = gate.reach(x)
    assert (v[:, :, 3:] == 0).all() and (v[:, :, :3] > 0).all()  # experts 3, 4 unreachable; 0..2 soft
    out = gate(RoutingInput(x))
    assert (out.weights[:, 3:] == 0).all()
    ((out.weights * torch.randn_like(out.weights)).sum() + out.aux_loss).backward()
    for p in gate.parameters():
        assert torch.isfinite(p.grad).all()
    assert (gate.split.weight.grad[2:4] != 0).any()  # node 1 (soft, reachable) still learns


def test_comet_entropy_is_training_only_and_zero_when_saturated():
    gate = comet(5, k=2, entropy_reg=2.0).double().train()
    x = torch.randn(6, 2, dtype=torch.float64)
    assert gate(RoutingInput(x)).aux_loss.item() > 0
    with torch.no_grad():
        gate.split.weight.zero_()
        gate.split.bias.fill_(5.0)
    out = gate(RoutingInput(x))
    # one-hot reach: -1 log(1 + 1e-6) per tree, ~ -1e-6 each
    assert out.aux_loss.item() == pytest.approx(2.0 * 2 * -math.log(1 + 1e-6), rel=1e-4)
    assert gate.eval()(RoutingInput(x)).aux_loss.item() == 0.0


@pytest.mark.parametrize("n,k", [(2, 1), (5, 2), (9, 4)])
def test_comet_split_bias_flag_changes_parameter_count(n, k):
    with_bias = comet(n, k, p=3)
    without = comet(n, k, p=3, split_bias=False)
    count = lambda g: sum(p.numel() for p in g.parameters())  # noqa: E731
    assert count(with_bias) - count(without) == (n - 1) * k
    assert without.split.bias is None
    out = without.train()(RoutingInput(torch.randn(4, 3)))
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(4))


# ==============================================================================================================
# DSelect-k
# ==============================================================================================================


def dselect(n: int, k: int, p: int = 2, seed: int = 0, **hp):
    torch.manual_seed(seed)
    return create_gate("dselect", GateDims(in_features=p, n_experts=n, k=k), **hp)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 9, 16])
def test_dselect_binary_codes_msb_first(n):
    m = max(1, math.ceil(math.log2(n)))
    expected = [[int(c) for c in np.binary_repr(i, m)] for i in range(n)]
    assert binary_codes(n).tolist() == expected
    if n == 5:
        assert expected[1] == [0, 0, 1] and expected[4] == [1, 0, 0]


def test_dselect_code_order_in_forward():
    # selector bits (1, 0, 0) must select expert 4 (MSB first), not expert 1 (LSB first)
    gate = dselect(5, k=1).eval()
    with torch.no_grad():
        gate.selector_logits.weight.zero_()
        gate.selector_logits.bias.copy_(torch.tensor([10.0, -10.0, -10.0]))
    w = gate(RoutingInput(torch.randn(3, 2))).weights
    assert torch.equal(w, torch.nn.functional.one_hot(torch.full((3,), 4), 5).float())


X_DS = np.array([[0.4, -0.3], [-1.0, 0.2], [0.1, 0.9]])
WZ = np.array([[0.3, 0.1], [-0.2, 0.4], [0.1, -0.3], [0.25, 0.05]])  # units j * m + t, k = 2, m = 2
CZ = np.array([0.05, -0.1, 0.0, 0.12])
WA = np.array([[0.5, -0.2], [-0.1, 0.3]])
CA = np.array([0.1, -0.05])


def dselect_reference_n3_k2(x, gamma, entropy_reg, zeta, reduction):
    codes = np.array([[0, 0], [0, 1], [1, 0]], dtype=np.float64)  # n = 3, m = 2, MSB first
    s = np_smooth_step((x @ WZ.T + CZ).reshape(-1, 2, 1, 2), gamma)  # [B, j, 1, t]
    r = np.prod(codes * s + (1 - codes) * (1 - s), axis=-1)  # [B, j, i]
    logits = x @ WA.T + CA
    sigma = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    g = (sigma[:, :, None] * r).sum(axis=1)
    entropy = -(r * np.log(r + 1e-6)).sum(axis=(1, 2))
    entropy = entropy.mean() if reduction == "mean" else entropy.sum()
    penalty = (1.0 / (r.sum(axis=-1) + 1e-6)).sum()
    return g, entropy_reg * entropy + zeta * penalty, penalty


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("gamma", [1.0, 2.5])
def test_dselect_matches_hand_computation(gamma, reduction):
    gate = dselect(3, k=2, gamma=gamma, entropy_reg=0.7, zeta=1.3, entropy_reduction=reduction).double().train()
    set_linear_(gate.selector_logits, WZ, CZ)
    set_linear_(gate.selector_mix, WA, CA)
    g_ref, aux_ref, penalty_ref = dselect_reference_n3_k2(X_DS, gamma, 0.7, 1.3, reduction)
    out = gate(RoutingInput(t64(X_DS)))
    np.testing.assert_allclose(out.weights.detach().numpy(), g_ref, rtol=1e-12, atol=1e-14)
    assert (out.weights.sum(-1) < 1 - 1e-3).all()  # n = 3 is not a power of 2: mass lost on code 11
    assert out.aux_loss.item() == pytest.approx(aux_ref, rel=1e-12)
    assert out.stats["non_power_of_2_penalty"].item() == pytest.approx(penalty_ref, rel=1e-12)


@pytest.mark.parametrize("n", [4, 5])
def test_dselect_entropy_sum_is_batch_times_mean(n):
    b = 8
    mean_gate = dselect(n, k=2, p=3, entropy_reduction="mean").double().train()
    sum_gate = dselect(n, k=2, p=3, seed=7, entropy_reduction="sum").double().train()
    sum_gate.load_state_dict(mean_gate.state_dict())
    x = RoutingInput(torch.randn(b, 3, dtype=torch.float64))
    e_mean = mean_gate(x).stats["entropy"].item()
    e_sum = sum_gate(x).stats["entropy"].item()
    assert e_mean > 0
    assert e_sum / e_mean == b
    if n == 4:  # no penalty: the aux losses differ by the same factor
        assert sum_gate(x).aux_loss.item() / mean_gate(x).aux_loss.item() == b


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_dselect_no_penalty_for_powers_of_two(n):
    gate = dselect(n, k=2, p=3, entropy_reg=0.5, zeta=10.0).train()
    out = gate(RoutingInput(torch.randn(6, 3)))
    assert "non_power_of_2_penalty" not in out.stats
    assert out.aux_loss.item() == 0.5 * out.stats["entropy"].item()
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(6))


@pytest.mark.parametrize("n", [3, 5, 9])
def test_dselect_penalty_present_for_non_powers_of_two(n):
    b, k = 6, 2
    gate = dselect(n, k=k, p=3, entropy_reg=0.5, zeta=10.0).train()
    out = gate(RoutingInput(torch.randn(b, 3)))
    penalty = out.stats["non_power_of_2_penalty"]
    assert penalty.item() > b * k  # sum_i r < 1 while selectors are soft
    torch.testing.assert_close(out.aux_loss, 0.5 * out.stats["entropy"] + 10.0 * penalty)
    assert gate.eval()(RoutingInput(torch.randn(b, 3))).aux_loss.item() == 0.0


def test_dselect_saturated_on_valid_codes_simplex_and_zero_penalty_gradient():
    n, k, b = 5, 2, 6
    gate = dselect(n, k=k, p=2, zeta=10.0, entropy_reg=1.0).train()
    x = torch.randn(b, 2)
    # soft: the penalty does push the selectors
    gate(RoutingInput(x)).aux_loss.backward()
    assert (gate.selector_logits.weight.grad != 0).any()
    gate.zero_grad()
    with torch.no_grad():  # selector 0 -> code 010 (expert 2), selector 1 -> code 100 (expert 4)
        gate.selector_logits.weight.mul_(10.0)  # |W x| << 5: stays saturated
        gate.selector_logits.bias.copy_(torch.tensor([-5.0, 5.0, -5.0, 5.0, -5.0, -5.0]))
    out = gate(RoutingInput(x))
    r = gate.selector_outputs(x)
    assert ((r == 0) | (r == 1)).all() and torch.equal(r.sum(-1), torch.ones(b, k))
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(b), atol=1e-6, rtol=0)  # simplex once saturated
    assert ((out.weights != 0).sum(-1) == 2).all() and (out.weights[:, [0, 1, 3]] == 0).all()
    assert out.stats["non_power_of_2_penalty"].item() == pytest.approx(b * k / (1 + 1e-6), rel=1e-6)
    out.aux_loss.backward()
    for p in gate.selector_logits.parameters():
        assert p.grad is not None and (p.grad == 0).all()


def test_dselect_gamma_changes_output_for_fixed_logits():
    """LibMTL calls the smooth-step with the default gamma = 1 regardless of the configured gamma."""
    a = dselect(4, k=2, p=2, gamma=1.0).eval()
    b = dselect(4, k=2, p=2, gamma=4.0).eval()
    set_linear_(a.selector_logits, np.full((4, 2), 0.2), np.full(4, 0.1))
    b.load_state_dict(a.state_dict())
    x = RoutingInput(torch.tensor([[0.5, 0.3], [-0.2, 0.4]]))
    wa, wb = a(x).weights, b(x).weights
    assert not torch.allclose(wa, wb, atol=1e-4)
    # by hand: all bits share t; gamma = 4 keeps S(t) closer to 1/2, so weights are closer to uniform
    assert (wb - 0.25).abs().max() < (wa - 0.25).abs().max()


# ==============================================================================================================
# Top-k
# ==============================================================================================================


def topk(n: int, k: int, p: int = 2, seed: int = 0, **hp):
    torch.manual_seed(seed)
    return create_gate("topk", GateDims(in_features=p, n_experts=n, k=k), **hp)


def test_topk_keeps_an_exact_zero_logit():
    """Official defect #5: the == 0.0 mask drops a selected logit that is exactly 0."""
    gate = topk(4, k=2).eval()
    set_linear_(gate.logits, np.zeros((4, 2)), [0.0, -1.0, 1.0, -2.0])
    w = gate(RoutingInput(torch.randn(3, 2))).weights
    assert ((w != 0).sum(-1) == 2).all()
    expected = torch.softmax(torch.tensor([0.0, 1.0]), 0)
    torch.testing.assert_close(w[:, [0, 2]], expected.expand(3, 2))
    assert (w[:, [1, 3]] == 0).all()


def test_topk_weights_are_softmax_of_kept_logits():
    gate = topk(6, k=3, p=3).double().eval()
    x = torch.randn(10, 3, dtype=torch.float64)
    logits = (x @ gate.logits.weight.T + gate.logits.bias).detach().numpy()
    expected = np.zeros_like(logits)
    for b, row in enumerate(logits):
        keep = np.argsort(-row)[:3]
        e = np.exp(row[keep] - row[keep].max())
        expected[b, keep] = e / e.sum()
    w = gate(RoutingInput(x)).weights.detach().numpy()
    np.testing.assert_allclose(w, expected, rtol=1e-12, atol=1e-15)
    assert ((w != 0).sum(-1) == 3).all()


def test_topk_noise_adds_a_parameter_and_is_training_only():
    plain, noisy = topk(5, k=2, p=3), topk(5, k=2, p=3, noisy=True)
    count = lambda g: sum(p.numel() for p in g.parameters())  # noqa: E731
    assert count(noisy) - count(plain) == 5 * 3  # W_noise, no bias
    plain.load_state_dict({key: v for key, v in noisy.state_dict().items() if key.startswith("logits.")})
    x = RoutingInput(torch.randn(8, 3))
    noisy.eval()
    first, second = noisy(x).weights, noisy(x).weights
    assert torch.equal(first, second)
    assert torch.equal(first, plain.eval()(x).weights)  # no noise in eval
    noisy.train()
    a = noisy(RoutingInput(x.x, stream=Stream(torch.tensor(0), torch.tensor(0)))).weights  # its stream at steps 0, 1
    b = noisy(RoutingInput(x.x, stream=Stream(torch.tensor(0), torch.tensor(1)))).weights
    assert not torch.equal(a, b)
    assert ((a != 0).sum(-1) == 2).all() and ((b != 0).sum(-1) == 2).all()
    (a * torch.randn_like(a)).sum().backward()
    assert noisy.noise.weight.grad is not None and (noisy.noise.weight.grad != 0).any()


# ==============================================================================================================
# Hash-r
# ==============================================================================================================


def hash_gate(n: int = 4, n_ids: int = 100, **hp):
    return create_gate("hash", GateDims(in_features=2, n_experts=n, n_ids=n_ids, k=1), **hp)


def test_hash_table_is_seeded():
    assert torch.equal(hash_gate(seed=5).table, hash_gate(seed=5).table)
    assert not torch.equal(hash_gate(seed=5).table, hash_gate(seed=6).table)


def test_hash_table_round_trips_through_state_dict():
    source, target = hash_gate(seed=1), hash_gate(seed=2)
    assert "table" in source.state_dict()
    assert not torch.equal(source.table, target.table)
    target.load_state_dict(source.state_dict())
    assert torch.equal(source.table, target.table)


def test_hash_assignment_is_balanced():
    n, n_ids = 16, 16000
    counts = torch.bincount(hash_gate(n=n, n_ids=n_ids, seed=0).table, minlength=n)
    assert counts.numel() == n
    assert ((counts - n_ids / n).abs() <= 0.2 * n_ids / n).all(), counts


def test_hash_default_seed_follows_the_run_seed():
    torch.manual_seed(11)
    a, b = hash_gate(), hash_gate()  # task gates of one model share the table
    assert torch.equal(a.table, b.table)
    torch.manual_seed(12)
    assert not torch.equal(a.table, hash_gate().table)
    torch.manual_seed(11)
    assert torch.equal(a.table, hash_gate().table)


def test_hash_output_is_one_hot_of_the_table():
    gate = hash_gate(n=5, n_ids=30, seed=3).train()
    ids = torch.arange(30)
    out = gate(RoutingInput(torch.randn(30, 2), sample_id=ids))
    assert torch.equal(out.weights, torch.nn.functional.one_hot(gate.table, 5).float())
    assert out.aux_loss.item() == 0.0
    assert len(list(gate.parameters())) == 0


# ==============================================================================================================
# Softmax (dense MMoE gate)
# ==============================================================================================================


def test_softmax_matches_hand_computation_and_is_dense():
    torch.manual_seed(0)
    gate = create_gate("softmax", GateDims(in_features=2, n_experts=3)).double().eval()
    w_hand, b_hand = np.array([[0.5, -1.0], [0.2, 0.3], [-0.4, 0.8]]), np.array([0.1, 0.0, -0.2])
    set_linear_(gate.logits, w_hand, b_hand)
    x = np.array([[1.0, 2.0], [-0.5, 0.25], [0.0, 0.0]])
    logits = x @ w_hand.T + b_hand
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    w = gate(RoutingInput(t64(x))).weights.detach().numpy()
    np.testing.assert_allclose(w, expected, rtol=1e-13)
    assert (w > 0).all()


def test_softmax_use_bias_flag():
    with_bias = create_gate("softmax", GateDims(in_features=3, n_experts=4))
    without = create_gate("softmax", GateDims(in_features=3, n_experts=4), use_bias=False)
    assert sum(p.numel() for p in with_bias.parameters()) - sum(p.numel() for p in without.parameters()) == 4
    assert with_bias.logits.bias is not None and (with_bias.logits.bias == 0).all()  # Keras Dense: zero bias
