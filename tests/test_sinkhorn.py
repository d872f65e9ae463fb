"""Batched log-space Sinkhorn and entropy penalty (``mtmoe.sinkhorn``; COMET paper eq. 8 and §4.3).

* one call on a batch of matrices with mixed tau (1e-3 .. 1e-7), iteration counts R (1 .. 150) and penalty scales
  (0 included) gives each matrix what it gets alone, bitwise, forward and gradient; rounds past a matrix's R and
  the buffers' size ``max_iterations`` change nothing;
* the numba loops equal autograd through the unrolled recursion in float64 (to float64 rounding: 1e-10 relative)
  and pass gradcheck;
* under ``torch.func.vmap`` over trials (own U, tau, R, zeta each), ``.backward()`` on the batched result gives
  each trial's own values and gradients, bitwise, from one kernel launch;
* the Triton kernels, run by Triton's interpreter on CPU, equal the numba loops (float64 rounding) and the unrolled
  recursion; on a CUDA device they equal the CPU loops, make no host synchronisation and replay in a CUDA graph.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtmoe.sinkhorn as module
from mtmoe import triton_support
from mtmoe.sinkhorn import log_sinkhorn, sinkhorn, sinkhorn_and_penalty

#: (tau, R, entropy scale) of one batch's matrices: the schedule's ends and middle, a tau that is no float32 value
MIXED = [(1e-3, 20, 1e-4), (1e-7, 150, 0.3), (10 ** -4.3, 1, 0.0), (1e-5, 85, 0.05), (1.0, 3, 0.5)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def schedules(config: list[tuple[float, int, float]], device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """``tau``, ``iterations`` and ``entropy_scale`` tensors of :func:`log_sinkhorn` for ``config``."""
    tau, iterations, scale = zip(*config)
    return (torch.tensor(tau, dtype=torch.float64, device=device), torch.tensor(iterations, device=device),
            torch.tensor(scale, dtype=torch.float64, device=device))


def module_init_u(m: int, n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """U as LocalSearch initialises it: U(-0.05, 0.05)."""
    generator = torch.Generator().manual_seed(seed)
    return ((torch.rand(m, n, n, generator=generator, dtype=torch.float64) - 0.5) * 0.1).to(dtype)


def near_uniform_u(config: list[tuple[float, int, float]], n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """:func:`module_init_u` scaled by tau / 0.05 per matrix: U / tau in (-1, 1), where P is not yet hard and
    the gradient (which scales like 1 / tau) is not negligible at any tau."""
    scale = torch.tensor([tau / 0.05 for tau, _, _ in config], dtype=torch.float64)[:, None, None]
    return (module_init_u(len(config), n, seed) * scale).to(dtype)


def unrolled_log_sinkhorn(u: torch.Tensor, tau: float, iterations: int) -> torch.Tensor:
    """Eq. (8) in log space, unrolled in torch (autograd differentiates it): rows then columns, then exp."""
    log_p = u / tau
    for _ in range(iterations):
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
        log_p = log_p - torch.logsumexp(log_p, dim=-2, keepdim=True)
    return log_p.exp()


def reference_entropy(p: torch.Tensor) -> torch.Tensor:
    """§4.3 in plain torch: column entropy of P plus row entropy of P / row sums, with log(. + 1e-6), per matrix."""
    rows = p / p.sum(-1, keepdim=True)
    return -(p * torch.log(p + 1e-6)).sum((-2, -1)) - (rows * torch.log(rows + 1e-6)).sum((-2, -1))


def forward_backward(call, u: torch.Tensor, upstream: torch.Tensor, penalty_weights: torch.Tensor):
    """``(P, penalty, dLoss/dU)`` for ``loss = sum(P * upstream) + sum(penalty * penalty_weights)``."""
    leaf = u.detach().clone().requires_grad_()
    p, penalty = call(leaf)
    ((p * upstream).sum() + (penalty * penalty_weights).sum()).backward()
    return p.detach(), penalty.detach(), leaf.grad


def upstreams(m: int, n: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(m, n, n, generator=generator, dtype=dtype),
            torch.rand(m, generator=generator, dtype=dtype) + 0.5)


# ----------------------------------------------------------------------------------------------- batch semantics


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [5, 16])
def test_a_batch_gives_each_matrix_what_it_gets_alone(n: int, dtype: torch.dtype) -> None:
    """Mixed tau, R and scales in one call: each matrix's P, penalty and gradient bitwise equal its own call."""
    u = near_uniform_u(MIXED, n, 0, dtype)
    upstream, weights = upstreams(len(MIXED), n, dtype)
    batch = forward_backward(lambda x: log_sinkhorn(x, *schedules(MIXED)), u, upstream, weights)
    for b, config in enumerate(MIXED):
        alone = forward_backward(lambda x: log_sinkhorn(x, *schedules([config])), u[b:b + 1], upstream[b:b + 1],
                                 weights[b:b + 1])
        for batched, single in zip(batch, alone):
            assert batched.dtype == dtype and torch.equal(batched[b:b + 1], single), (b, config)
    p, penalty, grad = batch
    assert p.shape == u.shape and penalty.shape == (len(MIXED),) and grad.shape == u.shape
    assert penalty[2] == 0 and bool((penalty[[0, 1, 3, 4]] > 0).all())  # scale 0: no penalty


