"""The experts' epilogue and the gates' weighted sum as one autograd node (``mtmoe.mixing``, issue 31): the backward
writes the gradient of the experts' matmul output in one pass.

Covers the numba kernels against the unfused backward (the mixing's ``bmm`` then the epilogue's backward): bitwise in
bfloat16 with one or two tasks (exact products, one rounding), to the rounding of a T-term sum otherwise; the kernel
split over threads; a vmapped pack of the expert layer mixed, forward and every gradient against the unfused layer
and ``bmm`` in float32 and under bf16 autocast, and one trial alone against the pack; MMoE's fused route against its
unfused one (a gate that reads the experts' outputs) for a comet net; the traffic the kernel reports; the Triton
kernel in Triton's interpreter; on a GPU, the Triton kernel against the numba one.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from torch.func import vmap

from mtmoe import triton_support
from mtmoe.dataset_info import DatasetInfo, TaskSpec
from mtmoe.experts import DenseExperts
from mtmoe.gates import gate_class
from mtmoe.mixing import _mix_backward_cpu, _mix_backward_cpu_bfloat16, mix_backward, mix_backward_reference
from mtmoe.mmoe import build_mmoe
from mtmoe.pack.roofline import measure
from mtmoe.random import Stream

from test_epilogue import bits_of
from test_random import run_interpreted

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def case(dtype: torch.dtype, tasks: int, rows: int = 37, n: int = 5, units: int = 30, seed: int = 0):
    """``(grad, weights, h)``: ``h`` a ReLU's output with zeros of both signs, the weights in [0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, n * units, generator=generator).relu().to(dtype)
    h[0, :7] = -0.0
    weights = torch.rand(rows, tasks, n, generator=generator).to(dtype)
    grad = torch.randn(rows, tasks, units, generator=generator).to(dtype)
    return grad, weights, h


def numba_kernel(grad: torch.Tensor, weights: torch.Tensor, h: torch.Tensor, scale: float) -> torch.Tensor:
    """The numba kernel over every row on this thread."""
    out = torch.empty_like(h)
    if h.dtype == torch.bfloat16:
        _mix_backward_cpu_bfloat16(*(x.view(torch.uint16).numpy() for x in (grad, weights, h, out)),
                                   np.float32(scale), 0, h.shape[0])
    else:
        _mix_backward_cpu(grad.numpy(), weights.numpy(), h.numpy(), out.numpy(), np.float32(scale), 0, h.shape[0])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tasks", [1, 2, 3])
@pytest.mark.parametrize("p", [0.5, 0.0])
def test_the_kernel_equals_the_unfused_backward(dtype: torch.dtype, tasks: int, p: float, monkeypatch) -> None:
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    for rows, n, units in ((37, 5, 30), (9, 3, 4)):  # MKL's small GEMMs accumulate without fused multiply-adds
        grad, weights, h = case(dtype, tasks, rows, n, units)
        out = mix_backward(grad, weights, h, p)
        expected = mix_backward_reference(grad, weights, h, p)
        assert out.dtype == dtype and out.shape == h.shape
        assert torch.equal(bits_of(out[h <= 0]), torch.zeros_like(bits_of(out[h <= 0])))  # +0 where h <= 0
        if dtype == torch.bfloat16 and tasks <= 2:
            assert torch.equal(bits_of(out), bits_of(expected))
        else:  # a sum of T products rounded once each (fused) or twice (plain): one rounding of the result apart
            tolerance = {torch.float32: 1e-6, torch.float64: 1e-14, torch.bfloat16: 2**-7}[dtype]
            torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


def test_the_kernel_split_over_threads_computes_the_same() -> None:
    grad, weights, h = case(torch.bfloat16, 2, rows=200)
    expected = bits_of(numba_kernel(grad, weights, h, 2.0))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(bits_of(mix_backward(grad, weights, h, 0.5)), expected), count
    finally:
        torch.set_num_threads(threads)


