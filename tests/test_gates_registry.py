"""Contract tests for every registered gate, parameterised over ``list_gates()`` (timm's ``test_models.py`` style).

A gate registered later is covered automatically: nothing below names a gate. Expectations come from the gate's
capability flags and the hyperparameters it searches (``search_space``; comet-protocol.md §9.4):

* ``sparse is False`` (dense gates): every expert is active, ``max_active()`` is ``None``;
* ``"gamma" in search_space`` (smooth-step, dense-to-sparse gates: COMET, DSelect-k): every expert is active at
  initialisation and at most ``max_active()`` are active once the smooth-step inputs are saturated;
* batch-level routers (``active_per_batch(B)`` not ``None``: Expert Choice, USMoE): exactly that many non-zero
  weights in a batch, however they fall on the samples (a sample may get none);
* any other sparse gate with a ``max_active()`` (Top-k, Hash-r, CompeteSMoE, SparseMixer): exactly ``max_active()``
  experts per sample; one without (ReMoE): at least ``min_active`` experts per sample.

Simplex rule: for ``simplex`` gates rows sum to 1 within 1e-5, except for gates that document unreachable codes
(DSelect-k with n not a power of 2, exposed as ``power_of_two = False``), whose rows only satisfy ``sum <= 1``; their
saturated simplex check on valid codes lives in ``test_gates_paper.py``. Rows of the other gates are only
non-negative (their documented sums are checked in ``test_gates_routers.py``).

Parameters: every gate meets every n in each test; a third factor (batch size, extreme case) is spread over them
pairwise (``tests/covering.py``): every gate and every n meets each of its values, not every (gate, n) pair.

Batch independence: in eval mode a gate that is not ``batch_dependent`` gives every sample the same weights whatever
the rest of its batch; a ``batch_dependent`` one does not (expected, and documented by the gate).
A gate's ``output_scale`` (SparseMixer's omega) enters the surrogate losses, so its gradient is checked too.
"""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from mtmoe.errors import UsageError
from mtmoe.gates import Gate, GateDims, RoutingInput, create_gate, gate_class, list_gates
from mtmoe.random import Stream

from covering import pairwise

GATES = list_gates()
N_EXPERTS = [2, 3, 5, 8, 9, 16]
P = 4  # routing features
B = 8  # batch
N_IDS = 40  # stable sample ids, for pre-assigned routers
K = 2
SATURATION_FACTOR = 1e7


EXPERT_SHAPE = (3,)  # one expert's output, as ``routing`` draws them


def dims(n: int, k: int = K, n_ids: int = N_IDS) -> GateDims:
    return GateDims(in_features=P, n_experts=n, n_ids=n_ids, k=min(k, n), expert_shape=EXPERT_SHAPE)


def build(name: str, n: int, seed: int = 0, **hparams) -> Gate:
    torch.manual_seed(seed)
    return create_gate(name, dims(n), **hparams)


def routing(gate: Gate, b: int = B, scale: float = 1.0, seed: int = 1, zero: bool = False) -> RoutingInput:
    generator = torch.Generator().manual_seed(seed)
    x = torch.zeros(b, P) if zero else torch.randn(b, P, generator=generator) * scale
    sample_id = torch.randint(0, N_IDS, (b,), generator=generator) if gate.needs_sample_id else None
    expert_outputs = (
        torch.randn(b, gate.n_experts, *EXPERT_SHAPE, generator=generator) if gate.needs_expert_outputs else None
    )
    return RoutingInput(x=x, sample_id=sample_id, expert_outputs=expert_outputs,
                        stream=Stream(torch.tensor(seed), torch.tensor(0)))


def takes(name: str, argument: str) -> bool:
    return argument in inspect.signature(gate_class(name).__init__).parameters


def is_smooth_step_gate(gate: Gate) -> bool:
    return "gamma" in gate.search_space


def simplex_exempt(gate: Gate) -> bool:
    """Gates whose rows may sum to < 1 before saturation (documented in dselect_k.py: n not a power of 2)."""
    return getattr(gate, "power_of_two", True) is False


