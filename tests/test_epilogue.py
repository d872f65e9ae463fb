"""The dense expert layer's fused epilogue (``mtmoe.epilogue``, issue 31): ``dropout(relu(y + bias))`` in one pass
and its backward in one, bitwise the unfused operations.

Covers the numba kernels against the torch reference (every dtype they take, packs spanning chunks, bfloat16 ties),
a vmapped pack of the expert layer against today's unfused code (forward, weight and bias gradients; the path
``fit`` and ``tune`` train through), one trial alone against the pack, the plain module against matmul + add,
the backward as the upstream gradient times the scale where ``h > 0``, the Triton kernels in Triton's interpreter,
and the traffic the kernels report to the roofline counters.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.func import vmap
from torch.nn import functional as F

from mtmoe import triton_support
from mtmoe.epilogue import _epilogue_kernel, bias_relu_dropout, epilogue_backward, epilogue_reference
from mtmoe.experts import DenseExperts
from mtmoe.pack.roofline import measure
from mtmoe.random import Stream, dropout, dropout_scale

from test_random import run_interpreted

SITE = 5
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bit patterns (bitwise comparisons: the sign of zero counts)."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.dtype.itemsize])


def cases(dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """``(y, bias, seed, step)``: one trial ``[6, 14]``; a pack of three whose trials span two numba chunks and end
    mid-row (``[3, 91, 45]``); a pack of two whose sizes are divisible by 16 (``[2, 40, 48]``: the Triton kernel's
    128-bit loads); for bfloat16, a bias of 2^-8 times y's first row, whose sums there lie halfway between two
    bfloat16 values (ties)."""
    generator = torch.Generator().manual_seed(0)
    one = (torch.randn(6, 14, generator=generator).to(dtype), torch.randn(14, generator=generator).to(dtype),
           torch.tensor(99), torch.tensor(4))
    three = (torch.randn(3, 91, 45, generator=generator).to(dtype), torch.randn(3, 45, generator=generator).to(dtype),
             torch.tensor([1, 2**40, 7]), torch.tensor([0, 5, 2**33]))
    two = (torch.randn(2, 40, 48, generator=generator).to(dtype), torch.randn(2, 48, generator=generator).to(dtype),
           torch.tensor([3, 2**35]), torch.tensor([2**32 + 1, 6]))
    out = [one, three, two]
    if dtype == torch.bfloat16:
        y = torch.randn(2, 64, 32, generator=generator).to(dtype)
        bias = (y[:, 0] * 2**-8).to(dtype)
        out.append((y, bias, torch.tensor([3, 4]), torch.tensor([1, 1])))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.5, 1 / 3, 0.0])
def test_numba_kernels_equal_the_reference(dtype: torch.dtype, p: float, monkeypatch) -> None:
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    for y, bias, seed, step in cases(dtype):
        out = _epilogue_kernel(y, bias, seed, step, SITE, p)
        expected = epilogue_reference(y, bias, seed, step, SITE, p)
        assert out.dtype == dtype and torch.equal(bits_of(out), bits_of(expected))
        upstream = torch.randn(y.shape).to(dtype)
        grad = epilogue_backward(upstream, out, p)
        assert torch.equal(bits_of(grad), bits_of(torch.where(expected > 0, upstream * dropout_scale(p), 0)))


def test_the_kernels_split_over_threads_compute_the_same() -> None:
    y, bias = torch.randn(3, 300, 77).to(torch.bfloat16), torch.randn(3, 77).to(torch.bfloat16)
    seed, step = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    expected = bits_of(epilogue_reference(y, bias, seed, step, SITE, 0.5))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            out = _epilogue_kernel(y, bias, seed, step, SITE, 0.5)
            assert torch.equal(bits_of(out), expected), count
            assert torch.equal(epilogue_backward(y, out, 0.5), torch.where(out > 0, y * 2, 0)), count
    finally:
        torch.set_num_threads(threads)


def unfused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, seed: torch.Tensor, step: torch.Tensor,
            p: float) -> torch.Tensor:
    """The expert layer as it was before the fusion: ``F.linear`` with its bias, ``relu_``, then the dropout."""
    h = F.linear(x, weight, bias).relu_()
    return dropout(h, seed, SITE, step, p) if p else h


def fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, seed: torch.Tensor, step: torch.Tensor,
          p: float) -> torch.Tensor:
    return bias_relu_dropout(F.linear(x, weight), bias, p, seed, step, SITE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.5, 0.0])
def test_a_vmapped_pack_computes_what_the_unfused_layer_computes(dtype: torch.dtype, p: float) -> None:
    """The engine's path: the layer vmapped over P = 3 trials (a linear layer is a matmul then the bias add there),
    forward and a plain ``.backward``: output, weight and bias gradients equal; the forward bitwise."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 37, 16, generator=generator).to(dtype)
    weight = torch.randn(3, 96, 16, generator=generator).to(dtype).requires_grad_()
    bias = torch.randn(3, 96, generator=generator).to(dtype).requires_grad_()
    seeds, steps = torch.tensor([1, 2**40, 7]), torch.tensor([0, 5, 2**33])
    upstream = torch.randn(3, 37, 96, generator=generator).to(dtype)
    results = []
    for layer in (unfused, fused):
        weight.grad = bias.grad = None
        out = vmap(lambda x, w, b, s, k: layer(x, w, b, s, k, p))(x, weight, bias, seeds, steps)
        (out * upstream).sum().backward()
        results.append((out.detach(), weight.grad, bias.grad))
    (out, weight_grad, bias_grad), (fused_out, fused_weight_grad, fused_bias_grad) = results
    assert torch.equal(bits_of(fused_out), bits_of(out))
    assert torch.equal(fused_weight_grad, weight_grad) and torch.equal(fused_bias_grad, bias_grad)
    x0, w0, b0 = x[1], weight[1].detach().clone().requires_grad_(), bias[1].detach().clone().requires_grad_()
    alone = bias_relu_dropout(x0 @ w0.T, b0, p, seeds[1], steps[1], SITE)  # a trial alone: the pack's slot
    (alone * upstream[1]).sum().backward()
    assert torch.equal(bits_of(alone), bits_of(fused_out[1]))
    assert torch.equal(w0.grad, fused_weight_grad[1]) and torch.equal(b0.grad, fused_bias_grad[1])


