"""Digits (S1.1, comet-protocol.md §5.2): MNIST and SVHN mixed, one 10-class task, a single-gate MoE.

Splits (S1.1): MNIST 50,000 / 10,000 / 10,000 and SVHN 480,420 / 75,000 / 75,000, the matching parts
concatenated (MNIST rows first). MNIST's training images are split as MultiMNIST's are (5/6 : 1/6, stratified,
scikit-learn's algorithm, seed 0) and its test images are the test set. SVHN's three files (73,257 train +
26,032 test + 531,131 extra = 630,420, exactly S1.1's total) are pooled and re-split the same way: 75,000 test,
then 75,000 validation from the rest, each stratified on the digit. With ``svhn_extra=False`` (a smaller stand-in,
not the paper's) the pool is train + test and the validation and test parts keep S1.1's proportion (75,000/630,420).

Common input (the paper is silent): 3x32x32, SVHN's format. An MNIST digit is zero-padded by 2 pixels to 32x32,
as LeNet-5 read MNIST, and repeated on the three channels; no interpolation touches either dataset.

SVHN's ``train_32x32.mat``, ``test_32x32.mat`` and ``extra_32x32.mat`` lie in ``<root>/SVHN/`` and are read as
torchvision's ``SVHN`` reads them (``scipy.io.loadmat``; ``X [32, 32, 3, N]`` to ``[N, 3, 32, 32]``, label 10 to
digit 0). torchvision's class checks each file's md5 before reading, which a test fixture cannot match, so it is
used for the (md5-checked) download only.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.io
import torch
from torch import Tensor
from torch.nn import functional as F
from torchvision.datasets import MNIST, SVHN
from torchvision.datasets.utils import download_url

from mtmoe.data.base import DatasetInfo, TaskSpec, register_dataset
from mtmoe.data.images import (
    SPLITS, ImageDataModule, Splits, check_n_ids, ensure_mnist, official_train_val, read_mnist, stratified_split,
    with_sample_ids,
)
from mtmoe.data.layout import SVHN as SVHN_FILES
from mtmoe.errors import UsageError

TASKS = (TaskSpec("digit", "multiclass", n_classes=10),)
SVHN_SIZES = {"train": 73_257, "test": 26_032, "extra": 531_131}
SVHN_HOLDOUT = 75_000  # S1.1: SVHN validation and test sizes, out of all 630,420 images
N_MNIST = 70_000


def read_svhn(path: Path) -> tuple[Tensor, Tensor]:
    """One SVHN ``*_32x32.mat``: uint8 images ``[N, 3, 32, 32]`` and int64 digits 0-9 (label 10 is digit 0)."""
    try:
        mat = scipy.io.loadmat(str(path))  # a short text file: ValueError, or IndexError on scipy 1.13
    except (scipy.io.matlab.MatReadError, ValueError, OSError, TypeError, IndexError) as error:
        raise UsageError(f"{path} is not a MATLAB file ({' '.join(str(error).split())[:120]})") from None
    images, labels = mat.get("X"), mat.get("y")
    if images is None or labels is None or images.ndim != 4 or images.shape[:3] != (32, 32, 3):
        raise UsageError(f"{path} is not an SVHN file: it needs X [32, 32, 3, N] and y [N, 1]")
    labels = labels.astype(np.int64).reshape(-1)
    if len(labels) != images.shape[3] or not np.isin(labels, np.arange(1, 11)).all():
        raise UsageError(f"{path}: y must hold one label in 1..10 per image")
    labels[labels == 10] = 0
    return torch.from_numpy(np.ascontiguousarray(images.transpose(3, 2, 0, 1))), torch.from_numpy(labels)


def mnist_as_svhn(images: Tensor) -> Tensor:
    """uint8 ``[N, 28, 28]`` -> ``[N, 3, 32, 32]``: zero-padded by 2 pixels, repeated on three channels."""
    return F.pad(images, (2, 2, 2, 2)).unsqueeze(1).expand(-1, 3, -1, -1).contiguous()


def split_svhn(labels: Tensor, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Train, validation and test indices of the pooled SVHN images (module docstring)."""
    n = len(labels)
    holdout = round(n * SVHN_HOLDOUT / sum(SVHN_SIZES.values()))
    rest, test = stratified_split(labels.numpy(), n - holdout, seed)
    train, val = stratified_split(labels.numpy()[rest], len(rest) - holdout, seed)
    return torch.from_numpy(rest[train]), torch.from_numpy(rest[val]), torch.from_numpy(test)


