"""MovieLens: task 1 "watch" (binary), task 2 "rating" (raw 1-5, masked to watched rows); comet-protocol.md §5.1.

Positives are all ratings; each user gets as many sampled unrated movies as negatives (1:1); the rows are split
90/10 (test) and the 90% again 87.5/12.5 (validation), both stratified on watch. The prepared splits are cached.
"""
from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from mtmoe.data.base import DatasetInfo, InMemoryDataModule, TaskSpec, register_dataset
from mtmoe.data.cache import load_or_prepare
from mtmoe.data.download import ensure_files, raw_sha256
from mtmoe.data.layout import RAW_FILES
from mtmoe.errors import SettingError, UsageError

TASKS = (TaskSpec("watch", "binary"), TaskSpec("rating", "regression", masked=True))


class Ratings(NamedTuple):
    user: np.ndarray  # int64, original id - 1
    item: np.ndarray  # int64, original id - 1
    rating: np.ndarray  # int64, raw 1..5


class _Variant(NamedTuple):
    name: str  # DatasetInfo.name, the CLI name (its files: mtmoe.data.layout.RAW_FILES)
    n_users: int
    n_items: int


_VARIANTS = {
    "1m": _Variant("movielens", 6040, 3952),
    "100k": _Variant("movielens-100k", 943, 1682),
}


def read_ratings(path: Path) -> Ratings:
    """Read ML-1M ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``) or ML-100K ``u.data`` (tab-separated).

    The separator is taken from the first line (``::`` is rewritten to a tab so pandas' C parser reads both). Ids
    become 0-based. Anything but four integer fields with ids >= 1 and a rating in 1..5 is a :class:`UsageError`
    naming the file and the line.
    """
    path = Path(path)
    data = path.read_bytes()
    first_line = data[: data.index(b"\n")] if b"\n" in data else data
    separator = "::" if b"::" in first_line else "\t"
    text = data.replace(b"::", b"\t") if separator == "::" else data
    try:
        frame = pd.read_csv(io.BytesIO(text), sep="\t", header=None, skip_blank_lines=False)
    except pd.errors.EmptyDataError:
        raise UsageError(f"{path} holds no ratings") from None
    except pd.errors.ParserError as error:
        raise UsageError(f"{path} is malformed: {str(error).split('C error: ')[-1].strip()}") from None
    if frame.shape[1] != 4:
        raise UsageError(f"{path} is malformed: line 1 has {frame.shape[1]} fields, expected 4")
    numbers = frame.apply(pd.to_numeric, errors="coerce").to_numpy(dtype=np.float64)
    bad = np.isnan(numbers).any(axis=1) | (numbers != np.round(numbers)).any(axis=1)
    bad |= (numbers[:, :2] < 1).any(axis=1) | (numbers[:, 2] < 1) | (numbers[:, 2] > 5)
    if bad.any():
        line = int(np.argmax(bad))
        content = data.split(b"\n")[line].decode(errors="replace")
        raise UsageError(
            f"{path} is malformed: line {line + 1} is not user{separator}item{separator}rating{separator}timestamp "
            f"(integers, ids >= 1, rating 1..5): {content!r}"
        )
    ids = numbers[:, :3].astype(np.int64)
    return Ratings(user=ids[:, 0] - 1, item=ids[:, 1] - 1, rating=ids[:, 2])