def test_under_autocast_the_module_equals_the_unfused_layer_and_f_linear_to_rounding() -> None:
    """The plain module (no vmap) in bf16 autocast and float32: bitwise matmul + add + ReLU + dropout; against
    ``F.linear`` with its bias (one fused GEMM on the CPU) equal to float32 rounding, bf16's within one rounding."""
    torch.manual_seed(0)
    experts = DenseExperts(24, 8, 4, dropout=0.5)
    experts.keras_init_()
    with torch.no_grad():
        experts.linear.bias.normal_()
    x = torch.randn(10, 24)
    stream = Stream(torch.tensor(3), torch.tensor(9), 1)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = experts(x, stream)
            y = F.linear(x, experts.linear.weight)
            bias = experts.linear.bias.to(y.dtype)
            expected = dropout((y + bias).relu(), stream.seed, stream.site, stream.step, 0.5)
            linear = dropout(F.linear(x, experts.linear.weight, bias).relu(), stream.seed, stream.site,
                             stream.step, 0.5)
        assert out.shape == (10, 4, 8) and torch.equal(bits_of(out.flatten(1)), bits_of(expected))
        tolerance = 2**-7 if autocast else 1e-6
        torch.testing.assert_close(out.flatten(1).float(), linear.float(), rtol=tolerance, atol=tolerance)
    experts.eval()
    assert torch.equal(experts(x).flatten(1), (x @ experts.linear.weight.T + experts.linear.bias).relu())


