"""Permutation-based local search, the "+" gates (COMET paper Section 4; comet-protocol.md §3, §9.1 rows 6-7, §9.2).

Covers the Sinkhorn operator's behaviour (its kernels are tested in ``test_sinkhorn.py``), Hungarian rounding, the
tau/R schedules, the ``LocalSearch`` state machine (window, rounding between steps, freeze, checkpointing, entropy
penalty, no host read in a training step), the Section 4.1 identity (permuting weights = re-indexing experts), "+"
keeps every gate's sparsity, a planted routing problem that only the "+" variant can solve, and the command line's
handling of "+" gates.
"""
from __future__ import annotations

import collections
import copy
import importlib.util
import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mtmoe.permutation as permutation_module
from conftest import run_cli
from test_sinkhorn import module_init_u, unrolled_log_sinkhorn
from mtmoe.data.base import DatasetInfo, TaskSpec
from mtmoe.errors import UsageError
from mtmoe.gates import GateDims, HashGate, gate_class, list_gates
from mtmoe.lit.module import MultiTaskMoE
from mtmoe.pack.settings import ModelSettings
from mtmoe.mmoe import MMoE, build_mmoe
from mtmoe.permutation import (
    ITERATIONS_END,
    ITERATIONS_START,
    TAU_END,
    TAU_START,
    LocalSearch,
    round_to_permutation,
    round_to_permutations,
    schedule,
)
from mtmoe.sinkhorn import LogSinkhorn, sinkhorn

FAST = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--data.batch_size=64"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add synchronisation cost (several times slower on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------------- helpers


def random_permutation_matrix(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return torch.eye(n, dtype=dtype)[order]


def planted_u(q: torch.Tensor, seed: int) -> torch.Tensor:
    """U(-0.05, 0.05) noise plus 0.2 on the permutation ``q``: ``q`` is the unique max-weight matching, with margin."""
    return module_init_u(1, q.shape[-1], seed, q.dtype) + 0.2 * q


def reference_penalty(p: torch.Tensor, zeta: float) -> torch.Tensor:
    """§4.3 in plain torch (autograd differentiates it): zeta times the mean over matrices of the column entropy
    of P plus the row entropy of P normalised by its row sums, with log(. + 1e-6) (the official code's)."""
    rows = p / p.sum(-1, keepdim=True)
    column_entropy = -(p * torch.log(p + 1e-6)).sum((-2, -1))
    row_entropy = -(rows * torch.log(rows + 1e-6)).sum((-2, -1))
    return zeta * (column_entropy + row_entropy).mean()


def assignment_matrix(u: torch.Tensor) -> torch.Tensor:
    """Permutation matrix of the max-weight matching of one ``[n, n]`` matrix (``linear_sum_assignment(-U)``)."""
    rows, cols = linear_sum_assignment(-u.detach().double().numpy())
    out = torch.zeros(u.shape, dtype=u.dtype)
    out[torch.as_tensor(rows), torch.as_tensor(cols)] = 1.0
    return out


def assert_permutation_matrices(p: torch.Tensor) -> None:
    assert p.dim() == 3 and p.shape[-1] == p.shape[-2]
    assert bool(((p == 0) | (p == 1)).all()), "entries must be exactly 0 or 1"
    assert bool((p.sum(-1) == 1).all()) and bool((p.sum(-2) == 1).all())


def task_weights(n: int = 6, batch: int = 8, tasks: int = 2, seed: int = 0) -> torch.Tensor:
    """Simplex weights of ``tasks`` task gates, stacked as MMoE hands them to local search: ``[B, T, n]``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randn(batch, n, generator=generator).softmax(-1) for _ in range(tasks)], dim=1)


class Counter:
    """Wraps a callable and counts its calls (their positional arguments kept)."""

    def __init__(self, fn):
        self.fn, self.calls, self.args = fn, 0, []

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.args.append(args)
        return self.fn(*args, **kwargs)


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, Counter]:
    """Counting wrappers around the library's roundings (``round_to_permutation``, one per rounded trial), the
    assignment solver (one per matrix), ``sinkhorn_and_penalty`` and ``LogSinkhorn.apply``. The tests' own calls of
    ``round_to_permutation`` (imported before the patch) are not counted as roundings, but their solves are."""
    counters = {
        "rounding": Counter(permutation_module.round_to_permutation),
        "assignment": Counter(permutation_module.linear_sum_assignment),
        "sinkhorn": Counter(permutation_module.sinkhorn_and_penalty),
        "apply": Counter(LogSinkhorn.apply),
    }
    monkeypatch.setattr(permutation_module, "round_to_permutation", counters["rounding"])
    monkeypatch.setattr(permutation_module, "linear_sum_assignment", counters["assignment"])
    monkeypatch.setattr(permutation_module, "sinkhorn_and_penalty", counters["sinkhorn"])
    monkeypatch.setattr(LogSinkhorn, "apply", counters["apply"])
    return counters


class HostReads(TorchDispatchMode):
    """Records the reads of a tensor's value by Python (``int(t)``, ``t.item()``, ``bool(t)``: ATen's
    ``_local_scalar_dense``) and ``nonzero``, whose output shape depends on values (as boolean indexing's does on
    a GPU): on a GPU each waits for the device, and none can be captured in a CUDA graph."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def schedule_at(step: int, window: int) -> tuple[float, int]:
    """:func:`schedule` of host integers, as host numbers (it takes and returns 0-d tensors: float64 tau, int64 R)."""
    tau, iterations = schedule(torch.tensor(step), torch.tensor(window))
    assert tau.shape == iterations.shape == ()
    assert tau.dtype == torch.float64 and iterations.dtype == torch.int64
    return float(tau), int(iterations)


