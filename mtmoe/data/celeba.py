"""CelebA (S1.1, comet-protocol.md §5.2): ten binary face attributes as equally weighted tasks.

Files in torchvision's layout under the data root: ``celeba/list_attr_celeba.txt``,
``celeba/list_eval_partition.txt`` and ``celeba/img_align_celeba/*.jpg`` (the aligned and cropped 178x218 images).
The split is the official partition (162,770 / 19,867 / 19,962). The images are decoded once (torchvision.io),
resized and cached as uint8.

Choices where the paper is silent (both are flags):

* **Attributes** (the paper uses "10 of the 40" without naming them): by default the ten closest to a 50%
  positive rate in CelebA's published attribute statistics, so that each task's accuracy and cross-entropy say
  something (on a 5%-positive attribute a constant predictor is 95% accurate): Attractive, Heavy_Makeup,
  High_Cheekbones, Male, Mouth_Slightly_Open, Oval_Face, Pointy_Nose, Smiling, Wavy_Hair, Wearing_Lipstick.
* **Resolution**: 64x64 RGB, the aligned image resized without cropping, the resolution common in multi-task
  CelebA work (e.g. Sener & Koltun, NeurIPS 2018). The four valid 3x3 convolutions and poolings of S1.2 leave a
  2x2x1 map, so each expert outputs 4 features. Table 6's FLOPs (22.02M per sample for Softmax) would fit an input
  near 100x100 at 2 FLOPs per multiply-add, but the same counting puts MultiFashionMNIST's stated 36x36 input at
  10.2M where Table 6 says 7.49M, so the table does not pin the resolution down.

torchvision's ``CelebA`` class itself insists on the md5 of five annotation files (identity, boxes and landmarks
too), which neither a partial copy nor a test fixture has; it is used for downloading only, and the two lists
needed are read here in its layout.
"""
from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms.v2.functional import resize

from mtmoe.data.base import DatasetInfo, TaskSpec, register_dataset
from mtmoe.data.images import SPLITS, ImageDataModule, Splits, check_n_ids, with_sample_ids
from mtmoe.data.layout import CELEBA
from mtmoe.errors import SettingError, UsageError

ATTRIBUTES = (
    "5_o_Clock_Shadow", "Arched_Eyebrows", "Attractive", "Bags_Under_Eyes", "Bald", "Bangs", "Big_Lips", "Big_Nose",
    "Black_Hair", "Blond_Hair", "Blurry", "Brown_Hair", "Bushy_Eyebrows", "Chubby", "Double_Chin", "Eyeglasses",
    "Goatee", "Gray_Hair", "Heavy_Makeup", "High_Cheekbones", "Male", "Mouth_Slightly_Open", "Mustache",
    "Narrow_Eyes", "No_Beard", "Oval_Face", "Pale_Skin", "Pointy_Nose", "Receding_Hairline", "Rosy_Cheeks",
    "Sideburns", "Smiling", "Straight_Hair", "Wavy_Hair", "Wearing_Earrings", "Wearing_Hat", "Wearing_Lipstick",
    "Wearing_Necklace", "Wearing_Necktie", "Young",
)
BALANCED_TEN = (
    "Attractive", "Heavy_Makeup", "High_Cheekbones", "Male", "Mouth_Slightly_Open", "Oval_Face", "Pointy_Nose",
    "Smiling", "Wavy_Hair", "Wearing_Lipstick",
)
N_IMAGES = 202_599
FOLDER, (ATTR_FILE, PARTITION_FILE, IMAGE_FOLDER) = CELEBA.folder, CELEBA.files


def read_attributes(path: Path) -> tuple[list[str], np.ndarray]:
    """``list_attr_celeba.txt``: a count line, the 40 names, then ``<image> <40 values of -1/1>`` per line.

    Returns the image names and a uint8 ``[N, 40]`` 0/1 array (-1 -> 0, as torchvision maps it).
    """
    lines = path.read_bytes().split(b"\n", 2)
    if len(lines) < 3 or tuple(lines[1].decode(errors="replace").split()) != ATTRIBUTES:
        raise UsageError(f"{path} is not CelebA's attribute list: line 2 must name the 40 attributes")
    frame = _read_table(path, lines[2], len(ATTRIBUTES) + 1)
    values = frame.iloc[:, 1:].to_numpy()
    bad = ~np.isin(values, (-1, 1)).all(axis=1)
    if bad.any():
        raise UsageError(f"{path} is malformed: line {int(np.argmax(bad)) + 3} has a value other than -1/1")
    return frame.iloc[:, 0].tolist(), (values == 1).astype(np.uint8)


def read_partition(path: Path) -> tuple[list[str], np.ndarray]:
    """``list_eval_partition.txt``: ``<image> <0 train | 1 validation | 2 test>`` per line."""
    frame = _read_table(path, path.read_bytes(), 2)
    partition = frame.iloc[:, 1].to_numpy()
    bad = ~np.isin(partition, (0, 1, 2))
    if bad.any():
        raise UsageError(f"{path} is malformed: line {int(np.argmax(bad)) + 1} has a partition other than 0/1/2")
    return frame.iloc[:, 0].tolist(), partition


def _read_table(path: Path, text: bytes, n_fields: int) -> pd.DataFrame:
    """Whitespace-separated rows of a name and integers; a malformed row is a one-line :class:`UsageError`."""
    try:
        frame = pd.read_csv(io.BytesIO(text), sep=r"\s+", header=None, dtype={0: str})
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as error:
        raise UsageError(f"{path} is malformed: {' '.join(str(error).split())}") from None
    numbers = frame.iloc[:, 1:].apply(pd.to_numeric, errors="coerce")
    if frame.shape[1] != n_fields or numbers.isna().any().any():
        raise UsageError(f"{path} is malformed: expected a name and {n_fields - 1} integers on each line")
    return pd.concat([frame.iloc[:, :1], numbers.astype(np.int64)], axis=1)


