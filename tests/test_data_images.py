"""Image datasets (comet-protocol.md §5.2): the MultiMNIST generator, Digits, CelebA, caching and missing files.

Tiny fixtures in the official formats (``image_fixtures.py``); real MNIST and Fashion-MNIST from ../shared/data.
"""
from __future__ import annotations

import importlib
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import jsonargparse
import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from conftest import REAL_DATA, run_cli
from image_fixtures import write_celeba, write_mnist, write_svhn
from mtmoe.data import DATASETS
from mtmoe.data.celeba import ATTRIBUTES, BALANCED_TEN, CelebADataModule
from mtmoe.data.digits import DigitsDataModule, read_svhn
from mtmoe.data.images import stratified_split
from mtmoe.data.multimnist import MultiFashionMNISTDataModule, MultiMNISTDataModule, composites
from mtmoe.errors import UsageError
from mtmoe.experts import ImageBottom
from mtmoe.gates import gate_class
from mtmoe.lit.module import MultiTaskMoE
from mtmoe.pack.settings import ModelSettings

IMAGE_DATASETS = ("multimnist", "multifashionmnist", "celeba", "digits")


def data_module(cls, root: Path, tmp_path: Path, **kwargs):
    return cls(root=str(root), cache_dir=str(tmp_path / "cache"), **{"download": False, **kwargs})


# ------------------------------------------------------------------------------------------------ official split


@pytest.mark.parametrize(
    "labels, n_train, seed, train, test",
    [  # scikit-learn 1.9.1: train_test_split(arange(n), train_size=n_train, stratify=labels, random_state=seed)
        ([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2], 8, 0, [1, 9, 6, 8, 2, 3, 5, 7], [0, 10, 11, 4]),
        ([2, 0, 1, 0, 2, 1, 1, 0, 2], 4, 3, [1, 8, 6, 5], [7, 4, 2, 0, 3]),  # tied remainders: random tie-break
        ([5, 5, 7, 7, 7, 9, 9, 9, 9, 9, 5, 7], 7, 11, [11, 4, 7, 10, 0, 8, 5], [6, 2, 1, 3, 9]),
    ],
)
def test_stratified_split_matches_scikit_learn(labels, n_train, seed, train, test) -> None:
    got_train, got_test = stratified_split(np.array(labels), n_train, seed)
    assert got_train.tolist() == train and got_test.tolist() == test


# -------------------------------------------------------------------------------------------- MultiMNIST generator


def generator_reference(images: np.ndarray, labels: np.ndarray, rng: np.random.RandomState):
    """The generator as comet-protocol.md §5.2 states it, one composite at a time on a float 36x36 canvas."""
    canvases, pairs = [], []
    for i in range(len(images)):
        others = [j for j in range(len(images)) if j != i]
        for draw in rng.randint(0, len(others) - 1, size=2):
            canvas = np.zeros((36, 36))
            canvas[:28, :28] += images[i]
            canvas[8:, 8:] += images[others[draw]]
            canvases.append(canvas)
            pairs.append((labels[i], labels[others[draw]]))
    return np.stack(canvases), np.array(pairs)


def test_composites_follow_the_generator() -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(9, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=9)
    got = composites(torch.from_numpy(images), torch.from_numpy(labels), np.random.RandomState(5))
    canvases, pairs = generator_reference(images, labels, np.random.RandomState(5))
    assert got["image"].dtype == torch.uint8 and got["image"].shape == (18, 2, 28, 28)
    model_input = ImageBottom(overlay_shift=8)(got)
    assert model_input.shape == (18, 1, 36, 36)
    torch.testing.assert_close(model_input[:, 0], torch.from_numpy(canvases / 255).float(), rtol=0, atol=1e-7)
    np.testing.assert_array_equal(np.stack([got["top_left"], got["bottom_right"]], 1), pairs)


