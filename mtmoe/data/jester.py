"""Jester (dataset 1): task 1 "rated" (did the user rate the joke), task 2 "rating" (in [-10, 10], masked to rated
pairs); Supplement S1.1 and comet-protocol.md §5.1.

The raw data are the three official sheets ``jester-data-1.xls``, ``-2``, ``-3`` (24,983 + 23,500 + 24,938 = 73,421
users, one row each): the first column is the user's number of rated jokes (dropped), then 100 joke columns, 99 =
not rated. Every user-joke pair is a record (7,342,100), split 70/15/15 (5.1M / 1.1M / 1.1M). A rating of exactly
0.0 is a real rating, so rated pairs are selected by an explicit mask, never by the value (§9.1 #13).

The rating scale is not stated by the paper; Table 7's MSE of about 0.73 fits a z-scored target, not the raw
scale (standard deviation about 5). ``rating_scale="zscore"`` (default) standardises the rated pairs with the
training split's mean and standard deviation (``rating_mean``/``rating_std`` after ``setup``; an MSE times
``rating_std**2`` is the raw-scale MSE); ``"raw"`` keeps [-10, 10].
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import pandas as pd
import torch
from python_calamine import CalamineError

from mtmoe.data.base import DatasetInfo, InMemoryDataModule, Splits, register_dataset
from mtmoe.data.cache import load_or_prepare
from mtmoe.data.download import ensure_files, raw_sha256
from mtmoe.data.layout import RAW_FILES
from mtmoe.data.recsys import rating_splits, rating_tasks
from mtmoe.errors import SettingError, UsageError

TASKS = rating_tasks("rated")
N_USERS, N_JOKES = 73_421, 100  # S1.2's embedding tables
NOT_RATED = 99.0


class JesterRatings(NamedTuple):
    rating: np.ndarray  # float32 [users, 100]; 0 where not rated
    rated: np.ndarray  # bool [users, 100]


def read_jester_sheet(path: Path) -> JesterRatings:
    """One ``jester-data-N.xls``: 101 numeric columns, a count in 0..100, then ratings in [-10, 10] or 99.

    Anything else is a :class:`UsageError` naming the file and the cell (1-based row and column, as a
    spreadsheet shows them).
    """
    path = Path(path)
    try:
        frame = pd.read_excel(path, header=None, engine="calamine")
    except (CalamineError, ValueError) as error:
        raise UsageError(f"{path} is not a readable .xls sheet ({error})") from None
    if frame.shape[1] != 1 + N_JOKES or frame.shape[0] == 0:
        raise UsageError(f"{path} is malformed: {frame.shape[0]} rows of {frame.shape[1]} columns, expected rows "
                         f"of {1 + N_JOKES} (the number of rated jokes, then {N_JOKES} jokes)")
    values = frame.apply(pd.to_numeric, errors="coerce").to_numpy(dtype=np.float64)
    count, ratings = values[:, 0], values[:, 1:]
    bad = np.zeros(values.shape, dtype=bool)
    bad[:, 0] = ~((count >= 0) & (count <= N_JOKES) & (count == np.round(count)))  # NaN compares False
    bad[:, 1:] = ~((ratings == NOT_RATED) | ((ratings >= -10) & (ratings <= 10)))
    if bad.any():
        row, column = np.argwhere(bad)[0]
        expected = "a count 0..100" if column == 0 else "a rating in [-10, 10] or 99 (not rated)"
        cell = frame.iat[row, column]
        cell = cell.item() if isinstance(cell, np.generic) else cell
        raise UsageError(f"{path} is malformed: row {row + 1}, column {column + 1} holds {cell!r}, "
                         f"expected {expected}")
    rated = ratings != NOT_RATED
    return JesterRatings(rating=np.where(rated, ratings, 0).astype(np.float32), rated=rated)


def read_jester(paths: list[Path]) -> JesterRatings:
    """The three sheets stacked: users numbered 0.. in file order, then row order."""
    sheets = [read_jester_sheet(path) for path in paths]
    ratings = JesterRatings(*(np.concatenate(parts) for parts in zip(*sheets)))
    if len(ratings.rated) > N_USERS:
        raise UsageError(f"{', '.join(map(str, paths))} hold {len(ratings.rated):,} users, more than Jester "
                         f"dataset 1's {N_USERS:,}")
    return ratings


def prepare_jester(ratings: JesterRatings, seed: int, stratify: bool = True) -> Splits:
    """Every user-joke pair a record (rated = task 1, rating on rated pairs = task 2), split 70/15/15."""
    n_users = len(ratings.rated)
    user = np.repeat(np.arange(n_users, dtype=np.int32), N_JOKES)
    joke = np.tile(np.arange(N_JOKES, dtype=np.int32), n_users)
    return rating_splits(user, joke, ratings.rating.ravel(), ratings.rated.ravel(), "rated", seed, stratify)


def standardise_ratings(splits: Splits) -> tuple[Splits, float, float]:
    """Rated pairs z-scored with the training split's mean and (population) standard deviation; unrated stay 0."""
    train = splits["train"]["rating"][splits["train"]["rating_mask"]].double()
    mean, std = train.mean().item(), train.std(correction=0).item()
    if not std > 0:  # no rated pair, or a single value: nothing to standardise with
        raise UsageError(f"cannot z-score the ratings: the training split's rated pairs have standard deviation "
                         f"{std} (pass --data.rating_scale raw)")
    scaled = {}
    for name, tensors in splits.items():
        rating = torch.where(tensors["rating_mask"], (tensors["rating"] - mean) / std, 0.0).float()
        scaled[name] = {**tensors, "rating": rating}
    return scaled, mean, std


