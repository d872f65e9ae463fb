"""Per-trial random streams (``mtmoe.random``, issue 25).

Covers the generator against an independent pure-Python statement of its construction, the numba and Triton
(interpreter; CUDA when present) kernels bitwise against the torch reference, a vmapped pack against each trial
alone (forward and gradient, a plain ``.backward`` through the vmapped graph), the backward as the gradient times the
recomputed mask, half precision and autocast, the small draws (uniform, Gumbel, Bernoulli), and the statistics of the
streams: uniformity, independence of neighbouring positions, keep fraction and independence across trials, steps and
sites. The statistical battery is also run on deliberately broken generators, each of which it must reject.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.stats
import torch
from torch.func import vmap
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mtmoe.random as module
from mtmoe import triton_support
from mtmoe.random import (
    bernoulli, dropout, dropout_reference, dropout_scale, dropout_threshold, gumbel, random_bits, uniform,
)

SITE = 5
LOW32 = 0xFFFFFFFF


def tensor(value: int | list[int]) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64)


def lowbias32(x: int) -> int:
    """Wellons' lowbias32 as published (hash-prospector), on a Python int."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & LOW32
    x ^= x >> 15
    x = (x * 0x846CA68B) & LOW32
    return x ^ (x >> 16)


def documented_bits(seed: int, site: int, step: int, position: int) -> int:
    """The construction as ``mtmoe.random``'s docstring states it, in Python integers."""
    lanes = [lowbias32(2 * site), lowbias32(2 * site + 1)]
    for value in (seed, step):
        for word in (value & LOW32, (value >> 32) & LOW32):
            lanes = [lowbias32(lane ^ word) for lane in lanes]
    return lowbias32(lowbias32(position ^ lanes[0]) ^ lanes[1])


# ---- the generator and its kernels, bitwise -----------------------------------------------------------------------

@pytest.mark.parametrize("seed, step", [(0, 0), (1, 1), (2**63 - 1, 3), (2**40 + 17, 2**35 + 1), (-5, 12)])
def test_reference_is_the_documented_construction(seed: int, step: int) -> None:
    positions = [0, 1, 2, 1000, 2**31, 2**32 - 1]
    bits = random_bits(tensor(seed), SITE, tensor(step), tensor(positions))
    assert bits.tolist() == [documented_bits(seed, SITE, step, p) for p in positions]
    assert bits.dtype == torch.int64


def test_numba_stream_equals_the_reference() -> None:
    seed, step, first, count = 2**45 + 3, 2**33 + 9, 12345, 3001
    lanes = np.empty(2, np.uint32)
    module._derive_keys(lanes, seed, step, *module._initial_lanes(SITE))
    words = np.empty(count, np.uint32)
    module._stream(words, count, first, lanes[0], lanes[1])
    expected = random_bits(tensor(seed), SITE, tensor(step), torch.arange(first, first + count))
    assert torch.equal(torch.from_numpy(words.astype(np.int64)), expected)