def test_overlap_adds_up_to_two_without_clipping() -> None:
    full = torch.full((1, 2, 28, 28), 255, dtype=torch.uint8)
    canvas = ImageBottom(overlay_shift=8)({"image": full})[0, 0]
    assert canvas[8:28, 8:28].eq(2.0).all() and canvas[:8, :28].eq(1.0).all() and canvas[28:, 8:].eq(1.0).all()
    assert canvas[:8, 28:].eq(0.0).all() and canvas[28:, :8].eq(0.0).all()


@pytest.fixture
def mnist_root(tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "data"
    return root, write_mnist(root)


def test_multimnist_splits_layers_and_ids(mnist_root, tmp_path: Path) -> None:
    root, written = mnist_root
    splits = data_module(MultiMNISTDataModule, root, tmp_path).load_splits()
    assert {s: len(t["image"]) for s, t in splits.items()} == {"train": 100, "val": 20, "test": 24}  # 2 per source
    ids = torch.cat([splits[s]["sample_id"] for s in ("train", "val", "test")])
    assert torch.equal(ids, torch.arange(144))
    val_labels = splits["val"]["top_left"]
    assert torch.equal(torch.bincount(val_labels, minlength=10), torch.full((10,), 2))  # stratified: 1 source per class
    train_sources = {bytes(image) for image in written["train_images"]}
    test_sources = [bytes(image) for image in written["t10k_images"]]
    for split, tensors in splits.items():
        image = tensors["image"]
        assert image.dtype == torch.uint8 and tensors["top_left"].dtype == torch.long
        assert torch.equal(image[0::2, 0], image[1::2, 0])  # each source image tops two composites
        assert not (image[:, 0] == image[:, 1]).flatten(1).all(1).any()  # partner is another image
        layers = [bytes(x) for x in image[:, 1].numpy()]
        if split == "test":
            assert all(layer in test_sources for layer in layers)
            assert [test_sources.index(bytes(x)) for x in image[0::2, 0].numpy()] == list(range(12))
        else:
            assert all(layer in train_sources for layer in layers)
    again = data_module(MultiMNISTDataModule, root, tmp_path / "other", generator_seed=0).load_splits()
    other = data_module(MultiMNISTDataModule, root, tmp_path / "third", generator_seed=1).load_splits()
    assert all(torch.equal(splits[s][k], again[s][k]) for s in splits for k in splits[s])
    assert not torch.equal(splits["train"]["image"], other["train"]["image"])


def test_cache_is_reused_and_keyed_on_the_raw_files(mnist_root, tmp_path: Path, monkeypatch) -> None:
    root, _ = mnist_root
    first = data_module(MultiMNISTDataModule, root, tmp_path).load_splits()
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("multimnist-seed0-") and cached[0].name.endswith("-v1.pt")

    def no_preparing(self):
        raise AssertionError("prepared again")

    monkeypatch.setattr(MultiMNISTDataModule, "prepare", no_preparing)
    second = data_module(MultiMNISTDataModule, root, tmp_path).load_splits()
    assert torch.equal(first["val"]["image"], second["val"]["image"])
    monkeypatch.undo()
    write_mnist(root, seed=3)  # new raw files: a new cache entry
    data_module(MultiMNISTDataModule, root, tmp_path).load_splits()
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_only_gz_files_are_gunzipped_without_network(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "data"
    written = write_mnist(root, name="FashionMNIST", gz=True)

    def offline(*args, **kwargs):
        raise AssertionError("network access")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    splits = data_module(MultiFashionMNISTDataModule, root, tmp_path, download=True).load_splits()
    assert (root / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte").is_file()
    assert torch.equal(splits["test"]["image"][0::2, 0], torch.from_numpy(written["t10k_images"]))
    assert not [p for p in (root / "FashionMNIST" / "raw").iterdir() if p.name.startswith(".")]


def test_missing_mnist_names_the_files(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as error:
        data_module(MultiMNISTDataModule, tmp_path / "empty", tmp_path).load_splits()
    message = str(error.value)
    raw = tmp_path / "empty" / "MNIST" / "raw"
    assert f"missing {raw / 'train-images-idx3-ubyte'}" in message and "t10k-labels-idx1-ubyte" in message
    assert "--data.download true" in message and "\n" not in message


def test_offline_download_is_one_line(tmp_path: Path, monkeypatch) -> None:
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(UsageError) as error:
        data_module(MultiMNISTDataModule, tmp_path / "root", tmp_path, download=True).load_splits()
    assert "could not get" in str(error.value) and "\n" not in str(error.value)


def test_cli_missing_data_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    for name, expected in (("multimnist", "MNIST"), ("digits", "MNIST"), ("celeba", "Google Drive")):
        code = run_cli(["fit", "--gate", "topk", "--data", name, f"--data.root={tmp_path / 'empty'}",
                        f"--data.cache_dir={tmp_path / 'cache'}", "--data.download=false"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: missing ") and expected in err[0]
    assert not (tmp_path / "cache").exists() and not Path("runs").exists()


# ------------------------------------------------------------------------------------------------------- Digits


def test_digits_splits_and_formats(tmp_path: Path) -> None:
    root = tmp_path / "data"
    mnist = write_mnist(root)
    svhn = write_svhn(root)  # 30 + 20 + 40 = 90 SVHN images: 11 each for val and test (75,000 / 630,420)
    splits = data_module(DigitsDataModule, root, tmp_path).load_splits()
    assert {s: len(t["digit"]) for s, t in splits.items()} == {"train": 50 + 68, "val": 10 + 11, "test": 12 + 11}
    assert torch.equal(torch.cat([t["sample_id"] for t in splits.values()]), torch.arange(162))
    test = splits["test"]
    assert test["image"].shape[1:] == (3, 32, 32) and test["image"].dtype == torch.uint8
    mnist_test = test["image"][:12]  # MNIST rows first: padded by 2, the same digit on three channels
    assert torch.equal(mnist_test[:, 0, 2:30, 2:30], torch.from_numpy(mnist["t10k_images"]))
    assert mnist_test[:, :, :2].eq(0).all() and mnist_test[:, :, :, 30:].eq(0).all()
    assert torch.equal(mnist_test[:, 0], mnist_test[:, 2])
    assert torch.equal(test["digit"][:12], torch.from_numpy(mnist["t10k_labels"]).long())
    pool = {bytes(image): digit for images, digits in svhn.values() for image, digit in zip(images, digits)}
    svhn_rows = []
    for split, n_mnist in (("train", 50), ("val", 10), ("test", 12)):  # SVHN rows follow the MNIST rows
        tensors = splits[split]
        svhn_rows += zip(map(bytes, tensors["image"][n_mnist:].numpy()), tensors["digit"][n_mnist:].tolist())
    assert len(svhn_rows) == 90 and {row for row, _ in svhn_rows} == set(pool)  # every SVHN image once
    assert all(pool[row] == digit for row, digit in svhn_rows)  # label 10 read as digit 0


def test_digits_without_extra(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_mnist(root)
    write_svhn(root, sizes={"train": 30, "test": 20})
    data = data_module(DigitsDataModule, root, tmp_path, svhn_extra=False)
    assert data.info.n_ids == 70_000 + 73_257 + 26_032
    sizes = {s: len(t["digit"]) for s, t in data.load_splits().items()}
    assert sizes == {"train": 50 + 38, "val": 10 + 6, "test": 12 + 6}


def test_digits_missing_svhn_names_url(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_mnist(root)
    write_svhn(root, sizes={"train": 30, "test": 20})
    with pytest.raises(UsageError) as error:
        data_module(DigitsDataModule, root, tmp_path).load_splits()
    message = str(error.value)
    assert str(root / "SVHN" / "extra_32x32.mat") in message and "http://ufldl.stanford.edu/housenumbers/" in message


def test_read_svhn_rejects_other_files(tmp_path: Path) -> None:
    import scipy.io

    path = tmp_path / "bad.mat"
    scipy.io.savemat(str(path), {"X": np.zeros((28, 28, 3, 2), np.uint8), "y": np.ones((2, 1))})
    with pytest.raises(UsageError, match="not an SVHN file"):
        read_svhn(path)
    scipy.io.savemat(str(path), {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.array([[1], [11]])})
    with pytest.raises(UsageError, match="1..10"):
        read_svhn(path)
    path.write_text("not a mat file")
    with pytest.raises(UsageError, match="not a MATLAB file"):
        read_svhn(path)


# ------------------------------------------------------------------------------------------------------- CelebA


def test_celeba_official_partition_and_targets(tmp_path: Path) -> None:
    root = tmp_path / "data"
    partition = (0, 1, 0, 2, 0, 0, 1, 2) + (0,) * 6
    attributes = write_celeba(root, partition=partition)
    data = data_module(CelebADataModule, root, tmp_path)
    splits = data.load_splits()
    order = np.argsort(partition, kind="stable")
    assert {s: len(t["image"]) for s, t in splits.items()} == {"train": 10, "val": 2, "test": 2}
    rows = torch.cat([splits[s]["image"] for s in ("train", "val", "test")])
    assert rows.shape == (14, 3, 64, 64) and rows.dtype == torch.uint8
    for name in BALANCED_TEN:
        got = torch.cat([splits[s][name] for s in ("train", "val", "test")])
        expected = attributes[order, ATTRIBUTES.index(name)]
        assert got.dtype == torch.float32 and got.tolist() == expected.tolist()
    from torchvision.io import ImageReadMode, decode_jpeg, read_file
    from torchvision.transforms.v2.functional import resize

    first_val = f"{order[10] + 1:06d}.jpg"
    decoded = decode_jpeg(read_file(str(root / "celeba" / "img_align_celeba" / first_val)), mode=ImageReadMode.RGB)
    assert torch.equal(splits["val"]["image"][0], resize(decoded, [64, 64], antialias=True))
    assert [t.name for t in data.info.tasks] == list(BALANCED_TEN)


def test_celeba_attribute_choice_and_size(tmp_path: Path) -> None:
    root = tmp_path / "data"
    attributes = write_celeba(root, partition=(0, 0, 1, 2))
    data = data_module(CelebADataModule, root, tmp_path, attributes=("Young", "Male"), image_size=48)
    splits = data.load_splits()
    assert set(splits["train"]) == {"image", "sample_id", "Young", "Male"}
    assert splits["train"]["Young"].tolist() == attributes[:2, ATTRIBUTES.index("Young")].tolist()
    assert splits["test"]["image"].shape == (1, 3, 48, 48)
    assert data.info.image_shape == (3, 48, 48) and [t.kind for t in data.info.tasks] == ["binary", "binary"]
    again = data_module(CelebADataModule, root, tmp_path, attributes=("Smiling",), image_size=48)
    assert torch.equal(again.load_splits()["train"]["image"], splits["train"]["image"])  # one cache per size
    assert len(list((tmp_path / "cache").iterdir())) == 1
    with pytest.raises(UsageError, match="distinct CelebA attribute names.*Smiles"):
        CelebADataModule(attributes=("Smiles",))
    with pytest.raises(UsageError, match="distinct"):
        CelebADataModule(attributes=("Male", "Male"))


def test_celeba_missing_and_malformed(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as error:
        data_module(CelebADataModule, tmp_path / "empty", tmp_path).load_splits()
    message = str(error.value)
    first_image = tmp_path / "empty" / "celeba" / "img_align_celeba" / "000001.jpg"
    assert "Google Drive" in message and str(first_image) in message
    assert "\n" not in message
    root = tmp_path / "data"
    write_celeba(root, partition=(0, 1, 2))
    attr = root / "celeba" / "list_attr_celeba.txt"
    lines = attr.read_text().splitlines()
    attr.write_text("\n".join(lines[:3] + [lines[3].replace("-1", "0", 1)] + lines[4:]) + "\n")
    with pytest.raises(UsageError, match="line 4 has a value other than -1/1"):
        data_module(CelebADataModule, root, tmp_path).load_splits()
    attr.write_text("\n".join(lines[:2] + [lines[2] + " 1"] + lines[3:]) + "\n")
    with pytest.raises(UsageError, match="malformed"):
        data_module(CelebADataModule, root, tmp_path).load_splits()


# ------------------------------------------------------------------------------------------ registry and info


def test_registry_signatures_and_static_info(tmp_path: Path) -> None:
    expected = {  # name: (n_experts, k, image_shape, tasks, n_ids)
        "multimnist": (16, 4, (1, 36, 36), 2, 140_000),
        "multifashionmnist": (5, 2, (1, 36, 36), 2, 140_000),
        "celeba": (6, 2, (3, 64, 64), 10, 202_599),
        "digits": (8, 2, (3, 32, 32), 1, 700_420),
    }
    for name in IMAGE_DATASETS:
        module_name, class_name = DATASETS[name].rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), class_name)
        parser = jsonargparse.ArgumentParser()
        parser.add_class_arguments(cls, "data")
        keys = {action.dest for action in parser._actions}
        assert "data.variant" not in keys and {"data.root", "data.batch_size", "data.download"} <= keys
        info = cls(root=str(tmp_path / "absent"), download=False).info  # nothing is read
        assert info.name == name and info.task_weighting == "equal" and info.image_shape is not None
        assert (info.n_experts, info.k, info.image_shape, len(info.tasks), info.n_ids) == expected[name]
    assert not (tmp_path / "absent").exists()


def test_unknown_dataset_lists_every_dataset(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert run_cli(["fit", "--gate", "topk", "--data", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown dataset 'nope'; valid datasets: ") and "\n" not in err
    assert all(name in err for name in DATASETS)


# ---------------------------------------------------------------------------------------------------- real data


@pytest.mark.slow
@pytest.mark.parametrize(
    "cls, folder, train_head, val_head, val_counts",
    [  # the split indices are scikit-learn 1.9.1's train_test_split(train_size=5/6, stratify=y, random_state=0)
        (MultiMNISTDataModule, "MNIST", [4769, 34012, 8646, 11459, 17444], [46884, 41969, 3903, 56935, 47474],
         [987, 1124, 993, 1022, 974, 903, 986, 1044, 975, 992]),
        (MultiFashionMNISTDataModule, "FashionMNIST", [14672, 40351, 31903, 35695, 44194],
         [8312, 11528, 36855, 28640, 19463], [1000] * 10),
    ],
)
def test_real_multimnist(cls, folder, train_head, val_head, val_counts, tmp_path: Path) -> None:
    if not (REAL_DATA / folder / "raw" / "train-images-idx3-ubyte").is_file():
        pytest.skip(f"../shared/data/{folder} is not beside the project")
    data = data_module(cls, REAL_DATA, tmp_path, batch_size=512)
    splits = data.load_splits()
    assert {s: len(t["image"]) for s, t in splits.items()} == {"train": 100_000, "val": 20_000, "test": 20_000}
    assert torch.bincount(splits["val"]["top_left"]).tolist() == [2 * c for c in val_counts]
    from torchvision.datasets import MNIST, FashionMNIST

    source = (MNIST if folder == "MNIST" else FashionMNIST)(str(REAL_DATA), train=True)
    for split, head in (("train", train_head), ("val", val_head)):
        assert torch.equal(splits[split]["image"][0:10:2, 0], source.data[head])
        assert torch.equal(splits[split]["top_left"][0:10:2], source.targets[head])
    batch = next(iter(data.train_dataloader()))
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (512, 2, 28, 28)
    model_input = ImageBottom(overlay_shift=8)(batch)
    assert model_input.shape == (512, 1, 36, 36) and 1.0 < float(model_input.max()) <= 2.0
    # 15 steps of 128 (4 experts, to stay fast) already beat chance (10%, cross-entropy ln 10 = 2.303)
    data.batch_size, data.eval_batch_size = 128, 1024
    pl.seed_everything(0, verbose=False)
    model = MultiTaskMoE.build(data.info, ModelSettings(gate=partial(gate_class("comet")), lr=1e-3, n_experts=4))
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=15, limit_val_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    val = model.last_results["val"]
    assert val["loss"] < 2.25 and val["top_left/accuracy"] > 0.15 and val["bottom_right/accuracy"] > 0.15
