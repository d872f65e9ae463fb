"""``--model.fused_mixing_sums`` (issue 31, item 3's target): the mixing's backward kernel also sums the expert
bias's gradient over a trial's rows and the gates' weights' gradient over the units (``mtmoe.mixing.
mix_backward_sums``), in its own order: off by default, not bitwise torch's ``sum`` and ``bmm``.

Covers the numba kernels against the plain backward (the gradient of ``y`` bitwise, the two sums to float rounding)
in float32, float64 and bfloat16, one to three tasks; a group's sums independent of the other groups (a trial's of
its pack); a vmapped pack of the expert layer mixed, forward and every gradient against the plain layer and
``bmm``, in float32 and under bf16 autocast, one trial alone bitwise its slot; a comet MMoE with and without the
setting; the engine: a trial of a pack bitwise the same trial in a pack of one, and close to the plain engine's;
the traffic it reports; the Triton kernel in Triton's interpreter; on a GPU, the Triton kernel against the numba one.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from mtmoe import triton_support
from mtmoe.experts import DenseExperts
from mtmoe.gates import gate_class
from mtmoe.mixing import mix_backward, mix_backward_sums, mix_weights_gradient
from mtmoe.mmoe import build_mmoe
from mtmoe.pack.roofline import measure

from test_engine import batches, engine_of, info, step, trials
from test_epilogue import bits_of
from test_mixing import Mixture, case, pack_case, pack_outputs, slot
from test_random import run_interpreted

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2**-6}


def plain(grad: torch.Tensor, weights: torch.Tensor, h: torch.Tensor, p: float, groups: int) -> list[torch.Tensor]:
    """The plain path's three gradients: :func:`mix_backward`, torch's sum over each group's rows, ``bmm``."""
    grad_y = mix_backward(grad, weights, h, p)
    return [grad_y, grad_y.view(groups, -1, grad_y.shape[-1]).sum(1), mix_weights_gradient(grad, h, weights)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tasks", [1, 2, 3])
def test_the_kernel_sums_what_torch_sums_to_rounding(dtype: torch.dtype, tasks: int, monkeypatch) -> None:
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    grad, weights, h = case(dtype, tasks, rows=36)
    for groups in (1, 3):
        fused, expected = mix_backward_sums(grad, weights, h, 0.5, groups), plain(grad, weights, h, 0.5, groups)
        assert torch.equal(bits_of(fused[0]), bits_of(expected[0]))
        for a, b in zip(fused[1:], expected[1:]):
            assert a.dtype == b.dtype and a.shape == b.shape
            scale = b.abs().max().item()
            torch.testing.assert_close(a, b, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale)
    for group in range(3):  # a group's sums are its own: the same bits alone
        rows = slice(12 * group, 12 * (group + 1))
        alone = mix_backward_sums(grad[rows], weights[rows], h[rows], 0.5, 1)
        for a, b in zip(alone, (fused[0][rows], fused[1][group:group + 1], fused[2][rows])):
            assert torch.equal(bits_of(a), bits_of(b))


def test_the_sums_differ_from_torchs_order_in_float32(monkeypatch) -> None:
    """Not bitwise (why the setting is off by default): row by row against torch's cascade sum."""
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    grad, weights, h = case(torch.float32, 2, rows=512, n=4, units=64)
    fused, expected = mix_backward_sums(grad, weights, h, 0.0, 1), plain(grad, weights, h, 0.0, 1)
    assert not torch.equal(fused[1], expected[1])


@pytest.mark.parametrize("autocast", [False, True])
def test_a_vmapped_pack_with_fused_sums_mixes_what_the_plain_layer_computes(autocast: bool) -> None:
    """P = 3 trials of 16 experts of 8 units, two tasks, dropout 0.5: the forward bitwise, the gradients to
    rounding (x's bitwise: it comes from the gradient of y); one trial alone (no vmap) bitwise its slot."""
    experts, summing = DenseExperts(24, 8, 16, dropout=0.5), DenseExperts(24, 8, 16, dropout=0.5, fused_sums=True)
    case = pack_case()
    unfused, fused = (pack_outputs(Mixture(e, f), *case, autocast) for e, f in ((experts, False), (summing, True)))
    assert torch.equal(bits_of(fused[0]), bits_of(unfused[0]))
    tolerance = 2**-7 if autocast else 1e-5
    for a, b in zip(fused[1:], unfused[1:]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * b.abs().max().item())
    if autocast:
        assert torch.equal(fused[1], unfused[1])  # the gradient of x: the gradient of y's matmul, bitwise
    alone = pack_outputs(Mixture(summing, True), *slot(case, 1), autocast)
    for a, b in zip(alone, fused):
        assert torch.equal(a[0], b[1])


@pytest.mark.parametrize("autocast", [False, True])
def test_an_mmoe_with_fused_mixing_sums_computes_the_plain_gradients_to_rounding(autocast: bool) -> None:
    """A comet MMoE (two tasks, dropout on) built with and without the setting, the same weights: the predictions
    bitwise, every parameter's gradient to rounding (the expert bias's and the gates' differ by the sums' order)."""
    torch.manual_seed(0)
    nets = [build_mmoe(info(0.5), gate_class("comet"), fused_mixing_sums=sums) for sums in (False, True)]
    nets[1].load_state_dict(nets[0].state_dict())
    assert nets[1].experts.fused_sums and not nets[0].experts.fused_sums
    batch = batches(0, 1)[0]
    results = []
    for net in nets:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            predictions = net(batch).predictions
        sum(p.float().sum() * (t + 1) for t, p in enumerate(predictions)).backward()
        results.append(([p.detach() for p in predictions], {n: p.grad for n, p in net.named_parameters()}))
    (plain_out, plain_grads), (fused_out, fused_grads) = results
    assert all(torch.equal(bits_of(a), bits_of(b)) for a, b in zip(fused_out, plain_out))
    tolerance = 2**-6 if autocast else 1e-5
    for name, expected in plain_grads.items():
        scale = expected.abs().max().item()
        torch.testing.assert_close(fused_grads[name], expected, rtol=tolerance, atol=tolerance * scale, msg=name)


def summing_trials(n: int, sums: bool) -> list:
    pack = trials("comet", 0.5, n)
    for trial in pack:
        trial.net.experts.fused_sums = sums
    return pack


@pytest.mark.parametrize("autocast", [False, True])
def test_a_trial_of_a_pack_trains_bitwise_as_in_a_pack_of_one_under_the_setting(autocast: bool) -> None:
    """Three comet trials with the setting, 4 steps: each slot's parameters bitwise those of the same trial in a pack
    of one (the kernel's sums are a trial's own), and close to the plain engine's."""
    data = [batches(p, 4) for p in range(3)]

    def trained(pack: list, slots: list[int]) -> list:
        engine = engine_of(pack)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for i in range(4):
                step(engine, [data[s] for s in slots], i)
        return [dict(trial.net.named_parameters()) for trial in pack]

    packed = trained(summing_trials(3, True), [0, 1, 2])
    for slot in range(3):
        alone = trained([summing_trials(3, True)[slot]], [slot])[0]
        for name, value in packed[slot].items():
            assert torch.equal(value, alone[name]), (slot, name)
    reference = trained(summing_trials(3, False), [0, 1, 2])
    for slot in range(3):
        for name, value in packed[slot].items():
            torch.testing.assert_close(value, reference[slot][name], rtol=0, atol=1e-3, msg=name)


def test_the_kernel_reports_its_traffic_and_both_products(monkeypatch) -> None:
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    grad, weights, h = case(torch.bfloat16, 2, rows=36)
    cost = measure(lambda: mix_backward_sums(grad, weights, h, 0.5, 3))
    # grad, weights and h read; the gradients of y, of the bias (3 x n * units) and of the weights written
    assert cost.by_kernel == {"mix backward (numba)": grad.nbytes + 2 * weights.nbytes + 2 * h.nbytes + 3 * 150 * 2}
    assert cost.launches == 1
    assert cost.flops == measure(lambda: plain(grad, weights, h, 0.5, 3)).flops == 2 * 2 * 36 * 2 * 5 * 30


TRITON_CHECK = """
import torch
from mtmoe import triton_support
from mtmoe.mixing import mix_backward_sums
bits = lambda x: x.view({2: torch.int16, 4: torch.int32}[x.dtype.itemsize])
generator = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for tasks, n, units in ((1, 5, 24), (2, 16, 64), (3, 3, 300)):
        h = torch.randn(12, n * units, generator=generator).relu().to(dtype)
        h[0, :9] = -0.0
        weights = torch.rand(12, tasks, n, generator=generator).to(dtype)
        grad = torch.randn(12, tasks, units, generator=generator).to(dtype)
        triton_support.INTERPRET = True
        out = mix_backward_sums(grad, weights, h, 1 / 3, 3)
        triton_support.INTERPRET = False
        expected = mix_backward_sums(grad, weights, h, 1 / 3, 3)
        assert torch.equal(bits(out[0]), bits(expected[0])), (dtype, tasks)  # the gradient of y
        assert torch.equal(bits(out[1]), bits(expected[1])), (dtype, tasks)  # the bias's: row by row, in order
        tolerance = 1e-5 if dtype == torch.float32 else 2**-7  # the weights': tl.sum's order
        torch.testing.assert_close(out[2], expected[2], rtol=tolerance, atol=tolerance * expected[2].abs().max())
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.integration  # a Python process of its own, importing torch and Triton's interpreter: CI, not the inner loop
def test_the_triton_kernel_equals_the_numba_kernel_in_the_interpreter() -> None:
    """float32 and bfloat16, one to three tasks, units a power of two or not, experts over one or several programs:
    the gradient of y and the bias's bitwise, the weights' to rounding."""
    run_interpreted(TRITON_CHECK)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equals_cpu(dtype: torch.dtype) -> None:
    """The Triton kernel on the GPU: the gradient of y and the bias's bitwise the numba kernel's, the weights' to
    rounding; all three close to the plain path on the GPU."""
    for tasks in (1, 2, 3):
        grad, weights, h = case(dtype, tasks, rows=300, n=16, units=64)
        out = mix_backward_sums(*(x.cuda() for x in (grad, weights, h)), 1 / 3, 3)
        expected = mix_backward_sums(grad, weights, h, 1 / 3, 3)
        assert torch.equal(bits_of(out[0].cpu()), bits_of(expected[0])), tasks
        assert torch.equal(bits_of(out[1].cpu()), bits_of(expected[1])), tasks
        reference = plain(*(x.cuda() for x in (grad, weights, h)), 1 / 3, 3)
        for a, b in zip(out, reference):
            torch.testing.assert_close(a, b, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * b.abs().max().item())