@register_dataset("jester")
class JesterDataModule(InMemoryDataModule):
    """Jester dataset 1 as the paper's Jester (S1.1-S1.3): ``<root>/jester/jester-data-{1,2,3}.xls``.

    Args:
        split_seed: seed of the 70/15/15 split (fixed across trials).
        stratify: stratify the split on task 1's label (our choice; the paper gives only the sizes).
        rating_scale: ``zscore`` (default; training-split statistics) or ``raw`` (see the module docstring).
        batch_size: 2048, the paper's (S1.3).
        root, cache_dir, eval_batch_size, seed, download: see :class:`InMemoryDataModule`.
    """

    task_weighting = "alpha"

    def __init__(
        self,
        split_seed: int = 0,
        stratify: bool = True,
        rating_scale: Literal["zscore", "raw"] = "zscore",
        batch_size: int = 2048,
        **kwargs,
    ) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        if rating_scale not in ("zscore", "raw"):
            raise SettingError("rating_scale", rating_scale, "must be zscore or raw")
        self.split_seed, self.stratify, self.rating_scale = split_seed, stratify, rating_scale
        self.rating_mean: float | None = None
        self.rating_std: float | None = None

    @property
    def info(self) -> DatasetInfo:
        return DatasetInfo(
            name="jester", tasks=TASKS, n_ids=N_USERS, n_users=N_USERS, n_items=N_JOKES,
            n_experts=16, k=2, embedding_dim=64, expert_units=128, tower_units=256, expert_dropout=0.5,
            task_weighting=self.task_weighting,
        )

    def raw_files(self) -> list[Path]:
        """The three sheets, fetched if missing and allowed; offline, one error naming every missing sheet."""
        paths, missing = [], []
        for name in RAW_FILES["jester"]:
            try:
                paths.append(ensure_files(self.root, name, self.download, self.verify, self.cache_dir))
            except UsageError as error:
                if self.download:
                    raise
                missing.append(str(error))
        if missing:
            raise UsageError("; ".join(missing))
        return paths

    def load_splits(self) -> Splits:
        paths = self.raw_files()
        digest = "".join(raw_sha256(path, self.cache_dir)[:8] for path in paths)
        split = "stratified" if self.stratify else "random"
        cache = self.cache_dir / f"jester-{digest}-seed{self.split_seed}-{split}-v1.pt"
        splits = load_or_prepare(cache, lambda: prepare_jester(read_jester(paths), self.split_seed, self.stratify))
        if self.rating_scale == "raw":
            return splits
        splits, self.rating_mean, self.rating_std = standardise_ratings(splits)
        return splits
