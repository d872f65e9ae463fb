"""``--model.fused_mixing_sums`` (issue 31, item 3): the experts' ``h`` is never written. The forward mixes each
row's ``h`` as it makes it (``mtmoe.mixing.mixed_forward``); the backward makes it again and writes the gradient of
``y``, the expert bias's (summed over a trial's rows) and the gates' weights' (summed over the units) in one pass
(``mix_backward_sums``), all in the kernels' own order: off by default, not bitwise torch's ``bmm`` and ``sum``.

Covers the numba kernels against the plain path (the epilogue's ``h``, ``bmm``, the mixing's backward, ``sum``): the
mixture to rounding, the gradient of ``y`` bitwise, the two sums to rounding, in float32, float64 and bfloat16, one
to three tasks, dropout on and off, rows of odd length and longer than one pass of the dropout stream; a trial's
results its own (bitwise alone); a vmapped pack of the expert layer mixed, output and every gradient against the plain
layer and ``bmm``, in float32 and under bf16 autocast, one trial alone bitwise its slot; a comet MMoE with and
without the setting; the engine: a trial of a pack bitwise the same trial in a pack of one, and close to the plain
engine's; the traffic the kernels report; the Triton kernels in Triton's interpreter; on a GPU, the Triton kernels
against the numba ones.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from mtmoe import triton_support
from mtmoe.epilogue import epilogue_reference
from mtmoe.experts import DenseExperts
from mtmoe.gates import gate_class
from mtmoe.mixing import mix, mix_backward, mix_backward_sums, mix_weights_gradient, mixed_forward
from mtmoe.mmoe import build_mmoe
from mtmoe.pack.roofline import measure

from test_engine import batches, engine_of, info, step, trials
from test_epilogue import bits_of
from test_mixing import Mixture, pack_case, pack_outputs, slot
from test_random import SITE, run_interpreted

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2**-6}
SHAPES = [(5, 30), (3, 7), (5, 431)]  # (n, units): rows of even length, of odd length, longer than 2,046 elements


def sums_case(dtype: torch.dtype, tasks: int, n: int = 5, units: int = 30, trials: int = 3, rows: int = 12,
              seed: int = 0) -> tuple:
    """``(y, bias, weights, grad, seeds, steps)`` of ``trials`` trials: the experts' matmul output ``[trials, rows,
    n * units]`` with zeros of both signs, their biases, the gates' weights in [0, 1), the mixture's gradient, and
    the trials' stream seeds and steps."""
    generator = torch.Generator().manual_seed(seed)
    y = torch.randn(trials, rows, n * units, generator=generator).to(dtype)
    y[0, 0, :7] = -0.0
    bias = torch.randn(trials, n * units, generator=generator).to(dtype)
    bias[0, :3] = 0.0
    weights = torch.rand(trials, rows, tasks, n, generator=generator).to(dtype)
    grad = torch.randn(trials, rows, tasks, units, generator=generator).to(dtype)
    return y, bias, weights, grad, torch.tensor([1, 2**40, 7][:trials]), torch.tensor([0, 5, 2**33][:trials])


def fused(case: tuple, p: float) -> list[torch.Tensor]:
    """The setting's kernels: the mixture, then the gradients of y, the bias and the weights."""
    y, bias, weights, grad, seeds, steps = case
    return [mixed_forward(y, bias, weights, seeds, steps, SITE, p),
            *mix_backward_sums(grad, weights, y, bias, seeds, steps, SITE, p)]


def plain(case: tuple, p: float) -> list[torch.Tensor]:
    """The plain path's: the epilogue's ``h`` mixed by ``bmm``, :func:`mix_backward`, torch's sum over each trial's
    rows, ``bmm`` for the weights'."""
    y, bias, weights, grad, seeds, steps = case
    h = epilogue_reference(y, bias, seeds, steps, SITE, p)
    grad_y = mix_backward(grad, weights, h, p)
    return [mix(weights, h), grad_y, grad_y.sum(1), mix_weights_gradient(grad, h, weights)]


