"""``PackMetrics`` (``mtmoe.pack.metrics``): each trial of a pack gets what one trial alone got from torchmetrics and
``RoutingStats`` before the engine (``tests/metrics_reference.py``, on the same network outputs): the same keys in the same order, the same values within ``RELATIVE_TOLERANCES``
(every other value exactly), for shared batches (evaluation) and per-trial batches (training), with ties in the binary
predictions, a masked regression task, trials whose rows hold one class, trials left out by ``active``, and a task
that sees no row. ``update``'s tensor operations do not depend on the pack's size and never read the host.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torchmetrics.functional.classification import binary_auroc as torchmetrics_auroc

from mtmoe.dataset_info import DatasetInfo, TaskSpec
from mtmoe.gates import gate_class
from mtmoe.gates.base import GateOutput
from mtmoe.losses import multitask_loss, task_weights
from mtmoe.mmoe import MMoEOutput
from mtmoe.pack.metrics import PackMetrics, binary_auroc, pack_bits
from mtmoe.routing_names import routing_of
from metrics_reference import RoutingBehaviour, TrialMetrics

RECSYS = (TaskSpec("watch", "binary"), TaskSpec("rating", "regression", masked=True))  # MovieLens' shape
IMAGES = (TaskSpec("left", "multiclass", 10), TaskSpec("right", "multiclass", 10))  # MultiMNIST's shape
P, N_EXPERTS, SIZES = 3, 6, (16, 16, 16, 5)  # 53 rows: a shorter last batch
ALPHAS = (0.1, 0.5, 0.9)
#: Values that differ from torchmetrics' by float32 rounding (module docstring); every other value is equal.
#: Measured worst cases: mse 1.5e-7, utilisation 8e-8, auroc 1e-7 (1.3e-7 on 200000 rows), loss_dataset 2.5e-8;
#: the float64 entropies and Jaccard indices of ``RoutingBehaviour`` summed in another order, 2e-16.
RELATIVE_TOLERANCES = {"mse": 1e-6, "utilisation": 1e-6, "auroc": 1e-6, "loss_dataset": 1e-7,
                       "routing_entropy": 1e-13, "expert_overlap": 1e-13}

Batch = dict[str, Tensor]


def dataset(tasks: tuple[TaskSpec, ...]) -> DatasetInfo:
    weighting = "alpha" if tasks == RECSYS else "equal"
    return DatasetInfo(name="tiny", tasks=tasks, n_ids=10, n_users=10, n_items=10, embedding_dim=4, expert_units=4,
                       tower_units=4, n_experts=N_EXPERTS, expert_dropout=0.0, task_weighting=weighting)


def alphas(tasks: tuple[TaskSpec, ...]) -> tuple[float | None, ...]:
    return ALPHAS if tasks == RECSYS else (None,) * P


def module_results(tasks, gate: str, alpha, batches: list[Batch], outputs: list[MMoEOutput], stage: str,
                   selection: str = "nonzero", k: int = 1) -> dict:
    """What one trial alone reported (torchmetrics, ``RoutingStats``) for network outputs ``outputs`` on ``batches``,
    and its routing behaviour one sample at a time (``RoutingBehaviour``)."""
    info = dataset(tasks)
    reference = TrialMetrics(tasks, task_weights(info, alpha), N_EXPERTS, gate_class(gate).simplex, stage, selection,
                             k)
    for batch, output in zip(batches, outputs):
        reference.update(batch, output.predictions, [g.weights for g in output.gates])
    return reference.results()


def targets(tasks, size: int, g: torch.Generator) -> Batch:
    batch: Batch = {}
    for task in tasks:
        if task.kind == "binary":
            batch[task.name] = (torch.rand(size, generator=g) < 0.4).float()
        elif task.kind == "multiclass":
            batch[task.name] = torch.randint(0, task.n_classes, (size,), generator=g)
        else:
            batch[f"{task.name}_mask"] = torch.rand(size, generator=g) < 0.5
            batch[task.name] = torch.where(batch[f"{task.name}_mask"], torch.rand(size, generator=g) * 5, 0.0)
    return batch


def prediction(task: TaskSpec, size: int, g: torch.Generator) -> Tensor:
    """Binary: logits in steps of 0.5 (ties), some of +-16..20 and some of 1e-9 (sigmoid rounds them to 0, 1 and
    0.5: more ties, and 1e-9 is a negative prediction)."""
    if task.kind == "binary":
        logits = torch.randint(-3, 4, (size,), generator=g) * 0.5
        draw = torch.rand(size, generator=g)
        logits = torch.where(draw < 0.2, logits.sign() * torch.randint(16, 21, (size,), generator=g), logits)
        return torch.where(draw > 0.9, 1e-9, logits)
    if task.kind == "multiclass":
        return torch.randn(size, task.n_classes, generator=g)
    return torch.randn(size, generator=g) + 2.5


def gate_outputs(n_tasks: int, size: int, g: torch.Generator) -> list[GateOutput]:
    """Top-2 rows on the simplex, but expert 0 never used by task 0, some rows empty and some off the simplex."""
    weights = torch.rand(size, n_tasks, N_EXPERTS, generator=g)
    weights[:, 0, 0] = 0.0
    weights = torch.where(weights >= weights.topk(2, dim=-1).values[..., 1:], weights, 0.0)
    weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * torch.where(torch.rand(size, n_tasks, 1, generator=g) < 0.2, 0.99, 1.0)
    weights = torch.where(torch.rand(size, n_tasks, 1, generator=g) < 0.1, 0.0, weights)
    return [GateOutput(weights[:, t], torch.zeros(())) for t in range(n_tasks)]


def epoch(tasks, shared: bool, seed: int, sizes=SIZES) -> list[tuple[list[Batch], list[MMoEOutput]]]:
    """Per batch: each trial's batch (one shared by all, or its own) and its network's outputs."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for size in sizes:
        trial_batches = [targets(tasks, size, g)] * P if shared else [targets(tasks, size, g) for _ in range(P)]
        outputs = [MMoEOutput([prediction(task, size, g) for task in tasks], gate_outputs(len(tasks), size, g))
                   for _ in range(P)]
        batches.append((trial_batches, outputs))
    return batches