def saturate_(gate: Gate, factor: float = SATURATION_FACTOR) -> list[nn.Module]:
    """Push a gate's smooth-step inputs far outside [-gamma/2, gamma/2]; returns the layers it scaled.

    For smooth-step gates the layers feeding the smooth-step are recognised by their initialisation,
    U(-gamma/100, gamma/100) (split nodes of COMET, selectors of DSelect-k); only those are scaled, so the leaf /
    mixing logits stay moderate and the count of active experts stays informative. Other gates get every
    parameter scaled (an extreme-logit stress test).
    """
    scaled: list[nn.Module] = []
    with torch.no_grad():
        if is_smooth_step_gate(gate):
            bound = gate.gamma / 100 + 1e-12
            for module in gate.modules():
                params = list(module.parameters(recurse=False))
                if isinstance(module, nn.Linear) and params and all(p.abs().max() <= bound for p in params):
                    for p in params:
                        p.mul_(factor)
                    scaled.append(module)
        else:
            for p in gate.parameters():
                p.mul_(factor)
            scaled.append(gate)
    return scaled


def surrogate_loss(out, seed: int = 2) -> torch.Tensor:
    """A random linear function of the weights (and of the output scale, if any) plus the auxiliary loss."""
    generator = torch.Generator().manual_seed(seed)
    loss = (out.weights * torch.randn(out.weights.shape, generator=generator)).sum() + out.aux_loss
    if out.output_scale is not None:
        loss = loss + (out.output_scale * torch.randn(out.output_scale.shape, generator=generator)).sum()
    return loss


def backward(gate: Gate, loss: torch.Tensor) -> None:
    """``loss.backward()``; a gate without trainable parameters (Hash-r) must give a constant loss instead."""
    if any(p.requires_grad for p in gate.parameters()):
        loss.backward()
    else:
        assert not loss.requires_grad


def n_active(weights: torch.Tensor) -> torch.Tensor:
    return (weights != 0).sum(dim=-1)


def check_weights(gate: Gate, weights: torch.Tensor, b: int, exact_simplex: bool | None = None) -> None:
    n = gate.n_experts
    assert weights.shape == (b, n)
    assert torch.isfinite(weights).all()
    assert (weights >= 0).all()
    if not gate.simplex:
        return
    sums = weights.sum(dim=-1)
    assert (sums <= 1 + 1e-5).all(), sums
    if exact_simplex is None:
        exact_simplex = not simplex_exempt(gate)
    if exact_simplex:
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------------------------
# registry and class-level contract
# --------------------------------------------------------------------------------------------------------------


def test_registry_is_not_empty_and_sorted():
    assert len(GATES) >= 1
    assert GATES == sorted(GATES)


def test_unknown_gate_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown gate"):
        create_gate("no-such-gate", dims(4))
    with pytest.raises(UsageError):
        gate_class("no-such-gate")


@pytest.mark.parametrize("name", GATES)
def test_class_contract(name):
    cls = gate_class(name)
    assert issubclass(cls, Gate)
    assert cls.registry_name == name
    init_params = inspect.signature(cls.__init__).parameters
    for hp in cls.search_space:  # every tunable hyperparameter is an __init__ keyword argument
        assert hp in init_params, f"{name}.search_space names {hp!r}, not an __init__ argument"
    for n in N_EXPERTS:
        gate = build(name, n)
        active = gate.max_active()
        if not gate.sparse:
            assert active is None
        if active is not None:
            assert 1 <= active <= n


@pytest.mark.parametrize("name", GATES)
@pytest.mark.parametrize("n", [1, 0])
def test_fewer_than_two_experts_is_a_usage_error(name, n):
    with pytest.raises(UsageError):
        create_gate(name, GateDims(in_features=P, n_experts=n, n_ids=N_IDS, k=1))


