"""What the image datasets share (comet-protocol.md §5.2): raw files read once into uint8 tensors and cached.

Batches carry ``image`` as uint8 (the model scales it on its device, :class:`mtmoe.experts.ImageBottom`), the task
targets, and ``sample_id``: the row's index in the prepared dataset (train, then validation, then test), stable
because preparation is seeded and cached, for pre-assigned routing (Hash-r).

MNIST and Fashion-MNIST are read by torchvision's dataset classes from ``<root>/MNIST/raw/`` and
``<root>/FashionMNIST/raw/`` (torchvision's layout). What is on disk is used first: torchvision with
``download=False`` needs only the four extracted IDX files; where only the ``.gz`` files lie there (whatever their
gzip wrapper, so also copies whose ``.gz`` md5 differs from the official one) they are gunzipped in place, with no
network access; only when neither is present is torchvision asked to download (md5-checked).
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import math
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torchvision.datasets import MNIST

from mtmoe.data.base import InMemoryDataModule, Splits
from mtmoe.data.cache import load_or_prepare
from mtmoe.data.layout import MNIST_SOURCES
from mtmoe.errors import UsageError
from mtmoe.files import atomic_path, remove_orphans

SPLITS = ("train", "val", "test")


def file_fingerprint(paths: list[Path]) -> str:
    """A short hash of the files' names, sizes and modification times: a cache key that costs no reading.

    Replacing or touching a raw file makes a new cache entry; hashing the contents (up to 1.6 GB for SVHN, 200k
    files for CelebA) would cost more than loading the cache.
    """
    digest = hashlib.sha256()
    for path in sorted(paths):
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


class ImageDataModule(InMemoryDataModule):
    """Base of the image DataModules: ``raw_files`` (present, or fetched) -> ``prepare`` once -> cached splits.

    The cache file is ``<cache_dir>/<cache_name>-<file_fingerprint>-v<version>.pt``, written atomically.
    """

    cache_version = 1

    def raw_files(self) -> list[Path]:  # pragma: no cover - abstract
        """Make sure the raw files are under ``root`` (or fetch them when ``download``) and return them."""
        raise NotImplementedError

    def cache_name(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def prepare(self) -> Splits:  # pragma: no cover - abstract
        raise NotImplementedError

    def load_splits(self) -> Splits:
        files = self.raw_files()
        cache = self.cache_dir / f"{self.cache_name()}-{file_fingerprint(files)}-v{self.cache_version}.pt"
        return load_or_prepare(cache, self.prepare)


def with_sample_ids(parts: dict[str, dict[str, Tensor]]) -> Splits:
    """Add ``sample_id`` (the row's index over train, then val, then test) to each split."""
    offset = 0
    for split in SPLITS:
        n = len(next(iter(parts[split].values())))
        parts[split]["sample_id"] = torch.arange(offset, offset + n)
        offset += n
    return {split: parts[split] for split in SPLITS}


def check_n_ids(splits: Splits, n_ids: int, what: str) -> None:
    total = sum(len(s["sample_id"]) for s in splits.values())
    if total > n_ids:
        raise UsageError(f"{what} holds {total} images, more than the official release's {n_ids}")


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """scikit-learn's ``_approximate_mode``: per-class draws by largest remainder, ties broken at random."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (indices,) = np.where(remainder == value)
            add_now = min(len(indices), need_to_add)
            floored[rng.choice(indices, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def stratified_split(labels: np.ndarray, n_train: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``train_test_split(range(n), train_size=n_train, stratify=labels, shuffle=True, random_state=seed)``.

    scikit-learn's ``StratifiedShuffleSplit`` re-implemented draw for draw on a legacy ``RandomState(seed)``
    (checked against scikit-learn 1.9.1: identical on MNIST and on the known answers in the tests), so the official
    generator's split (5/6 of the 60k training images, stratified, seed 0) is reproduced without scikit-learn.
    """
    n_test = len(labels) - n_train
    classes, inverse = np.unique(labels, return_inverse=True)
    class_counts = np.bincount(inverse)
    class_indices = np.split(np.argsort(inverse, kind="mergesort"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i in range(len(classes)):
        members = class_indices[i].take(rng.permutation(class_counts[i]), mode="clip")
        train.extend(members[: n_i[i]])
        test.extend(members[n_i[i] : n_i[i] + t_i[i]])
    return rng.permutation(np.asarray(train, dtype=np.int64)), rng.permutation(np.asarray(test, dtype=np.int64))


def official_train_val(labels: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """The official split of MNIST's training images: 5/6 train, 1/6 validation, stratified (50k/10k)."""
    train, val = stratified_split(labels.numpy(), math.floor(5 / 6 * len(labels)), seed)
    return torch.from_numpy(train), torch.from_numpy(val)


def _gunzip_all(paths: list[Path]) -> None:
    """Decompress each ``<path>.gz`` next to it, all or none: on any error no extracted file is left, and the
    :class:`UsageError` names the ``.gz`` that failed."""
    with contextlib.ExitStack() as extracted:  # every rename happens once all are decompressed
        for path in paths:
            source = path.with_name(path.name + ".gz")
            tmp = extracted.enter_context(atomic_path(path))
            try:
                with open(tmp, "wb") as out, gzip.open(source, "rb") as compressed:
                    shutil.copyfileobj(compressed, out, 1 << 20)
            except (EOFError, zlib.error, gzip.BadGzipFile) as error:
                raise UsageError(f"{source} is not a complete gzip file ({error or 'truncated'}): delete it and rerun "
                                 f"with --data.download true, or put the extracted {path.name} beside it") from None


def check_idx(path: Path) -> None:
    """A :class:`UsageError` naming ``path`` unless it is an IDX file of uint8 data (magic ``0 0 8 ndim``,
    big-endian int32 sizes) exactly as long as its header says: a truncated copy is caught before reading."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        magic = handle.read(4)
        ndim = magic[3] if len(magic) == 4 and magic[:3] == b"\0\0\x08" else 0
        dims = np.frombuffer(handle.read(4 * ndim), dtype=">i4") if ndim else np.array([], dtype=">i4")
    expected = 4 + 4 * ndim + int(np.prod(dims, dtype=np.int64))
    if not ndim or len(dims) != ndim or size != expected:
        what = f"{size:,} bytes where its header says {expected:,}" if ndim and len(dims) == ndim else "no IDX header"
        raise UsageError(f"{path} is not a complete uint8 IDX file ({what}): truncated or modified? Delete it and "
                         f"rerun (with --data.download true if its .gz is not beside it)")


def mnist_files(root: Path, dataset: type[MNIST]) -> list[Path]:
    """The four extracted IDX files torchvision's ``dataset`` (MNIST or FashionMNIST) reads under ``root``."""
    return MNIST_SOURCES[dataset.__name__].paths(root)


def ensure_mnist(root: Path, dataset: type[MNIST], download: bool) -> list[Path]:
    """Make the four IDX files of ``dataset`` present under ``root`` (gunzip or download if needed); return them."""
    files = mnist_files(root, dataset)
    missing = [path for path in files if not path.is_file()]
    if not missing:
        return files
    raw = files[0].parent
    hint = (f"put {', '.join(p.name for p in files)} (gunzipped from {dataset.mirrors[0]}) in {raw}, "
            f"where torchvision.datasets.{dataset.__name__}(root={root}) reads them")
    remove_orphans(raw)
    try:
        if all(path.with_name(path.name + ".gz").is_file() for path in missing):
            _gunzip_all(missing)
        elif download:
            dataset(str(root), train=True, download=True)
        else:
            raise UsageError(f"missing {missing[0]}: {hint} (or pass --data.download true)")
    except (OSError, RuntimeError) as error:  # unwritable root, offline (URLError is an OSError)
        reason = " ".join(str(getattr(error, "reason", None) or getattr(error, "strerror", None) or error).split())
        raise UsageError(f"could not get {missing[0].name} ({reason[:200]}); {hint}") from None
    return files


def read_mnist(root: Path, dataset: type[MNIST], download: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Training and test images (uint8 ``[N, 28, 28]``) and labels (int64) read by torchvision's ``dataset``."""
    files = ensure_mnist(root, dataset, download)
    for path in files:
        check_idx(path)
    try:
        train, test = dataset(str(root), train=True), dataset(str(root), train=False)
    except (RuntimeError, AssertionError, ValueError) as error:
        raise UsageError(f"{files[0].parent} holds unreadable IDX files ({error})") from None
    if len(train.data) != len(train.targets) or len(test.data) != len(test.targets):
        raise UsageError(f"{files[0].parent}: image and label files of different lengths")
    return train.data, train.targets.long(), test.data, test.targets.long()