def assert_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * b.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tasks", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernels_compute_the_plain_mixing_to_rounding(dtype: torch.dtype, tasks: int, shape: tuple,
                                                           monkeypatch) -> None:
    """The mixture and the two sums to rounding, the gradient of y bitwise; a trial's results the same bits alone."""
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    case = sums_case(dtype, tasks, *shape)
    for p in (0.5, 0.0):
        out, expected = fused(case, p), plain(case, p)
        assert torch.equal(bits_of(out[1]), bits_of(expected[1]))
        for a, b in zip(out[::2] + out[3:], expected[::2] + expected[3:]):
            assert_close(a, b, dtype)
        for trial in range(3):  # a trial's results are its own
            alone = fused(tuple(t[trial:trial + 1] for t in case), p)
            for a, b in zip(alone, out):
                assert torch.equal(bits_of(a), bits_of(b[trial:trial + 1]))


def test_the_sums_differ_from_torchs_order_in_float32(monkeypatch) -> None:
    """Not bitwise (why the setting is off by default): row by row against torch's cascade sum."""
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    case = sums_case(torch.float32, 2, n=4, units=64, trials=1, rows=512)
    assert not torch.equal(fused(case, 0.0)[2], plain(case, 0.0)[2])


@pytest.mark.parametrize("autocast", [False, True])
def test_a_vmapped_pack_with_fused_sums_mixes_what_the_plain_layer_computes(autocast: bool) -> None:
    """P = 3 trials of 16 experts of 8 units, two tasks, dropout 0.5: the output and the gradients to rounding (x's
    bitwise under bf16 autocast: it comes from the gradient of y); one trial alone (no vmap) bitwise its slot."""
    experts, summing = DenseExperts(24, 8, 16, dropout=0.5), DenseExperts(24, 8, 16, dropout=0.5, fused_sums=True)
    case = pack_case()
    unfused, summed = (pack_outputs(Mixture(e, f), *case, autocast) for e, f in ((experts, False), (summing, True)))
    tolerance = 2**-7 if autocast else 1e-5
    for a, b in zip(summed, unfused):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * b.abs().max().item())
    if autocast:
        assert torch.equal(summed[1], unfused[1])  # the gradient of x: the gradient of y's matmul, bitwise
    alone = pack_outputs(Mixture(summing, True), *slot(case, 1), autocast)
    for a, b in zip(alone, summed):
        assert torch.equal(a[0], b[1])


@pytest.mark.parametrize("autocast", [False, True])
def test_an_mmoe_with_fused_mixing_sums_computes_the_plain_gradients_to_rounding(autocast: bool) -> None:
    """A comet MMoE (two tasks, dropout on) built with and without the setting, the same weights: the predictions
    and every parameter's gradient to rounding (the mixture, the expert bias's and the gates' gradients differ by the
    sums' order)."""
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
    tolerance = 2**-6 if autocast else 1e-5
    for a, b in zip(fused_out, plain_out):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * b.abs().max().item())
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


def test_the_kernels_report_their_traffic_and_products(monkeypatch) -> None:
    """The forward reads y, the bias, the weights and each trial's seed and step (16 bytes) and writes the mixture;
    the backward reads the mixture's gradient too and writes the three gradients: ``h`` is neither written nor read.
    Their FLOPs are the plain path's products' (``bmm`` forward; the mixing's backward's two). Float32: in bfloat16
    the numba kernels take the bias widened to float32 (a cast, as the epilogue's numba kernel; Triton reads it as
    it is)."""
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    y, bias, weights, grad, seeds, steps = sums_case(torch.float32, 2)
    forward = measure(lambda: mixed_forward(y, bias, weights, seeds, steps, SITE, 0.5))
    read = y.nbytes + bias.nbytes + weights.nbytes + 3 * 16
    assert forward.by_kernel == {"mixed forward (numba)": read + grad.nbytes} and forward.launches == 1
    backward = measure(lambda: mix_backward_sums(grad, weights, y, bias, seeds, steps, SITE, 0.5))
    written = y.nbytes + bias.nbytes + weights.nbytes
    assert backward.by_kernel == {"mix backward (numba)": read + grad.nbytes + written} and backward.launches == 1
    h = epilogue_reference(y, bias, seeds, steps, SITE, 0.5)
    assert forward.flops == measure(lambda: mix(weights, h)).flops == 2 * 36 * 2 * 5 * 30
    plain_backward = measure(lambda: (mix_backward(grad, weights, h, 0.5), mix_weights_gradient(grad, h, weights)))
    assert backward.flops == plain_backward.flops == 2 * forward.flops