def pack_inputs(tasks, trial_batches: list[Batch], outputs: list[MMoEOutput], shared: bool):
    """``PackMetrics.update``'s arguments for the trials' outputs: losses as the module computes them."""
    weights = [task_weights(dataset(tasks), alpha) for alpha in alphas(tasks)]
    losses = [multitask_loss(tasks, w, o.predictions, b) for w, o, b in zip(weights, outputs, trial_batches)]
    batch_loss = torch.stack([loss for loss, _, _ in losses])
    task_losses = torch.stack([torch.stack(values) for _, values, _ in losses])
    counts = torch.stack([torch.stack([c.float() for c in values]) for _, _, values in losses])
    batch = trial_batches[0] if shared else {k: torch.stack([b[k] for b in trial_batches]) for k in trial_batches[0]}
    predictions = [torch.stack([o.predictions[t] for o in outputs]) for t in range(len(tasks))]
    gate_weights = torch.stack([torch.stack([gate.weights for gate in o.gates], dim=1) for o in outputs])
    return predictions, task_losses, counts, batch_loss, batch, gate_weights


def new_metrics(tasks, gate: str, selection: str = "nonzero", k: int = 1, capacity: int = P) -> PackMetrics:
    weights = torch.tensor([task_weights(dataset(tasks), alpha) for alpha in alphas(tasks)])[:capacity]
    return PackMetrics(tasks, N_EXPERTS, gate_class(gate).simplex, capacity, "cpu", weights, selection, k)


def assert_same(ours: dict, expected: dict) -> None:
    assert list(ours) == list(expected)
    for key, value in expected.items():
        assert type(ours[key]) is type(value), key
        tolerance = RELATIVE_TOLERANCES.get(key.rsplit("/", 1)[-1], 0.0)
        torch.testing.assert_close(torch.tensor(ours[key], dtype=torch.float64),
                                   torch.tensor(value, dtype=torch.float64),
                                   rtol=tolerance, atol=0.0, equal_nan=True, msg=lambda m: f"{key}: {m}")


def check_epoch(tasks, gate: str, data, shared: bool, stage: str = "val", selection: str = "nonzero",
                k: int = 1) -> list[dict]:
    """Pack the epoch's batches, compare each trial with the module alone; the pack's results."""
    metrics = new_metrics(tasks, gate, selection, k)
    for trial_batches, outputs in data:
        metrics.update(*pack_inputs(tasks, trial_batches, outputs, shared), prediction_metrics=stage != "train")
    results = metrics.results()
    for p, alpha in enumerate(alphas(tasks)):
        batches, outputs = [b[p] for b, _ in data], [o[p] for _, o in data]
        assert_same(results[p], module_results(tasks, gate, alpha, batches, outputs, stage, selection, k))
    assert metrics.loss.tolist() == [trial["loss"] for trial in results]
    return results


