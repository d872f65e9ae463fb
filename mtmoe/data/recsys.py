"""What the explicit-rating recommenders (Books, Jester; comet-protocol.md §5.1) share: tasks, split, tensors, cache.

Both datasets label every record themselves (no negative sampling): task 1 is binary, task 2 the rating on the
rows that have one, selected by an explicit bool mask (Jester has genuine 0.0 ratings, so the official code's
``y != 0`` mask would drop real rows; §5.1 and §9.1 #13). Records are split 70/15/15 (S1.1).
"""
from __future__ import annotations


import numpy as np
import torch
from torch import Tensor

from mtmoe.data.base import Splits, TaskSpec
from mtmoe.data.movielens import stratified_split



def rating_tasks(binary_task: str) -> tuple[TaskSpec, TaskSpec]:
    """Task 1 ``binary_task`` (binary, every row), task 2 ``rating`` (regression on the masked rows)."""
    return TaskSpec(binary_task, "binary"), TaskSpec("rating", "regression", masked=True)


def split_70_15_15(labels: np.ndarray, seed: int, stratify: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row indices ``(train, val, test)``: ``ceil(0.3 n)`` rows held out, halved into test and validation.

    The paper gives only the sizes (S1.1: Books 389,706 / 83,509 / 83,509, exactly these); stratifying on task 1's
    label, as the official MovieLens split does, is our choice (``stratify=False``: a plain random split of the
    same sizes).
    """
    rng = np.random.default_rng(seed)
    strata = labels if stratify else np.zeros(len(labels), dtype=np.int8)
    train, holdout = stratified_split(strata, 0.3, rng)
    val, test = (holdout[part] for part in stratified_split(strata[holdout], 0.5, rng))
    return train, val, test


def rating_splits(
    user: np.ndarray, item: np.ndarray, rating: np.ndarray, rated: np.ndarray, binary_task: str,
    seed: int, stratify: bool,
) -> Splits:
    """The 70/15/15 splits as compact tensors: int32 ``user``/``item``/``sample_id`` (= user, the id Hash-r routes
    on, S1.3), float32 ``binary_task`` (= rated) and ``rating`` (0 where unrated), bool ``rating_mask`` (= rated).
    """
    user, item = user.astype(np.int32), item.astype(np.int32)
    rating = np.where(rated, rating, 0).astype(np.float32)
    label = rated.astype(np.float32)

    def tensors(index: np.ndarray) -> dict[str, Tensor]:
        users = torch.from_numpy(user[index])
        return {
            "user": users,
            "item": torch.from_numpy(item[index]),
            "sample_id": users,
            binary_task: torch.from_numpy(label[index]),
            "rating": torch.from_numpy(rating[index]),
            "rating_mask": torch.from_numpy(rated[index]),
        }

    train, val, test = split_70_15_15(rated, seed, stratify)
    return {"train": tensors(train), "val": tensors(val), "test": tensors(test)}