class Mixture(torch.nn.Module):
    """The expert layer mixed by the weights: fused (:meth:`DenseExperts.mixed`) or not (the layer, then ``bmm``, as
    MMoE mixes for a gate that reads the experts' outputs)."""

    def __init__(self, experts: DenseExperts, fused: bool) -> None:
        super().__init__()
        self.experts, self.fused = experts, fused

    def forward(self, x: torch.Tensor, weights: torch.Tensor, stream: Stream) -> torch.Tensor:
        if self.fused:
            return self.experts.mixed(self.experts.matmul(x), weights, stream)
        return torch.bmm(weights, self.experts(x, stream).flatten(2))


def pack_outputs(module: Mixture, params: dict, x: torch.Tensor, weights: torch.Tensor, upstream: torch.Tensor,
                 seeds: torch.Tensor, steps: torch.Tensor, autocast: bool) -> list[torch.Tensor]:
    """The pack's path (vmapped over the trials' stacked ``params``, inputs and streams): the output, then the
    gradients of x, the weights, the layer's weight and bias."""
    params = {name: t.detach().clone().requires_grad_() for name, t in params.items()}
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()

    def trial(params, x, weights, seed, step):
        return torch.func.functional_call(module, params, (x, weights, Stream(seed, step, 1)))

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = vmap(trial, randomness="error")(params, x, weights, seeds, steps)
    (out.float() * upstream).sum().backward()
    return [out.detach(), x.grad, weights.grad, params["experts.linear.weight"].grad,
            params["experts.linear.bias"].grad]


def pack_case() -> tuple:
    """P = 3 trials of an expert layer of 16 experts of 8 units on 24 inputs, 40 rows, two tasks: the stacked
    parameters, inputs, weights, the output's upstream gradient, and the trials' stream seeds and steps."""
    generator = torch.Generator().manual_seed(3)
    params = {f"experts.{name}": torch.randn(3, *t.shape, generator=generator) / 4
              for name, t in DenseExperts(24, 8, 16).named_parameters()}
    x = torch.randn(3, 40, 24, generator=generator)
    weights = torch.rand(3, 40, 2, 16, generator=generator)
    upstream = torch.randn(3, 40, 2, 8, generator=generator)
    return params, x, weights, upstream, torch.tensor([1, 2**40, 7]), torch.tensor([0, 5, 2**33])


def slot(case: tuple, p: int) -> tuple:
    """Trial ``p`` of :func:`pack_case`'s, as a pack of one."""
    params, *tensors = case
    return {k: t[p:p + 1] for k, t in params.items()}, *(t[p:p + 1] for t in tensors)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_vmapped_pack_mixes_what_the_unfused_layer_and_bmm_compute(autocast: bool) -> None:
    """P = 3 trials of 16 experts of 8 units, two tasks, dropout 0.5: the forward bitwise; the gradients bitwise under
    bf16 autocast, to float32 rounding in float32; one trial alone (no vmap) bitwise its slot of the pack."""
    experts, case = DenseExperts(24, 8, 16, dropout=0.5), pack_case()
    unfused, fused = (pack_outputs(Mixture(experts, f), *case, autocast) for f in (False, True))
    assert torch.equal(bits_of(fused[0]), bits_of(unfused[0]))
    for a, b in zip(fused[1:], unfused[1:]):
        if autocast:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    alone = pack_outputs(Mixture(experts, True), *slot(case, 1), autocast)
    for a, b in zip(alone, fused):
        assert torch.equal(a[0], b[1])


def test_an_mmoe_mixes_fused_as_it_mixes_unfused() -> None:
    """A comet MMoE (two tasks, dropout on) in training under bf16 autocast: the predictions and every parameter's
    gradient bitwise those of the unfused route, which a gate reading the experts' outputs takes (there the experts'
    epilogue runs before the gates: the streams are keyed, so the order draws nothing else; the matmul runs first
    in both, so the bottom's gradient sums its readers' in the same order)."""
    info = DatasetInfo(name="tiny", tasks=(TaskSpec("watch", "binary"), TaskSpec("rating", "regression")),
                       n_ids=50, n_users=50, n_items=40, embedding_dim=8, expert_units=16, tower_units=8,
                       n_experts=5, k=2, expert_dropout=0.5)
    torch.manual_seed(0)
    net = build_mmoe(info, gate_class("comet"))
    batch = {"user": torch.randint(50, (32,)), "item": torch.randint(40, (32,)), "sample_id": torch.arange(32)}
    results = []
    for reads_outputs in (False, True):
        net.zero_grad()
        net.step.zero_()
        for gate in net.gates:
            gate.needs_expert_outputs = reads_outputs  # an instance attribute over the class's
        with torch.autocast("cpu", dtype=torch.bfloat16):
            predictions = net(batch).predictions
        sum(p.float().sum() * (t + 1) for t, p in enumerate(predictions)).backward()
        results.append(([p.detach() for p in predictions],
                         {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}))
    (fused, fused_grads), (unfused, unfused_grads) = results
    assert all(torch.equal(bits_of(a), bits_of(b)) for a, b in zip(fused, unfused))
    assert fused_grads.keys() == unfused_grads.keys() and "experts.linear.weight" in fused_grads
    for name in fused_grads:
        assert torch.equal(fused_grads[name], unfused_grads[name]), name