def test_rounds_past_a_matrixs_own_r_change_nothing() -> None:
    """A matrix with R = 20 gives the same result beside one running 150 rounds and whatever the buffers' room
    (``max_iterations`` 20, 150, 200); R = 21 does differ, so the comparison sees the iteration count."""
    config = [(1e-3, 20, 1e-4), (1e-3, 150, 1e-4)]
    u = module_init_u(2, 6, 3)  # at the window's start: 20 rounds are far from converged
    upstream, weights = upstreams(2, 6, torch.float64)
    reference = forward_backward(lambda x: log_sinkhorn(x, *schedules(config[:1]), max_iterations=20), u[:1],
                                 upstream[:1], weights[:1])
    for max_iterations in (150, 200):
        batch = forward_backward(lambda x: log_sinkhorn(x, *schedules(config), max_iterations=max_iterations), u,
                                 upstream, weights)
        assert all(torch.equal(b[:1], r) for b, r in zip(batch, reference)), max_iterations
    one_more = forward_backward(lambda x: log_sinkhorn(x, *schedules([(1e-3, 21, 1e-4)])), u[:1], upstream[:1],
                                weights[:1])
    assert not any(torch.equal(o, r) for o, r in zip(one_more, reference))


def test_iterations_outside_the_buffers_raise_on_the_host() -> None:
    u = near_uniform_u(MIXED[:2], 4, 0)
    tau, _, scale = schedules(MIXED[:2])
    for bad in ([0, 5], [5, 151]):
        with pytest.raises(ValueError, match=r"iterations must be in \[1, 150\]"):
            log_sinkhorn(u, tau, torch.tensor(bad), scale)
    with pytest.raises(ValueError, match=r"\[1, 10\], got 5..11"):
        log_sinkhorn(u, tau, torch.tensor([5, 11]), scale, max_iterations=10)


def test_per_trial_wrapper_takes_tensors_or_numbers_and_averages_the_penalty() -> None:
    """``sinkhorn_and_penalty(u [m, n, n], tau, R, zeta)``: 0-d tensors and Python numbers give the same bits;
    the penalty is ``zeta * mean_b H(P_b)`` (§4.3) and ``sinkhorn`` is its P."""
    u = module_init_u(3, 6, 4)
    tau, iterations, zeta = 1e-3, 20, 0.3
    p, penalty = sinkhorn_and_penalty(u, tau, iterations, zeta)
    p_t, penalty_t = sinkhorn_and_penalty(u, torch.tensor(tau, dtype=torch.float64), torch.tensor(iterations),
                                          torch.tensor(zeta, dtype=torch.float64))
    assert torch.equal(p, p_t) and torch.equal(penalty, penalty_t) and penalty.shape == ()
    assert torch.equal(sinkhorn(u, tau, iterations), p)
    assert float(sinkhorn_and_penalty(u, tau, iterations, 0.0)[1]) == 0.0
    expected = zeta * reference_entropy(unrolled_log_sinkhorn(u, tau, iterations)).mean()
    assert torch.allclose(penalty, expected, rtol=1e-12, atol=0)