def prepare_digits(mnist: tuple[Tensor, Tensor, Tensor, Tensor], svhn: tuple[Tensor, Tensor], seed: int) -> Splits:
    """MNIST's and SVHN's splits (module docstring), concatenated split by split."""
    train_images, train_labels, test_images, test_labels = mnist
    train, val = official_train_val(train_labels, seed)
    mnist_parts = {
        "train": (train_images[train], train_labels[train]),
        "val": (train_images[val], train_labels[val]),
        "test": (test_images, test_labels),
    }
    svhn_images, svhn_labels = svhn
    svhn_index = dict(zip(SPLITS, split_svhn(svhn_labels, seed)))
    return with_sample_ids({
        split: {
            "image": torch.cat([mnist_as_svhn(mnist_parts[split][0]), svhn_images[svhn_index[split]]]),
            "digit": torch.cat([mnist_parts[split][1], svhn_labels[svhn_index[split]]]),
        }
        for split in SPLITS
    })


@register_dataset("digits")
class DigitsDataModule(ImageDataModule):
    """Digits: MNIST (``<root>/MNIST/raw/``) and SVHN (``<root>/SVHN/*_32x32.mat``); module docstring.

    Architecture (S1.2): one gate over 8 experts, k = 2; each expert ``Conv5x5(10) -> pool -> Conv5x5(20) -> pool
    -> Dense(50)``, the tower ``Dense(50) -> Dense(50) -> Dense(10)``.

    Args:
        svhn_extra: pool SVHN's 531,131 ``extra`` images too (the paper's sizes); False: train + test only.
        split_seed: seed of the MNIST and SVHN splits.
        root, cache_dir, batch_size, eval_batch_size, seed, download: see :class:`InMemoryDataModule`.
    """

    task_weighting = "equal"

    def __init__(self, svhn_extra: bool = True, split_seed: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.svhn_extra, self.split_seed = svhn_extra, split_seed

    @property
    def n_ids(self) -> int:
        return N_MNIST + sum(size for name, size in SVHN_SIZES.items() if name != "extra" or self.svhn_extra)

    @property
    def info(self) -> DatasetInfo:
        return DatasetInfo(
            name="digits", tasks=TASKS, n_ids=self.n_ids, image_shape=(3, 32, 32), n_experts=8, k=2,
            expert_units=50, tower_units=50, expert_dropout=0.0, task_weighting=self.task_weighting,
            conv_layers=((5, 10), (5, 20)), expert_layers=1, tower_layers=2,
        )

    def svhn_files(self) -> list[Path]:
        return [path for path in SVHN_FILES.paths(self.root) if self.svhn_extra or path.name != "extra_32x32.mat"]

    def raw_files(self) -> list[Path]:
        mnist = ensure_mnist(self.root, MNIST, self.download)
        for path in self.svhn_files():
            if path.is_file():
                continue
            url, _, md5 = SVHN.split_list[path.name.removesuffix("_32x32.mat")]
            hint = f"download {url} into {path.parent}"
            if not self.download:
                raise UsageError(f"missing {path}: {hint} (or pass --data.download true)")
            try:
                download_url(url, str(path.parent), path.name, md5)
            except (OSError, RuntimeError) as error:
                reason = " ".join(str(getattr(error, "reason", None) or error).split())[:200]
                raise UsageError(f"could not download {url} ({reason}); offline? {hint}") from None
        return mnist + self.svhn_files()

    def cache_name(self) -> str:
        return f"digits-{'extra' if self.svhn_extra else 'noextra'}-seed{self.split_seed}"

    def prepare(self) -> Splits:
        svhn = [read_svhn(path) for path in self.svhn_files()]
        images, labels = torch.cat([s[0] for s in svhn]), torch.cat([s[1] for s in svhn])
        splits = prepare_digits(read_mnist(self.root, MNIST, False), (images, labels), self.split_seed)
        check_n_ids(splits, self.n_ids, str(self.root))
        return splits
