"""The training engine (``mtmoe.pack.engine``): a trial trained in a pack computes what it computes alone.

"Alone" is the plain modules' own loop here, independent of the engine: the trial's ``MMoE`` forward pass,
``multitask_loss``, ``backward`` and ``torch.optim.Adam(fused=True)``, with local search's rounding done between steps
when it is due. For every registered gate and every "+" variant, each gate with dropout off and on (a gate with
one, its "+" with the other: ``tests/covering.py``), each trial of a pack of 4 (the study's planned values of
``mtmoe/tuning/spaces/movielens-100k.yaml`` for that gate, and each trial its own seed, alpha and Adam epsilon)
trains 26 steps on its own batches with the losses, parameters and buffers of its run alone (float32 rounding: the
tolerances below). Also: evaluation, a slot refilled mid-run, a diverging trial beside others, PackedAdam against
``torch.optim.Adam``, CompeteSMoE's coin at its threshold, bf16 autocast.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from covering import variants_over
from replay import ReplayStandIn

from mtmoe.host_threads import MIN_PART
from mtmoe.dataset_info import DatasetInfo, TaskSpec
from mtmoe.gates import gate_class, list_gates
from mtmoe.gates.competesmoe import uniform_hash
from mtmoe.losses import multitask_loss
from mtmoe.pack.adam import PackedAdam
from mtmoe.pack.engine import PackEngine, Trial
from mtmoe.pack.settings import build_trial
from mtmoe.pack.stack import TrialStack
from mtmoe.tuning.objective import plan_configurations
from mtmoe.run_settings import config_key, model_settings
from mtmoe.tuning.packs import pack_key
from mtmoe.tuning.space import load_space

P, B, STEPS, STEPS_PER_EPOCH = 4, 24, 26, 2  # E_perm of 1..10 epochs: windows of 2..20 steps, all within the run
#: Batched and unbatched kernels round differently (float32); measured worst cases: losses 4.3e-6, parameters 3e-7,
#: except where a batch-level router's discrete choice over the batch met a near-tie (Expert Choice, dropout on:
#: 4.3e-5 in one expert's bias, the losses still within 4.3e-6).
LOSS_TOLERANCE, PARAM_TOLERANCE = 1e-5, 1e-4
VARIANTS = [name + plus for name in list_gates() for plus in ("", "+") if not plus or gate_class(name).permutable]


def info(dropout: float) -> DatasetInfo:
    return DatasetInfo(name="tiny", tasks=(TaskSpec("watch", "binary"), TaskSpec("rating", "regression", masked=True)),
                       n_ids=50, n_users=50, n_items=40, embedding_dim=8, expert_units=16, tower_units=8, n_experts=5,
                       k=2, expert_dropout=dropout)


def trials(name: str, dropout: float, n: int = P, seed: int = 0) -> list[Trial]:
    """``n`` trials of ``name``: the study's planned values for it on MovieLens-100K (every tunable setting), and
    each its own seed, alpha and Adam epsilon."""
    space = load_space("movielens-100k", name)
    planned = plan_configurations(space, 8 * n, seed)
    packable = [params for params in planned if pack_key(space, params) == pack_key(space, planned[0])][:n]
    assert len(packable) == n
    cls = gate_class(name.rstrip("+"))
    out = []
    for p, params in enumerate(packable):
        config = Namespace(model=Namespace(gate=Namespace(class_path=f"{cls.__module__}.{cls.__qualname__}")))
        for key, value in {**space.fixed, **params}.items():  # as the tune worker applies them (TrialFactory)
            if key.startswith("model.") and key != "model.n_experts":
                config[config_key(key)] = value
        if "warmup" in cls.__init__.__code__.co_varnames:
            config["model.gate.init_args.warmup"] = 0.1
        settings = model_settings(config.model)
        # the planned range of lr, 10x: these short runs move the weights visibly
        settings = replace(settings, lr=settings.lr * 10, alpha=(0.1, 0.5, 0.9, 0.3)[p % 4],
                           adam_eps=(1e-7, 1e-8, 1e-6, 1e-7)[p % 4])
        torch.manual_seed(100 + p)
        out.append(build_trial(info(dropout), p, settings, max_epochs=STEPS // STEPS_PER_EPOCH))
    return out


def batches(p: int, steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(p)
    out = []
    for _ in range(steps):
        user = torch.randint(0, 50, (B,), generator=g)
        out.append({"user": user, "item": torch.randint(0, 40, (B,), generator=g), "sample_id": user,
                    "watch": (torch.rand(B, generator=g) < 0.5).float(), "rating": torch.rand(B, generator=g) * 5,
                    "rating_mask": torch.rand(B, generator=g) < 0.5})
    return out


def train_alone(trial: Trial, data: list[dict]) -> list[float]:
    """The plain loop: forward, loss, backward, ``torch.optim.Adam(fused=True)``; local search rounded when due."""
    net = trial.net
    search = net.local_search
    if search is not None:
        search.set_window(STEPS_PER_EPOCH)
    for gate in net.gates:
        gate.set_training_steps(STEPS_PER_EPOCH * trial.max_epochs)
    optimizer = torch.optim.Adam(net.parameters(), lr=trial.lr, eps=trial.adam_eps, fused=True)
    net.train()
    losses = []
    for batch in data:
        if search is not None and search.rounding_due(training=True):
            search.round_()
        output = net(batch)
        loss, _, _ = multitask_loss(info(0.0).tasks, list(trial.task_weights), output.predictions, batch)
        optimizer.zero_grad()
        (loss + output.aux_loss).backward()
        if search is not None and search.frozen:
            search.log_weights.grad = None  # unused by a step after the window: Adam leaves it as it is
        optimizer.step()
        losses.append(loss.item())
    return losses


def engine_of(pack: list[Trial]) -> PackEngine:
    engine = PackEngine(pack[0].net, info(0.0).tasks, len(pack), "cpu")
    engine.set_steps_per_epoch(STEPS_PER_EPOCH)
    for slot, trial in enumerate(pack):
        engine.load(slot, trial)
    return engine


def step(engine: PackEngine, data: list[list[dict]], i: int) -> torch.Tensor:
    """Step ``i`` of every slot on its own batch; the slots' losses ``[P]``."""
    engine.train_metrics.reset()
    engine.train_step({key: torch.stack([d[i][key] for d in data]) for key in data[0][i]})
    return engine.train_metrics.loss.clone()