def sample_negatives(
    user: np.ndarray, item: np.ndarray, n_users: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Per user, ``min(#positives, #unrated)`` distinct movies drawn uniformly from the rated catalogue minus the
    user's positives (§5.1).

    Each user walks an independent random permutation of the catalogue and keeps the first unrated movies, which is
    uniform sampling without replacement. Only a user who rated more than half the catalogue gets fewer negatives
    than positives (ML-1M: user 4169, 2,314 ratings of 3,706 movies, hence 922 = 2·2314 − 3706 missing negatives,
    exactly the official 1,000,209 − 999,287).
    """
    catalogue = np.unique(item)
    taken = np.zeros((n_users, len(catalogue)), dtype=bool)
    taken[user, np.searchsorted(catalogue, item)] = True
    n_negative = np.minimum(np.bincount(user, minlength=n_users), len(catalogue) - taken.sum(axis=1))
    index_type = np.min_scalar_type(len(catalogue))
    permutation = rng.permuted(np.broadcast_to(np.arange(len(catalogue), dtype=index_type), taken.shape), axis=1)
    free = ~np.take_along_axis(taken, permutation, axis=1)
    keep = free & (np.cumsum(free, axis=1, dtype=index_type) <= n_negative[:, None])
    rows, columns = np.nonzero(keep)
    return rows.astype(np.int64), catalogue[permutation[rows, columns]]


def stratified_split(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Row indices ``(rest, holdout)``: ``ceil(fraction · n)`` rows held out, each class in proportion.

    Class sizes use largest remainders (as sklearn's ``StratifiedShuffleSplit``); both parts come in random order.
    """
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    n_holdout = math.ceil(round(fraction * len(labels), 6))
    exact = n_holdout * counts / len(labels)
    per_class = np.floor(exact).astype(np.int64)
    per_class[np.argsort(per_class - exact, kind="stable")[: n_holdout - per_class.sum()]] += 1
    rest, holdout = [], []
    for label, size in enumerate(per_class):
        members = rng.permutation(np.flatnonzero(inverse == label))
        holdout.append(members[:size])
        rest.append(members[size:])
    return rng.permutation(np.concatenate(rest)), rng.permutation(np.concatenate(holdout))


def prepare_movielens(ratings: Ratings, n_users: int, n_items: int, seed: int) -> dict[str, dict[str, Tensor]]:
    """Positives + sampled negatives, split 78.75/11.25/10 stratified on watch (§5.1), all from one seeded stream.

    Returns ``{"train"|"val"|"test": {user, item, sample_id (= user), watch, rating, rating_mask}}``; negatives have
    ``watch = 0``, ``rating = 0`` and ``rating_mask = False``.
    """
    for name, ids, limit in (("user", ratings.user, n_users), ("movie", ratings.item, n_items)):
        if len(ids) and ids.max() >= limit:
            raise UsageError(f"{name} id {ids.max() + 1} exceeds the dataset's {limit} {name}s")
    rng = np.random.default_rng(seed)
    negative_user, negative_item = sample_negatives(ratings.user, ratings.item, n_users, rng)
    user = np.concatenate([ratings.user, negative_user])
    item = np.concatenate([ratings.item, negative_item])
    rating = np.concatenate([ratings.rating, np.zeros(len(negative_user), dtype=np.int64)]).astype(np.float32)
    watch = np.concatenate([np.ones(len(ratings.user)), np.zeros(len(negative_user))]).astype(np.float32)
    rest, test = stratified_split(watch, 0.1, rng)
    train, val = (rest[part] for part in stratified_split(watch[rest], 0.125, rng))

    def tensors(index: np.ndarray) -> dict[str, Tensor]:
        return {
            "user": torch.from_numpy(user[index]),
            "item": torch.from_numpy(item[index]),
            "sample_id": torch.from_numpy(user[index]),
            "watch": torch.from_numpy(watch[index]),
            "rating": torch.from_numpy(rating[index]),
            "rating_mask": torch.from_numpy(watch[index] == 1),
        }

    return {"train": tensors(train), "val": tensors(val), "test": tensors(test)}


class MovieLensDataModule(InMemoryDataModule):
    """MovieLens-1M (the paper's) or MovieLens-100K with sampled negatives (comet-protocol.md §5.1, §4).

    Args:
        variant: ``1m`` (``<root>/ml-1m/ratings.dat``) or ``100k`` (``<root>/ml-100k/u.data``).
        negative_seed: seed of the negative sampling and of the split (fixed across trials).
        root, cache_dir, batch_size, eval_batch_size, seed, download: see :class:`InMemoryDataModule`.
    """

    task_weighting = "alpha"

    def __init__(self, variant: Literal["1m", "100k"] = "1m", negative_seed: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        if variant not in _VARIANTS:
            raise SettingError("variant", variant, f"must be one of {', '.join(_VARIANTS)}")
        self.variant, self.negative_seed = variant, negative_seed

    @property
    def info(self) -> DatasetInfo:
        variant = _VARIANTS[self.variant]
        return DatasetInfo(
            name=variant.name, tasks=TASKS, n_ids=variant.n_users, n_users=variant.n_users, n_items=variant.n_items,
            n_experts=16, k=2, embedding_dim=128, expert_units=256, tower_units=256, expert_dropout=0.5,
            task_weighting=self.task_weighting,
        )

    def load_splits(self) -> dict[str, dict[str, Tensor]]:
        variant = _VARIANTS[self.variant]
        (entry,) = RAW_FILES[variant.name]
        path = ensure_files(self.root, entry, self.download, self.verify, self.cache_dir)
        digest = raw_sha256(path, self.cache_dir)[:16]
        cache = self.cache_dir / f"movielens-{self.variant}-{digest}-seed{self.negative_seed}-v1.pt"

        def prepare() -> dict[str, dict[str, Tensor]]:
            ratings = read_ratings(path)  # its errors name the file
            try:
                return prepare_movielens(ratings, variant.n_users, variant.n_items, self.negative_seed)
            except UsageError as error:
                raise UsageError(f"{path}: {error}") from None

        return load_or_prepare(cache, prepare)


@register_dataset("movielens")
class MovieLens1MDataModule(MovieLensDataModule):
    """MovieLens-1M, the paper's MovieLens (CLI name ``movielens``); arguments as :class:`MovieLensDataModule`."""

    def __init__(self, **kwargs) -> None:
        super().__init__(variant="1m", **kwargs)


@register_dataset("movielens-100k")
class MovieLens100KDataModule(MovieLensDataModule):
    """MovieLens-100K, a small stand-in with the same protocol (CLI name ``movielens-100k``)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(variant="100k", **kwargs)