def test_the_backward_is_the_gradient_times_the_scale_where_h_is_positive() -> None:
    """Against autograd through the reference's three operations (equal: the sign of a zero aside), with the
    forward's step even after the step buffer moved on; the bias's gradient is the rows' sum."""
    generator = torch.Generator().manual_seed(2)
    y = torch.randn(40, 50, generator=generator, requires_grad=True)
    bias = torch.randn(50, generator=generator, requires_grad=True)
    upstream = torch.randn(40, 50, generator=generator)
    seed, step = torch.tensor(3), torch.tensor(8)
    out = bias_relu_dropout(y, bias, 0.3, seed, step, SITE)
    step += 1
    out.backward(upstream)
    y_reference, bias_reference = (t.detach().clone().requires_grad_() for t in (y, bias))
    epilogue_reference(y_reference, bias_reference, seed, torch.tensor(8), SITE, 0.3).backward(upstream)
    assert torch.equal(y.grad, y_reference.grad) and torch.equal(bias.grad, bias_reference.grad)
    assert torch.equal(y.grad, torch.where(out > 0, upstream * dropout_scale(0.3), 0))
    with pytest.raises(TypeError, match="int64"):
        bias_relu_dropout(y, bias, 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_report_their_traffic(dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    y = torch.randn(3, 20, 50).to(dtype).requires_grad_()
    bias = torch.randn(3, 50).to(dtype)
    seed, step = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    out = _epilogue_kernel(y, bias, seed, step, SITE, 0.5)
    cost = measure(lambda: _epilogue_kernel(y, bias, seed, step, SITE, 0.5))
    # y and the bias read, a seed and a step per trial, the output written
    assert cost.by_kernel["epilogue (numba)"] == 2 * out.nbytes + bias.nbytes + 3 * 16
    cost = measure(lambda: epilogue_backward(out, out, 0.5))
    assert cost.by_kernel["epilogue backward (numba)"] == 3 * out.nbytes  # gradient and h read, gradient written
    assert cost.launches == 1


TRITON_CHECK = """
import torch
from torch.func import vmap
from mtmoe.epilogue import _epilogue_kernel, bias_relu_dropout, epilogue_backward, epilogue_reference
from mtmoe.triton_support import use_triton
bits = lambda x: x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.dtype.itemsize])
t = lambda v: torch.tensor(v, dtype=torch.int64)
for dtype in (torch.float32, torch.float64, torch.bfloat16):
    y = torch.randn(3, 29, 45).to(dtype)
    bias = torch.randn(3, 45).to(dtype)
    if dtype == torch.bfloat16:
        bias[0] = (y[0, 0] * 2**-8).to(dtype)
    seed, step = t([1, 2**40, 7]), t([0, 5, 2**33])
    for p in (1 / 3, 0.0):
        assert use_triton(y.device)
        out = _epilogue_kernel(y, bias, seed, step, 5, p)
        expected = epilogue_reference(y, bias, seed, step, 5, p)
        assert out.dtype == dtype and torch.equal(bits(out), bits(expected)), (dtype, p)
        grad = epilogue_backward(y, out, p)
        reference = torch.where(expected > 0, y * (1.5 if p else 1.0), 0)
        assert torch.equal(bits(grad), bits(reference)), (dtype, p)
y = torch.randn(3, 7, 45, requires_grad=True)
bias = torch.randn(3, 45, requires_grad=True)
upstream = torch.randn(3, 7, 45)
layer = vmap(lambda y, b, s, k: bias_relu_dropout(y, b, 0.5, s, k, 5))
(layer(y, bias, t([3, 4, 5]), t([7, 7, 0])) * upstream).sum().backward()
y2, bias2 = (x.detach().clone().requires_grad_() for x in (y, bias))
(epilogue_reference(y2, bias2, t([3, 4, 5]), t([7, 7, 0]), 5, 0.5) * upstream).sum().backward()
assert torch.equal(y.grad, y2.grad) and torch.equal(bias.grad, bias2.grad)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.integration  # a Python process of its own, importing torch and Triton's interpreter: CI, not the inner loop
def test_triton_kernels_equal_the_reference_in_the_interpreter() -> None:
    """The CUDA kernels on CPU tensors in Triton's interpreter: every dtype, a pack of three over several blocks,
    bfloat16 ties, with and without dropout, and a vmapped forward with its backward."""
    run_interpreted(TRITON_CHECK)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_equals_cpu(dtype: torch.dtype) -> None:
    for y, bias, seed, step in cases(dtype):
        on_cpu = _epilogue_kernel(y, bias, seed, step, SITE, 1 / 3)
        cuda = [x.cuda() for x in (y, bias, seed, step)]
        out = _epilogue_kernel(*cuda, SITE, 1 / 3)
        assert torch.equal(bits_of(out.cpu()), bits_of(on_cpu))
        assert torch.equal(bits_of(epilogue_backward(cuda[0], out, 1 / 3).cpu()),
                           bits_of(epilogue_backward(y, on_cpu, 1 / 3)))