def test_the_kernel_reports_its_traffic(monkeypatch) -> None:
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    grad, weights, h = case(torch.bfloat16, 2)
    cost = measure(lambda: mix_backward(grad, weights, h, 0.5))
    # the mixture's gradient, the weights and h read, the gradient of y written
    assert cost.by_kernel == {"mix backward (numba)": grad.nbytes + weights.nbytes + 2 * h.nbytes}
    assert cost.launches == 1
    # its product's FLOPs, as FlopCounterMode counts the bmm it replaces
    assert cost.flops == measure(lambda: mix_backward_reference(grad, weights, h, 0.5)).flops == 2 * 37 * 2 * 5 * 30


TRITON_CHECK = """
import numpy as np, torch
from mtmoe.mixing import _mix_backward_cpu, _mix_backward_cpu_bfloat16, mix_backward
from mtmoe.triton_support import use_triton
bits = lambda x: x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.dtype.itemsize])
generator = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.float64, torch.bfloat16):
    for tasks in (1, 2, 3):
        h = torch.randn(7, 5 * 300, generator=generator).relu().to(dtype)  # rows of two blocks
        h[0, :9] = -0.0
        weights = torch.rand(7, tasks, 5, generator=generator).to(dtype)
        grad = torch.randn(7, tasks, 300, generator=generator).to(dtype)
        assert use_triton(h.device)
        out = mix_backward(grad, weights, h, 1 / 3)
        expected = torch.empty_like(h)
        if dtype == torch.bfloat16:
            _mix_backward_cpu_bfloat16(*(x.view(torch.uint16).numpy() for x in (grad, weights, h, expected)),
                                       np.float32(1.5), 0, 7)
        else:
            _mix_backward_cpu(grad.numpy(), weights.numpy(), h.numpy(), expected.numpy(), np.float32(1.5), 0, 7)
        assert torch.equal(bits(out), bits(expected)), (dtype, tasks)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.integration  # a Python process of its own, importing torch and Triton's interpreter: CI, not the inner loop
def test_the_triton_kernel_equals_the_numba_kernel_in_the_interpreter() -> None:
    """Every dtype, one to three tasks, rows over two blocks, zeros of both signs in h: bitwise."""
    run_interpreted(TRITON_CHECK)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_equals_cpu(dtype: torch.dtype) -> None:
    """The Triton kernel on the GPU bitwise the numba kernel, and the fused pack's gradients on the GPU those of the
    unfused layer and cuBLAS's ``bmm`` (bitwise in bfloat16: two tasks); sizes divisible by 16 (the kernel's
    128-bit loads) and not."""
    for tasks, n, units in ((1, 16, 64), (2, 16, 64), (3, 16, 64), (2, 5, 30)):
        grad, weights, h = case(dtype, tasks, rows=300, n=n, units=units)
        out = mix_backward(*(x.cuda() for x in (grad, weights, h)), 1 / 3)
        assert torch.equal(bits_of(out.cpu()), bits_of(numba_kernel(grad, weights, h, 1.5))), tasks
        expected = mix_backward_reference(*(x.cuda() for x in (grad, weights, h)), 1 / 3)
        if dtype == torch.bfloat16 and tasks <= 2:
            assert torch.equal(bits_of(out), bits_of(expected)), tasks
        else:
            tolerance = {torch.float32: 1e-5, torch.float64: 1e-14, torch.bfloat16: 2**-7}[dtype]
            torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