def assert_same_state(packed: Trial, alone: Trial, rtol: float = 0, atol: float = PARAM_TOLERANCE) -> None:
    reference = dict(alone.net.named_parameters())
    for key, value in packed.net.named_parameters():  # the trial's own net sees its slot
        assert torch.allclose(value, reference[key], rtol=rtol, atol=atol), key
    buffers = dict(alone.net.named_buffers())
    for key, value in packed.net.named_buffers():
        if value.is_floating_point():
            assert torch.allclose(value, buffers[key], rtol=0, atol=atol), key
        else:
            assert torch.equal(value, buffers[key]), key


@pytest.mark.parametrize("name, dropout", variants_over([0.0, 0.5], every_gate_meets_every_value=True))
def test_each_trial_of_a_pack_trains_as_it_would_alone(name: str, dropout: float) -> None:
    alone = trials(name, dropout)
    expected = torch.tensor([train_alone(trial, batches(p)) for p, trial in enumerate(alone)])
    packed = trials(name, dropout)
    engine = engine_of(packed)
    data = [batches(p) for p in range(P)]
    losses = torch.stack([step(engine, data, i) for i in range(STEPS)], dim=1)
    assert torch.allclose(losses, expected, rtol=0, atol=LOSS_TOLERANCE), (losses - expected).abs().max()
    for p in range(P):
        assert_same_state(packed[p], alone[p])
        if name.endswith("+"):  # its window ended and its permutation was rounded as alone
            assert packed[p].net.local_search.frozen
            assert torch.equal(packed[p].net.local_search.rounded, alone[p].net.local_search.rounded)


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_evaluation_equals_each_trial_alone(name: str) -> None:
    pack = trials(name, 0.5)
    batch = batches(0)[0]
    expected = []
    for trial in pack:
        trial.net.eval()
        with torch.no_grad():
            output = trial.net(batch)
            expected.append(multitask_loss(info(0.0).tasks, list(trial.task_weights), output.predictions, batch)[0])
    engine = engine_of(pack)
    engine.prepare_evaluation()
    engine.eval_step(batch)
    results = engine.eval_metrics.results()
    got = torch.tensor([r["loss"] for r in results])
    assert torch.allclose(got, torch.stack(expected), rtol=0, atol=LOSS_TOLERANCE)


@pytest.mark.parametrize("name", ["comet+", "sparsemixer"])
def test_a_refilled_slot_trains_its_trial_as_alone(name: str) -> None:
    """Trial C enters slot 0 after 10 steps of trial A beside B: fresh moments, buffers, schedules, its own seed and
    draws; B is undisturbed."""
    a, b, c = trials(name, 0.5, 3)
    c_alone = trials(name, 0.5, 3)[2]
    b_alone = trials(name, 0.5, 3)[1]
    expected_c = train_alone(c_alone, batches(2, STEPS - 10))
    expected_b = train_alone(b_alone, batches(1))
    engine = engine_of([a, b])
    data = [batches(0), batches(1)]
    losses_b = [step(engine, data, i)[1].item() for i in range(10)]
    engine.slots[0] = None
    engine.load(0, c)
    data[0] = [None] * 10 + batches(2, STEPS - 10)
    later = [step(engine, data, i) for i in range(10, STEPS)]
    assert [x[0].item() for x in later] == pytest.approx(expected_c, abs=LOSS_TOLERANCE)
    assert losses_b + [x[1].item() for x in later] == pytest.approx(expected_b, abs=LOSS_TOLERANCE)
    assert_same_state(c, c_alone)
    assert_same_state(b, b_alone)


