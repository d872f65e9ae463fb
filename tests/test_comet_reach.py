"""COMET's leaf reach in one kernel each way (``mtmoe.gates.reach``, issue 31).

Covers the numba kernels against the plain operations (smooth step, ``cat``, ``index_select``, product over depth),
values and gradients bitwise, in float32 and bfloat16, n in {4, 5, 8, 16}, k in {1, 2}, gammas whose smooth step
saturates (h exactly 0 or 1) and ties at +-gamma/2; that the test data shows a reversed sum order; a COMET gate,
alone and as a vmapped pack of trials with their own gammas, in float32 and under bf16 autocast: weights, the
entropy regulariser and every gradient bitwise those of the plain path; the traffic the kernels report; the Triton
kernels in Triton's interpreter; on a GPU, the Triton kernels against the numba ones.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

from mtmoe import triton_support
from mtmoe.gates import reach as reach_module
from mtmoe.gates.base import GateDims, RoutingInput, product
from mtmoe.gates.comet import COMETGate, path_index
from mtmoe.gates.reach import reach, reach_reference
from mtmoe.gates.smooth_step import smooth_step
from mtmoe.pack.roofline import measure

from covering import pairwise
from test_epilogue import bits_of
from test_random import run_interpreted

GAMMAS = (0.01, 0.1, 1.0, 10.0)


def splits(dtype: torch.dtype, n: int, k: int, gamma: float, rows: int = 41, seed: int = 0) -> torch.Tensor:
    """The split map's output ``[rows, (n-1) k]``: about a third beyond +-gamma/2 (h exactly 0 or 1), and the first
    two rows' first node exactly at -gamma/2 and gamma/2 (the clamps' ties)."""
    t = torch.randn(rows, (n - 1) * k, generator=torch.Generator().manual_seed(seed)) * gamma
    t[0, 0], t[1, 0] = -gamma / 2, gamma / 2
    return t.to(dtype)


def forward_backward(function, t: torch.Tensor, gamma, paths: torch.Tensor, seed: int = 1):
    """The reach ``[*trials, rows, k, n]`` (as the gate reads it) and the gradient of ``t`` from a random upstream one
    (the same for each trial)."""
    t = t.detach().clone().requires_grad_()
    v = function(t, gamma, paths).transpose(-1, -2)
    v.backward(torch.randn(v.shape[-3:], generator=torch.Generator().manual_seed(seed)).to(v.device, v.dtype).expand(
        v.shape))
    return v.detach(), t.grad


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    differ = bits_of(a) != bits_of(b)
    assert not differ.any(), (f"{what}: {int(differ.sum())} of {differ.numel()} elements differ, by up to "
                              f"{float((a.double() - b.double()).abs().max())}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4, 5, 8, 16])
@pytest.mark.parametrize("k", [1, 2])
def test_the_kernels_compute_the_plain_path(dtype: torch.dtype, n: int, k: int, monkeypatch) -> None:
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    paths = path_index(n)
    for gamma in GAMMAS:
        t = splits(dtype, n, k, gamma)
        gamma = torch.tensor(gamma, dtype=torch.float64)
        v, grad = forward_backward(reach, t, gamma, paths)
        plain_v, plain_grad = forward_backward(reach_reference, t, gamma, paths)
        assert_bitwise(v, plain_v)
        assert_bitwise(grad, plain_grad)
        h = smooth_step(t, gamma)
        assert (h == 0).any() and (h == 1).any()  # saturated nodes, whose gradient is exactly 0


def reversed_sums(t: torch.Tensor, gamma, paths: torch.Tensor) -> torch.Tensor:
    """:func:`reach_reference` with the leaves gathered last to first: the same values, each edge's gradient summed
    over the leaves in reverse order."""
    n, depth = paths.shape
    h = smooth_step(t.unflatten(-1, (n - 1, -1)), gamma)
    edges = torch.cat([h, 1 - h, h.new_ones(()).expand(*h.shape[:-2], 1, h.shape[-1])], dim=-2)
    gathered = edges.index_select(-2, paths.flip(0).flatten()).unflatten(-2, (n, depth))
    return product(gathered, dim=-2).flip(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_test_data_shows_the_order_of_each_edges_sum(dtype: torch.dtype, monkeypatch) -> None:
    """Summed over the leaves in reverse (the root's edges have eight leaves each), the gradient differs in its
    rounding somewhere, and the values do not: the tests above would catch a kernel that sums in another order."""
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    paths, gamma = path_index(16), torch.tensor(10.0, dtype=torch.float64)
    t = splits(dtype, 16, 2, 1.0, rows=200)  # gamma 10: no node saturated
    v, grad = forward_backward(reach, t, gamma, paths)
    reversed_v, reversed_grad = forward_backward(reversed_sums, t, gamma, paths)
    assert_bitwise(v, reversed_v)
    assert not torch.equal(grad, reversed_grad)


def test_the_kernels_split_over_threads_compute_the_same(monkeypatch) -> None:
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    paths, gamma = path_index(16), torch.tensor(1.0, dtype=torch.float64)
    t = splits(torch.bfloat16, 16, 2, 1.0, rows=700)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        split = forward_backward(reach, t, gamma, paths)
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(split, forward_backward(reach_reference, t, gamma, paths)):
        assert_bitwise(a, b)


def gates(n: int, k: int, gammas: tuple[float, ...]) -> list[COMETGate]:
    torch.manual_seed(0)
    built = [COMETGate(GateDims(12, n), k=k, gamma=gamma, entropy_reg=0.5) for gamma in gammas]
    for gate in built:
        with torch.no_grad():
            gate.split.weight.mul_(300.0)  # |t| up to about gamma: some nodes saturate, some do not
        gate.train()
    return built


def run_gates(built: list[COMETGate], x: torch.Tensor, autocast: bool, vmapped: bool):
    """Weights, the regulariser and every gradient (parameters and input) of one forward and backward: a pack of
    ``built`` under ``vmap`` with its own gammas, or ``built[0]`` alone."""
    x = x.detach().clone().requires_grad_()
    upstream = torch.randn(len(built), *x.shape[:-1], built[0].n_experts, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if vmapped:
            params, buffers = stack_module_state(built)  # gamma, entropy_reg and the paths: one per trial

            def forward(params, buffers):
                out = functional_call(built[0], {**params, **buffers}, (RoutingInput(x=x),))
                return out.weights, out.aux_loss

            weights, aux = vmap(forward, randomness="error")(params, buffers)
        else:
            params = dict(built[0].named_parameters())
            out = built[0](RoutingInput(x=x))
            weights, aux = out.weights.unsqueeze(0), out.aux_loss.unsqueeze(0)
    ((weights.float() * upstream[:weights.shape[0]]).sum() + aux.float().sum()).backward()
    grads = {name: p.grad for name, p in params.items()} | {"x": x.grad}
    return weights.detach(), aux.detach(), grads


@pytest.mark.parametrize("autocast", [True, False])
@pytest.mark.parametrize("vmapped", [True, False])
@pytest.mark.parametrize("n,k", [(5, 2), (16, 2), (8, 1)])
def test_a_gate_computes_what_the_plain_path_computes(autocast: bool, vmapped: bool, n: int, k: int,
                                                      monkeypatch) -> None:
    """A COMET gate in training, alone or as a pack of three with gammas 0.01, 1 and 10 (the first saturated):
    weights, entropy regulariser and every gradient bitwise the plain operations' (``fused`` off)."""
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    x = torch.randn(64, 12, generator=torch.Generator().manual_seed(2))
    fused = run_gates(gates(n, k, (0.01, 1.0, 10.0)), x, autocast, vmapped)
    monkeypatch.setattr(reach_module, "fused", lambda t: False)
    plain = run_gates(gates(n, k, (0.01, 1.0, 10.0)), x, autocast, vmapped)
    assert_bitwise(fused[0], plain[0])
    assert_bitwise(fused[1], plain[1])
    assert fused[2].keys() == plain[2].keys() and "split.weight" in fused[2]
    for name in fused[2]:
        assert_bitwise(fused[2][name], plain[2][name])


def test_a_packed_trial_computes_what_it_computes_alone(monkeypatch) -> None:
    """The kernels take each trial's gamma and paths (a pack's stacked buffer) from its row block: a pack's trial t
    bitwise trial t alone, values and gradients, also beside an empty slot whose paths are zeros."""
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    gammas = torch.tensor([0.01, 1.0, 10.0, 1.0], dtype=torch.float64)
    paths = torch.stack([path_index(8)] * 3 + [torch.zeros_like(path_index(8))])
    t = torch.stack([splits(torch.float32, 8, 2, float(g), seed=s) for s, g in enumerate(gammas)])
    packed = forward_backward(lambda t, g, p: vmap(reach)(t, g, p), t, gammas, paths)
    for trial in range(4):
        alone = forward_backward(reach_reference, t[trial], gammas[trial], paths[trial])
        for a, b in zip(packed, alone):
            assert_bitwise(a[trial], b)


def test_the_kernels_report_their_traffic(monkeypatch) -> None:
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    paths, gamma = path_index(16), torch.tensor(1.0, dtype=torch.float64)
    t = splits(torch.float32, 16, 2, 1.0, rows=64).requires_grad_()
    v = reach(t, gamma, paths)
    grad = torch.randn(v.shape)
    forward = measure(lambda: reach(t, gamma, paths))
    backward = measure(lambda: v.backward(grad, retain_graph=True))
    fixed = 3 * 4 + paths.nbytes  # the smooth step's three coefficients and the leaves' paths
    assert forward.by_kernel["comet reach (numba)"] == t.nbytes + fixed + v.nbytes  # beside the coefficients'
    assert backward.by_kernel == {"comet reach backward (numba)": t.nbytes + fixed + grad.nbytes + t.nbytes}
    assert backward.launches == 1
    monkeypatch.setattr(reach_module, "fused", lambda t: False)
    plain = measure(lambda: reach(t, gamma, paths).backward(grad))
    assert plain.bytes > 10 * (forward.bytes + backward.bytes)  # some twenty passes over [rows, n, k] each way


TRITON_CHECK = """
import torch
from mtmoe.gates.comet import path_index
from mtmoe.gates.reach import reach, reach_reference
from mtmoe.triton_support import use_triton
from torch.func import vmap
bits = lambda x: x.view({2: torch.int16, 4: torch.int32}[x.element_size()])
def run(function, t, gamma, paths):
    t = t.detach().clone().requires_grad_()
    v = function(t, gamma, paths).transpose(-1, -2)
    v.backward(torch.randn(v.shape[-3:], generator=torch.Generator().manual_seed(1)).to(v.dtype).expand(v.shape))
    return v.detach(), t.grad
for n, dtype, k in ROWS:
    dtype, paths, gamma = getattr(torch, dtype), path_index(n), 1.0 if k == 1 else 0.01
    t = torch.randn(2, 40, (n - 1) * k, generator=torch.Generator().manual_seed(n)) * gamma
    t[0, 0, 0], t[0, 1, 0] = -gamma / 2, gamma / 2
    t = t.to(dtype)
    assert use_triton(t.device)
    gamma = torch.tensor(gamma, dtype=torch.float64)
    for a, b in zip(run(reach, t, gamma, paths), run(reach_reference, t, gamma, paths)):
        assert torch.equal(bits(a), bits(b)), (dtype, n, k)
for dtype in (torch.float32, torch.bfloat16):
    gammas = torch.tensor([0.01, 1.0, 10.0], dtype=torch.float64)  # a pack: each trial's gamma and paths
    paths = torch.stack([path_index(16), path_index(16), torch.zeros_like(path_index(16))])
    t = torch.randn(3, 40, 30, generator=torch.Generator().manual_seed(0)).to(dtype)
    packed = run(lambda t, g, p: vmap(reach)(t, g, p), t, gammas, paths)
    for trial in range(3):  # the empty slot's edge sums in another order (its edges at every depth): values only
        alone = run(reach_reference, t[trial], gammas[trial], paths[trial])[:1 if trial == 2 else 2]
        assert all(torch.equal(bits(a[trial]), bits(b)) for a, b in zip(packed, alone)), (dtype, trial)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.integration  # a Python process of its own, importing torch and Triton's interpreter: CI, not the inner loop
def test_the_triton_kernels_compute_the_plain_path_in_the_interpreter() -> None:
    """Float32 and bfloat16, n in {4, 5, 8, 16} (N and its powers of two padded or not), k in {1, 2}, pairwise
    (``tests/covering.py``: every n in both dtypes and with both k, each dtype with both k), saturated and not (``t``
    scales with gamma: the same masks at any gamma), ties, over several programs, and per dtype a vmapped pack at
    n = 16 with gammas 0.01, 1 and 10 and its own paths (one all zeros, as an empty slot's: its values only):
    bitwise. The full product runs on the numba kernels above, and on a GPU in ``test_cuda_equals_cpu``."""
    rows = pairwise((4, 5, 8, 16), ("float32", "bfloat16"), (1, 2))
    run_interpreted(f"ROWS = {rows!r}\n" + TRITON_CHECK)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equals_cpu(dtype: torch.dtype) -> None:
    """The Triton kernels on the GPU bitwise the numba kernels; the reach bitwise the plain operations on the GPU,
    and the gradient close to theirs: on the GPU the plain backward of ``index_select`` adds an edge's leaves with
    atomics, in no fixed order (the numba kernels equal the plain operations on the CPU bitwise, above)."""
    for n in (5, 16):
        paths = path_index(n)
        for gamma in GAMMAS:
            t = splits(dtype, n, 2, gamma, rows=4096)
            gamma = torch.tensor(gamma, dtype=torch.float64)
            on_cpu = forward_backward(reach, t, gamma, paths)
            cuda = forward_backward(reach, t.cuda(), gamma.cuda(), paths.cuda())
            plain = forward_backward(reach_reference, t.cuda(), gamma.cuda(), paths.cuda())
            for what, a, b in zip(("reach", "gradient"), cuda, on_cpu):
                assert_bitwise(a.cpu(), b, f"n={n} gamma={float(gamma)} {what}: Triton on the GPU against numba")
            assert_bitwise(cuda[0], plain[0], f"n={n} gamma={float(gamma)} reach: Triton against the plain GPU path")
            # a sum of up to n/2 terms in another order: a few roundings of the largest term's magnitude
            scale = 16 * torch.finfo(dtype).eps
            torch.testing.assert_close(cuda[1], plain[1], rtol=scale, atol=scale * float(plain[1].abs().max()))
