"""The reference the engine's metrics (``mtmoe.pack.metrics.PackMetrics``) are tested against: one trial's epoch
results computed as ``MultiTaskMoE`` computed them before the training engine (commit 46207d7), with torchmetrics
(``BinaryAUROC(thresholds=None)``, ``BinaryAccuracy``, ``MeanSquaredError``, ``MulticlassAccuracy``, ``MeanMetric``)
and the routing statistics of the paper and the official code (``RoutingStats``); the routing behaviour of issue 35
(``RoutingBehaviour``: entropy, Jaccard overlap, load, selections changed) one sample at a time."""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics import MeanMetric, MeanSquaredError, Metric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, MulticlassAccuracy

from mtmoe.dataset_info import TaskSpec
from mtmoe.losses import multitask_loss, task_rows
from mtmoe.pack.metrics import SIMPLEX_TOLERANCE


class RoutingStats(Metric):
    """Accumulates, over an epoch, what the paper and the official code log about a gate's weights ``[B, n]``:
    ``experts_per_sample`` (mean number of weights > 0, the paper's n/s), ``utilisation`` (per-expert mean weight),
    ``selection_rate`` (per-expert fraction of samples routed to it), ``unused_experts``, ``simplex_violations``
    (rows whose sum differs from 1 by more than 1e-5, simplex gates only) and ``zero_expert_fraction``."""

    full_state_update = False

    def __init__(self, n_experts: int, simplex: bool = True) -> None:
        super().__init__()
        self.n_experts, self.simplex = n_experts, simplex
        self.add_state("weight_sum", torch.zeros(n_experts, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("selected", torch.zeros(n_experts, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("violations", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("empty", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, weights: Tensor) -> None:
        weights = weights.detach()
        active = weights > 0
        self.weight_sum += weights.sum(0).double()
        self.selected += active.sum(0).double()
        self.violations += ((weights.sum(-1) - 1).abs() > SIMPLEX_TOLERANCE).sum().double()
        self.empty += (~active.any(-1)).sum().double()
        self.count += weights.shape[0]

    def compute(self) -> dict[str, Tensor]:
        count = self.count.clamp_min(1)
        stats = {
            "experts_per_sample": self.selected.sum() / count,
            "utilisation": self.weight_sum / count,
            "selection_rate": self.selected / count,
            "unused_experts": (self.selected == 0).sum().double(),
            "zero_expert_fraction": self.empty / count,
        }
        if self.simplex:
            stats["simplex_violations"] = self.violations / count
        return stats


def selected_set(row: Tensor, selection: str, k: int) -> frozenset[int]:
    """The experts one gate row selects (``mtmoe.pack.metrics``' definitions), one weight at a time."""
    values = row.tolist()
    if selection == "nonzero":
        return frozenset(i for i, w in enumerate(values) if w > 0)
    if selection == "above_uniform":
        return frozenset(i for i, w in enumerate(values) if w > 1 / len(values))
    return frozenset(sorted(range(len(values)), key=lambda i: -values[i])[:k])


class RoutingBehaviour:
    """One trial's routing behaviour per task gate, sample by sample in Python floats: the mean entropy of the row
    scaled to sum 1, the mean Jaccard index with the other gates' selected sets (1 for two empty sets), each
    expert's share of the selections and, given the previous pass's selections per sample (``previous``), the share
    of samples whose selected set changed; :attr:`sets` holds this pass's."""

    def __init__(self, n_tasks: int, n_experts: int, selection: str, k: int,
                 previous: list[tuple[frozenset[int], ...]] | None = None) -> None:
        self.n_tasks, self.selection, self.k, self.previous = n_tasks, selection, k, previous
        self.entropy, self.overlap, self.changed = [0.0] * n_tasks, [0.0] * n_tasks, [0] * n_tasks
        self.load = [[0] * n_experts for _ in range(n_tasks)]
        self.sets: list[tuple[frozenset[int], ...]] = []

    def update(self, gate_weights: list[Tensor]) -> None:
        for b in range(gate_weights[0].shape[0]):
            rows = [weights[b].double() for weights in gate_weights]
            sets = tuple(selected_set(row, self.selection, self.k) for row in rows)
            for t, row in enumerate(rows):
                total = sum(row.tolist())
                self.entropy[t] -= sum(w / total * math.log(w / total) for w in row.tolist() if w > 0)
                for i in sets[t]:
                    self.load[t][i] += 1
                others = [len(sets[t] & s) / len(sets[t] | s) if sets[t] | s else 1.0
                          for u, s in enumerate(sets) if u != t]
                self.overlap[t] += sum(others) / max(len(others), 1)
                if self.previous is not None:
                    self.changed[t] += sets[t] != self.previous[len(self.sets)][t]
            self.sets.append(sets)

    def results(self, t: int) -> dict[str, float | list[float]]:
        n = len(self.sets)
        chosen = sum(self.load[t])
        out = {"routing_entropy": self.entropy[t] / n}
        if self.n_tasks > 1:
            out["expert_overlap"] = self.overlap[t] / n
        out["expert_load"] = [count / chosen if chosen else 0.0 for count in self.load[t]]
        if self.previous is not None:
            out["selection_changed"] = self.changed[t] / n
        return out


def task_metrics(task: TaskSpec) -> MetricCollection:
    if task.kind == "binary":
        return MetricCollection({"auroc": BinaryAUROC(thresholds=None), "accuracy": BinaryAccuracy()})
    if task.kind == "regression":
        return MetricCollection({"mse": MeanSquaredError()})
    return MetricCollection({"accuracy": MulticlassAccuracy(num_classes=task.n_classes, average="micro")})


class TrialMetrics:
    """One trial's metrics of one stage, updated per batch from its predictions and gate weights."""

    def __init__(self, tasks: tuple[TaskSpec, ...], weights: list[float], n_experts: int, simplex: bool,
                 stage: str, selection: str = "nonzero", k: int = 1) -> None:
        self.tasks, self.weights, self.stage = tasks, weights, stage
        self.behaviour = None if stage == "train" else RoutingBehaviour(len(tasks), n_experts, selection, k)
        self.collections = {task.name: MetricCollection({**task_metrics(task), "loss": MeanMetric(),
                                                         "routing": RoutingStats(n_experts, simplex)},
                                                        compute_groups=False) for task in tasks}
        self.batch_loss = MeanMetric()

    def update(self, batch: dict[str, Tensor], predictions: list[Tensor], gate_weights: list[Tensor]) -> None:
        loss, task_losses, counts = multitask_loss(self.tasks, self.weights, predictions, batch)
        for task, prediction, weights, value, count in zip(self.tasks, predictions, gate_weights, task_losses, counts):
            metrics = self.collections[task.name]
            metrics["loss"].update(value.detach(), count)
            metrics["routing"].update(weights)
            if self.stage != "train":
                prediction, target = task_rows(task, prediction, batch)
                if task.kind == "binary":
                    prediction, target = prediction.sigmoid(), target.long()
                for name, metric in metrics.items():
                    if name not in ("loss", "routing") and target.shape[0] > 0:
                        metric.update(prediction.detach(), target)
        self.batch_loss.update(loss.detach(), next(iter(batch.values())).shape[0])
        if self.behaviour is not None:
            self.behaviour.update(gate_weights)

    def results(self) -> dict[str, float | list[float]]:
        results: dict[str, float | list[float]] = {"loss": float(self.batch_loss.compute())}
        for task in self.tasks:
            for name, metric in self.collections[task.name].items():
                if metric.update_count == 0:
                    continue
                value = metric.compute()
                for key, v in (value if isinstance(value, dict) else {name: value}).items():
                    results[f"{task.name}/{key}"] = v.tolist() if v.numel() > 1 else float(v)
            if self.behaviour is not None:
                t = self.tasks.index(task)
                results.update({f"{task.name}/{key}": v for key, v in self.behaviour.results(t).items()})
        results["loss_dataset"] = sum(w * results[f"{t.name}/loss"] for w, t in zip(self.weights, self.tasks))
        return results
