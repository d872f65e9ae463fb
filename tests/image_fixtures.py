"""Tiny image datasets written in their official formats, where the loaders (and torchvision) expect them.

* MNIST / Fashion-MNIST: the four IDX files in ``<root>/<MNIST|FashionMNIST>/raw/`` (optionally only ``.gz``);
* SVHN: ``train_32x32.mat``, ``test_32x32.mat``, ``extra_32x32.mat`` in ``<root>/SVHN/`` (``X [32, 32, 3, N]``,
  ``y [N, 1]`` with 10 for the digit 0), written with ``scipy.io.savemat``;
* CelebA: ``list_attr_celeba.txt``, ``list_eval_partition.txt`` and 178x218 JPEGs in ``img_align_celeba/`` under
  ``<root>/celeba/``.

Every image encodes its label (a bright block whose position depends on the class), so a model can learn it.
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import scipy.io
import torch
from torchvision.io import encode_jpeg, write_file

from mtmoe.data.celeba import ATTRIBUTES


def labelled_images(labels: np.ndarray, height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``[N, height, width]`` noise with a bright 4x4 block at a class-dependent place."""
    images = rng.integers(0, 60, size=(len(labels), height, width), dtype=np.uint8)
    for i, label in enumerate(labels):
        row, col = 2 + 2 * (label % 5), 2 + 8 * (label // 5)
        images[i, row : row + 4, col : col + 4] = 250
    return images


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> None:
    """An IDX file (big-endian magic ``0x08 0x0<ndim>``, int32 sizes, uint8 data), optionally gzipped."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">i4").tobytes()
    data = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def write_mnist(root: Path, name: str = "MNIST", n_train: int = 60, n_test: int = 12, seed: int = 0,
                gz: bool = False) -> dict[str, np.ndarray]:
    """MNIST-format IDX files for torchvision's ``MNIST``/``FashionMNIST``; returns the arrays written.

    Training labels are balanced (``n_train / 10`` per class) so the official stratified split applies.
    """
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.permutation(np.arange(n) % 10).astype(np.uint8)
        images = labelled_images(labels, 28, 28, rng)
        write_idx(root / name / "raw" / f"{split}-images-idx3-ubyte", images, gz)
        write_idx(root / name / "raw" / f"{split}-labels-idx1-ubyte", labels, gz)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images, labels
    return arrays


def write_svhn(root: Path, sizes: dict[str, int] | None = None, seed: int = 1) -> dict[str, tuple]:
    """SVHN ``*_32x32.mat`` files; returns per file the images ``[N, 3, 32, 32]`` and the digits 0-9 written."""
    rng = np.random.default_rng(seed)
    written = {}
    for name, n in (sizes or {"train": 30, "test": 20, "extra": 40}).items():
        digits = rng.permutation(np.arange(n) % 10)
        grey = labelled_images(digits, 32, 32, rng)
        images = np.stack([grey // (c + 1) for c in range(3)], axis=1)  # [N, 3, 32, 32], channels differ
        path = root / "SVHN" / f"{name}_32x32.mat"
        path.parent.mkdir(parents=True, exist_ok=True)
        y = np.where(digits == 0, 10, digits).astype(np.uint8).reshape(-1, 1)
        scipy.io.savemat(str(path), {"X": images.transpose(2, 3, 1, 0), "y": y})
        written[name] = (images, digits)
    return written


def write_celeba(root: Path, partition: tuple[int, ...] = (0,) * 24 + (1,) * 8 + (2,) * 8, seed: int = 2) -> np.ndarray:
    """CelebA's two lists and one 178x218 JPEG per image; returns the 0/1 attributes ``[N, 40]`` written.

    Attribute ``Smiling`` is drawn in the image (a bright block), the others are random.
    """
    rng = np.random.default_rng(seed)
    folder = root / "celeba"
    (folder / "img_align_celeba").mkdir(parents=True, exist_ok=True)
    n = len(partition)
    attributes = rng.integers(0, 2, size=(n, len(ATTRIBUTES))).astype(np.uint8)
    names = [f"{i + 1:06d}.jpg" for i in range(n)]
    smiling = attributes[:, ATTRIBUTES.index("Smiling")]
    for name, label in zip(names, smiling):
        image = np.stack([labelled_images(np.array([5 * label]), 218, 178, rng)[0]] * 3)
        write_file(str(folder / "img_align_celeba" / name), encode_jpeg(torch.from_numpy(image), quality=95))
    rows = ["".join(f" {'1' if a else '-1':>2}" for a in row) for row in attributes]  # official: aligned columns
    (folder / "list_attr_celeba.txt").write_text(
        f"{n}\n{' '.join(ATTRIBUTES)} \n" + "".join(f"{name}{row}\n" for name, row in zip(names, rows))
    )
    (folder / "list_eval_partition.txt").write_text("".join(f"{name} {p}\n" for name, p in zip(names, partition)))
    return attributes
