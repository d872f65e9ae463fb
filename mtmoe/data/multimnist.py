"""MultiMNIST and MultiFashionMNIST (S1.1, comet-protocol.md §5.2): two 10-class tasks on overlaid image pairs.

The official generator (``data/utils/data_generators/generate_mnist_dataset.py``), vectorised and draw for draw:

1. MNIST's 60k training images are split 5/6 : 1/6, stratified on the label, with scikit-learn's algorithm and
   ``random_state=seed`` (:func:`mtmoe.data.images.stratified_split`): 50k train, 10k validation; the 10k test
   images stay the test set.
2. In each split every source image i is the top-left layer of two composites; each one's bottom-right layer is
   another image of the same split, drawn with ``np.random.seed(seed)``'s legacy stream as
   ``randint(0, len(others) - 1)`` over the split's other images (so, as in the official code, the last of them
   is never drawn). Splits are drawn in the official order: validation, test, train.
3. A composite is the two layers added on a 36x36 canvas, the second shifted by 8 pixels both ways (4 from the
   centre); pixels / 255 reach 2.0 where strokes overlap (no clipping). Labels ``[top_left, bottom_right]``.

Result: 100k / 20k / 20k composites. They are stored exactly, as uint8 layer pairs ``image [N, 2, 28, 28]``; the
model adds them on its device (:class:`mtmoe.experts.ImageBottom` with ``overlay_shift = 8``). The sum of two
uint8 images does not fit a byte, and the pair is smaller than an int16 canvas.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torchvision.datasets import MNIST, FashionMNIST

from mtmoe.data.base import DatasetInfo, TaskSpec, register_dataset
from mtmoe.data.images import (
    ImageDataModule, Splits, check_n_ids, ensure_mnist, official_train_val, read_mnist, with_sample_ids,
)
from mtmoe.errors import SettingError, UsageError

TASKS = (TaskSpec("top_left", "multiclass", n_classes=10), TaskSpec("bottom_right", "multiclass", n_classes=10))
SHIFT = 8  # 36 = 28 + 2 * 4: the second image sits 8 pixels right of and below the first
N_IDS = 140_000  # 2 * (50k + 10k + 10k) composites


class _Variant(NamedTuple):
    name: str  # DatasetInfo.name and CLI name
    source: type[MNIST]
    n_experts: int
    k: int


_VARIANTS = {
    "mnist": _Variant("multimnist", MNIST, 16, 4),
    # S1.2 ("16/5"), Table 3 (n = 5) and the official 5-expert configs say 5; S1.3's "6" is taken as a typo.
    "fashion": _Variant("multifashionmnist", FashionMNIST, 5, 2),
}


def composites(images: Tensor, labels: Tensor, rng: np.random.RandomState) -> dict[str, Tensor]:
    """Two composites per source image: ``image [2N, 2, 28, 28]`` (top-left, bottom-right layers) and both labels.

    Rows 2i and 2i+1 have image i on top-left, as the official generator appends them. Needs N >= 3.
    """
    n = len(images)
    draws = rng.randint(0, n - 2, size=(n, 2))  # official randint(0, len(others) - 1): high is exclusive
    partners = torch.from_numpy(draws + (draws >= np.arange(n)[:, None]))  # position among "others" -> index
    top = torch.arange(n).repeat_interleave(2)
    bottom = partners.reshape(-1)
    return {
        "image": torch.stack([images[top], images[bottom]], dim=1),
        "top_left": labels[top],
        "bottom_right": labels[bottom],
    }


def prepare_multimnist(
    train_images: Tensor, train_labels: Tensor, test_images: Tensor, test_labels: Tensor, seed: int
) -> Splits:
    """The official generator's splits and composites (module docstring) from MNIST-format arrays."""
    train, val = official_train_val(train_labels, seed)
    sources = {
        "val": (train_images[val], train_labels[val]),
        "test": (test_images, test_labels),
        "train": (train_images[train], train_labels[train]),
    }
    for split, (images, _) in sources.items():
        if len(images) < 3:
            raise UsageError(f"the {split} split has {len(images)} source images; composites need at least 3")
    rng = np.random.RandomState(seed)  # the official np.random.seed(seed) stream, drawn val, test, train
    return with_sample_ids({split: composites(images, labels, rng) for split, (images, labels) in sources.items()})


class MultiMNISTFamilyDataModule(ImageDataModule):
    """MultiMNIST (``variant="mnist"``) or MultiFashionMNIST (``"fashion"``), generated once and cached.

    Architecture (S1.2, Table 3): 16 experts with k = 4 (MultiFashionMNIST: 5 experts, k = 2; S1.3 says 6, a typo
    against S1.2, Table 3 and the official configs), each ``Conv5x5(10) -> pool -> Conv5x5(20) -> pool ->
    Dense(50) -> Dense(50)``, towers ``Dense(50) -> Dense(50) -> Dense(10)``, the two tasks equally weighted.

    Args:
        variant: ``mnist`` (``<root>/MNIST/raw/``) or ``fashion`` (``<root>/FashionMNIST/raw/``).
        generator_seed: seed of the split and of the partner draws (the official generator's is 0).
        root, cache_dir, batch_size, eval_batch_size, seed, download: see :class:`InMemoryDataModule`.
    """

    task_weighting = "equal"

    def __init__(self, variant: Literal["mnist", "fashion"] = "mnist", generator_seed: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        if variant not in _VARIANTS:
            raise SettingError("variant", variant, f"must be one of {', '.join(_VARIANTS)}")
        self.variant, self.generator_seed = variant, generator_seed

    @property
    def info(self) -> DatasetInfo:
        variant = _VARIANTS[self.variant]
        return DatasetInfo(
            name=variant.name, tasks=TASKS, n_ids=N_IDS, image_shape=(1, 28 + SHIFT, 28 + SHIFT),
            n_experts=variant.n_experts, k=variant.k, expert_units=50, tower_units=50, expert_dropout=0.0,
            task_weighting=self.task_weighting, conv_layers=((5, 10), (5, 20)), expert_layers=2, tower_layers=2,
            overlay_shift=SHIFT,
        )

    def raw_files(self) -> list[Path]:
        return ensure_mnist(self.root, _VARIANTS[self.variant].source, self.download)

    def cache_name(self) -> str:
        return f"{_VARIANTS[self.variant].name}-seed{self.generator_seed}"

    def prepare(self) -> Splits:
        splits = prepare_multimnist(*read_mnist(self.root, _VARIANTS[self.variant].source, False), self.generator_seed)
        check_n_ids(splits, N_IDS, str(self.root / _VARIANTS[self.variant].source.__name__))
        return splits


@register_dataset("multimnist")
class MultiMNISTDataModule(MultiMNISTFamilyDataModule):
    """MultiMNIST (CLI name ``multimnist``); arguments as :class:`MultiMNISTFamilyDataModule`."""

    def __init__(self, **kwargs) -> None:
        super().__init__(variant="mnist", **kwargs)


@register_dataset("multifashionmnist")
class MultiFashionMNISTDataModule(MultiMNISTFamilyDataModule):
    """MultiFashionMNIST (CLI name ``multifashionmnist``); arguments as :class:`MultiMNISTFamilyDataModule`."""

    def __init__(self, **kwargs) -> None:
        super().__init__(variant="fashion", **kwargs)
