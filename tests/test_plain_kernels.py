"""``MTMOE_PLAIN_KERNELS`` (``mtmoe.plain_kernels``): each fused kernel it names runs as its torch operations, which
compute the same values; an unknown name is one error line."""
from __future__ import annotations

import pytest
import torch

import mtmoe.plain_kernels as plain
from mtmoe import kernel_traffic
from mtmoe.errors import UsageError
from mtmoe.random import dropout

from conftest import run_cli
from test_engine import batches, engine_of, trials

#: The labels each kernel reports to the operation counters (:func:`mtmoe.kernel_traffic.fused_kernel`) on the CPU.
LABELS = {"adam": {"adam (numba)"}, "dropout": {"dropout (numba)"},
          "epilogue": {"epilogue (numba)", "epilogue backward (numba)"}, "mixing": {"mix backward (numba)"},
          "reach": {"comet reach (numba)", "comet reach backward (numba)"},
          "shared_input": {"shared input backward (numba)"}}
#: Where the torch operations equal the kernel to float rounding only, on this CPU: numba's Adam fuses its
#: multiply-adds as torch's fused Adam does, the element-wise update does not (on a GPU the Triton kernel rounds as
#: the element-wise update: bitwise); the mixing's backward accumulates the tasks' products with a fused multiply-add
#: as a GEMM does, and MKL's small GEMMs do not.
ROUNDING = {"adam", "mixing"}
PACK, STEPS = 3, 3


class Labels:
    """The fused kernels reported while it listens."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def kernel(self, name: str, read: int, written: int, flops: int = 0) -> None:
        self.names.add(name)

    def __enter__(self) -> Labels:
        kernel_traffic.LISTENERS.append(self)
        return self

    def __exit__(self, *_) -> None:
        kernel_traffic.LISTENERS.remove(self)


@pytest.fixture
def plain_set(monkeypatch):
    """Set the kernels that run plain, as ``MTMOE_PLAIN_KERNELS`` would."""
    def set_(names) -> None:
        monkeypatch.setattr(plain, "plain_kernels", lambda: frozenset(names))
    return set_


def trained(gate: str = "comet") -> tuple[dict[str, torch.Tensor], set[str]]:
    """A pack of comet trials (dropout on) after a few training steps: its parameters and the kernels reported."""
    engine = engine_of(trials(gate, 0.1, n=PACK))
    data = [batches(p, STEPS) for p in range(PACK)]
    with Labels() as labels:
        for i in range(STEPS):
            engine.train_step({key: torch.stack([data[p][i][key] for p in range(PACK)]) for key in data[0][i]})
    return {name: t.detach().clone() for name, t in engine.stack.params.items()}, labels.names


@pytest.fixture(scope="module")
def fused_pack() -> tuple[dict[str, torch.Tensor], set[str]]:
    return trained()


def test_a_value_names_kernels_or_all_and_an_unknown_name_is_refused() -> None:
    assert plain.parse("") == frozenset() and plain.parse(" , ") == frozenset()
    assert plain.parse("mixing, epilogue") == {"mixing", "epilogue"}
    assert plain.parse("all") == frozenset(plain.KERNELS) | {"eval_graphs"}
    with pytest.raises(UsageError, match=r"MTMOE_PLAIN_KERNELS='mixing,epilog': unknown kernel 'epilog'; give a "
                                         r"comma-separated list of adam, dropout, .*, or all"):
        plain.parse("mixing,epilog")


@pytest.mark.parametrize("kernel", sorted(set(plain.KERNELS) - {"dropout"}))
def test_a_named_kernel_runs_as_torch_operations_computing_the_same(kernel: str, fused_pack, plain_set) -> None:
    """A comet pack's training steps with one kernel named: that kernel reports no launch, the others still run
    (the epilogue's torch operations take their dropout from the dropout kernel), and the weights are those of the
    fused kernels (bitwise, or to float rounding where :data:`ROUNDING` says)."""
    fused, fused_labels = fused_pack
    assert set().union(*(LABELS[k] for k in plain.KERNELS if k != "dropout")) == fused_labels
    plain_set({kernel})
    params, labels = trained()
    assert labels == fused_labels - LABELS[kernel] | (LABELS["dropout"] if kernel == "epilogue" else set())
    for name, tensor in params.items():
        if kernel in ROUNDING:
            torch.testing.assert_close(tensor, fused[name], rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(tensor, fused[name]), name


def test_all_runs_the_pack_on_torch_operations_alone(fused_pack, plain_set) -> None:
    fused, _ = fused_pack
    plain_set(plain.KERNELS)
    params, labels = trained()
    assert labels == set()
    for name, tensor in params.items():
        torch.testing.assert_close(tensor, fused[name], rtol=1e-5, atol=1e-6, msg=name)


def test_dropout_named_runs_its_reference_bitwise(plain_set) -> None:
    """The dropout kernel (the experts that are not dense layers: convolutions) against its torch reference."""
    h = torch.randn(3, 40, 24)
    seed, step = torch.tensor([1, 2, 3]), torch.tensor([5, 5, 6])
    with Labels() as labels:
        fused = dropout(h, seed, 2, step, 0.3)
    assert labels.names == LABELS["dropout"]
    plain_set({"dropout"})
    with Labels() as labels:
        reference = dropout(h, seed, 2, step, 0.3)
    assert labels.names == set() and torch.equal(fused, reference)


def test_the_cli_refuses_an_unknown_kernel_in_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setenv(plain.ENVIRONMENT, "mixin")
    plain.plain_kernels.cache_clear()
    try:
        for argv in (["fit", "--gate", "comet", "--data", "movielens-100k"],
                     ["tune", "--gate", "comet", "--data", "movielens-100k"]):
            assert run_cli(argv) == 2
            assert capsys.readouterr().err.splitlines() == [
                "error: MTMOE_PLAIN_KERNELS='mixin': unknown kernel 'mixin'; give a comma-separated list of adam, "
                "dropout, epilogue, eval_graphs, mixing, reach, shared_input, or all"]
    finally:
        plain.plain_kernels.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_all_plain_is_captured_unsynchronised_and_trains_as_fused(plain_set) -> None:
    """On a GPU, the pack's training step with every kernel as torch operations (what a failed preflight trains
    with) is captured in a CUDA graph, replays without a host read, and trains the weights the Triton kernels train
    (to float32 rounding: the mixing's backward sums as cuBLAS does)."""
    from test_engine_cuda import cuda_engine, pack_batch, unsynchronised

    inputs = [pack_batch(step, 3) for step in range(8)]
    results = []
    for names in ((), tuple(plain.KERNELS)):
        plain_set(names)
        engine = cuda_engine("comet", graphs=True)
        with Labels() as labels:
            for step in range(4):  # warm-up and capture
                engine.train_step(inputs[step])
            unsynchronised(lambda: [engine.train_step(inputs[step]) for step in range(4, 8)])
        assert (labels.names == set()) == bool(names), labels.names
        results.append(engine.stack.flat.clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