@pytest.mark.parametrize("name", [g for g in GATES if takes(g, "k")])
@pytest.mark.parametrize("n", [2, 5])
def test_bad_k_is_a_usage_error(name, n):
    for bad in (0, -1, n + 1):
        with pytest.raises(UsageError):
            create_gate(name, dims(n), k=bad)
    with pytest.raises(UsageError):  # k left unset: the dataset default dims.k is checked too
        create_gate(name, GateDims(in_features=P, n_experts=n, n_ids=N_IDS, k=n + 1))
    for good in (1, n):  # the boundaries are valid
        active = create_gate(name, dims(n), k=good).max_active()
        assert active is None or active == good


@pytest.mark.parametrize("name", [g for g in GATES if takes(g, "gamma")])
def test_bad_gamma_is_a_usage_error(name):
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(UsageError):
            create_gate(name, dims(5), gamma=bad)
    create_gate(name, dims(5), gamma=0.5)


# --------------------------------------------------------------------------------------------------------------
# forward contract, for every gate and n
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, n, b", pairwise(GATES, N_EXPERTS, [B, 1]))
def test_weights_on_simplex(name, n, b):
    gate = build(name, n)
    for mode in (True, False):
        gate.train(mode)
        out = gate(routing(gate, b=b))
        check_weights(gate, out.weights, b)
        assert out.aux_loss.shape == ()
        assert torch.isfinite(out.aux_loss)


@pytest.mark.parametrize("n", N_EXPERTS)
@pytest.mark.parametrize("name", GATES)
def test_active_experts(name, n):
    gate = build(name, n).eval()
    weights = gate(routing(gate)).weights
    active = gate.max_active()
    if not gate.sparse:
        assert (n_active(weights) == n).all()
    elif is_smooth_step_gate(gate):
        assert (n_active(weights) == n).all(), "smooth-step gates start dense"
        scaled = saturate_(gate)
        assert scaled, "saturate_ found no smooth-step input layer"
        weights = gate(routing(gate, scale=10.0)).weights
        check_weights(gate, weights, B, exact_simplex=not simplex_exempt(gate))
        counts = n_active(weights)
        if not simplex_exempt(gate):  # an exempt gate's selectors may all saturate on unreachable codes
            assert (counts >= 1).all()
        if active is not None:
            assert (counts <= active).all(), counts
        # the saturation is real: every smooth-step input sits in a flat region, so those layers get zero gradient
        weights.sum().backward()
        for module in scaled:
            for p in module.parameters():
                assert p.grad is not None and (p.grad == 0).all()
    elif gate.active_per_batch(B) is not None:
        for mode in (True, False):  # batch-level in training always, in eval when batch-dependent
            if mode or gate.batch_dependent:
                counts = n_active(gate.train(mode)(routing(gate)).weights)
                assert counts.sum() == gate.active_per_batch(B), counts
        if not gate.batch_dependent:  # evaluated per sample: the per-sample guarantee applies
            assert (n_active(gate.eval()(routing(gate)).weights) == active).all()
    elif active is not None:
        assert (n_active(weights) == active).all(), n_active(weights)
    else:
        assert (n_active(weights) >= gate.min_active).all()


@pytest.mark.parametrize("n", N_EXPERTS)
@pytest.mark.parametrize("name", GATES)
def test_gradients_reach_every_parameter(name, n):
    """On a batch of 256: SparseMixer gives its router no gradient from a sample whose sampling mask leaves one
    expert (``pi_D = 1``), which at initialisation is most samples for small n."""
    gate = build(name, n).train()
    out = gate(routing(gate, b=256))
    backward(gate, surrogate_loss(out))
    for pname, p in gate.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{pname} got no gradient"
            assert torch.isfinite(p.grad).all(), pname
            assert (p.grad != 0).any(), f"{pname} got an all-zero gradient"


@pytest.mark.parametrize("name, n, case", pairwise(
    GATES, N_EXPERTS, ["x*1e6", "x=0", "partly saturated", "saturated", "saturated,x*1e15"]))