def test_reference_entropy_end_points() -> None:
    uniform = torch.full((1, 4, 4), 0.25, dtype=torch.float64)
    assert float(reference_entropy(uniform)) == pytest.approx(2 * 4 * math.log(4), rel=1e-5)
    assert abs(float(reference_entropy(torch.eye(4, dtype=torch.float64).unsqueeze(0)))) < 1e-5


# ------------------------------------------------------------------------------------------------- ground truth


def assert_matches_the_unrolled_recursion(config, u: torch.Tensor, batch) -> None:
    """``batch`` (P, penalty, gradient of :func:`forward_backward` with :func:`upstreams`) equals autograd through
    :func:`unrolled_log_sinkhorn` and :func:`reference_entropy` per matrix, to float64 rounding (1e-10 relative)."""
    upstream, weights = upstreams(len(config), u.shape[-1], torch.float64)
    for b, (tau, iterations, scale) in enumerate(config):
        leaf = u[b].detach().double().clone().requires_grad_()
        p = unrolled_log_sinkhorn(leaf, tau, iterations)
        penalty = scale * reference_entropy(p)
        ((p * upstream[b]).sum() + weights[b] * penalty).backward()
        assert torch.allclose(batch[0][b].double(), p, rtol=0, atol=1e-12), (b, config[b])
        assert torch.allclose(batch[1][b].double(), penalty, rtol=1e-10, atol=0), (b, config[b])
        largest = float(leaf.grad.abs().max())
        assert largest > 1e-3 / tau  # a real gradient (they scale like 1 / tau) is compared
        assert torch.allclose(batch[2][b].double(), leaf.grad, rtol=0, atol=1e-10 * largest), (b, config[b])


def test_numba_loops_equal_autograd_through_the_unrolled_recursion() -> None:
    """U / tau in (-10, 10): after 3 and 20 rounds rows are still off 1, so that the penalty's row entropy (of P
    normalised by its row sums) and its gradient differ from the column entropy's."""
    u = near_uniform_u(MIXED, 7, 5) * 10
    upstream, weights = upstreams(len(MIXED), 7, torch.float64)
    batch = forward_backward(lambda x: log_sinkhorn(x, *schedules(MIXED)), u, upstream, weights)
    assert bool(((batch[0][[0, 4]].sum(-1) - 1).abs().amax(-1) > 1e-2).all())
    assert_matches_the_unrolled_recursion(MIXED, u, batch)


def test_gradcheck_with_mixed_iterations_and_scales() -> None:
    config = [(1.0, 1, 0.5), (0.5, 4, 0.0), (1.0, 7, 2.0)]
    probe = torch.randn(3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: log_sinkhorn(x, *schedules(config)), (probe,))


def test_the_penalty_or_p_alone_sends_the_same_gradient() -> None:
    """Autograd gives no gradient for an unused output: it counts as zero."""
    u = near_uniform_u(MIXED, 5, 6)
    upstream, weights = upstreams(len(MIXED), 5, torch.float64)
    call = lambda x: log_sinkhorn(x, *schedules(MIXED))  # noqa: E731
    leaf = u.clone().requires_grad_()
    penalty_only = torch.autograd.grad(call(leaf)[1] @ weights, leaf)[0]
    assert torch.equal(penalty_only, forward_backward(call, u, torch.zeros_like(upstream), weights)[2])
    leaf = u.clone().requires_grad_()
    p_only = torch.autograd.grad((call(leaf)[0] * upstream).sum(), leaf)[0]
    assert torch.equal(p_only, forward_backward(call, u, upstream, torch.zeros_like(weights))[2])