def test_evaluation_recsys_after_reset():
    """MovieLens' tasks on shared batches: ties, a masked task, a batch without rated rows; a second epoch after
    ``reset`` is counted alone."""
    data = epoch(RECSYS, shared=True, seed=0)
    data[-1][0][0]["rating_mask"][:] = False  # shared: every trial's last batch has no rated row
    metrics = new_metrics(RECSYS, "topk")
    for trial_batches, outputs in epoch(RECSYS, shared=True, seed=1):
        metrics.update(*pack_inputs(RECSYS, trial_batches, outputs, shared=True))
    metrics.reset()
    for trial_batches, outputs in data:
        metrics.update(*pack_inputs(RECSYS, trial_batches, outputs, shared=True))
    for p, (ours, alpha) in enumerate(zip(metrics.results(), ALPHAS)):
        expected = module_results(RECSYS, "topk", alpha, [b[p] for b, _ in data], [o[p] for _, o in data], "val")
        assert_same(ours, expected)
        assert expected["watch/unused_experts"] == 1.0 and expected["watch/simplex_violations"] > 0
        assert expected["watch/zero_expert_fraction"] > 0


def test_evaluation_images_without_simplex():
    """MultiMNIST's two 10-class tasks, a batch-level router (no ``simplex_violations``)."""
    results = check_epoch(IMAGES, "expertchoice", epoch(IMAGES, shared=True, seed=2), shared=True)
    assert "left/simplex_violations" not in results[0] and "left/accuracy" in results[0]


@pytest.mark.filterwarnings("ignore:No (positive|negative) samples in targets")
def test_per_trial_batches_and_single_class_trials():
    """Each trial its own rows; trial 1 sees only negatives, trial 2 only positives: AUROC 0, as torchmetrics."""
    data = epoch(RECSYS, shared=False, seed=3)
    for trial_batches, _ in data:
        trial_batches[1]["watch"].zero_()
        trial_batches[2]["watch"].fill_(1.0)
    results = check_epoch(RECSYS, "topk", data, shared=False)
    assert [trial["watch/auroc"] for trial in results][1:] == [0.0, 0.0] and results[0]["watch/auroc"] > 0


@pytest.mark.filterwarnings("ignore:Encountered `nan` values")
def test_training_epoch_counts_losses_and_routing_only():
    """Without prediction metrics; trial 2's NaN loss in batch 1 is left out of its means, as ``MeanMetric`` does."""
    data = epoch(RECSYS, shared=False, seed=4)
    trial_batches, outputs = data[1]
    outputs[2].predictions[1][trial_batches[2]["rating_mask"].nonzero()[0]] = float("nan")
    results = check_epoch(RECSYS, "topk", data, shared=False, stage="train")
    assert "watch/auroc" not in results[0] and "rating/mse" not in results[0] and "rating/loss" in results[0]
    assert all(trial["loss"] == trial["loss"] for trial in results)


def test_inactive_trials_and_a_task_without_rows():
    """``active`` leaves trial 1's second batch and all of trial 2 out; no row is rated: ``rating/mse`` is left out
    and ``rating/loss`` is NaN, as the module reports them; a trial never counted has NaN losses only."""
    data = epoch(RECSYS, shared=True, seed=5)
    for trial_batches, _ in data:
        trial_batches[0]["rating_mask"][:] = False
    metrics = new_metrics(RECSYS, "topk")
    for i, (trial_batches, outputs) in enumerate(data):
        metrics.update(*pack_inputs(RECSYS, trial_batches, outputs, shared=True),
                       active=torch.tensor([True, i != 1, False]))
    results = metrics.results()
    for p, skipped in ((0, ()), (1, (1,))):
        kept = [i for i in range(len(data)) if i not in skipped]
        expected = module_results(RECSYS, "topk", ALPHAS[p], [data[i][0][p] for i in kept],
                                  [data[i][1][p] for i in kept], "val")
        assert_same(results[p], expected)
        assert "rating/mse" not in expected and expected["rating/loss"] != expected["rating/loss"]
    assert list(results[2]) == ["loss", "loss_dataset"] and all(v != v for v in results[2].values())


