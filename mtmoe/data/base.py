"""What every dataset provides: task specs, architecture defaults, in-memory batching by index, file helpers.

A dataset's tensors live in memory; batches are dicts of tensors sliced with a shuffled index permutation
(:class:`IndexBatches`), so there is no per-sample Python ``__getitem__`` or collate in the training loop.

Batch convention (a ``dict[str, Tensor]``): the model's inputs (``user``/``item`` ids or ``image``), ``sample_id``
(a stable id per sample, for pre-assigned routing), one target per task under the task's name, and for masked
tasks a bool tensor ``<task>_mask`` selecting the rows that task's loss and metrics see (masks are data; they are
never inferred from target values).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor

from mtmoe.data.layout import data_root
from mtmoe.dataset_info import DatasetInfo, TaskSpec  # noqa: F401  (re-exported: the model's view of a dataset)
from mtmoe.errors import SettingError
from mtmoe.host_threads import run_split

Splits = dict[str, dict[str, Tensor]]  # {"train"|"val"|"test": {name: tensor}}

def shuffled_order(n_rows: int, seed: int, epoch: int, out: Tensor | None = None) -> Tensor:
    """The training order of an epoch: a permutation drawn on the CPU from ``torch.Generator(seed + epoch)``, so it
    is reproducible, differs between epochs, and is the same on every device (trial packs draw theirs with it);
    into ``out`` (int64, ``[n_rows]``) where given."""
    return torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch), out=out)


def epoch_orders(n_rows: int, draws: list[tuple[int, int] | None]) -> Tensor:
    """``[len(draws), n_rows]``: row p the :func:`shuffled_order` of ``draws[p]`` (a seed and an epoch), or the rows
    in order for ``None``. The rows are drawn in place, split over torch's threads (each row from its own
    generator: any split draws the same), as a pack's trials need theirs at every epoch's start."""
    orders = torch.empty(len(draws), n_rows, dtype=torch.int64)

    def draw(lo: int, hi: int) -> None:
        for row in range(lo, hi):
            if draws[row] is None:
                torch.arange(n_rows, out=orders[row])
            else:
                shuffled_order(n_rows, *draws[row], out=orders[row])

    run_split(draw, len(draws), min_part=1)
    return orders


class IndexBatches:
    """An epoch-by-epoch iterable of dict batches cut from in-memory tensors by (shuffled) index.

    Shuffling uses :func:`shuffled_order`, so the order is reproducible and differs between epochs. The epoch is
    ``current_epoch()`` when given (the trainer's, so a run resumed from a checkpoint draws the orders the
    uninterrupted run draws), else the number of passes made so far.
    """

    def __init__(
        self, tensors: dict[str, Tensor], batch_size: int, shuffle: bool, seed: int = 0,
        current_epoch: Callable[[], int] | None = None,
    ) -> None:
        sizes = {len(t) for t in tensors.values()}
        if len(sizes) != 1:
            raise ValueError(f"tensors of different lengths: {sizes}")
        self.tensors, self.batch_size, self.shuffle, self.seed = tensors, batch_size, shuffle, seed
        self.n_rows = sizes.pop()
        self.epoch = 0
        self.current_epoch = current_epoch

    def __len__(self) -> int:
        return -(-self.n_rows // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        if self.shuffle:
            if self.current_epoch is not None:
                self.epoch = self.current_epoch()
            order = shuffled_order(self.n_rows, self.seed, self.epoch).to(next(iter(self.tensors.values())).device)
            self.epoch += 1
            for start in range(0, self.n_rows, self.batch_size):
                index = order[start : start + self.batch_size]
                yield {key: t[index] for key, t in self.tensors.items()}
        else:
            for start in range(0, self.n_rows, self.batch_size):
                yield {key: t[start : start + self.batch_size] for key, t in self.tensors.items()}


def register_dataset(name: str):
    """``@register_dataset("name")`` on a DataModule: the dataset the CLI's ``--data name`` selects. The line is read
    from the file without importing it (:mod:`mtmoe.discovery`), and so are the class's literal attributes (its
    static facts, as ``task_weighting``: ``report`` and ``bootstrap`` know a dataset's default alpha without
    Lightning); a DataModule of another package registers with an entry point of the group ``mtmoe.datasets``
    instead."""
    def decorator(cls: type) -> type:
        cls.registry_name = name
        return cls

    return decorator


class InMemoryDataModule(pl.LightningDataModule):
    """Base DataModule: subclasses implement ``info`` and ``load_splits`` (train/val/test dicts of tensors).

    Args:
        root: data root holding the raw files, downloads go there (default: ``$MTMOE_DATA``, else
            ``~/.cache/mtmoe/data``).
        cache_dir: where prepared splits are cached (default: ``$MTMOE_CACHE``, else ``~/.cache/mtmoe``).
        batch_size: training batch size (the paper's per dataset, S1.3).
        eval_batch_size: validation/test batch size (default: ``batch_size``).
        seed: seed of the training shuffle (default: the run's seed, ``--seed_everything``, so the trials of a study
            each draw their own batches).
        download: fetch missing raw files from the official source (with checksum and a progress bar).
        verify: refuse raw files whose size or sha256 differs from the manifest's (``mtmoe/data/manifest.json``; a
            truncated or modified copy); False uses them as they are (default: ``$MTMOE_VERIFY``, else true).
        data_on_device: when training on a GPU, copy the splits to it once at setup and cut batches there (no
            host-to-device copy per step); False keeps them in host memory and Lightning copies each batch.
    """

    registry_name: ClassVar[str]  # set by :func:`register_dataset`
    #: How the loss weights the tasks (``alpha``: ``(alpha, 1 - alpha)`` for two tasks; ``equal``): each dataset sets
    #: it as a literal, which its ``info`` reads and :mod:`mtmoe.discovery` reads without importing the file.
    task_weighting: ClassVar[Literal["alpha", "equal"]]

    def __init__(
        self,
        root: str | None = None,
        cache_dir: str | None = None,
        batch_size: int = 512,
        eval_batch_size: int | None = None,
        seed: int | None = None,
        download: bool = True,
        verify: bool | None = None,
        data_on_device: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise SettingError("batch_size", batch_size, "must be >= 1")
        if eval_batch_size is not None and eval_batch_size < 1:
            raise SettingError("eval_batch_size", eval_batch_size, "must be >= 1")
        self.root = data_root(root)
        self.cache_dir = Path(cache_dir or os.environ.get("MTMOE_CACHE") or Path.home() / ".cache" / "mtmoe")
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.seed = torch.initial_seed() if seed is None else seed
        self.download, self.data_on_device, self.verify = download, data_on_device, verify
        self.splits: dict[str, dict[str, Tensor]] | None = None

    @property
    def info(self) -> DatasetInfo:  # pragma: no cover - abstract
        raise NotImplementedError

    def load_splits(self) -> dict[str, dict[str, Tensor]]:  # pragma: no cover - abstract
        """Read (preparing and caching once if needed) and return ``{"train"|"val"|"test": tensors}``."""
        raise NotImplementedError

    def prepare_data(self) -> None:
        self.load_splits()

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:
            self.splits = self.load_splits()
        device = self.trainer.strategy.root_device if self.trainer is not None else None
        if self.data_on_device and device is not None and device.type != "cpu":
            self.splits = {name: {k: t.to(device) for k, t in split.items()} for name, split in self.splits.items()}

    def _batches(self, split: str, train: bool) -> IndexBatches:
        self.setup()
        size = self.batch_size if train else self.eval_batch_size
        trainer = self.trainer
        epoch = (lambda: trainer.current_epoch) if trainer is not None else None
        return IndexBatches(self.splits[split], size, shuffle=train, seed=self.seed, current_epoch=epoch)

    def train_dataloader(self) -> IndexBatches:
        return self._batches("train", train=True)

    def val_dataloader(self) -> IndexBatches:
        return self._batches("val", train=False)

    def test_dataloader(self) -> IndexBatches:
        return self._batches("test", train=False)