def test_a_finished_trial_keeps_its_best_weights_when_its_slot_is_refilled() -> None:
    """At the end of its trial a net gets its own copy of its best epoch's weights (issue 25): a trial refilled into
    its slot and trained on does not change it."""
    pack = trials("comet+", 0.5, 3)
    engine = engine_of(pack[:2])
    data = [batches(0), batches(1)]
    for epoch in range(3):
        engine.start_epoch()
        for i in range(2 * epoch, 2 * epoch + 2):
            engine.train_step({key: torch.stack([d[i][key] for d in data]) for key in data[0][i]})
        engine.prepare_evaluation()
        engine.eval_step(batches(5, 1)[0])
        validation = engine.eval_metrics.results()
        if epoch == 1:
            best = {name: tensor[0].clone() for name, tensor in engine.stack.tensors().items()}
            validation[0]["loss"] = -1.0  # trial 0's best epoch, whatever its loss
        ended = engine.end_epoch(validation)
    engine.slots[0].wait = engine.slots[0].patience  # it stops now
    (result,) = engine.test(engine.release([0]), [batches(6, 1)[0]])
    assert result.results["best_epoch"] == 1
    finished = dict(pack[0].net.named_parameters()) | dict(pack[0].net.named_buffers())
    for name, value in best.items():
        assert torch.equal(finished[name], value), name
    engine.load(0, pack[2])
    engine.train_step({key: torch.stack([batches(2)[0][key], data[1][6][key]]) for key in data[0][0]})
    for name, value in best.items():
        assert torch.equal(finished[name], value), name
    assert not ended


def test_a_diverging_trial_leaves_its_neighbours_bit_identical() -> None:
    """Slot 1 holds a trial whose Adam has no epsilon and a huge learning rate (NaN within steps) in one pack, a
    healthy trial in the other: slots 0 and 2 end bitwise the same in both."""
    packs = []
    for diverging in (True, False):
        pack = trials("comet", 0.5, 3)
        if diverging:
            pack[1].lr, pack[1].adam_eps = 1e4, 0.0
        engine = engine_of(pack)
        data = [batches(p) for p in range(3)]
        losses = torch.stack([step(engine, data, i) for i in range(STEPS)], dim=1)
        packs.append((pack, losses))
    (sick, sick_losses), (healthy, healthy_losses) = packs
    assert not torch.isfinite(sick_losses[1]).all() and torch.isfinite(healthy_losses).all()
    assert torch.equal(sick_losses[[0, 2]], healthy_losses[[0, 2]])
    for slot in (0, 2):
        assert_same_state(sick[slot], healthy[slot], atol=0)


ADAM_SETTINGS = [(1e-3, 1e-7), (3e-2, 1e-8), (5e-4, 1e-3)]  # the three trials' (lr, eps) in the Adam tests


def test_packed_adam_equals_torch_adam_per_trial() -> None:
    """Given the same gradients, each trial's row follows ``torch.optim.Adam(fused=True)`` (what ``fit`` used before
    the engine) with its own lr and eps, to float32 rounding (the fused kernel contracts one product into a fused
    multiply-add); a skipped parameter stays as Adam leaves a parameter without gradient, moments included."""

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    reference, packed = [model(p) for p in range(3)], [model(p) for p in range(3)]
    optimizers = [torch.optim.Adam(m.parameters(), lr=lr, eps=eps, fused=True)
                  for m, (lr, eps) in zip(reference, ADAM_SETTINGS)]
    stack = TrialStack(packed[0], 3, "cpu")
    adam = PackedAdam(stack)
    for slot, (module, (lr, eps)) in enumerate(zip(packed, ADAM_SETTINGS)):
        stack.load(slot, module)
        adam.reset(slot, lr, eps)
    generator = torch.Generator().manual_seed(0)
    for i in range(40):
        skip = i >= 20  # from step 20, trial 1 leaves its last layer's bias alone (no gradient)
        grads = {name: torch.randn(leaf.shape, generator=generator) for name, leaf in stack.params.items()}
        for name, leaf in stack.params.items():
            leaf.grad.copy_(grads[name])
        adam.step({"2.bias": torch.tensor([False, True, False])} if skip else None)
        for p in range(3):
            for name, param in reference[p].named_parameters():
                param.grad = None if skip and p == 1 and name == "2.bias" else grads[name][p].clone()
            optimizers[p].step()
    for p in range(3):
        for (key, value), expected in zip(packed[p].named_parameters(), reference[p].parameters()):
            assert torch.allclose(value, expected, rtol=0, atol=1e-7), key
    assert torch.equal(adam._blocks("2.bias")[2][1],
                       optimizers[1].state[reference[1][2].bias]["exp_avg"])