def dense(data) -> None:
    """The epoch's gate rows made dense (a softmax of random logits, Softmax's), in place."""
    g = torch.Generator().manual_seed(8)
    for _, outputs in data:
        for output in outputs:
            for gate in output.gates:
                gate.weights = torch.randn(gate.weights.shape, generator=g).softmax(-1)


@pytest.mark.parametrize("selection, k", [("topk", 2), ("above_uniform", 1)])
def test_a_dense_gate_selects_its_top_k_or_its_weights_above_uniform(selection, k):
    data = epoch(RECSYS, shared=True, seed=9)
    dense(data)
    results = check_epoch(RECSYS, "softmax", data, shared=True, selection=selection, k=k)
    if selection == "topk":  # k of the n experts: a top-2 gate's loads sum to 1 over its experts
        assert all(abs(sum(trial["watch/expert_load"]) - 1) < 1e-12 for trial in results)
    assert 0 < results[0]["watch/routing_entropy"] < torch.log(torch.tensor(float(N_EXPERTS)))
    assert 0 < results[0]["watch/expert_overlap"] < 1


def pass_through(metrics: PackMetrics, data, slots: list[int]) -> list[dict]:
    """One tracked evaluation pass of the trials in ``slots`` over ``data``'s batches; their routing results."""
    metrics.reset()
    metrics.tracking = True
    for trial_batches, outputs in data:
        predictions, task_losses, counts, batch_loss, batch, weights = pack_inputs(RECSYS, trial_batches, outputs, True)
        metrics.update([p[slots] for p in predictions], task_losses[slots], counts[slots], batch_loss[slots], batch,
                       weights[slots])
    return [routing_of(trial) for trial in metrics.results()]


def test_selections_changed_since_the_previous_pass_packed_and_alone():
    """Three validation passes: the second keeps the first's gate rows in batches 0 and 2 and draws new ones in
    batches 1 and 3, the third repeats the second; slot 1 gets a new trial before the second pass (``forget``) and
    has no ``selection_changed`` until the third. Each trial's values equal a per-sample reference and its values
    alone (a pack of one)."""
    first, fresh = epoch(RECSYS, shared=True, seed=10), epoch(RECSYS, shared=True, seed=11)
    second = [first[0], fresh[1], first[2], fresh[3]]
    passes = [first, second, second]
    packed = new_metrics(RECSYS, "topk")
    alone = [new_metrics(RECSYS, "topk", capacity=1) for _ in range(P)]
    for i, data in enumerate(passes):
        if i == 1:
            packed.forget([1])
            alone[1].forget()
        ours = pass_through(packed, data, list(range(P)))
        for p in range(P):
            assert ours[p] == pass_through(alone[p], data, [p])[0]
            previous = None
            if i > 0 and not (i == 1 and p == 1):
                previous = RoutingBehaviour(len(RECSYS), N_EXPERTS, "nonzero", 1)
                for _, outputs in passes[i - 1]:
                    previous.update([gate.weights for gate in outputs[p].gates])
            reference = RoutingBehaviour(len(RECSYS), N_EXPERTS, "nonzero", 1, previous and previous.sets)
            for _, outputs in data:
                reference.update([gate.weights for gate in outputs[p].gates])
            expected = {f"{task.name}/{key}": value for t, task in enumerate(RECSYS)
                        for key, value in reference.results(t).items()}
            assert list(ours[p]) == list(expected)
            for key, value in expected.items():
                torch.testing.assert_close(torch.tensor(ours[p][key], dtype=torch.float64),
                                           torch.tensor(value, dtype=torch.float64), rtol=1e-13, atol=0.0, msg=lambda m: f"pass {i} trial {p} {key}: {m}")
        changed = [trial.get("watch/selection_changed") for trial in ours]
        if i == 1:
            assert changed[1] is None and 0.3 < changed[0] < 1  # batches 1 and 3 changed (21 of 53 rows), some not
        if i == 2:
            assert changed == [0.0] * P


def test_selections_are_packed_one_bit_per_expert():
    mask = torch.rand(3, 5, 2, 11, generator=torch.Generator().manual_seed(12)) < 0.5
    bits = pack_bits(mask)
    assert bits.dtype == torch.uint8 and bits.shape == (3, 5, 2, 2)
    unpacked = (bits.unsqueeze(-1).int() >> torch.arange(8)) & 1
    assert torch.equal(unpacked.flatten(-2)[..., :11].bool(), mask)


