"""The multi-task training objective (comet-protocol.md §5), as plain functions shared by the LightningModule and
trial packs (where it runs under ``torch.func.vmap`` with per-trial task weights).

``sum_t w_t L_t`` with, for the recommenders, ``w = (alpha, 1 - alpha)`` over (BCE of task 1, MSE of task 2 on the
rated rows only, via the batch's explicit mask), and equal weights for the other datasets. A masked task's loss is
the mean over the rows its mask selects, computed as a masked sum over the whole batch divided by the count: the
same value as compacting the rows (to float rounding), with static shapes and no host synchronisation; a batch with
no such row contributes 0.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from mtmoe.errors import SettingError, UsageError
from mtmoe.dataset_info import DEFAULT_ALPHA, DatasetInfo, TaskSpec


def task_weights(info: DatasetInfo, alpha: float | None) -> list[float]:
    """``(alpha, 1 - alpha)`` for two-task recommenders (default alpha: :data:`mtmoe.dataset_info.DEFAULT_ALPHA`),
    equal weights otherwise."""
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise SettingError("alpha", alpha, "must be in [0, 1]")
    if info.task_weighting == "alpha":
        alpha = DEFAULT_ALPHA if alpha is None else alpha
        return [alpha, 1.0 - alpha]
    if alpha is not None:
        raise UsageError(f"alpha applies to the two-task recommenders only; {info.name} weights its tasks equally")
    return [1.0 / len(info.tasks)] * len(info.tasks)


def task_rows(task: TaskSpec, prediction: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The predictions and targets of the rows a task sees (its explicit mask, for masked tasks): for metrics."""
    target = batch[task.name]
    if task.masked:
        mask = batch[f"{task.name}_mask"]
        return prediction[mask], target[mask]
    return prediction, target


def row_losses(task: TaskSpec, prediction: Tensor, target: Tensor) -> Tensor:
    """Each row's loss: BCE on logits, squared error, or cross-entropy on class logits."""
    if task.kind == "binary":
        return F.binary_cross_entropy_with_logits(prediction, target.float(), reduction="none")
    if task.kind == "regression":
        return F.mse_loss(prediction, target.float(), reduction="none")
    return F.cross_entropy(prediction, target.long(), reduction="none")


def task_loss(task: TaskSpec, prediction: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Mean loss of one task over the rows it sees, and the number of those rows (a tensor)."""
    losses = row_losses(task, prediction, batch[task.name])
    if not task.masked:
        return losses.mean(), torch.full((), losses.shape[0], dtype=torch.long, device=losses.device)
    mask = batch[f"{task.name}_mask"]
    count = mask.sum()
    return losses.where(mask, 0.0).sum() / count.clamp_min(1), count


def multitask_loss(tasks: tuple[TaskSpec, ...], weights: list[float] | Tensor, predictions: list[Tensor],
                   batch: dict[str, Tensor]) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """``sum_t w_t L_t``, the per-task losses and their row counts; ``weights`` may be a tensor ``[T]``."""
    losses, counts = zip(*(task_loss(task, p, batch) for task, p in zip(tasks, predictions)))
    total = sum(weights[t] * losses[t] for t in range(len(tasks)))
    return total, list(losses), list(counts)