def test_packed_adam_cpu_kernel_is_the_same_on_any_number_of_threads() -> None:
    """The CPU update (one numba kernel over the flat tensors, split over torch's threads, parts crossing blocks
    and trials) gives the same bits on 1, 2 or 3 threads, and per trial follows ``torch.optim.Adam(fused=True)``
    to float32 rounding; reading the gradients where they lie (per block, split by rows) gives the same bits."""

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(150, 300), torch.nn.Tanh(), torch.nn.Linear(300, 3))

    generator = torch.Generator().manual_seed(0)
    grads = [{name: torch.randn(3, *p.shape, generator=generator) for name, p in model(0).named_parameters()}
             for _ in range(5)]
    reference = [model(p) for p in range(3)]
    for module, (lr, eps) in zip(reference, ADAM_SETTINGS):
        optimizer = torch.optim.Adam(module.parameters(), lr=lr, eps=eps, fused=True)
        for step_grads in grads:
            for name, param in module.named_parameters():
                param.grad = step_grads[name][reference.index(module)].clone()
            optimizer.step()
    threads, results = torch.get_num_threads(), []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            nets, state = packed_adam_run(model, grads, [False, False, True])
            results.append(state)
            assert torch.equal(packed_adam_run(model, grads, [False, False, True], copies=True)[1], state)
            # the copies' gradients read in bfloat16: what their float32 widening gives, bitwise
            assert torch.equal(packed_adam_run(model, grads, [False, False, True], copies=True, gradients=True)[1],
                               packed_adam_run(model, bfloat16_rounded(grads), [False, False, True])[1])
            # every gradient read where it lies (transposed weights; the copies' in bfloat16): the same bits
            assert torch.equal(packed_adam_run(model, grads, [False, False, True], kept=True)[1], state)
            assert torch.equal(packed_adam_run(model, grads, [False, False, True], copies=True, gradients=True,
                                               kept=True)[1],
                               packed_adam_run(model, bfloat16_rounded(grads), [False, False, True])[1])
            for p in range(3):
                for (name, value), expected in zip(nets[p].named_parameters(), reference[p].parameters()):
                    if not (p == 2 and name == "2.weight"):
                        assert torch.allclose(value, expected, rtol=0, atol=1e-7), (count, p, name)
                    else:
                        assert torch.equal(value, model(2)[2].weight)
    finally:
        torch.set_num_threads(threads)
    assert state.numel() // 3 >= 3 * MIN_PART  # the flat parameters are large enough to be split into 3 parts
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


COPIED = frozenset({"0.weight", "0.bias", "2.bias"})  # packed_adam_run's parameters with bfloat16 copies