def test_auroc_of_a_large_split_with_ties():
    """``binary_auroc`` against torchmetrics' on 20000 rows of few distinct scores, unseen rows weighted 0."""
    g = torch.Generator().manual_seed(6)
    scores = (torch.randn(4, 20000, generator=g) * 3).round().sigmoid()
    positive = torch.rand(4, 20000, generator=g) < scores * 0.8
    seen = torch.rand(4, 20000, generator=g) < 0.7
    ours = binary_auroc(scores, positive, seen)
    for p in range(4):
        expected = torchmetrics_auroc(scores[p][seen[p]], positive[p][seen[p]].long(), thresholds=None)
        torch.testing.assert_close(ours[p], expected.double(), rtol=RELATIVE_TOLERANCES["auroc"], atol=0.0)


#: Operations that read the device's values on the host (a synchronisation) or give them a data-dependent shape.
HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
              "aten._unique2.default", "aten.unique_consecutive.default", "aten.unique_dim.default", "boolean index"}


class OpCounter(TorchDispatchMode):
    """Counts the aten operations run under it; indexing by a boolean mask counts as ``boolean index``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        indices = args[1] if str(func).startswith("aten.index") else ()
        masked = any(isinstance(i, Tensor) and i.dtype == torch.bool for i in indices)
        self.ops["boolean index" if masked else str(func)] += 1
        return func(*args, **(kwargs or {}))


def update_ops(tasks, gate: str, shared: bool, n_trials: int, active: bool, tracking: bool = False) -> Counter:
    """The operations of ``update`` for a pack of ``n_trials`` copies of one trial (``tracking``: in the second
    tracked pass, which compares with the first's selections)."""
    trial_batches, outputs = epoch(tasks, shared, seed=7, sizes=(8,))[0]
    predictions, task_losses, counts, batch_loss, batch, weights = pack_inputs(tasks, trial_batches, outputs, shared)
    copies = lambda x: x[:1].repeat(n_trials, *(1,) * (x.ndim - 1))  # noqa: E731
    metrics = PackMetrics(tasks, N_EXPERTS, gate_class(gate).simplex, n_trials, "cpu",
                          copies(new_metrics(tasks, gate).task_weights))
    arguments = ([copies(p) for p in predictions], copies(task_losses), copies(counts), copies(batch_loss),
                 batch if shared else {k: copies(v) for k, v in batch.items()}, copies(weights))
    live = torch.ones(n_trials, dtype=torch.bool) if active else None
    metrics.tracking = tracking
    if tracking:
        metrics.update(*arguments, active=live)
        metrics.reset()
    with OpCounter() as counter:
        metrics.update(*arguments, active=live)
    return counter.ops


@pytest.mark.parametrize("tasks, gate, shared, active, tracking", [
    (RECSYS, "topk", True, False, False), (RECSYS, "topk", False, True, False),
    (IMAGES, "expertchoice", True, True, False),
    (RECSYS, "topk", True, True, True), (IMAGES, "softmax", True, False, True)])
def test_update_ops_do_not_depend_on_the_pack_size(tasks, gate, shared, active, tracking):
    one, many = (update_ops(tasks, gate, shared, n, active, tracking) for n in (1, 16))
    assert one == many and sum(one.values()) > 10
    assert not HOST_READS & set(one)


@pytest.mark.parametrize("probe, host_read", [
    (lambda x: x.sum().item(), "aten._local_scalar_dense.default"),
    (lambda x: x[x > 0], "boolean index"),
    (lambda x: (x > 0).nonzero(), "aten.nonzero.default"),
    (lambda x: x.masked_select(x > 0), "aten.masked_select.default"),
], ids=["item", "boolean index", "nonzero", "masked_select"])
def test_the_op_counter_sees_a_loop_over_trials_and_each_host_read(probe, host_read):
    """The counter behind the test above can fail it: a loop over trials shows as one operation per trial, and each
    way of reading a device value on the host shows under its name. It asserts what each probe means, not how a torch
    release decomposes it (torch 2.15 dispatches ``x[x > 1] = 0.0`` as a sync-free ``masked_fill_``, where 2.14 ran a
    boolean ``index_put_``)."""
    x = torch.ones(P, 2)
    with OpCounter() as loop:
        _ = [row.sum() for row in x]
    assert loop.ops["aten.sum.default"] == P
    with OpCounter() as counter:
        probe(x)
    assert host_read in HOST_READS and counter.ops[host_read] == 1