def search_loss(output: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A loss of :class:`LocalSearch`'s output ``(w P, penalty)`` that prefers moving weight between experts."""
    out, aux = output
    return out[:, 0, 0].sum() - out[:, 1, 2].sum() + aux


def model_loss(output) -> torch.Tensor:
    return sum(p.sum() for p in output.predictions) + output.aux_loss


def train_step(module: nn.Module, inputs, optimiser: torch.optim.Optimizer | None = None, loss_of=search_loss,
               engine_promise: bool = False):
    """A training step of a plain :class:`LocalSearch` or "+" :class:`MMoE` as the engine does it: round the latest
    soft matrix when due (between steps, on the host), forward, then with an ``optimiser`` backward and its step,
    U's gradient dropped once the window is over (the engine skips U's update after the step that ends the window;
    Adam would still move U on a zero gradient). ``engine_promise``: set ``may_search`` as the engine does (False
    from the step that ends the window on). Returns the forward pass's output."""
    search = module if isinstance(module, LocalSearch) else module.local_search
    module.train()
    if search.rounding_due(training=True):
        search.round_()
    if engine_promise:
        search.may_search = int(search.step) + 1 < int(search.window)
    output = module(inputs)
    if optimiser is not None:
        optimiser.zero_grad()
        loss = loss_of(output)
        if loss.requires_grad:  # (a frozen search under the engine's promise has nothing to back-propagate into)
            loss.backward()
        if search.frozen:
            search.log_weights.grad = None
        optimiser.step()
    return output


def gathered(weights: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``weights [B, T, n]`` times the permutation matrices ``p [1 or T, n, n]`` as a gather: slot i's weight moves
    to expert col_ind[i] (``w P`` exactly)."""
    return weights.gather(-1, p.argmax(-2).expand(weights.shape))


def softly_permuted(weights: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``w P`` rescaled to the gates' own row sums, per task (``p`` ``[1 or T, n, n]``)."""
    raw = torch.einsum("btn,tnm->btm", weights, p.expand(weights.shape[1], -1, -1).to(weights.dtype))
    return raw * (weights.sum(-1, keepdim=True) / raw.sum(-1, keepdim=True))


def tiny_info(n_experts: int = 6) -> DatasetInfo:
    tasks = (TaskSpec("watch", "binary"), TaskSpec("rating", "regression", masked=True))
    return DatasetInfo(name="tiny", tasks=tasks, n_ids=12, n_users=12, n_items=15, n_experts=n_experts, k=2,
                       embedding_dim=4, expert_units=5, tower_units=3, expert_dropout=0.0)


def tiny_batch(info: DatasetInfo, size: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    user = torch.randint(0, info.n_users, (size,), generator=generator)
    item = torch.randint(0, info.n_items, (size,), generator=generator)
    return {"user": user, "item": item, "sample_id": user}


def base_and_plus(gate: str, info: DatasetInfo, seed: int = 0, **search) -> tuple[MMoE, MMoE]:
    """The base MMoE and its "+" model with identical bottom, experts, gates and towers."""
    torch.manual_seed(seed)
    base = build_mmoe(info, partial(gate_class(gate)))
    plus = build_mmoe(info, partial(gate_class(gate)), local_search={"epochs": 1, **search})
    missing, unexpected = plus.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(key.startswith("local_search.") for key in missing)
    generator = torch.Generator().manual_seed(seed + 1)
    user = torch.randn(base.bottom.user.weight.shape, generator=generator)
    item = torch.randn(base.bottom.item.weight.shape, generator=generator)
    with torch.no_grad():  # O(1) embeddings (Keras' U(-0.05, 0.05) gives near-constant outputs)
        for model in (base, plus):
            model.bottom.user.weight.copy_(user)
            model.bottom.item.weight.copy_(item)
    return base, plus


def set_hard_permutation(search: LocalSearch, p: torch.Tensor) -> None:
    """Put ``search`` past its window with the rounded matrix ``p`` (the soft matrix is rounded once, to itself)."""
    search.soft.copy_(p)
    search.set_window(1)
    search.step.fill_(1)
    search.round_()
    assert search.frozen and torch.equal(search.rounded, p.to(search.rounded.dtype))


# ------------------------------------------------------------------------------------------------ 1. Sinkhorn, rounding


@pytest.mark.parametrize("n", [6, 16])
@pytest.mark.parametrize("tau, init", [(1.0, "module"), (1.0, "normal"), (0.1, "module")])
def test_sinkhorn_is_doubly_stochastic(n: int, tau: float, init: str) -> None:
    """R = 150: columns sum to 1 to rounding (the recursion ends with a column step), rows within 1e-5 (§9.4)."""
    for seed in range(5):
        u = module_init_u(2, n, seed) if init == "module" else torch.randn(2, n, n, dtype=torch.float64)
        p = sinkhorn(u, tau, 150)
        assert p.dtype == torch.float64 and p.shape == (2, n, n)
        assert float((p.sum(-2) - 1).abs().max()) < 1e-12
        assert float((p.sum(-1) - 1).abs().max()) < 1e-5
        assert bool((p >= 0).all() and (p <= 1).all())
    p32 = sinkhorn(module_init_u(1, n, 0, torch.float32), tau, 150)  # the library's working dtype
    assert p32.dtype == torch.float32 and float((p32.sum(-2) - 1).abs().max()) < 1e-6


@pytest.mark.parametrize("step", [0, 1, 3, 5, 8, 9, 10])
def test_sinkhorn_at_schedule_temperatures(step: int) -> None:
    """At the schedule's (tau, R): exactly column-stochastic, finite, in [0, 1]; with a clear matching it is that
    matching (``linear_sum_assignment(-U)``), hard to 1e-12 and doubly stochastic. (tau and R as the module hands
    them to Sinkhorn: 0-d tensors.)"""
    tau, iterations = schedule(torch.tensor(step), torch.tensor(10))
    for seed in range(4):
        p = sinkhorn(module_init_u(1, 6, seed), tau, iterations)
        assert bool(torch.isfinite(p).all()) and bool((p >= 0).all() and (p <= 1).all())
        assert float((p.sum(-2) - 1).abs().max()) < 1e-12
        q = random_permutation_matrix(6, seed, torch.float64)
        u = planted_u(q, seed)
        assert torch.equal(assignment_matrix(u[0]), q)
        p = sinkhorn(u, tau, iterations)
        assert float((p[0] - q).abs().max()) < 1e-12
        assert float((p.sum(-1) - 1).abs().max()) < 1e-12


@pytest.mark.parametrize("tau", [1e-3, 1e-4, 1e-5, 1e-6, 1e-7])
@pytest.mark.parametrize("iterations", [20, 150])
def test_sinkhorn_small_tau_is_the_max_weight_matching(tau: float, iterations: int) -> None:
    """tau -> 0: S(U / tau) -> M(U), the permutation matrix of ``linear_sum_assignment(-U)`` (Section 4.2)."""
    for seed in range(3):
        q = random_permutation_matrix(8, 10 + seed, torch.float64)
        u = planted_u(q, seed)
        expected = assignment_matrix(u[0])
        assert torch.equal(expected, q)
        p = sinkhorn(u, tau, iterations)
        assert torch.allclose(p[0], expected, atol=1e-12, rtol=0)
        assert torch.equal(round_to_permutation(p)[0], expected)


def test_sinkhorn_small_tau_without_a_clear_matching_is_not_row_stochastic() -> None:
    """Documented behaviour of the faithful algorithm, not of this implementation (it equals plain torch):
    in log space at tau <= 1e-3 each normalisation moves a potential by O(tau log n) while the gaps are O(0.1),
    so R <= 150 iterations do not converge when rows of U compete for a column. The output stays exactly
    column-stochastic, but a row can hold two columns' mass (row sum 2) while two others share one (0.5, 0.5):
    the "pseudo-convergence" the paper's entropy penalty and the final rounding deal with (§4.3)."""
    worst = 0.0
    for seed in range(10):
        u = module_init_u(1, 6, seed)
        p = sinkhorn(u, TAU_END, ITERATIONS_END)
        assert torch.allclose(p, unrolled_log_sinkhorn(u, TAU_END, ITERATIONS_END), atol=1e-12, rtol=0)
        assert float((p.sum(-2) - 1).abs().max()) < 1e-12
        worst = max(worst, float((p.sum(-1) - 1).abs().max()))
        assert_permutation_matrices(round_to_permutation(p))  # rounding copes with it
    assert worst > 0.4


def test_round_to_permutation_random_soft_inputs() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        soft = torch.rand(3, 7, 7, generator=generator)
        hard = round_to_permutation(soft)
        assert hard.shape == soft.shape and hard.dtype == soft.dtype
        assert_permutation_matrices(hard)
        for m in range(3):
            assert torch.equal(hard[m], assignment_matrix(soft[m]))  # the max-weight matching (eq. 5)
    doubly = sinkhorn(torch.rand(2, 7, 7, generator=generator, dtype=torch.float64), 0.1, 50)
    assert_permutation_matrices(round_to_permutation(doubly))


def test_round_to_permutation_ties_zero_and_fixed_points() -> None:
    assert torch.equal(round_to_permutation(torch.zeros(2, 5, 5)), torch.eye(5).repeat(2, 1, 1))
    for tied in (torch.full((1, 5, 5), 0.2), torch.tensor([[[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]]),
                 torch.ones(1, 4, 1).expand(1, 4, 4).clone()):
        assert_permutation_matrices(round_to_permutation(tied))
    for seed in range(10):
        for n in (2, 6, 16):
            p = random_permutation_matrix(n, seed).unsqueeze(0)
            assert torch.equal(round_to_permutation(p), p)
    stacked = torch.stack([random_permutation_matrix(9, s) for s in range(4)])
    assert torch.equal(round_to_permutation(stacked), stacked)


def test_round_to_permutations_rounds_many_trials_and_keeps_what_it_cannot_round() -> None:
    """The loop's rounding of a pack's trials ``[P, m, n, n]`` at once: each trial's soft matrices rounded as alone;
    a trial without a soft matrix yet (zeros) or with a non-finite one (diverged) keeps its previous rounding; the
    result has the previous rounding's dtype and device."""
    generator = torch.Generator().manual_seed(0)
    soft = torch.rand(4, 2, 6, 6, generator=generator)
    soft[1] = 0.0  # before its first training step
    soft[2, 1, 3, 4] = math.nan  # diverged (one matrix is enough)
    previous = torch.stack([torch.stack([random_permutation_matrix(6, 10 * t + m) for m in range(2)])
                            for t in range(4)]).double()
    out = round_to_permutations(soft, previous)
    assert out.shape == previous.shape and out.dtype == torch.float64 and out is not previous
    for t in (0, 3):
        assert torch.equal(out[t], round_to_permutation(soft[t]).double())
        assert not torch.equal(out[t], previous[t])
    for t in (1, 2):
        assert torch.equal(out[t], previous[t])
    assert round_to_permutation(soft[2]) is None
    one = round_to_permutations(soft[0], previous[1])  # one trial's [m, n, n]
    assert torch.equal(one, out[0])


# ---------------------------------------------------------------------------------------------------- 2. Schedules


def test_schedule_end_points_and_shape() -> None:
    assert schedule_at(0, 10) == (pytest.approx(1e-3, rel=1e-12), 20)
    assert schedule_at(10, 10) == (pytest.approx(1e-7, rel=1e-12), 150)
    assert (TAU_START, TAU_END, ITERATIONS_START, ITERATIONS_END) == (1e-3, 1e-7, 20, 150)
    for window in (3, 7, 10, 64, 1000):  # every step of a window in one call (elementwise)
        steps = torch.arange(window + 1)
        tau, iterations = schedule(steps, torch.tensor(window))
        assert tau.dtype == torch.float64 and iterations.dtype == torch.int64 and tau.shape == iterations.shape
        assert torch.allclose(tau.log10(), -3 - 4 * steps.double() / window, atol=1e-12, rtol=0)  # log-linear
        assert iterations.tolist() == [20 + (130 * t) // window for t in range(window + 1)]  # int() truncation
    assert schedule_at(5, 10)[0] == pytest.approx(1e-5, rel=1e-12)
    assert schedule_at(9, 10) == (pytest.approx(10**-6.6, rel=1e-12), 137)  # tau(T-1), R(T-1) (§9.1 row 7)
    assert [schedule_at(t, 3)[1] for t in range(4)] == [20, 63, 106, 150]  # 63.33 -> 63, 106.67 -> 106
    assert schedule_at(25, 10) == (pytest.approx(1e-7, rel=1e-12), 150)  # clamped after the window (§9.2)
    # a pack: each trial at its own step of its own window
    steps, windows = torch.tensor([0, 5, 9, 25, 3, 1]), torch.tensor([10, 10, 10, 10, 3, 64])
    tau, iterations = schedule(steps, windows)
    expected = [schedule_at(s, w) for s, w in zip(steps.tolist(), windows.tolist())]
    assert list(zip(tau.tolist(), iterations.tolist())) == expected


# -------------------------------------------------------------------------------------- 3. LocalSearch state machine


def make_search(seed: int = 0, steps_per_epoch: int = 3, soften: float | None = None, **kwargs) -> LocalSearch:
    torch.manual_seed(seed)
    search = LocalSearch(6, 2, **{"epochs": 2, **kwargs})
    search.set_window(steps_per_epoch)
    if soften is not None:  # shrink U so that U / tau is O(1): a genuinely soft matrix at tau = 1e-3
        with torch.no_grad():
            search.log_weights.mul_(soften)
    return search


def test_window_and_step_counter() -> None:
    """Training forward passes advance the step (a device buffer), evaluation does not; it stops at the window's
    end. The loop rounds before the step that ends the window and before evaluating inside it."""
    search = LocalSearch(6, 2, epochs=2)
    search.train()
    with pytest.raises(RuntimeError, match="set_window"):
        search(task_weights())
    search.set_window(3)
    assert int(search.window) == 6 and int(search.step) == 0 and not search.frozen
    assert search.step.dtype == search.window.dtype == torch.long and search.step.shape == ()
    assert not search.rounding_due(training=False)  # no training step yet: nothing to round
    search.eval()
    search(task_weights())
    assert int(search.step) == 0  # evaluation does not advance the counter
    search.train()
    for expected in range(1, 7):
        assert search.rounding_due(training=True) == (expected == 6)  # before the step that ends the window
        search(task_weights())
        assert int(search.step) == expected
        assert search.rounding_due(training=False) == (expected < 6)  # evaluating inside the window
        search.eval()
        search(task_weights())
        assert int(search.step) == expected
        search.train()
    assert search.frozen
    for _ in range(3):
        search(task_weights())
        assert not search.rounding_due(training=True) and not search.rounding_due(training=False)
    assert int(search.step) == 6  # frozen: the counter stops at the window
    promised = make_search(steps_per_epoch=2)  # the engine's promise that no trial searches: the counter still runs
    promised.may_search = False
    promised.train()
    for expected in (1, 2, 3, 4, 4):
        promised(task_weights())
        assert int(promised.step) == expected
    assert promised.frozen


def test_training_matrices_are_soft_and_differentiable_inside_the_window() -> None:
    """A training step inside the window uses the Sinkhorn matrix of its own schedule (kept in ``soft``): genuinely
    fractional, doubly stochastic; the permuted weights are ``w P`` rescaled to the gates' row sums; the output and
    the penalty are differentiable in U, with autograd's gradient through the unrolled recursion (float64)."""
    search = make_search(soften=1e-4, zeta=0.5)
    search.train()
    weights = task_weights()
    target = torch.randn(8, 1, 6, generator=torch.Generator().manual_seed(1))
    for step in range(1, 4):
        out, aux = search(weights)
        assert int(search.step) == step
        tau, iterations = schedule_at(step, 6)
        value = search.soft
        assert value.shape == (1, 6, 6) and value.dtype == torch.float32 and not value.requires_grad
        assert float(value.min()) > 0.01 and float(value.max()) < 0.99  # genuinely fractional
        assert float((value.sum(-2) - 1).abs().max()) < 1e-6 and float((value.sum(-1) - 1).abs().max()) < 1e-5
        assert torch.equal(value, sinkhorn(search.log_weights.detach(), tau, iterations))
        stats = search.statistics()
        assert stats["tau"] == pytest.approx(tau, rel=1e-12) and stats["iterations"] == iterations
        assert stats["step"] == step and stats["frozen"] == 0.0
        assert out.requires_grad and aux.requires_grad and aux.shape == ()
        assert torch.allclose(out, softly_permuted(weights, value), atol=1e-7, rtol=1e-6)
        for w, o in zip(weights.unbind(1), out.unbind(1)):  # w P rescaled to the gate's row sums
            assert torch.allclose(o.sum(-1), w.sum(-1), atol=1e-6)
        (grad,) = torch.autograd.grad((out * target).sum() + aux, search.log_weights)
        u = search.log_weights.detach().double().requires_grad_()
        p_ref = unrolled_log_sinkhorn(u, tau, iterations)
        loss_ref = (softly_permuted(weights.double(), p_ref) * target.double()).sum() + reference_penalty(p_ref, 0.5)
        assert float(aux.detach()) == pytest.approx(float(reference_penalty(p_ref, 0.5).detach()), rel=1e-5)
        (grad_ref,) = torch.autograd.grad(loss_ref, u)
        scale = float(grad_ref.abs().max())
        assert scale > 1.0  # a real gradient (1/tau-scaled) is compared
        assert torch.allclose(grad.double(), grad_ref, rtol=0, atol=1e-4 * scale)


def test_permuted_weights_keep_the_gates_row_sums_when_sinkhorn_rows_are_off() -> None:
    """Late in the window Sinkhorn's rows need not sum to 1 (see above); ``w P`` is rescaled to the gate's own row
    sums (the official ``normalise``), so a "+" gate still hands the experts simplex weights."""
    for seed in range(30):
        search = make_search(seed=seed, steps_per_epoch=50)  # window 100
        search.step.fill_(97)
        search.train()
        weights = task_weights(seed=seed)
        out, _ = search(weights)
        p = search.soft[0]
        if float((p.sum(-1) - 1).abs().max()) > 0.1:
            break
    else:
        pytest.fail("no U in 30 seeds gave a Sinkhorn output with rows off by > 0.1")
    for w, o in zip(weights.unbind(1), out.unbind(1)):
        raw = w @ p
        assert float((raw.sum(-1) - 1).abs().max()) > 1e-3  # un-normalised, w P leaves the simplex
        assert torch.allclose(o.detach(), raw * (w.sum(-1, keepdim=True) / raw.sum(-1, keepdim=True)), atol=1e-6)
        assert torch.allclose(o.detach().sum(-1), w.sum(-1), atol=1e-6)


def test_gradient_reaches_u_at_the_module_initialisation() -> None:
    """U(-0.05, 0.05) and tau = 1e-3: nearly hard, the gradient may be tiny, but the path exists (§3.8)."""
    search = make_search()
    search.train()
    out, aux = search(task_weights())
    (out[:, 0, 0].sum() + out[:, 1, 1].sum() + aux).backward()
    assert search.log_weights.grad is not None and bool(torch.isfinite(search.log_weights.grad).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
def test_a_training_step_reads_no_device_value_on_the_host(dtype: torch.dtype) -> None:
    """Step, window, the schedule, the window test and the choice between the soft and the rounded matrix are device
    tensors: forward and backward of a training step read nothing on the host (on a GPU: no synchronisation, and
    the step can be captured in a CUDA graph), inside the window, at its end and after it, with and without the
    engine's promise; the rounding happens between steps. zeta stays a float64 setting when the module changes
    dtype (``.double()``, ``.half()``), as the buffers follow it."""
    search = make_search(soften=1e-2, steps_per_epoch=2, zeta=1e-2)  # window 4
    {torch.float32: search.float, torch.float64: search.double, torch.float16: search.half}[dtype]()
    assert search.zeta.dtype == torch.float64 and float(search.zeta) == 1e-2 and search.zeta.shape == ()
    assert search.log_weights.dtype == search.soft.dtype == search.rounded.dtype == dtype
    assert search.step.dtype == search.window.dtype == search.rounded_index.dtype == torch.long
    weights = task_weights().to(dtype)
    for step in range(1, 8):  # 1..3 inside, 4 the transition, 5..7 after; the engine's promise from 6 on
        if search.rounding_due(training=True):
            search.round_()
        search.may_search = step < 6
        reads = HostReads()
        with reads:
            out, aux = search(weights)
            loss = search_loss((out, aux))
            if loss.requires_grad:
                loss.backward()
        assert reads.reads == [], step
        assert out.dtype == aux.dtype == dtype and search.soft.dtype == dtype
        assert (search.log_weights.grad is not None) == (step < 6)
        search.log_weights.grad = None
    assert search.frozen and int(search.step) == 4
    reads = HostReads()
    with reads:  # the check sees host reads
        bool(search.step > 0)
        (weights > 0.1).nonzero()
    assert len(reads.reads) == 2


@pytest.mark.parametrize("gate", ["softmax", "topk", "comet"])
def test_a_plus_model_training_step_reads_no_device_value_on_the_host(gate: str) -> None:
    """The same for a whole "+" MMoE (random stream, gates, local search, mixing), inside and after the window."""
    info = tiny_info()
    _, plus = base_and_plus(gate, info)
    plus.local_search.set_window(2)
    plus.train()
    for step in range(1, 4):
        if plus.local_search.rounding_due(training=True):
            plus.local_search.round_()
        reads = HostReads()
        with reads:
            model_loss(plus(tiny_batch(info, seed=step))).backward()
        assert reads.reads == [], step
    assert plus.local_search.frozen


def test_evaluation_uses_the_rounded_matrix_inside_the_window(spies: dict[str, Counter]) -> None:
    """Evaluation permutes by the rounded matrix (a gather, no gradient, no penalty). The forward pass solves no
    assignment: the loop rounds the latest soft matrix first when :meth:`rounding_due` says so; until then the
    previous rounding is used (the identity before any)."""
    search = make_search(soften=1e-3)
    weights = task_weights()
    search.eval()
    out, aux = search(weights)
    assert torch.equal(out, weights) and aux is None  # before any training step: identity
    for step in range(1, 5):  # inside the window (6 steps); U moved so that each step has another rounding
        q = random_permutation_matrix(6, step)
        with torch.no_grad():
            search.log_weights.copy_(1e-3 * planted_u(q, step))
        search.train()
        search(weights)
        search.eval()
        assert search.rounding_due(training=False)
        previous = search.rounded.clone()
        solves = spies["assignment"].calls
        assert torch.equal(search(weights)[0], gathered(weights, previous))  # not rounded by the forward pass
        assert spies["rounding"].calls == step - 1 and spies["assignment"].calls == solves
        search.round_()
        assert spies["rounding"].calls == step and spies["assignment"].calls == solves + 1  # one solve: m = 1
        hard = search.rounded
        assert_permutation_matrices(hard)
        assert torch.equal(hard, round_to_permutation(search.soft))
        assert torch.equal(search.rounded_index, hard.argmax(-2))
        out, aux = search(weights)
        assert not out.requires_grad and aux is None
        assert torch.equal(out, gathered(weights, hard)) and torch.allclose(out, weights @ hard[0])
        assert torch.equal(hard[0], q) and not torch.equal(hard, previous)  # (the checks above are not vacuous)
        assert int(search.step) == step  # evaluation does not advance the counter
    assert not search.frozen


def test_eval_rounded_false_evaluates_the_soft_matrix_inside_the_window(spies: dict[str, Counter]) -> None:
    search = make_search(soften=1e-3, eval_rounded=False)
    weights = task_weights()
    search.eval()
    assert torch.equal(search(weights)[0], weights)  # no soft matrix yet: the rounded identity
    optimiser = torch.optim.SGD(search.parameters(), lr=1e-9)  # gradients are 1/tau-scaled
    for _ in range(2):
        train_step(search, weights, optimiser)
    search.eval()
    assert not search.rounding_due(training=False)  # nothing to round before evaluating
    out, aux = search(weights)
    assert not out.requires_grad and aux is None
    soft = sinkhorn(search.log_weights.detach(), *schedule_at(2, 6))  # the current schedule's matrix of the current U
    assert float(soft.min()) > 0.01
    assert float((soft - search.soft).abs().max()) > 1e-3  # (U has moved since the last training step's matrix)
    assert torch.allclose(out, softly_permuted(weights, soft), atol=1e-7, rtol=1e-6)
    assert float((out - gathered(weights, search.rounded)).abs().max()) > 1e-3  # not the rounded matrix
    assert int(search.step) == 2
    search.may_search = False  # the engine's promise that no trial evaluates a soft matrix: the rounded gather
    assert torch.equal(search(weights)[0], gathered(weights, search.rounded))
    search.may_search = True
    for _ in range(4):
        train_step(search, weights)
    search.eval()
    assert search.frozen and spies["rounding"].calls == 1  # only at the transition
    assert not torch.equal(search.rounded, torch.eye(6).unsqueeze(0))
    assert torch.equal(search(weights)[0], gathered(weights, search.rounded))  # after the window: the frozen matrix


@pytest.mark.parametrize("promise", [False, True], ids=["plain", "engine-promise"])
def test_frozen_after_the_window(spies: dict[str, Counter], promise: bool) -> None:
    """§3.5, §9.1 row 7, §9.2: soft for steps 1..T-1; before step T the loop rounds the last soft matrix, once, and
    from T on the module permutes by that matrix: no assignment solve, no penalty, U's update skipped (U constant),
    a constant parameter set. Without the engine's promise (``may_search``) the module still computes the soft
    branch, for one Sinkhorn iteration, and discards it (its gradient to U is exactly zero); with it, no Sinkhorn."""
    search = make_search(soften=1e-3)
    optimiser = torch.optim.Adam(search.parameters(), lr=1e-3)
    parameters = list(search.parameters())
    assert len(parameters) == 1 and parameters[0] is search.log_weights
    weights = task_weights()
    for step in range(1, 6):
        u_before = search.log_weights.detach().clone()
        out, aux = train_step(search, weights, optimiser, engine_promise=promise)
        assert search.log_weights.grad is not None and float(aux.detach()) > 0
        assert not torch.equal(search.log_weights.detach(), u_before)  # Adam moved U
        assert list(search.parameters()) == parameters and search.log_weights is parameters[0]
    assert spies["sinkhorn"].calls == 5 and spies["apply"].calls == 5
    assert spies["rounding"].calls == 0 and spies["assignment"].calls == 0
    last_soft = search.soft.clone()
    u_before = search.log_weights.detach().clone()

    assert search.rounding_due(training=True)
    out, aux = train_step(search, weights, optimiser, engine_promise=promise)  # step T = 6: the transition
    assert search.frozen and int(search.step) == 6
    assert spies["rounding"].calls == 1 and spies["assignment"].calls == 1
    assert torch.equal(search.soft, last_soft)  # the last soft matrix stays (the window's)
    frozen = search.rounded.clone()
    assert_permutation_matrices(frozen)
    assert not torch.equal(frozen, torch.eye(6).unsqueeze(0))
    assert torch.equal(frozen, round_to_permutation(last_soft))  # (this check is one more solve of our own)
    spies["assignment"].calls -= 1
    assert float(aux.detach()) == 0.0 and aux.dtype == weights.dtype
    assert torch.equal(out, gathered(weights, frozen))
    assert out.requires_grad != promise  # the discarded soft branch is still in the graph without the promise
    assert search.log_weights.grad is None and torch.equal(search.log_weights.detach(), u_before)

    for _ in range(5):
        assert not search.rounding_due(training=True)
        out, aux = train_step(search, weights, optimiser, engine_promise=promise)
        assert torch.equal(out, gathered(weights, frozen)) and float(aux.detach()) == 0.0
        assert search.log_weights.grad is None
        search.eval()
        assert not search.rounding_due(training=False)
        out, aux = search(weights)
        assert torch.equal(out, gathered(weights, frozen)) and aux is None
    assert spies["rounding"].calls == 1 and spies["assignment"].calls == 1
    assert spies["sinkhorn"].calls == spies["apply"].calls == (5 if promise else 11)
    for args in spies["apply"].args[5:]:  # the discarded soft branch: one iteration
        assert torch.equal(args[2], torch.ones(1, dtype=torch.long))
    assert int(search.step) == 6 and torch.equal(search.log_weights.detach(), u_before)
    assert torch.equal(search.soft, last_soft) and torch.equal(search.rounded, frozen)
    assert list(search.parameters()) == parameters
    assert search.assignment() == [frozen[0].argmax(-1).tolist()]
    search.train()
    out, aux = search(weights)  # what the loop drops: a zero gradient (without the promise) or none at all
    if promise:
        assert not out.requires_grad and not aux.requires_grad
    else:
        (grad,) = torch.autograd.grad(search_loss((out, aux)), search.log_weights)
        assert not grad.any()


@pytest.mark.parametrize("promise", [False, True], ids=["plain", "engine-promise"])
def test_gradient_through_a_frozen_permutation_in_a_model_stops_at_u(promise: bool) -> None:
    """In a full MMoE after the window the loss back-propagates into gates and experts but not into U: exact zeros
    from the discarded soft branch (the loop drops them, the engine skips U), none under the engine's promise."""
    info = tiny_info()
    _, plus = base_and_plus("topk", info)
    search = plus.local_search
    search.set_window(1)
    train_step(plus, tiny_batch(info), engine_promise=promise)  # step 1 = T: transition
    assert search.frozen and search.may_search != promise
    output = plus(tiny_batch(info, seed=1))
    model_loss(output).backward()
    if promise:
        assert search.log_weights.grad is None
    else:
        assert search.log_weights.grad is not None and not search.log_weights.grad.any()
    assert plus.gates[0].logits.weight.grad is not None and plus.experts.linear.weight.grad is not None
    assert plus.gates[0].logits.weight.grad.any() and plus.experts.linear.weight.grad.any()


def test_per_task_gives_one_permutation_per_task() -> None:
    shared = make_search()
    shared.train()
    shared(task_weights())
    assert shared.log_weights.shape == shared.soft.shape == shared.rounded.shape == (1, 6, 6)
    search = make_search(per_task=True)
    assert search.log_weights.shape == search.soft.shape == search.rounded.shape == (2, 6, 6)
    q = torch.stack([random_permutation_matrix(6, 1), random_permutation_matrix(6, 2)])
    assert not torch.equal(q[0], q[1])
    with torch.no_grad():
        search.log_weights.copy_(torch.cat([planted_u(q[t], t).float() for t in range(2)]))
    planted = search.log_weights.detach().clone()
    weights = task_weights()
    for step in range(1, 7):  # steps 1, 2: fractional (U shrunk); 3..5 soft, nearly hard; 6 the transition
        with torch.no_grad():
            search.log_weights.copy_(planted * (1e-4 if step < 3 else 1.0))
        out, _ = train_step(search, weights)
        if step < 6:
            assert torch.equal(search.soft, sinkhorn(search.log_weights.detach(), *schedule_at(step, 6)))
            assert step > 2 or float(search.soft.max()) < 0.9
            for t in range(2):  # each task gate's weights go through its own soft matrix
                own = softly_permuted(weights[:, t:t + 1], search.soft[t:t + 1])[:, 0]
                assert torch.allclose(out[:, t], own, atol=1e-7, rtol=1e-6)
    assert search.frozen and torch.equal(search.rounded, q)
    assert search.assignment() == [q[0].argmax(-1).tolist(), q[1].argmax(-1).tolist()]
    for training in (True, False):
        search.train(training)
        out, _ = search(weights)
        for t in range(2):  # each task gate's weights go through its own matrix
            assert torch.allclose(out[:, t], weights[:, t] @ q[t], atol=1e-7)
            assert torch.equal(out[:, t][:, q[t].argmax(-1)], weights[:, t])  # slot i feeds expert col_ind[i]


def test_checkpoint_resume_inside_and_after_the_window(spies: dict[str, Counter]) -> None:
    """State is in buffers (§9.2 row 1): resuming mid-window continues with identical step, tau, R, outputs,
    penalties and updates of U; resuming after the window keeps the same permutation without solving again. The loop
    sets the window again after loading (``set_window``, the same length), as the engine does for every trial."""
    original = make_search(seed=0, steps_per_epoch=4, soften=1e-2)  # window 8
    optimiser = torch.optim.SGD(original.parameters(), lr=10.0)  # stateless: the resumed run's own SGD continues it
    weights = task_weights()
    for _ in range(3):
        train_step(original, weights, optimiser)
    original.eval()
    original.round_()  # an evaluation inside the window: its rounding is in the checkpoint
    state = original.state_dict()
    assert set(state) == {"log_weights", "step", "window", "soft", "rounded"}
    resumed = LocalSearch(6, 2, epochs=2)  # fresh: different U, step 0, no window
    assert not torch.equal(resumed.log_weights, original.log_weights)
    resumed.load_state_dict(state)
    resumed.set_window(4)
    assert int(resumed.step) == 3 and int(resumed.window) == 8
    assert torch.equal(resumed.soft, original.soft) and torch.equal(resumed.rounded, original.rounded)
    assert torch.equal(resumed.rounded_index, original.rounded_index)
    resumed.eval()
    assert torch.equal(original(weights)[0], resumed(weights)[0])
    resumed_optimiser = torch.optim.SGD(resumed.parameters(), lr=10.0)
    for step in range(4, 10):  # steps 4..7 soft, 8 the transition, 9 frozen
        out_original, aux_original = train_step(original, weights, optimiser)
        out_resumed, aux_resumed = train_step(resumed, weights, resumed_optimiser)
        assert int(original.step) == int(resumed.step) == min(step, 8)
        assert torch.equal(out_original, out_resumed) and torch.equal(aux_original, aux_resumed)
        assert torch.equal(original.soft, resumed.soft) and torch.equal(original.rounded, resumed.rounded)
        assert torch.equal(original.log_weights, resumed.log_weights)
        assert original.statistics() == resumed.statistics()
    assert original.frozen and resumed.frozen
    assert resumed.assignment() != [list(range(6))]  # (the checks below are not vacuous)
    after = LocalSearch(6, 2, epochs=2)
    assert torch.equal(after.rounded_index, torch.arange(6).unsqueeze(0))
    after.load_state_dict(resumed.state_dict())
    after.set_window(4)
    roundings = spies["rounding"].calls
    for mode in (False, True):
        after.train(mode)
        assert not after.rounding_due(mode)
        assert torch.equal(after(weights)[0], weights @ resumed.rounded[0])  # the index is refreshed on loading
    assert after.frozen and after.assignment() == resumed.assignment() and int(after.step) == 8
    assert torch.equal(after.rounded_index, resumed.rounded_index)
    assert spies["rounding"].calls == roundings  # the rounding came with the checkpoint


def test_a_loaded_permutation_is_applied_through_its_gather_index() -> None:
    """Loading a state refreshes the gather index (derived from ``rounded``, not saved: checkpoints written before
    the index existed load too)."""
    source = LocalSearch(6, 2, epochs=1)
    q = random_permutation_matrix(6, seed=3)
    assert not torch.equal(q, torch.eye(6))
    set_hard_permutation(source, q.unsqueeze(0))
    state = source.state_dict()
    assert "rounded_index" not in state
    target = LocalSearch(6, 2, epochs=1)
    target.load_state_dict(state)
    target.set_window(1)
    weights = task_weights()
    for mode in (False, True):
        target.train(mode)
        assert torch.equal(target(weights)[0], weights @ q)


def test_usage_errors() -> None:
    with pytest.raises(UsageError, match="zeta must be >= 0"):
        LocalSearch(6, 2, zeta=-1.0)
    with pytest.raises(UsageError, match="perm_epochs must be >= 1"):
        LocalSearch(6, 2, epochs=0)
    with pytest.raises(UsageError, match="zeta must be >= 0"):
        MultiTaskMoE.build(tiny_info(), ModelSettings(gate=partial(gate_class("topk")), perm_epochs=2, zeta=-1e-4))
    assert MultiTaskMoE.build(tiny_info(), ModelSettings(gate=partial(gate_class("topk")))).net.local_search is None


def test_seeding_torch_alone_reproduces_u() -> None:
    torch.manual_seed(3)
    first = LocalSearch(6, 2).log_weights.detach().clone()
    torch.manual_seed(3)
    assert torch.equal(first, LocalSearch(6, 2).log_weights.detach())
    assert float(first.abs().max()) <= 0.05


def test_entropy_penalty_only_in_training_and_inside_the_window() -> None:
    """Training steps inside the window add ``zeta H(P)`` (differentiable in U); evaluation adds none (``None``);
    the step that ends the window and those after it add an exact 0 (a tensor: the step's code does not depend on
    where a trial is in its window), as does zeta = 0."""
    search = make_search(soften=1e-2, zeta=0.5)
    search.train()
    out, aux = search(task_weights())
    assert aux.requires_grad and aux.shape == () and aux.dtype == torch.float32
    assert float(aux.detach()) > 0 and torch.allclose(aux, reference_penalty(search.soft, 0.5), rtol=1e-6)
    aux.backward()
    assert search.log_weights.grad is not None and float(search.log_weights.grad.abs().max()) > 0
    search.eval()
    assert search(task_weights())[1] is None
    penalties = []
    while not search.frozen:
        penalties.append(float(train_step(search, task_weights())[1].detach()))
    assert len(penalties) == 5 and all(value > 0 for value in penalties[:-1]) and penalties[-1] == 0.0
    for promise in (False, True):  # after the window, with and without the engine's promise
        search.may_search = not promise
        assert float(search(task_weights())[1].detach()) == 0.0
    search.eval()
    assert search(task_weights())[1] is None
    no_penalty = make_search(soften=1e-2, zeta=0.0)
    no_penalty.train()
    out, aux = no_penalty(task_weights())
    assert float(aux.detach()) == 0.0 and float(no_penalty.soft.max()) < 0.99  # (a soft step: H(P) > 0)
    # in a model: the penalty is part of the training aux loss, absent in evaluation
    info = tiny_info()
    _, plus = base_and_plus("softmax", info, zeta=0.25)
    plus.local_search.set_window(10)
    plus.train()
    output = plus(tiny_batch(info))
    assert output.local_search_aux is not None and float(output.aux_loss.detach()) == pytest.approx(
        float(reference_penalty(plus.local_search.soft, 0.25)), rel=1e-5)
    assert float(output.aux_loss.detach()) > 0
    plus.eval()
    output = plus(tiny_batch(info))
    assert output.local_search_aux is None and float(output.aux_loss) == 0.0


# ---------------------------------------------------------------------------------- 4. Section 4.1: P = re-indexing


def reindex_experts(model: MMoE, assignment: list[int]) -> MMoE:
    """A copy of ``model`` (no local search) whose expert i is ``model``'s expert ``assignment[i]``."""
    clone = copy.deepcopy(model)
    n, units = model.experts.n_experts, model.experts.units
    with torch.no_grad():
        weight = model.experts.linear.weight.view(n, units, -1)
        bias = model.experts.linear.bias.view(n, units)
        clone.experts.linear.weight.copy_(weight[assignment].reshape_as(model.experts.linear.weight))
        clone.experts.linear.bias.copy_(bias[assignment].reshape(-1))
    return clone


PERMUTABLE = [g for g in list_gates() if gate_class(g).permutable]  # gates with a "+" variant


@pytest.mark.parametrize("gate", PERMUTABLE)
def test_permuting_weights_equals_reindexing_experts(gate: str) -> None:
    """sum_l (w P)_l f_l = sum_i w_i f_{col_ind[i]}: the "+" model with a hard P is the base model whose experts
    are re-indexed (Section 4.1); an identity P reproduces the base model exactly (§9.4)."""
    info = tiny_info()
    batch = tiny_batch(info)
    base, plus = base_and_plus(gate, info)
    base.eval()
    plus.eval()
    set_hard_permutation(plus.local_search, torch.eye(6).unsqueeze(0))
    with torch.no_grad():
        reference = base(batch)
        identity = plus(batch)
    for a, b in zip(identity.predictions, reference.predictions):
        assert torch.equal(a, b)
    for a, b in zip(identity.gates, reference.gates):
        assert torch.equal(a.weights, b.weights)

    p = round_to_permutation(torch.rand(1, 6, 6, generator=torch.Generator().manual_seed(7)))
    assignment = p[0].argmax(-1).tolist()
    assert assignment != list(range(6))
    set_hard_permutation(plus.local_search, p)
    assert plus.local_search.assignment() == [assignment]
    reindexed = reindex_experts(base, assignment)
    reindexed.eval()
    with torch.no_grad():
        permuted = plus(batch)
        expected = reindexed(batch)
    moved = 0.0
    for a, b, c in zip(permuted.predictions, expected.predictions, reference.predictions):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
        moved = max(moved, float((a - c).abs().max()))
    assert moved > 1e-4  # the permutation does change the model (the check above is not vacuous)
    for permuted_gate, base_gate in zip(permuted.gates, reference.gates):  # slot i's weight now sits at col_ind[i]
        assert torch.allclose(permuted_gate.weights[:, assignment], base_gate.weights, atol=1e-7, rtol=1e-6)


BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_local_search.py"
_spec = importlib.util.spec_from_file_location("bench_local_search", BENCHMARK)
bench_local_search = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_local_search)


def test_after_the_window_a_plus_step_adds_only_a_gather() -> None:
    """"From then on training is exactly the base gate with re-indexed experts": under the engine's promise that no
    trial searches (``may_search`` False, as the engine sets it after every trial's window), forward and backward
    of a frozen "+" model compute what the base model does, plus the gather of the weights and its backward, the
    step counter's saturating increment (computed, not branched on: no host read) and the exact-zero penalty."""
    info = tiny_info()
    base, plus = base_and_plus("softmax", info)
    plus.local_search.set_window(1)
    batch = tiny_batch(info)
    train_step(plus, batch, engine_promise=True)  # the transition step
    assert plus.local_search.frozen and not plus.local_search.may_search
    counted = {}
    for name, model in (("base", base), ("plus", plus)):
        model.train()
        with bench_local_search.ComputeOperations() as counter:
            output = model(batch)
            (sum(p.sum() for p in output.predictions) + output.aux_loss).backward()
        counted[name] = collections.Counter(counter.names)
    gather = {"gather": 1, "new_zeros": 1, "scatter_add": 1}  # w[..., index], its backward
    counter_step = {"lt": 1, "add": 1, "where": 1, "copy_": 1}  # step = where(step < window, step + 1, step)
    penalty = {"new_zeros": 1, "add": 1}  # the zero penalty, added to the gates' auxiliary losses
    expected = collections.Counter(gather) + collections.Counter(counter_step) + collections.Counter(penalty)
    assert counted["plus"] - counted["base"] == expected
    assert not counted["base"] - counted["plus"]


# ------------------------------------------------------------------------- 5. "+" keeps every gate's sparsity


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("gate", PERMUTABLE)
def test_plus_keeps_experts_per_sample_after_the_window(gate: str, saturate: bool) -> None:
    info = tiny_info()
    base, plus = base_and_plus(gate, info, zeta=1e-4)
    if saturate:  # large routing inputs: COMET and DSelect-k trees/selectors saturate, softmaxes sharpen
        with torch.no_grad():
            for model in (base, plus):
                model.bottom.user.weight.mul_(300.0)
                model.bottom.item.weight.mul_(300.0)
    q = random_permutation_matrix(6, 3)  # a derangement-free check would be vacuous: make sure P moves experts
    assert (q.argmax(-1) != torch.arange(6)).any()
    with torch.no_grad():
        plus.local_search.log_weights.copy_(planted_u(q, 0).float())
    plus.local_search.set_window(2)
    for seed in range(3):  # step 1 soft, step 2 transition (rounded before it), then frozen
        train_step(plus, tiny_batch(info, seed=seed))
    assert plus.local_search.frozen and torch.equal(plus.local_search.rounded[0], q)
    batch = tiny_batch(info, size=32, seed=5)
    assert torch.equal(base.seed, plus.seed)
    # the same state for both: the stream's step (dropout, SparseMixer's sampling) and what the training steps moved
    # in the gates (the loss-free bias)
    base.load_state_dict({key: value for key, value in plus.state_dict().items() if not key.startswith("local_search.")})
    for training in (True, False):
        base.train(training)
        plus.train(training)
        with torch.no_grad():
            base_out = base(batch)
            plus_out = plus(batch)
        for b, p in zip(base_out.gates, plus_out.gates):
            assert torch.equal((p.weights > 0).sum(-1), (b.weights > 0).sum(-1))
            assert bool((p.weights >= 0).all())
            assert torch.allclose(p.weights.sum(-1), b.weights.sum(-1), atol=1e-6)
            assert torch.allclose(p.weights[:, q.argmax(-1)], b.weights, atol=1e-7, rtol=1e-6)
            if gate_class(gate).simplex and gate != "dselect":  # DSelect-k: n = 6 is not a power of 2
                assert torch.allclose(p.weights.sum(-1), torch.ones(len(p.weights)), atol=1e-5)
            if saturate and gate != "softmax":  # sparse rows exist, so the count comparison is not vacuous
                assert int((b.weights > 0).sum(-1).min()) <= 2


# -------------------------------------------------------------------------------------- 6. Planted routing problem


class _Features(nn.Module):
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["x"]


class _FrozenConstantExperts(nn.Module):
    """Expert e always outputs the fixed vector ``outputs[e]`` (no trainable parameters)."""

    def __init__(self, outputs: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("outputs", outputs)

    def forward(self, h: torch.Tensor, stream=None) -> torch.Tensor:
        return self.outputs.expand(h.shape[0], *self.outputs.shape)


def planted_problem(seed: int, plus: bool, dtype: torch.dtype, lr: float, eps: float,
                    n: int = 4, n_ids: int = 64, steps_per_epoch: int = 100, epochs: int = 2) -> dict:
    """Hash-r with frozen constant experts; targets route slot i to expert swap(i) (a transposition of slots 0, 1).

    Expert e outputs the one-hot e_e, the gate's table sends sample s to slot table[s], and the target of s is
    e_{swap(table[s])}. For the "+" model, whose initial permutation is the matching sigma0 of its random U, the
    experts are re-indexed (expert sigma0(i) of "+" is expert i of the base) so both models start from the same
    function. Only U is trainable; the base model has nothing to train. Returns the final eval losses.
    """
    torch.manual_seed(seed)
    slots = n
    target_of_slot = torch.arange(slots)
    target_of_slot[[0, 1]] = target_of_slot[[1, 0]]
    experts = torch.eye(n, dtype=dtype)
    search = LocalSearch(n, 1, epochs=epochs, zeta=1e-4) if plus else None
    if plus:
        sigma0 = torch.as_tensor(linear_sum_assignment(-search.log_weights.detach()[0].double().numpy())[1])
        experts = torch.empty_like(experts)
        experts[sigma0] = torch.eye(n, dtype=dtype)
    gate = HashGate(GateDims(in_features=1, n_experts=n, n_ids=n_ids), seed=seed)
    model = MMoE(_Features(), _FrozenConstantExperts(experts), [gate], [nn.Identity()], search).to(dtype)
    ids = torch.arange(n_ids)
    batch = {"x": torch.zeros(n_ids, 1, dtype=dtype), "sample_id": ids}
    target = torch.eye(n, dtype=dtype)[target_of_slot[gate.table[ids]]]

    def loss_of(output) -> torch.Tensor:
        return (output.predictions[0] - target).pow(2).sum(-1).mean()

    result = {}
    if plus:
        assert list(model.parameters()) == [search.log_weights]
        search.set_window(steps_per_epoch)
        optimiser = torch.optim.Adam(model.parameters(), lr=lr, eps=eps)
        for _ in range(epochs * steps_per_epoch + 2):
            train_step(model, batch, optimiser, lambda output: loss_of(output) + output.aux_loss)
        assert search.frozen
        result["learned"] = search.assignment()[0] == sigma0[target_of_slot].tolist()
    model.eval()
    with torch.no_grad():
        result["loss"] = float(loss_of(model(batch)))
    return result


@pytest.mark.parametrize(
    "dtype, eps, seeds, min_learned, min_better",
    [
        # float64 U, Adam with a negligible eps: sign-like steps that follow the tiny 1/tau-scaled gradients
        (torch.float64, 1e-30, range(5), 3, 3),
        # the library's float32 with Adam's usual eps: gradients of far-from-tie entries underflow, fewer seeds learn
        (torch.float32, 1e-8, range(8), 4, 5),
    ],
    ids=["float64", "float32"],
)
def test_planted_swap_is_found_by_hash_plus_only(dtype, eps, seeds, min_learned, min_better) -> None:
    """The faithful schedule (tau 1e-3 -> 1e-7, R 20 -> 150, U(-0.05, 0.05), zeta 1e-4) over a 200-step window
    finds a planted transposition that Hash-r cannot represent; Adam lr 3e-3. Measured (this test's seeds):
    float64 learns 4/5, float32 5/8; a "+" model never ends worse than its base in either."""
    base_losses, plus_losses, learned = [], [], []
    for seed in seeds:
        base_losses.append(planted_problem(seed, False, dtype, 3e-3, eps)["loss"])
        plus_result = planted_problem(seed, True, dtype, 3e-3, eps)
        plus_losses.append(plus_result["loss"])
        learned.append(plus_result["learned"])
    print(f"\nplanted swap ({dtype}): base {[round(v, 3) for v in base_losses]}, "
          f"plus {[round(v, 3) for v in plus_losses]}, learned {learned}")
    assert all(v > 0.5 for v in base_losses)  # Hash-r alone cannot represent the swap
    for loss, found in zip(plus_losses, learned):
        assert (loss < 1e-6) == found  # the planted permutation is exactly the zero-loss one
    assert sum(learned) >= min_learned
    assert sum(p < b - 1e-6 for p, b in zip(plus_losses, base_losses)) >= min_better
    assert sum(plus_losses) / len(plus_losses) < 0.5 * sum(base_losses) / len(base_losses)


# ------------------------------------------------------------------------------------------------ 7. Command line


def assert_one_line_error(capsys: pytest.CaptureFixture, *fragments: str) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--gate", "comet+", "--trainer.max_epochs=2", "--model.perm_epochs=3"],
         ["perm_epochs=3 is longer than the run", "max_epochs=2"]),
        (["--gate", "topk+", "--trainer.max_epochs=2", "--model.zeta=-1"], ["--model.zeta -1.0 is not allowed: zeta must be >= 0"]),
        (["--gate", "foo+", "--trainer.max_epochs=2"], ["unknown gate 'foo+'", "comet"]),
        (["--gate", "comet+", "--trainer.max_epochs=2", "--model.perm_epochs=0"], ["--model.perm_epochs 0 is not allowed: perm_epochs must be >= 1"]),
    ],
    ids=["perm-longer-than-run", "negative-zeta", "unknown-plus-gate", "zero-perm-epochs"],
)
def test_cli_bad_plus_input_exits_2(tiny_root: Path, argv: list[str], fragments: list[str], capsys) -> None:
    code = run_cli(["fit", "--data", "movielens-100k", f"--data.root={tiny_root}", *FAST, *argv])
    assert code == 2
    assert_one_line_error(capsys, *fragments)
    assert not list(Path(".").rglob("results.json")) and not list(Path(".").rglob("*.ckpt"))


def test_cli_checkpoint_with_a_different_permutation(tiny_root: Path, capsys) -> None:
    """A topk+ checkpoint with 4 experts. Lightning >= 2.5's CLI rebuilds the model from the hyperparameters saved in
    the checkpoint (they override the command line), so ``test`` with the default n just works with n = 4; a
    checkpoint without those hyperparameters meets the default 16 experts and must fail in one line, as must a
    model without local search."""
    common = ["--data", "movielens-100k", f"--data.root={tiny_root}", *FAST]
    assert run_cli(["fit", "--gate", "topk+", *common, "--model.n_experts=4", "--model.perm_epochs=1",
                    "--trainer.max_epochs=1"]) == 0
    checkpoint = next(Path("runs").rglob("*.ckpt"))
    capsys.readouterr()
    assert run_cli(["test", "--gate", "topk+", *common, f"--ckpt_path={checkpoint}",
                    "--trainer.logger.init_args.name=from_hparams"]) == 0
    results = json.loads(next(Path("runs/from_hparams").rglob("results.json")).read_text())
    assert sorted(results["permutation"]["assignment"][0]) == [0, 1, 2, 3]

    saved = torch.load(checkpoint, weights_only=False)
    assert saved["state_dict"]["net.local_search.log_weights"].shape == (1, 4, 4)
    del saved["hyper_parameters"]
    bare = Path("bare.ckpt")
    torch.save(saved, bare)
    capsys.readouterr()
    assert run_cli(["test", "--gate", "topk+", *common, f"--ckpt_path={bare}"]) == 2
    assert_one_line_error(capsys, "permutations of shape (1, 4, 4)", "(1, 16, 16)")
    assert run_cli(["test", "--gate", "topk", *common, "--model.n_experts=4", f"--ckpt_path={bare}"]) == 2
    assert_one_line_error(capsys, "permutations of shape (1, 4, 4)", "no local search")


def test_cli_fit_comet_plus_reports_the_frozen_permutation(tiny_root: Path, capsys) -> None:
    code = run_cli(["fit", "--gate", "comet+", "--data", "movielens-100k", f"--data.root={tiny_root}", *FAST,
                    "--trainer.max_epochs=1", "--model.perm_epochs=1", "--model.lr=1e-3"])
    assert code == 0
    assert "comet+ on movielens-100k" in capsys.readouterr().out
    results = json.loads(next(Path("runs").rglob("results.json")).read_text())
    assert results["gate"] == "comet+"
    permutation = results["permutation"]
    assert len(permutation["assignment"]) == 1  # one permutation shared by the task gates (official)
    assignment = permutation["assignment"][0]
    assert len(assignment) == 16 and sorted(assignment) == list(range(16))
    assert permutation["frozen"] == 1.0
    assert permutation["moved_experts"] == sum(a != i for i, a in enumerate(assignment))
    assert permutation["step"] >= 1
    assert math.isfinite(results["test"]["loss"])


def test_plus_shortcut_keeps_an_explicit_window_in_any_order() -> None:
    from mtmoe.run import translate_shortcuts

    for argv in (["--model.perm_epochs=3", "--gate", "comet+"], ["--gate", "comet+", "--model.perm_epochs=3"]):
        translated = translate_shortcuts(argv)
        assert [a for a in translated if a.startswith("--model.perm_epochs")] == ["--model.perm_epochs=3"]
    assert "--model.perm_epochs=5" in translate_shortcuts(["--gate", "topk+"])
    assert not any(a.startswith("--model.perm_epochs") for a in translate_shortcuts(["--gate", "topk"]))