def bfloat16_rounded(grads: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """``grads`` with the gradients of :data:`COPIED` rounded to bfloat16 (and widened back to float32)."""
    return [{name: g.bfloat16().float() if name in COPIED else g for name, g in step.items()} for step in grads]


def packed_adam_run(model, grads: list[dict[str, torch.Tensor]], skipped: list[bool], device: str = "cpu",
                    fused: bool = True, copies: bool = False, gradients: bool = False,
                    kept: bool = False) -> tuple[list[torch.nn.Module], torch.Tensor]:
    """Three trials, ``model(0..2)``, stacked with :data:`ADAM_SETTINGS` after one :class:`PackedAdam` step per
    entry of ``grads`` (``[3, ...]`` per parameter), the trials marked in ``skipped`` leaving ``2.weight`` alone: the
    nets (holding views of their slots) and the parameters and both moments as one flat tensor. With ``copies``,
    the steps also write bfloat16 copies of the first layer and the last bias (:data:`COPIED`), which must then be
    the parameters cast (those of the skipped trial included) while the other blocks' are left alone
    (:meth:`PackedAdam.step`); with ``gradients`` too, the steps read those parameters' gradients rounded to
    bfloat16 from :meth:`PackedAdam.bfloat16_gradients` (their float32 blocks hold NaN, which must go unread). With
    ``kept``, every gradient is read where it lies (``step``'s ``kept``): the weights' in the transposed layout a
    linear layer's gradient has, the biases' contiguous, the copies' in bfloat16 with ``gradients``, and every
    block (float32 and bfloat16) holds NaN."""
    nets = [model(p) for p in range(3)]
    stack = TrialStack(nets[0], 3, device)
    adam = PackedAdam(stack, fused=fused)
    for slot, (net, (lr, eps)) in enumerate(zip(nets, ADAM_SETTINGS)):
        stack.load(slot, net)
        adam.reset(slot, lr, eps)
    names = COPIED
    for step_grads in grads:
        for name, leaf in stack.params.items():
            leaf.grad.copy_(step_grads[name])
        if copies:
            adam.bfloat16_copies(names)
        if gradients:
            blocks = adam.bfloat16_gradients()
            assert blocks.keys() == names
            for name, block in blocks.items():
                block.copy_(step_grads[name])
                stack.params[name].grad.fill_(float("nan"))
        where = {}
        if kept:
            for name, leaf in stack.params.items():
                gradient = step_grads[name].to(torch.bfloat16 if gradients and name in names else torch.float32)
                where[name] = gradient.transpose(-1, -2).contiguous().transpose(-1, -2) if gradient.dim() == 3 \
                    else gradient.clone()
                leaf.grad.fill_(float("nan"))
                if gradients and name in names:
                    adam.bfloat16_gradients()[name].fill_(float("nan"))
        adam.step({"2.weight": torch.tensor(skipped, device=device)}, copies=copies, gradients=gradients, kept=where)
    if copies:
        assert adam._half_version == stack.flat._version  # written by the step: no cast needed before the next
        for name in stack.params:
            copy = stack.block(adam.half, name)
            assert torch.equal(copy, stack.params[name].to(torch.bfloat16)) == (name in names), name
    return nets, torch.cat([stack.flat, adam.exp_avg, adam.exp_avg_sq])


def adam_states(device: str, fused: bool, copies: bool = False, gradients: bool = False,
                rounded: bool = False, kept: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`packed_adam_run` of a 150-30-3 MLP on ``device``, 4 steps, trial 1 leaving its last weight alone: the
    flat state (on the CPU) and that weight's initial values. Blocks of 4,500, 30, 90 and 3 elements per trial: the
    Triton kernel's units end inside and at blocks."""

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(150, 30), torch.nn.Tanh(), torch.nn.Linear(30, 3)).to(device)

    generator = torch.Generator().manual_seed(0)
    grads = [{name: torch.randn(3, *p.shape, generator=generator).to(device) for name, p in model(0).named_parameters()}
             for _ in range(4)]
    grads = bfloat16_rounded(grads) if rounded else grads
    _, state = packed_adam_run(model, grads, [False, True, False], device, fused, copies, gradients, kept)
    return state.cpu(), model(1)[2].weight.detach().cpu()


def check_interpreted_adam_kernel() -> None:
    """Run with ``TRITON_INTERPRET=1``: the Triton kernel on CPU tensors gives the numba kernel's and the
    element-wise path's states to float32 rounding (the interpreter rounds the lerp's product, which the GPU fuses),
    with the skipped weight as it was; either kernel writing bfloat16 copies computes the same states, and copies
    equal to the parameters cast (:func:`packed_adam_run`); either kernel reading the copies' gradients in bfloat16
    computes the states of their float32 widening; either kernel reading every gradient where it lies (``kept``:
    transposed, contiguous, bfloat16) computes the same states bitwise."""
    from mtmoe import triton_support

    assert triton_support.INTERPRET
    triton_state, initial = adam_states("cpu", fused=True)
    triton_support.INTERPRET = False
    numba_state, _ = adam_states("cpu", fused=True)
    elementwise_state, _ = adam_states("cpu", fused=False)
    for other in (numba_state, elementwise_state):
        assert torch.allclose(triton_state, other, rtol=0, atol=1e-7), (triton_state - other).abs().max()
    assert torch.equal(adam_states("cpu", fused=True, copies=True)[0], numba_state)
    numba_rounded = adam_states("cpu", fused=True, rounded=True)[0]
    assert torch.equal(adam_states("cpu", fused=True, copies=True, gradients=True)[0], numba_rounded)
    assert torch.equal(adam_states("cpu", fused=True, kept=True)[0], numba_state)
    assert torch.equal(adam_states("cpu", fused=True, copies=True, gradients=True, kept=True)[0], numba_rounded)
    triton_support.INTERPRET = True
    assert torch.equal(adam_states("cpu", fused=True, copies=True)[0], triton_state)
    triton_rounded = adam_states("cpu", fused=True, rounded=True)[0]
    assert torch.equal(adam_states("cpu", fused=True, copies=True, gradients=True)[0], triton_rounded)
    assert torch.equal(adam_states("cpu", fused=True, kept=True)[0], triton_state)
    assert torch.equal(adam_states("cpu", fused=True, copies=True, gradients=True, kept=True)[0], triton_rounded)

    def wide(seed: int) -> torch.nn.Module:  # a weight of 70 x 40: tiles over both of its axes
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(40, 70))

    grads = [{name: torch.randn(3, *p.shape) for name, p in wide(0).named_parameters()} for _ in range(2)]
    kept, flat = (packed_adam_run(wide, grads, [False] * 3, kept=kept)[1] for kept in (True, False))
    assert torch.equal(kept, flat)
    skipped = triton_state[3 * 4530 + 90:3 * 4530 + 180]  # trial 1's row of the last weight
    assert torch.equal(skipped, initial.flatten())
    print("ok")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.integration  # a Python process of its own, importing torch and Triton's interpreter: CI, not the inner loop