def test_float32_keeps_its_dtype_flushes_would_be_subnormals_and_matches_float64() -> None:
    """float32 in, float32 P, penalty and gradient out; entries below finfo.tiny / finfo.eps are exact zeros (the
    window's start produces such entries), every other entry is the float64 recursion's."""
    floor = torch.finfo(torch.float32).tiny / torch.finfo(torch.float32).eps
    config = [(1e-3, 20, 1e-4), (0.1, 20, 0.0)]
    u = module_init_u(2, 16, 0, torch.float32)
    upstream, weights = upstreams(2, 16, torch.float32)
    p, penalty, grad = forward_backward(lambda x: log_sinkhorn(x, *schedules(config)), u, upstream, weights)
    p64, penalty64, grad64 = forward_backward(lambda x: log_sinkhorn(x, *schedules(config)), u.double(),
                                              upstream.double(), weights.double())
    assert p.dtype == penalty.dtype == grad.dtype == torch.float32
    assert bool(((p64 > 0) & (p64 < floor)).any())
    assert not bool(((p > 0) & (p < floor)).any())
    assert torch.equal(p, torch.where(p64 < floor, 0.0, p64).float())  # the float64 recursion, rounded
    assert torch.allclose(penalty, penalty64.float(), rtol=1e-6, atol=0)
    assert torch.allclose(grad.double(), grad64, rtol=1e-4, atol=1e-6 * float(grad64.abs().max()))


# ------------------------------------------------------------------------------------------------------- vmap

#: Three trials of a pack: own (tau, R, zeta) each
TRIALS = [(1e-3, 20, 1e-4), (1e-7, 150, 0.0), (10 ** -4.3, 77, 0.3)]


def trial_pack(m: int, n: int, dtype=torch.float64, trials=TRIALS) -> tuple[torch.Tensor, ...]:
    """Stacked U ``[P, m, n, n]`` (each trial's U / tau in (-1, 1)), its upstream gradients and the per-trial
    ``tau``, ``R``, ``zeta`` ``[P]``."""
    u = torch.stack([near_uniform_u([trial] * m, n, seed, dtype) for seed, trial in enumerate(trials)])
    generator = torch.Generator().manual_seed(7)
    upstream = torch.randn(u.shape, generator=generator, dtype=dtype)
    return u, upstream, *schedules(trials)