def decode_images(paths: list[Path], size: int) -> Tensor:
    """JPEG files -> uint8 ``[N, 3, size, size]`` (RGB, antialiased resize), decoded by a thread pool.

    torchvision's decode and resize release the GIL, so threads decode in parallel; this runs once per cache.
    """

    def load(path: Path) -> Tensor:
        try:
            image = decode_jpeg(read_file(str(path)), mode=ImageReadMode.RGB)
        except (RuntimeError, OSError) as error:
            raise UsageError(f"cannot decode {path} ({' '.join(str(error).split())[:120]})") from None
        return resize(image, [size, size], antialias=True)

    out = torch.empty(len(paths), 3, size, size, dtype=torch.uint8)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for i, image in enumerate(pool.map(load, paths, chunksize=256)):
            out[i] = image
    return out


@register_dataset("celeba")
class CelebADataModule(ImageDataModule):
    """CelebA with its official partition; one binary task per chosen attribute (module docstring).

    Architecture (S1.2): 6 experts, each ``4 x [Conv3x3 (4, 4, 4, 1 filters) -> ReLU -> MaxPool] -> flatten``, a
    ``Dense(1)`` tower (sigmoid in the loss) per task, k = 2, tasks equally weighted.

    Args:
        attributes: the attribute names that become tasks (default: the ten most balanced).
        image_size: side of the square the images are resized to (default 64).
        root, cache_dir, batch_size, eval_batch_size, seed, download: see :class:`InMemoryDataModule`.
    """

    task_weighting = "equal"

    def __init__(self, attributes: tuple[str, ...] = BALANCED_TEN, image_size: int = 64, **kwargs) -> None:
        super().__init__(**kwargs)
        attributes = tuple(attributes)
        unknown = [name for name in attributes if name not in ATTRIBUTES]
        if unknown or not attributes or len(set(attributes)) != len(attributes):
            raise UsageError(f"attributes must be distinct CelebA attribute names, got {unknown or list(attributes)} "
                             f"(valid: {', '.join(ATTRIBUTES)})")
        if image_size < 1:
            raise SettingError("image_size", image_size, "must be >= 1")
        self.attributes, self.image_size = attributes, image_size

    @property
    def info(self) -> DatasetInfo:
        return DatasetInfo(
            name="celeba", tasks=tuple(TaskSpec(name, "binary") for name in self.attributes), n_ids=N_IMAGES,
            image_shape=(3, self.image_size, self.image_size), n_experts=6, k=2, expert_dropout=0.0,
            task_weighting=self.task_weighting, conv_layers=((3, 4), (3, 4), (3, 4), (3, 1)), expert_layers=0,
            tower_layers=0,
        )

    def raw_files(self) -> list[Path]:
        folder, files, missing = self.root / FOLDER, CELEBA.paths(self.root), CELEBA.missing(self.root)
        if not missing:
            return files
        hint = (f"download {IMAGE_FOLDER}.zip, {ATTR_FILE} and {PARTITION_FILE} from CelebA's Google Drive "
                f"(linked from https://mmlab.ie.cuhk.edu.hk/projects/CelebA.html; scripted Drive downloads often "
                f"fail), put the two lists in {folder} and unzip the archive there so that "
                f"{folder / IMAGE_FOLDER / '000001.jpg'} exists")
        if not self.download:
            raise UsageError(f"missing {missing[0]}: {hint} (or pass --data.download true)")
        try:
            from torchvision.datasets import CelebA

            CelebA(str(self.root), split="all", download=True)
        except Exception as error:  # noqa: BLE001 - any failure of the Drive download gets the manual instructions
            reason = " ".join(str(error).split())[:200]
            raise UsageError(f"could not download CelebA ({reason}); {hint}") from None
        return files

    def cache_name(self) -> str:
        return f"celeba-{self.image_size}px"

    def prepare(self) -> Splits:
        folder = self.root / FOLDER
        names, attributes = read_attributes(folder / ATTR_FILE)
        partition_names, partition = read_partition(folder / PARTITION_FILE)
        if partition_names != names:
            raise UsageError(f"{folder / PARTITION_FILE} and {folder / ATTR_FILE} list different images")
        order = np.argsort(partition, kind="stable")  # train, validation, test; file order within each
        images = decode_images([folder / IMAGE_FOLDER / names[i] for i in order], self.image_size)
        sizes = np.bincount(partition, minlength=3).tolist()
        parts = zip(images.split(sizes), torch.from_numpy(attributes[order]).split(sizes))
        splits = with_sample_ids({
            split: {"image": image, "attributes": attribute} for split, (image, attribute) in zip(SPLITS, parts)
        })
        check_n_ids(splits, N_IMAGES, str(folder))
        return splits

    def load_splits(self) -> Splits:
        """The cached images and all 40 attributes, with one float target per chosen attribute."""
        columns = [ATTRIBUTES.index(name) for name in self.attributes]
        splits = {}
        for split, tensors in super().load_splits().items():
            targets = tensors["attributes"][:, columns].float()
            splits[split] = {"image": tensors["image"], "sample_id": tensors["sample_id"],
                             **{name: targets[:, j].contiguous() for j, name in enumerate(self.attributes)}}
        return splits