def test_packed_adam_triton_kernel_in_the_interpreter() -> None:
    """:func:`check_interpreted_adam_kernel` in a process with ``TRITON_INTERPRET=1`` (read at import)."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_engine as t; " \
           "t.check_interpreted_adam_kernel()"
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1",
                                                               "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_competesmoe_coin_at_its_threshold_is_the_same_packed_and_alone() -> None:
    """The competition probability at the draw of step 0 (seed 102) and one float64 step either side: the coin
    compares float64 with float64 packed and alone, so the first step's losses agree (issue 25: a pack used to
    compare with float32(p), which flips one of these coins)."""
    draw = float(uniform_hash(torch.tensor(102), torch.tensor(0)))
    values = [math.nextafter(draw, 0.0), draw, math.nextafter(draw, 1.0)]
    assert any((float(torch.tensor(v, dtype=torch.float32)) > draw) != (v > draw) for v in values)
    for value in values:
        alone, packed = trials("competesmoe", 0.0, 3), trials("competesmoe", 0.0, 3)
        for trial in alone + packed:
            for gate in trial.net.gates:
                gate.competition_prob.fill_(value)
                gate.seed.fill_(102)
        expected = [train_alone(trial, batches(p, 1))[0] for p, trial in enumerate(alone)]
        losses = step(engine_of(packed), [batches(p, 1) for p in range(3)], 0)
        assert losses.tolist() == pytest.approx(expected, abs=LOSS_TOLERANCE)


def test_packed_experts_stay_in_bf16_under_autocast() -> None:
    """A pack's expert layer under bf16 autocast returns bf16, as the unpacked layer does (vmap's linear, matmul then
    add, would promote through the float32 bias), and a packed training step runs with finite losses."""
    pack = trials("topk", 0.5, 2)
    experts = pack[0].net.experts
    params = {key: value.detach().expand(2, *value.shape) for key, value in experts.named_parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.func.vmap(lambda params, x: torch.func.functional_call(experts.eval(), params, (x,)),
                              in_dims=(0, None))(params, torch.randn(4, 16))
        losses = step(engine_of(pack), [batches(0), batches(1)], 0)
        alone = experts.eval()(torch.randn(4, 16))
    assert out.dtype == alone.dtype == torch.bfloat16
    assert torch.isfinite(losses).all()


def test_a_checkpointed_trial_continues_in_another_slot_and_pack_exactly() -> None:
    """:meth:`PackEngine.checkpoint` at an epoch's end, loaded (``Trial.saved``) into fresh nets of a larger pack in
    other slots: the next epochs' losses, the parameters, buffers, Adam's state, best weights and early stopping's
    state are bitwise those of the pack that was never stopped (comet+, dropout on, local search's window inside
    the saved part)."""
    epochs, cut = 5, 2
    data = [batches(p, epochs * STEPS_PER_EPOCH) for p in range(3)]

    def run_epochs(engine: PackEngine, order: list[int | None], first: int, last: int) -> list[torch.Tensor]:
        losses = []
        for epoch in range(first, last):
            engine.start_epoch()
            for i in range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH):
                losses.append(step(engine, [data[p or 0] for p in order], i)[[order.index(p) for p in range(3)]])
            # trial p's validation loss: improving at some epochs, not at others
            engine.end_epoch([{"loss": 0.0 if p is None else [1.0, 0.5, 0.7, 0.4, 0.45][epoch] + p / 10}
                              for p in order])
        return losses

    whole = trials("comet+", 0.5, 3)
    whole_engine = engine_of(whole)
    expected = run_epochs(whole_engine, [0, 1, 2], 0, epochs)

    first = trials("comet+", 0.5, 3)
    engine = engine_of(first)
    run_epochs(engine, [0, 1, 2], 0, cut)
    saved = dict(engine.checkpoint())
    assert sorted(saved) == [0, 1, 2] and all(state["progress"]["epochs_run"] == cut for state in saved.values())
    again = trials("comet+", 0.5, 3)
    order = [None, 2, 0, 1]  # slot -> trial
    resumed = PackEngine(again[0].net, info(0.0).tasks, len(order), "cpu")
    resumed.set_steps_per_epoch(STEPS_PER_EPOCH)
    for slot, p in enumerate(order):
        if p is not None:
            again[p].saved = saved[p]
            resumed.load(slot, again[p])
    losses = run_epochs(resumed, order, cut, epochs)
    assert all(torch.equal(a, b) for a, b in zip(losses, expected[cut * STEPS_PER_EPOCH:]))
    for p in range(3):
        slot = order.index(p)
        for name in ("epochs_run", "steps", "best_score", "best_epoch", "wait", "history"):
            assert getattr(again[p], name) == getattr(whole[p], name), name
        for name, tensor in resumed.stack.tensors().items():
            assert torch.equal(tensor[slot], whole_engine.stack.tensors()[name][p]), name
            assert torch.equal(resumed.best[name][slot], whole_engine.best[name][p]), name
        for name, row in resumed.adam.slot_state(slot).items():
            assert torch.equal(row, whole_engine.adam.slot_state(p)[name]), name


def flat(checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of a :meth:`PackEngine.checkpoint`'s trials' states, by its path."""
    out = {}

    def walk(value, prefix: str) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, (dict, list, tuple)):
            for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
                walk(item, f"{prefix}/{key}")

    for key, state in checkpoint:
        walk(state, str(key))
    return out