def packs(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(h, seed, step)``: one trial, a pack of three with a trial numel that spans two numba chunks and is odd, a
    pack of two of 4,096 elements each (divisible by 16: the Triton kernel's 128-bit loads), and, for half
    precision, one trial of every finite value (p = 1/3 scales by 1.5: many rounding ties)."""
    generator = torch.Generator().manual_seed(0)
    one = torch.randn(6, 7, generator=generator).to(dtype)
    three = torch.randn(3, 4099, generator=generator).to(dtype)
    two = torch.randn(2, 4096, generator=generator).to(dtype)
    cases = [(one, tensor(99), tensor(4)), (three, tensor([1, 2**40, 7]), tensor([0, 5, 2**33])),
             (two, tensor([3, 11]), tensor([1, 2]))]
    if dtype.itemsize == 2:
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        cases.append((every[torch.isfinite(every)], tensor(5), tensor(6)))
    return cases


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bit patterns (bitwise comparisons: the sign of zero counts)."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.dtype.itemsize])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.5, 0.1, 1 / 3])
def test_numba_kernel_equals_the_reference(dtype: torch.dtype, p: float, monkeypatch) -> None:
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    for h, seed, step in packs(dtype):
        assert not triton_support.use_triton(h.device)
        out = module._dropout_kernel(h, seed, step, SITE, p)
        assert out.dtype == dtype
        assert torch.equal(bits_of(out), bits_of(dropout_reference(h, seed, SITE, step, p)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_numba_kernel_split_over_threads_equals_the_reference(dtype: torch.dtype, monkeypatch) -> None:
    """The CPU kernel runs its chunks on torch's threads (``mtmoe.host_threads.run_split``): with 2 threads the
    split falls inside a trial, with 3 on trial boundaries; every split gives the reference's bits."""
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    h = torch.randn(3, 50_001).to(dtype)
    seed, step = torch.tensor([1, 2**40, 7]), torch.tensor([0, 5, 2**33])
    expected = bits_of(dropout_reference(h, seed, SITE, step, 0.5))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(bits_of(module._dropout_kernel(h, seed, step, SITE, 0.5)), expected), count
    finally:
        torch.set_num_threads(threads)


TRITON_CHECK = """
import torch
from torch.func import vmap
import mtmoe.random as module
from mtmoe.random import dropout, dropout_reference
from mtmoe.triton_support import use_triton
t = lambda v: torch.tensor(v, dtype=torch.int64)
bits = lambda x: x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.dtype.itemsize])
for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
    cases = [(torch.randn(6, 7).to(dtype), t(99), t(4), 0.5),
             (torch.randn(3, 1100).to(dtype), t([1, 2**40, 7]), t([0, 5, 2**33]), 1 / 3)]
    if dtype == torch.bfloat16:  # every fifth finite value, scaled by 1.5: the kernel's own rounding, many ties
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        cases.append((every[torch.isfinite(every)][::5], t(5), t(6), 1 / 3))
    for h, seed, step, p in cases:
        assert use_triton(h.device)
        out = module._dropout_kernel(h, seed, step, 5, p)
        assert out.dtype == dtype and torch.equal(bits(out), bits(dropout_reference(h, seed, 5, step, p))), dtype
h = torch.randn(3, 40, 9, requires_grad=True)
seeds, steps, upstream = t([3, 4, 2**62]), t([7, 7, 0]), torch.randn(3, 40, 9)
(vmap(lambda h, s, k: dropout(h, s, 5, k, 0.3))(h, seeds, steps) * upstream).sum().backward()
mask = dropout_reference(torch.ones(3, 40, 9), seeds, 5, steps, 0.3)
assert torch.equal(h.grad, upstream * mask)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.integration  # a Python process of its own, importing torch and Triton's interpreter: CI, not the inner loop
def test_triton_kernel_equals_the_reference_in_the_interpreter() -> None:
    """The CUDA kernel on CPU tensors in Triton's interpreter: every dtype, one trial and a pack of three over
    several blocks, a fifth of the finite bfloat16 values, and a vmapped forward with its backward."""
    run_interpreted(TRITON_CHECK)


def run_interpreted(code: str) -> None:
    """``code`` in a Python process with ``TRITON_INTERPRET=1`` (read at import): it must succeed and print
    ``ok`` first."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_cuda_equals_cpu(dtype: torch.dtype) -> None:
    for h, seed, step in packs(dtype):
        on_cpu = dropout(h, seed, SITE, step, 1 / 3) if seed.dim() == 0 else vmap(
            lambda h, s, k: dropout(h, s, SITE, k, 1 / 3))(h, seed, step)
        cuda = [x.cuda() for x in (h, seed, step)]
        assert torch.equal(bits_of(module._dropout_kernel(*cuda, SITE, 1 / 3).cpu()), bits_of(on_cpu))
        assert torch.equal(bits_of(dropout_reference(cuda[0], cuda[1], SITE, cuda[2], 1 / 3).cpu()), bits_of(on_cpu))
        positions = torch.arange(99)
        assert torch.equal(random_bits(cuda[1].unsqueeze(-1), SITE, cuda[2].unsqueeze(-1), positions.cuda()).cpu(),
                           random_bits(seed.unsqueeze(-1), SITE, step.unsqueeze(-1), positions))


# ---- a pack draws what each trial draws alone; autograd ---------------------------------------------------------

def test_a_pack_draws_what_each_trial_draws_alone() -> None:
    """P = 3 trials with their own seeds and steps: the vmapped forward (the numba kernel once for all) and a plain
    ``.backward`` through it give each trial its forward and gradient alone, and the gradient is the upstream
    gradient times the mask over 1 - p."""
    generator = torch.Generator().manual_seed(1)
    h = torch.randn(3, 16, 33, generator=generator, requires_grad=True)
    upstream = torch.randn(3, 16, 33, generator=generator)
    seeds, steps = tensor([11, 2**50 + 3, 11]), tensor([4, 0, 5])
    out = vmap(lambda h, seed, step: dropout(h, seed, SITE, step, 0.5))(h, seeds, steps)
    (out * upstream).sum().backward()
    reference = vmap(lambda h, seed, step: dropout_reference(h, seed, SITE, step, 0.5))(h.detach(), seeds, steps)
    assert torch.equal(out, reference)
    for trial in range(3):
        alone = h[trial].detach().clone().requires_grad_()
        out_alone = dropout(alone, seeds[trial], SITE, steps[trial], 0.5)
        (out_alone * upstream[trial]).sum().backward()
        assert torch.equal(out_alone, out[trial])
        assert torch.equal(alone.grad, h.grad[trial])
        keep = out_alone != 0
        assert torch.equal(alone.grad, upstream[trial] * keep / (1 - 0.5))
    assert not torch.equal(out[0] != 0, out[2] != 0)  # same seed, other step


def test_backward_recomputes_the_forward_mask() -> None:
    """The gradient is ``grad * keep * scale`` with the forward's step even if the step buffer moved on, equals
    autograd through the reference, and is itself differentiable (the same function of the gradient)."""
    h = torch.randn(40, 50, requires_grad=True)
    seed, step = tensor(3), tensor(8)
    upstream = torch.randn(40, 50, requires_grad=True)
    out = dropout(h, seed, SITE, step, 0.3)
    step += 1  # as a model counts its forward passes
    (grad,) = torch.autograd.grad(out, h, upstream, create_graph=True)
    mask = dropout_reference(torch.ones(40, 50), seed, SITE, tensor(8), 0.3)
    assert torch.equal(grad, upstream * mask)
    h_reference = h.detach().clone().requires_grad_()
    dropout_reference(h_reference, seed, SITE, tensor(8), 0.3).backward(upstream.detach())
    assert torch.equal(grad, h_reference.grad)
    direction = torch.randn(40, 50)
    (second,) = torch.autograd.grad(grad, upstream, direction)
    assert torch.equal(second, direction * mask)


def test_nested_vmap_and_a_shared_seed() -> None:
    """Trials along two vmapped dimensions, and a seed shared by a vmapped batch (the same mask for each)."""
    h = torch.randn(2, 3, 5, 6)
    seeds, steps = torch.arange(6).view(2, 3), torch.arange(6).view(2, 3) * 7
    out = vmap(vmap(lambda h, seed, step: dropout(h, seed, SITE, step, 0.3)))(h, seeds, steps)
    assert torch.equal(out, dropout_reference(h, seeds, SITE, steps, 0.3))
    shared = vmap(lambda h: dropout(h, seeds[0, 0], SITE, steps[0, 0], 0.3))(h[0])
    keep = dropout_reference(torch.ones(5, 6), seeds[0, 0], SITE, steps[0, 0], 0.3) != 0
    assert torch.equal(shared != 0, keep.expand(3, 5, 6))


def test_half_precision_and_autocast() -> None:
    """bf16 under CPU autocast (the expert layer's output), fp16 and float64; p = 0 returns ``h`` itself."""
    x, weight = torch.randn(8, 12), torch.randn(20, 12)
    seed, step = tensor(1), tensor(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = F.linear(x, weight).relu_()
        out = dropout(h, seed, SITE, step, 0.5)
    assert h.dtype == out.dtype == torch.bfloat16
    assert torch.equal(out, dropout_reference(h, seed, SITE, step, 0.5))
    assert torch.equal(out, h * 2 * (out != 0))  # scale 2 is exact
    for dtype in (torch.float16, torch.float64):
        h = torch.randn(8, 20, dtype=dtype)
        assert torch.equal(dropout(h, seed, SITE, step, 0.2), dropout_reference(h, seed, SITE, step, 0.2))
    assert dropout(h, seed, SITE, step, 0.0) is h


def test_quantisation_and_arguments() -> None:
    assert dropout_threshold(0.5) == 32768 and dropout_scale(0.5) == 2.0
    assert dropout_threshold(0.1) == 6554 and dropout_scale(0.1) == float(np.float32(1 / 0.9))
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError):
            dropout(torch.ones(3), tensor(0), SITE, tensor(0), p)
    for site in (-1, 2**31):
        with pytest.raises(ValueError):
            dropout(torch.ones(3), tensor(0), site, tensor(0), 0.5)
    with pytest.raises(TypeError):
        dropout(torch.ones(3), torch.tensor(0, dtype=torch.int32), SITE, tensor(0), 0.5)
    with pytest.raises(ValueError):
        dropout(torch.ones(2, 3), tensor([1, 2, 3]), SITE, tensor(0), 0.5)


# ---- small draws ------------------------------------------------------------------------------------------------

def test_small_draws() -> None:
    """Uniforms exact in their dtype and in [0, 1), finite Gumbel noise, Bernoulli coins; the same per trial under
    vmap."""
    seed, step = tensor(7), tensor(3)
    for dtype, digits in ((torch.float64, 32), (torch.float32, 24), (torch.bfloat16, 8)):
        u = uniform(seed, SITE, step, (64, 16), "cpu", dtype)
        assert u.dtype == dtype and u.shape == (64, 16)
        assert 0 <= float(u.min()) and float(u.max()) < 1
        scaled = u.double() * 2.0**digits
        assert torch.equal(scaled, scaled.floor())
    assert torch.equal(uniform(seed, SITE, step, (64, 16), "cpu"),
                       random_bits(seed, SITE, step, torch.arange(1024).view(64, 16)).double() / 2**32)
    g = gumbel(seed, SITE, step, (4096,), "cpu", torch.float32)
    assert g.dtype == torch.float32 and bool(torch.isfinite(g).all())
    coins = bernoulli(seed, SITE, step, (4096,), 0.25, "cpu")
    assert coins.dtype == torch.bool and abs(float(coins.double().mean()) - 0.25) < 5 * math.sqrt(0.25 * 0.75 / 4096)
    assert bool(bernoulli(seed, SITE, step, (9,), 1.0, "cpu").all()) and not bool(
        bernoulli(seed, SITE, step, (9,), 0.0, "cpu").any())
    seeds, steps = tensor([1, 2, 1]), tensor([5, 5, 6])
    packed = vmap(lambda seed, step: gumbel(seed, SITE, step, (8, 4), "cpu"))(seeds, steps)
    for trial in range(3):
        assert torch.equal(packed[trial], gumbel(seeds[trial], SITE, steps[trial], (8, 4), "cpu"))


class NoHostReads(TorchDispatchMode):
    """Fails on the operations that CUDA graphs and vmap cannot take: reading a value on the host (``.item()``,
    ``bool``, ``.tolist()``), data-dependent shapes and dtype views."""

    FORBIDDEN = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                 torch.ops.aten.masked_select.default, torch.ops.aten.view.dtype}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func not in self.FORBIDDEN, func
        return func(*args, **(kwargs or {}))


def test_the_reference_reads_nothing_on_the_host() -> None:
    seed, step = tensor(7), tensor(3)
    with NoHostReads():
        uniform(seed, SITE, step, (5, 3), "cpu")
        gumbel(seed, SITE, step, (5, 3), "cpu")
        bernoulli(seed, SITE, step, (5, 3), 0.5, "cpu")
        dropout_reference(torch.ones(2, 5, 3), tensor([1, 2]), SITE, step, 0.5)
    with pytest.raises(AssertionError), NoHostReads():  # the check sees a host read
        bool(seed > 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gumbel_noise_is_finite_at_the_extreme_bits(dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setattr(module, "random_bits", lambda seed, site, step, position: tensor([0, LOW32]))
    noise = gumbel(tensor(0), SITE, tensor(0), (2,), "cpu", dtype)
    assert bool(torch.isfinite(noise).all()) and float(noise[0]) < float(noise[1])


def test_uniform_and_gumbel_distributions() -> None:
    u = uniform(tensor(0), SITE, tensor(0), (1 << 15,), "cpu").numpy()
    assert scipy.stats.kstest(u, "uniform").pvalue > 1e-3
    g = gumbel(tensor(0), SITE + 1, tensor(0), (1 << 15,), "cpu").numpy()
    assert scipy.stats.kstest(g, "gumbel_r").pvalue > 1e-3


# ---- statistics, and their power against broken generators -------------------------------------------------------

def keep_masks(bits, seed: torch.Tensor, step: torch.Tensor, numel: int, p: float, site: int = SITE) -> torch.Tensor:
    """Dropout's keep decisions from a generator ``bits``: element ``i`` from the 16-bit half ``i & 1`` of word
    ``i >> 1`` (what the kernels compute from :func:`random_bits`)."""
    words = bits(seed.unsqueeze(-1), site, step.unsqueeze(-1), torch.arange((numel + 1) // 2))
    return torch.stack((words & 0xFFFF, words >> 16), dim=-1).flatten(-2)[..., :numel] >= dropout_threshold(p)


def chi_square_z(counts: torch.Tensor) -> float:
    """The chi-square statistic of equiprobable ``counts`` as a z-score (normal approximation)."""
    expected = float(counts.sum()) / counts.numel()
    statistic = float(((counts.double() - expected) ** 2).sum()) / expected
    df = counts.numel() - 1
    return (statistic - df) / math.sqrt(2 * df)


def agreement_z(masks: torch.Tensor, p: float) -> float:
    """The largest |z| of the fraction of equal decisions between any two rows of ``masks``, against the
    independent rows' p^2 + (1 - p)^2."""
    n = masks.shape[-1]
    expected = p * p + (1 - p) * (1 - p)
    agree = (masks.unsqueeze(0) == masks.unsqueeze(1)).double().mean(-1)
    off_diagonal = agree[~torch.eye(masks.shape[0], dtype=torch.bool)]
    return float((off_diagonal - expected).abs().max()) / math.sqrt(expected * (1 - expected) / n)


SEEDS = tensor([0, 1, 2, 3, 2**32, 2**33, 2**62 + 1, 12345])  # neighbours in the low and in the high word
STEPS = tensor([0, 1, 2, 3, 2**32, 2**32 + 1, 1000, 1001])


def statistics(bits):
    """``(name, z)`` for z-scores that stay small (|z| < 5) for a stream of independent uniform bits, computed
    one at a time."""
    words = bits(tensor(0), SITE, tensor(0), torch.arange(1 << 18))
    yield "16-bit halves", chi_square_z(torch.bincount(torch.cat((words & 0xFFFF, words >> 16)), minlength=1 << 16))
    ones = torch.stack([(words >> b) & 1 for b in range(32)]).sum(-1).double()
    yield "bit frequencies", float(((ones - words.numel() / 2) / math.sqrt(words.numel() / 4)).abs().max())
    yield "neighbouring words", chi_square_z(torch.bincount((words[:-1] >> 28) * 16 + (words[1:] >> 28),
                                                             minlength=256))
    n, p = 1 << 14, 0.3
    keep = keep_masks(bits, tensor(0), tensor(0), 1 << 18, p)
    yield "keep fraction", (float(keep.double().mean()) - (1 - p)) / math.sqrt(p * (1 - p) / keep.numel())
    yield "across seeds", agreement_z(keep_masks(bits, SEEDS, tensor(9), n, p), p)
    yield "across steps", agreement_z(keep_masks(bits, tensor(9), STEPS, n, p), p)
    yield "across sites", agreement_z(torch.stack([keep_masks(bits, tensor(9), tensor(9), n, p, site)
                                                   for site in range(8)]), p)


def test_the_streams_statistics() -> None:
    """Uniform 16-bit halves (65,536 buckets) and bits, independent neighbouring words, keep fraction 1 - p, and
    masks of different seeds, steps or sites agreeing as independent ones do (p^2 + (1 - p)^2)."""
    z = dict(statistics(random_bits))
    assert all(abs(value) < 5 for value in z.values()), z


BROKEN = {
    "constant": lambda seed, site, step, position: torch.zeros_like(position + seed + step),
    "position-independent": lambda seed, site, step, position: random_bits(seed, site, step, position * 0),
    "a counter": lambda seed, site, step, position: (position + random_bits(seed, site, step, position * 0)) & LOW32,
    "seed-blind": lambda seed, site, step, position: random_bits(seed * 0, site, step, position),
    "blind to the seed's high word": lambda seed, site, step, position: random_bits(seed & LOW32, site, step,
                                                                                    position),
    "step-blind": lambda seed, site, step, position: random_bits(seed, site, step * 0, position),
    "site-blind": lambda seed, site, step, position: random_bits(seed, 0, step, position),
    "one hash of a sum": lambda seed, site, step, position: module._lowbias32((position + seed + step) & LOW32),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_the_statistics_reject_a_broken_generator(name: str) -> None:
    assert any(abs(z) > 5 for _, z in statistics(BROKEN[name]))


FMA_CHECK = """
import torch
import mtmoe.random  # under the interpreter: tl.fma fused where Triton's interpreter does not fuse it
from mtmoe.triton_support import tl, triton

@triton.jit
def fma_kernel(x_ptr, z_ptr, out_ptr):
    x = tl.load(x_ptr + tl.arange(0, 2))
    tl.store(out_ptr + tl.arange(0, 2), tl.fma(x, x, tl.load(z_ptr + tl.arange(0, 2))))

for dtype, e in ((torch.float32, 12), (torch.float64, 27)):
    x = torch.tensor([1 + 2.0**-e, 3.0], dtype=dtype)
    z = torch.tensor([-(1 + 2.0**-(e - 1)), 1.0], dtype=dtype)
    out = torch.empty_like(x)
    fma_kernel[(1,)](x, z, out)
    assert out.tolist() == [2.0**(-2 * e), 10.0], (dtype, out.tolist())
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_interpreter_fuses_tl_fma_as_a_gpu_does() -> None:
    """``tl.fma`` under Triton's interpreter rounds once, as on a GPU and as the CPU kernels' ``_fma`` (Triton 3.8's
    interpreter rounds twice; ``mtmoe.random`` replaces it there): ``(1 + 2^-e)^2 - (1 + 2^-(e-1))`` is
    ``2^-2e``, not 0, in float32 and float64."""
    run_interpreted(FMA_CHECK)