TRITON_CHECK = """
import torch
from mtmoe import triton_support
from mtmoe.mixing import mix_backward_sums, mixed_forward
bits = lambda x: x.view({2: torch.int16, 4: torch.int32}[x.dtype.itemsize])
generator = torch.Generator().manual_seed(0)
seeds, steps = torch.tensor([1, 2**40, 7]), torch.tensor([0, 5, 2**33])
for dtype in (torch.float32, torch.bfloat16):
    for tasks, n, units in ((1, 5, 24), (2, 16, 64), (3, 3, 7)):
        y = torch.randn(3, 4, n * units, generator=generator).to(dtype)
        y[0, 0, :9] = -0.0
        bias = torch.randn(3, n * units, generator=generator).to(dtype)
        weights = torch.rand(3, 4, tasks, n, generator=generator).to(dtype)
        grad = torch.randn(3, 4, tasks, units, generator=generator).to(dtype)
        for p in (1 / 3, 0.0):
            results = []
            for interpret in (True, False):
                triton_support.INTERPRET = interpret
                results.append([mixed_forward(y, bias, weights, seeds, steps, 5, p),
                                *mix_backward_sums(grad, weights, y, bias, seeds, steps, 5, p)])
            triton_support.INTERPRET = False
            (out, grad_y, grad_bias, grad_weights), expected = results
            assert torch.equal(bits(out), bits(expected[0])), (dtype, tasks, p)  # the experts in order
            assert torch.equal(bits(grad_y), bits(expected[1])), (dtype, tasks, p)
            assert torch.equal(bits(grad_bias), bits(expected[2])), (dtype, tasks, p)  # row by row, in order
            tolerance = 1e-5 if dtype == torch.float32 else 2**-7  # the weights': tl.sum's order
            torch.testing.assert_close(grad_weights, expected[3], rtol=tolerance,
                                       atol=tolerance * expected[3].abs().max())
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.integration  # a Python process of its own, importing torch and Triton's interpreter: CI, not the inner loop
def test_the_triton_kernels_equal_the_numba_kernels_in_the_interpreter() -> None:
    """float32 and bfloat16, one to three tasks, dropout on and off, rows of odd length, units a power of two or
    not, experts over one or several programs: the mixture, the gradient of y and the bias's bitwise, the weights' to
    rounding."""
    run_interpreted(TRITON_CHECK)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equals_cpu(dtype: torch.dtype) -> None:
    """The Triton kernels on the GPU: the mixture, the gradient of y and the bias's bitwise the numba kernels', the
    weights' to rounding; all four close to the plain path on the GPU. Rows of 1,024 and of 21 elements."""
    for tasks, n, units in ((1, 16, 64), (2, 16, 64), (3, 16, 64), (2, 3, 7)):
        case = sums_case(dtype, tasks, n, units, rows=300)
        on_gpu = tuple(t.cuda() for t in case)
        out, expected = fused(on_gpu, 1 / 3), fused(case, 1 / 3)
        for a, b in zip(out[:3], expected[:3]):
            assert torch.equal(bits_of(a.cpu()), bits_of(b)), tasks
        assert_close(out[3].cpu(), expected[3], dtype)
        for a, b in zip(out, plain(on_gpu, 1 / 3)):
            assert_close(a, b, dtype)