def two_epochs(at_end) -> PackEngine:
    """A comet pack of three trained two epochs (dropout on), ``at_end(engine, epoch)`` at each epoch's end."""
    engine = engine_of(trials("comet", 0.5, 3))
    data = [batches(p, 2 * STEPS_PER_EPOCH) for p in range(3)]
    for epoch in range(2):
        engine.start_epoch()
        for i in range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH):
            step(engine, data, i)
        engine.end_epoch([{"loss": 1.0 - epoch / 10 - p / 100} for p in range(3)])
        at_end(engine, epoch)
    return engine


def test_a_checkpoint_kept_on_the_device_is_the_host_checkpoint_in_buffers_it_reuses() -> None:
    """``checkpoint(on_device=True)`` (what ``tune`` keeps at each epoch end): every tensor of every trial's state
    equal to the host checkpoint's, in buffers the next call overwrites (no new memory an epoch), which then hold
    the later state."""
    checkpoints = []

    def compared(engine: PackEngine, epoch: int) -> None:
        kept, host = flat(engine.checkpoint(on_device=True)), flat(engine.checkpoint())
        assert kept.keys() == host.keys() and len(kept) > 30
        assert all(torch.equal(kept[name], host[name]) for name in host)
        checkpoints.append((kept, host))

    two_epochs(compared)
    (first, first_host), (kept, host) = checkpoints
    assert all(kept[name].untyped_storage().data_ptr() == first[name].untyped_storage().data_ptr() for name in kept)
    assert any(not torch.equal(first_host[name], host[name]) for name in host)  # overwritten with the later state


def test_a_snapshot_made_into_states_an_epoch_later_holds_its_own_epoch_end() -> None:
    """``tune`` keeps ``snapshot(on_device=True)`` at each epoch end and makes the trials' states of it only when it
    writes a checkpoint (a stop, ``--checkpoint-every``), which may come an epoch later: those states are the host
    checkpoint of the snapshot's epoch end, tensors and progress, not of the epoch trained since."""
    first = {}

    def snapshot_first(engine: PackEngine, epoch: int) -> None:
        if epoch == 0:
            first.update(states=engine.snapshot(on_device=True), host=engine.checkpoint())

    engine = two_epochs(snapshot_first)
    later, host = first["states"](), first["host"]
    assert [(key, state["progress"]) for key, state in later] == [(key, state["progress"]) for key, state in host]
    kept, expected, now = flat(later), flat(host), flat(engine.checkpoint())
    assert kept.keys() == expected.keys() and len(kept) > 30
    assert all(torch.equal(kept[name], expected[name]) for name in expected)
    assert any(not torch.equal(kept[name], now[name]) for name in now)  # trained on since


class AccumulatingEngine(PackEngine):
    """The training step as it was before gradients were written in place: the flat gradient zeroed, then autograd
    accumulating into the leaves' ``.grad`` views of it."""

    def _train_step(self, batch: dict[str, torch.Tensor]) -> None:
        self.template.train()
        self.stack.flat_grad.zero_()
        loss, aux, task_losses, counts, predictions, weights = self._forward(
            self._tensors(), batch, self.task_weights, True)
        (loss + aux).float().sum().backward()
        self.adam.step(*self._schedule_updates())