@pytest.mark.parametrize("m", [1, 2])
def test_vmap_over_trials_gives_each_trial_alone_from_one_launch(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``vmap(sinkhorn_and_penalty)`` over 3 trials (own U, tau, R, zeta) and ``.backward()``: every trial's P,
    penalty and gradient bitwise equal to the trial's own call with Python numbers; one forward and one backward
    kernel call for the pack."""
    u, upstream, tau, iterations, zeta = trial_pack(m, 6)
    launches = {name: 0 for name in ("_forward_cpu", "_backward_cpu")}
    for name in launches:
        kernel = getattr(module, name)

        def counted(*args, name=name, kernel=kernel):
            launches[name] += 1
            return kernel(*args)

        monkeypatch.setattr(module, name, counted)
    weights = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    stacked = u.clone().requires_grad_()
    p, penalty = torch.func.vmap(sinkhorn_and_penalty)(stacked, tau, iterations, zeta)
    assert p.shape == u.shape and penalty.shape == (len(TRIALS),)
    ((p * upstream).sum() + (penalty * weights).sum()).backward()
    assert launches == {"_forward_cpu": 1, "_backward_cpu": 1}
    for k, (tau_k, iterations_k, zeta_k) in enumerate(TRIALS):
        alone = u[k].clone().requires_grad_()
        p_k, penalty_k = sinkhorn_and_penalty(alone, tau_k, iterations_k, zeta_k)
        ((p_k * upstream[k]).sum() + weights[k] * penalty_k).backward()
        assert torch.equal(p[k], p_k) and torch.equal(penalty[k], penalty_k)
        assert torch.equal(stacked.grad[k], alone.grad)


def test_vmap_with_shared_arguments_and_nested() -> None:
    """Arguments not vmapped (``in_dims`` None: one schedule for all trials, per matrix or per trial) broadcast;
    vmap over a vmap folds both axes."""
    u = torch.stack([near_uniform_u(MIXED, 5, seed) for seed in range(2)])
    shared = torch.func.vmap(log_sinkhorn, in_dims=(0, None, None, None))(u, *schedules(MIXED))
    for k in range(2):
        alone = log_sinkhorn(u[k], *schedules(MIXED))
        assert torch.equal(shared[0][k], alone[0]) and torch.equal(shared[1][k], alone[1])
    u, upstream, tau, iterations, zeta = trial_pack(2, 5)
    shared = torch.func.vmap(sinkhorn_and_penalty, in_dims=(0, None, 0, None))(u, tau[2], iterations, zeta[2])
    for k in range(len(TRIALS)):
        alone = sinkhorn_and_penalty(u[k], tau[2], iterations[k], zeta[2])
        assert torch.equal(shared[0][k], alone[0]) and torch.equal(shared[1][k], alone[1])
    grid = torch.func.vmap(torch.func.vmap(sinkhorn_and_penalty, in_dims=(0, None, None, None)))(
        u.unsqueeze(1).expand(-1, 2, -1, -1, -1), tau, iterations, zeta)
    single = torch.func.vmap(sinkhorn_and_penalty)(u, tau, iterations, zeta)
    assert torch.equal(grid[0][:, 1], single[0]) and torch.equal(grid[1][:, 0], single[1])


# ---------------------------------------------------------------------------------------------------- Triton


def triton_inputs(device: str, n: int, dtype: torch.dtype, config=MIXED, trials=TRIALS) -> dict:
    """Inputs of :func:`triton_results` on ``device``: a batch of matrices with ``config``'s (tau, R, scale) and
    a pack of trials with ``trials``' (m = 2)."""
    upstream, weights = upstreams(len(config), n, dtype)
    pack_u, pack_upstream, tau, iterations, zeta = trial_pack(2, n, dtype, trials)
    inputs = {"u": near_uniform_u(config, n, n, dtype), "upstream": upstream, "weights": weights,
              "schedules": schedules(config), "pack_u": pack_u, "pack_upstream": pack_upstream,
              "pack_weights": torch.ones(len(trials), dtype=dtype), "pack_schedules": (tau, iterations, zeta)}
    return {key: tuple(x.to(device) for x in value) if isinstance(value, tuple) else value.to(device)
            for key, value in inputs.items()}


def triton_results(inputs: dict) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """P, penalty and gradient of the batch and of the vmapped pack of :func:`triton_inputs`."""
    batch = forward_backward(lambda x: log_sinkhorn(x, *inputs["schedules"]), inputs["u"], inputs["upstream"],
                             inputs["weights"])
    pack = forward_backward(lambda x: torch.func.vmap(sinkhorn_and_penalty)(x, *inputs["pack_schedules"]),
                            inputs["pack_u"], inputs["pack_upstream"], inputs["pack_weights"])
    return batch, pack


def assert_close_to_the_numba_loops(triton, numba, dtype: torch.dtype) -> None:
    """Triton's P, penalty, gradient against the numba loops' (float32: their rounding; float64: 1e-12 on P and
    the penalty, 1e-10 of the largest gradient)."""
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12
    (p_t, penalty_t, grad_t), (p_c, penalty_c, grad_c) = triton, numba
    assert p_t.dtype == penalty_t.dtype == grad_t.dtype == dtype
    assert torch.allclose(p_t.cpu(), p_c, rtol=0, atol=tolerance)
    assert torch.allclose(penalty_t.cpu(), penalty_c, rtol=10 * tolerance, atol=tolerance)
    largest = float(grad_c.abs().max())
    assert largest > 0
    assert torch.allclose(grad_t.cpu() / largest, grad_c / largest, rtol=0,
                          atol=1e-5 if dtype == torch.float32 else 1e-10)


#: Shorter schedules for Triton's interpreter (~10 ms a round per matrix): one matrix of R = 150 in the last batch
INTERPRETED = [[(1e-3, 20, 1e-4), (10 ** -4.3, 1, 0.0), (1e-7, 5, 0.3)]] * 3 + [MIXED[:4]]
INTERPRETED_TRIALS = [(1e-3, 3, 1e-4), (1e-7, 1, 0.0), (10 ** -4.3, 5, 0.3)]


def check_interpreted_triton_kernels() -> None:
    """Run with ``TRITON_INTERPRET=1``: the Triton kernels on CPU tensors (mixed tau, R 1..150, scales, n below, at
    and above the 16-wide block, float32 and float64, a vmapped pack) equal the numba loops and the unrolled
    recursion, and clamp an R outside ``[1, max_iterations]`` (a CUDA tensor is not checked on the host)."""
    assert triton_support.INTERPRET
    for (n, dtype), config in zip([(2, torch.float32), (5, torch.float64), (16, torch.float32), (17, torch.float64)],
                                  INTERPRETED):
        results = {}
        for interpret in (True, False):
            triton_support.INTERPRET = interpret
            assert triton_support.use_triton(torch.device("cpu")) == interpret
            results[interpret] = triton_results(triton_inputs("cpu", n, dtype, config, INTERPRETED_TRIALS))
        for triton, numba in zip(results[True], results[False]):
            assert_close_to_the_numba_loops(triton, numba, dtype)
        if dtype == torch.float64:
            assert_matches_the_unrolled_recursion(config, near_uniform_u(config, n, n), results[True][0])
    triton_support.INTERPRET = True
    u, tau, scale = near_uniform_u(MIXED[:2], 4, 0), *schedules(MIXED[:2])[::2]
    outputs = [torch.empty(2, 4, 4, dtype=torch.float64), torch.empty(2, dtype=torch.float64),
               torch.empty(2, 10, 4, 4, dtype=torch.float64), torch.empty(2, 10, 4, 4, dtype=torch.float64),
               torch.empty(2, 4, 4, dtype=torch.float64)]
    module._forward_cuda[(2,)](u, tau, torch.tensor([0, 11]), scale, *outputs, 0.0, 4, 10, BLOCK=16,
                               EPS=module.ENTROPY_EPS)
    clamped = log_sinkhorn(u, tau, torch.tensor([1, 10]), scale, max_iterations=10)
    assert torch.equal(outputs[0], clamped[0]) and torch.equal(outputs[1], clamped[1])
    print("ok")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.integration  # a Python process of its own, importing torch and Triton's interpreter: CI, not the inner loop
def test_triton_kernels_in_the_interpreter_equal_the_numba_loops() -> None:
    """:func:`check_interpreted_triton_kernels` in a process with ``TRITON_INTERPRET=1`` (read at import)."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_sinkhorn as t; " \
           "t.check_interpreted_triton_kernels()"
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA device and Triton")
@pytest.mark.parametrize(("n", "dtype"), [(2, torch.float32), (5, torch.float64), (16, torch.float32),
                                          (33, torch.float64)])
def test_cuda_kernels_equal_the_cpu_loops_without_synchronising(n: int, dtype: torch.dtype) -> None:
    """On the GPU (a mixed batch and a vmapped pack) the Triton kernels give the CPU loops' results, and a step
    after the first (which compiles them) reads nothing back to the host."""
    inputs = triton_inputs("cuda", n, dtype)
    triton_results(inputs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host read of a CUDA tensor raises
    try:
        gpu = triton_results(inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for on_gpu, on_cpu in zip(gpu, triton_results(triton_inputs("cpu", n, dtype))):
        assert_close_to_the_numba_loops(on_gpu, on_cpu, dtype)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA device and Triton")
def test_a_cuda_graph_replays_a_pack_step_with_new_schedules() -> None:
    """Forward and backward of a vmapped 3-trial pack captured once in a CUDA graph; replayed after writing other
    U, tau, R and zeta into its inputs, it gives the CPU loops' results for those."""
    n, dtype = 6, torch.float32
    u, upstream, tau, iterations, zeta = (x.cuda() for x in trial_pack(2, n, dtype))
    leaf = u.clone().requires_grad_()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        p, penalty = torch.func.vmap(sinkhorn_and_penalty)(leaf, tau, iterations, zeta)
        ((p * upstream).sum() + penalty.sum()).backward()
        return p, penalty

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels and warms the allocator outside the capture
        for _ in range(2):
            leaf.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p, penalty = step()
    grad = leaf.grad
    for trials in (TRIALS[1:] + TRIALS[:1], TRIALS[::-1]):
        new_u, _, *values = trial_pack(2, n, dtype, trials)
        with torch.no_grad():
            leaf.copy_(new_u)
        for tensor, value in zip((tau, iterations, zeta), values):
            tensor.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        for k, (tau_k, iterations_k, zeta_k) in enumerate(trials):
            alone = new_u[k].clone().requires_grad_()
            p_k, penalty_k = sinkhorn_and_penalty(alone, tau_k, iterations_k, zeta_k)
            ((p_k * upstream[k].cpu()).sum() + penalty_k).backward()
            assert_close_to_the_numba_loops((p[k], penalty[k], grad[k]), (p_k.detach(), penalty_k.detach(),
                                                                           alone.grad), dtype)