def test_finite_at_extreme_inputs(name, n, case):
    """Includes exact-zero reach probabilities next to soft splits ("partly saturated"), where a plain log(v)
    turns 0 * inf into NaN gradients for the soft splits."""
    gate = build(name, n).train()
    if case == "partly saturated":
        saturate_(gate, factor=60.0)
    elif case.startswith("saturated"):
        saturate_(gate)
    scale = {"x*1e6": 1e6, "x=0": 0.0, "partly saturated": 1.0, "saturated": 10.0, "saturated,x*1e15": 1e15}[case]
    out = gate(routing(gate, scale=scale, zero=case == "x=0"))
    check_weights(gate, out.weights, B, exact_simplex=False)
    assert torch.isfinite(out.aux_loss)
    for value in out.stats.values():
        assert torch.isfinite(value).all()
    backward(gate, surrogate_loss(out))
    for pname, p in gate.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), f"non-finite gradient in {pname}"


@pytest.mark.parametrize("n", N_EXPERTS)
@pytest.mark.parametrize("name", GATES)
def test_eval_is_deterministic_and_has_no_aux_loss(name, n):
    gate = build(name, n).eval()
    x = routing(gate)
    first, second = gate(x), gate(x)
    assert torch.equal(first.weights, second.weights)
    assert first.aux_loss.shape == ()
    assert first.aux_loss.item() == 0.0
    assert not first.stats or all(torch.isfinite(v).all() for v in first.stats.values())


@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("name", GATES)
def test_eval_batch_independence_follows_the_flag(name, n):
    """A sample's eval weights ignore the rest of its batch unless the gate is ``batch_dependent``."""
    gate = build(name, n).eval()
    full = routing(gate, b=2 * B)
    first_half = RoutingInput(*(None if t is None else t[:B] for t in (full.x, full.sample_id, full.expert_outputs)))
    changed = routing(gate, b=2 * B, seed=7)  # same first half, other second half
    for field in ("x", "sample_id", "expert_outputs"):
        if getattr(full, field) is not None:
            getattr(changed, field)[:B] = getattr(full, field)[:B]
    weights = gate(full).weights[:B]
    if not gate.batch_dependent:
        torch.testing.assert_close(gate(first_half).weights, weights)
        torch.testing.assert_close(gate(changed).weights[:B], weights)
    else:
        assert not torch.equal(gate(changed).weights[:B], weights)


@pytest.mark.parametrize("n", N_EXPERTS)
@pytest.mark.parametrize("name", GATES)
def test_state_dict_round_trip(name, n):
    source = build(name, n, seed=0).eval()
    target = build(name, n, seed=123).eval()
    x = routing(source, b=2 * N_IDS)
    if gate_class(name).needs_sample_id:  # cover every stable id
        x.sample_id = torch.arange(2 * N_IDS) % N_IDS
    state = source.state_dict()
    if state:  # a gate with state drawn at random must differ before loading
        assert not torch.equal(source(x).weights, target(x).weights)
    target.load_state_dict(state)
    assert torch.equal(source(x).weights, target(x).weights)
    assert set(target.state_dict()) == set(state)


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the reads of a tensor's value by Python (``int(t)``, ``t.item()``, ``bool(t)``) and the operations whose
    output shape depends on values (``nonzero``): on a GPU, each waits for the device to finish its queued work."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", GATES)
def test_a_training_step_reads_no_device_value(name: str) -> None:
    """A training forward and backward of every gate (its counters, schedules and coins are device tensors) reads
    nothing on the host, so a GPU step never waits for the device and can be captured in a CUDA graph."""
    gate = build(name, 8).train().double()
    inputs = routing(gate, b=64)
    inputs = RoutingInput(inputs.x.double(), inputs.sample_id,
                          None if inputs.expert_outputs is None else inputs.expert_outputs.double(), inputs.stream)
    for _ in range(3):
        reads = HostReads()
        with reads:
            out = gate(inputs)
            loss = out.weights.square().sum() + out.aux_loss
            if loss.requires_grad:  # Hash-r has nothing to train
                loss.backward()
        assert reads.reads == [], name