@pytest.mark.parametrize("name, autocast", variants_over([False, True], every_gate_meets_every_value=True))
def test_gradients_written_in_place_equal_zeroed_and_accumulated_ones(name: str, autocast: bool) -> None:
    """Every gate and "+" variant, each gate in float32 and in bf16 autocast (a gate in one, its "+" in the other:
    ``tests/covering.py``), over steps inside and after local search's window: the gradients copied into the flat
    gradient or left where autograd computed them (:meth:`TrialStack.tracked`, blocks no gradient reached zeroed)
    and the weights Adam makes of them are bitwise those of zeroing and accumulating; under autocast the expert
    layer reads the bfloat16 copies Adam writes (:meth:`PackedAdam.bfloat16_copies`) instead of autocast's casts,
    the same values, and the copies' gradients go to the bfloat16 blocks Adam reads
    (:meth:`PackedAdam.bfloat16_gradients`) or stay where they lie, the accumulated float32 gradients exactly."""
    data = [batches(p, 6) for p in range(2)]
    engines = []
    for kind in (PackEngine, AccumulatingEngine):
        pack = trials(name, 0.5, 2)
        for trial in pack:
            if trial.net.local_search is not None:
                trial.net.local_search.epochs = 1  # a window of 2 steps: 4 steps after it
        engine = kind(pack[0].net, info(0.0).tasks, 2, "cpu")
        engine.set_steps_per_epoch(STEPS_PER_EPOCH)
        for slot, trial in enumerate(pack):
            engine.load(slot, trial)
        engines.append(engine)
    for i in range(6):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for engine in engines:
                step(engine, data, i)
        written, accumulated = engines
        in_bfloat16 = written.adam.bfloat16_gradients() if autocast else {}
        assert written.stack.kept  # the gradients Adam read where autograd left them (their blocks unwritten)
        for name, leaf in written.stack.params.items():
            expected = accumulated.stack.params[name].grad
            gradient = written.stack.kept.get(name, in_bfloat16.get(name, leaf.grad))
            assert torch.equal(gradient.float(), expected), (i, name)
        assert torch.equal(written.stack.flat, accumulated.stack.flat), i
        if autocast:  # the expert layer read Adam's bfloat16 copies, and the step wrote the next ones
            assert written.adam.half_names == {"experts.linear.weight", "experts.linear.bias", "towers.0.0.weight",
                                               "towers.0.0.bias", "towers.1.0.weight", "towers.1.0.bias"}
            assert in_bfloat16.keys() == written.adam.half_names  # their gradients in bfloat16, read by Adam
            for name in written.adam.half_names:
                assert torch.equal(written.stack.block(written.adam.half, name),
                                   written.stack.params[name].to(torch.bfloat16)), (i, name)
            assert written.adam._half_version == written.stack.flat._version


@pytest.mark.parametrize("name, autocast", variants_over([False, True]))
def test_a_replayed_training_step_needs_no_python_state(name: str, autocast: bool) -> None:
    """A CUDA graph of the training step replays its kernels and no Python. On this CPU a stand-in for the capture
    (``tests/replay.py``) reruns each step after its key's first with every Python attribute of the engine, its stack,
    Adam, metrics and template modules put back as it was: over steps inside and after local search's window and a
    refilled slot, every gate's losses and weights are the eager engine's, bit for bit (each gate in float32 or in
    bf16 autocast, its "+" in the other)."""
    data = [batches(p, 8) for p in range(3)]
    results = []
    for replayed in (False, True):
        engine = engine_of(trials(name, 0.5, 3))
        if replayed:
            engine.captured = ReplayStandIn(engine._train_step, [engine, engine.stack, engine.adam,
                                                                 engine.train_metrics, *engine.template.modules()])
        losses = []
        for i in range(8):
            if i == 4:
                engine.slots[1] = None
                engine.load(1, trials(name, 0.5, 4)[3])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                losses.append(step(engine, data, i))
        results.append((torch.stack(losses), engine.stack.flat.clone()))
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1], results[0][1])


def test_the_collector_is_paused_during_a_capture_and_restored_after() -> None:
    """``collector_paused`` (around each CUDA graph capture): dead reference cycles survive allocations that would
    trigger a collection (so none finalises a dead engine's graph mid-capture), the collector is on again after,
    also when the capture raises, and stays off where it was off."""
    import gc

    from mtmoe.pack.graphs import collector_paused

    finalised = []

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            finalised.append(True)

    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1)  # a collection at (nearly) every allocation while the collector is on
    try:
        with collector_paused():
            assert not gc.isenabled()
            Cycle()
            _ = [[i] for i in range(10_000)]
            assert not finalised
        assert gc.isenabled()
        _ = [[i] for i in range(10_000)]
        gc.collect()
        assert finalised
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("capture failed")
        assert gc.isenabled()
        gc.disable()
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
