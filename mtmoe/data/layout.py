"""Where each dataset's raw files lie under the data root (``datasets/README.md``): the one table the DataModules
find their files in and ``python -m mtmoe datasets`` reports on, importable without torch.

A dataset reads one or more sources, each a folder of the data root and the files in it the loader needs. A
recommender's sources are entries of ``manifest.json``, which lists their files with URL and checksums
(:mod:`mtmoe.data.download`); the image datasets' follow torchvision's layout.
"""
from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from mtmoe.data.download import manifest_entry


def data_root(root: str | os.PathLike | None = None) -> Path:
    """The data root in force: ``root`` (``--data.root``), else ``$MTMOE_DATA``, else ``~/.cache/mtmoe/data``."""
    return Path(root or os.environ.get("MTMOE_DATA") or Path.home() / ".cache" / "mtmoe" / "data")


class Source(NamedTuple):
    """A folder of the data root and the files (or sub-folders) in it that a loader reads."""

    folder: str  # relative to the data root, "/"-separated
    files: tuple[str, ...]
    by_hand: str = ""  # why missing files are not downloaded on first use (empty: they are)
    gunzips: bool = False  # a file's ``.gz`` beside it stands in for it (extracted on first use, offline)

    def paths(self, root: Path) -> list[Path]:
        return [Path(root) / self.folder / name for name in self.files]

    def missing(self, root: Path) -> list[Path]:
        """The files absent under ``root`` (where ``gunzips``, a file whose ``.gz`` lies beside it is not)."""
        return [path for path in self.paths(root) if not path.exists()
                and not (self.gunzips and path.with_name(path.name + ".gz").is_file())]


IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MNIST_SOURCES = {  # torchvision class name -> where torchvision.datasets.<name>(root) reads its IDX files
    name: Source(f"{name}/raw", IDX_FILES, gunzips=True) for name in ("MNIST", "FashionMNIST")
}
SVHN = Source("SVHN", ("train_32x32.mat", "test_32x32.mat", "extra_32x32.mat"))
CELEBA = Source("celeba", ("list_attr_celeba.txt", "list_eval_partition.txt", "img_align_celeba"),
                by_hand="scripted downloads from CelebA's Google Drive need gdown and often fail")

RAW_FILES: dict[str, tuple[str | Source, ...]] = {  # dataset -> its sources (a str: an entry of manifest.json)
    "movielens": ("ml-1m",),
    "movielens-100k": ("ml-100k",),
    "books": ("book-crossing",),
    "jester": ("jester-1-1", "jester-1-2", "jester-1-3"),  # jester-data-1.xls, -2, -3 in this order
    "multimnist": (MNIST_SOURCES["MNIST"],),
    "multifashionmnist": (MNIST_SOURCES["FashionMNIST"],),
    "digits": (MNIST_SOURCES["MNIST"], SVHN),
    "celeba": (CELEBA,),
}


def manifest_source(name: str) -> Source:
    """Manifest entry ``name`` as a :class:`Source` (its files share one folder; ``by_hand``: the entry's)."""
    entry = manifest_entry(name)
    paths = [PurePosixPath(path) for path in entry["files"]]
    return Source(str(paths[0].parent), tuple(path.name for path in paths), entry.get("by_hand", ""))


def sources(dataset: str) -> list[Source]:
    return [manifest_source(s) if isinstance(s, str) else s for s in RAW_FILES[dataset]]


def files_status(dataset: str, root: Path) -> tuple[str, str]:
    """Whether ``dataset``'s files are under ``root`` (``present``, or ``missing ...`` with what happens next), and
    the folders they go in."""
    if dataset not in RAW_FILES:
        return "not described here (a dataset of another package: its DataModule finds its files)", "-"
    found = sources(dataset)
    folders = ", ".join(dict.fromkeys(str(Path(root) / source.folder) for source in found))
    missing = [(path, source) for source in found for path in source.missing(root)]
    if not missing:
        return "present", folders
    first, source = missing[0]
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    fetch = f"place them there by hand: {source.by_hand}; datasets/README.md" if source.by_hand else "downloaded on first use"
    return f"missing {first.relative_to(root).as_posix()}{more} ({fetch})", folders
