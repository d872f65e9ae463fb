"""MovieLens loading, negative sampling, split and cache (comet-protocol.md §5.1); raw-file fetching."""
from __future__ import annotations

import hashlib
import importlib
import json
import math
import shutil
from pathlib import Path

import jsonargparse
import numpy as np
import pytest
import torch

from mtmoe.data import DATASETS, IndexBatches, MovieLens1MDataModule, MovieLens100KDataModule
from mtmoe.data import download, movielens
from mtmoe.data.movielens import Ratings, prepare_movielens, read_ratings, stratified_split
from mtmoe.errors import UsageError

REAL_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
N_USERS, N_ITEMS = 30, 40


def make_ratings(seed: int = 0) -> np.ndarray:
    """Rows ``(user, movie, rating, timestamp)`` with original 1-based ids, in random order.

    Movies 37..40 are never rated; user 1 rates 30 of the 36 rated movies (more than half), so it gets fewer
    negatives than positives.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for user in range(1, N_USERS + 1):
        count = 30 if user == 1 else int(rng.integers(1, 15))
        movies = rng.choice(np.arange(1, 37), size=count, replace=False)
        rows += [(user, movie, rng.integers(1, 6), rng.integers(900_000_000, 1_000_000_000)) for movie in movies]
    table = np.array(rows, dtype=np.int64)
    return table[rng.permutation(len(table))]


def write_ml1m(root: Path, table: np.ndarray) -> Path:
    path = root / "ml-1m" / "ratings.dat"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("::".join(map(str, row)) + "\n" for row in table))
    return path


def write_ml100k(root: Path, table: np.ndarray) -> Path:
    path = root / "ml-100k" / "u.data"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(map(str, row)) + "\n" for row in table))
    return path


@pytest.fixture
def table() -> np.ndarray:
    return make_ratings()


@pytest.fixture
def module(tmp_path: Path, table: np.ndarray) -> MovieLens1MDataModule:
    write_ml1m(tmp_path / "data", table)
    return MovieLens1MDataModule(root=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"), download=False)


def concat(splits: dict[str, dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    return {key: torch.cat([splits[s][key] for s in ("train", "val", "test")]).numpy() for key in splits["train"]}


def test_read_ratings_both_formats_zero_based(tmp_path: Path, table: np.ndarray) -> None:
    one_m = read_ratings(write_ml1m(tmp_path, table))
    hundred_k = read_ratings(write_ml100k(tmp_path, table))
    for got in (one_m, hundred_k):
        np.testing.assert_array_equal(got.user, table[:, 0] - 1)
        np.testing.assert_array_equal(got.item, table[:, 1] - 1)
        np.testing.assert_array_equal(got.rating, table[:, 2])
        assert got.user.dtype == got.item.dtype == np.int64


def test_negative_sampling_invariants(module: MovieLens1MDataModule, table: np.ndarray) -> None:
    rows = concat(module.load_splits())
    positive = rows["watch"] == 1
    assert positive.sum() == len(table)
    assert sorted(zip(rows["user"][positive], rows["item"][positive], rows["rating"][positive])) == sorted(
        zip(table[:, 0] - 1, table[:, 1] - 1, table[:, 2].astype(np.float32))
    )
    catalogue = np.unique(table[:, 1] - 1)
    negative_keys = rows["user"][~positive] * N_ITEMS + rows["item"][~positive]
    positive_keys = (table[:, 0] - 1) * N_ITEMS + table[:, 1] - 1
    assert not np.isin(negative_keys, positive_keys).any()
    assert len(np.unique(negative_keys)) == len(negative_keys)
    assert np.isin(rows["item"][~positive], catalogue).all()
    n_positive = np.bincount(table[:, 0] - 1, minlength=N_USERS)
    n_negative = np.bincount(rows["user"][~positive], minlength=N_USERS)
    np.testing.assert_array_equal(n_negative, np.minimum(n_positive, len(catalogue) - n_positive))
    assert (n_negative <= n_positive).all() and n_negative[0] == len(catalogue) - 30 < n_positive[0]
    assert rows["user"].min() == 0 and rows["user"].max() == N_USERS - 1
    assert rows["item"].max() < N_ITEMS
    np.testing.assert_array_equal(rows["sample_id"], rows["user"])


def test_seeded_determinism(table: np.ndarray) -> None:
    ratings = Ratings(table[:, 0] - 1, table[:, 1] - 1, table[:, 2])
    first, again, other = (prepare_movielens(ratings, N_USERS, N_ITEMS, seed) for seed in (0, 0, 1))
    for split in first:
        for key in first[split]:
            assert torch.equal(first[split][key], again[split][key])
    assert not all(torch.equal(first[s]["item"], other[s]["item"]) for s in first)


def test_split_sizes_stratification_and_masks(module: MovieLens1MDataModule) -> None:
    splits = module.load_splits()
    total = sum(len(s["user"]) for s in splits.values())
    overall = concat(splits)["watch"].mean()
    assert abs(len(splits["test"]["user"]) - 0.1 * total) <= 1
    assert abs(len(splits["val"]["user"]) - 0.125 * (total - len(splits["test"]["user"]))) <= 1
    for tensors in splits.values():
        n = len(tensors["user"])
        assert abs(tensors["watch"].mean().item() - overall) <= 1 / n
        assert tensors["user"].dtype == tensors["item"].dtype == tensors["sample_id"].dtype == torch.long
        assert tensors["watch"].dtype == tensors["rating"].dtype == torch.float32
        mask = tensors["rating_mask"]
        assert mask.dtype == torch.bool and torch.equal(mask, tensors["watch"] == 1)
        assert ((tensors["rating"][mask] >= 1) & (tensors["rating"][mask] <= 5)).all()
        assert (tensors["rating"][mask] == tensors["rating"][mask].round()).all()
        assert (tensors["rating"][~mask] == 0).all()


def test_stratified_split_reproduces_official_ml1m_counts() -> None:
    """Official ML-1M counts (§5.1): test 100,021/99,929, val 112,524/112,420, train 787,664/786,938."""
    rng = np.random.default_rng(0)
    watch = rng.permutation(np.r_[np.ones(1_000_209), np.zeros(999_287)])
    rest, test = stratified_split(watch, 0.1, rng)
    train, val = (rest[part] for part in stratified_split(watch[rest], 0.125, rng))
    counts = {name: (int(watch[i].sum()), int((watch[i] == 0).sum())) for name, i in
              (("train", train), ("val", val), ("test", test))}
    assert counts == {"train": (787_664, 786_938), "val": (112_524, 112_420), "test": (100_021, 99_929)}
    assert len(np.unique(np.r_[train, val, test])) == len(watch)


def test_info_is_static(tmp_path: Path) -> None:
    one_m = MovieLens1MDataModule(root=str(tmp_path / "absent"), download=False).info
    hundred_k = MovieLens100KDataModule(root=str(tmp_path / "absent"), download=False).info
    sizes = [(info.name, info.n_users, info.n_items, info.n_ids) for info in (one_m, hundred_k)]
    assert sizes == [("movielens", 6040, 3952, 6040), ("movielens-100k", 943, 1682, 943)]
    tasks = [(t.name, t.kind, t.masked) for t in one_m.tasks]
    assert tasks == [("watch", "binary", False), ("rating", "regression", True)]
    architecture = (one_m.n_experts, one_m.k, one_m.embedding_dim, one_m.expert_units, one_m.tower_units)
    assert architecture == (16, 2, 128, 256, 256)
    assert (one_m.expert_dropout, one_m.task_weighting) == (0.5, "alpha")


def test_registry_and_cli_signatures() -> None:
    for name in ("movielens", "movielens-100k"):  # the image datasets: tests/test_data_images.py
        module_name, class_name = DATASETS[name].rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), class_name)
        parser = jsonargparse.ArgumentParser()  # what the CLI sees: **kwargs resolved through super().__init__
        parser.add_class_arguments(cls, "data")
        keys = {action.dest for action in parser._actions}
        assert "data.variant" not in keys and {"data.negative_seed", "data.root", "data.batch_size"} <= keys
        assert cls(download=False).info.name == name


def test_cache_written_reused_and_atomic(
    module: MovieLens1MDataModule, tmp_path: Path, table: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = module.load_splits()
    cached = list((tmp_path / "cache").glob("*.pt"))
    assert len(cached) == 1 and cached[0].name.startswith("movielens-1m-") and cached[0].name.endswith("-seed0-v1.pt")

    def no_reading(path: Path) -> Ratings:
        raise AssertionError("the raw file was parsed again")

    monkeypatch.setattr(movielens, "read_ratings", no_reading)
    second = MovieLens1MDataModule(root=module.root, cache_dir=module.cache_dir, download=False).load_splits()
    for split in first:
        for key in first[split]:
            assert torch.equal(first[split][key], second[split][key])
    monkeypatch.undo()
    write_ml1m(tmp_path / "data", table[:-1])  # changed raw file: new cache entry
    MovieLens1MDataModule(root=module.root, cache_dir=module.cache_dir, download=False).load_splits()
    names = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(names) == 3 and "raw-sha256.json" in names and not any(".tmp" in name for name in names)


def test_missing_file_without_download(tmp_path: Path) -> None:
    data = MovieLens1MDataModule(root=str(tmp_path), cache_dir=str(tmp_path / "cache"), download=False)
    with pytest.raises(UsageError) as error:
        data.load_splits()
    message = str(error.value)
    assert str(tmp_path / "ml-1m" / "ratings.dat") in message and "ml-1m.zip" in message and "\n" not in message


@pytest.mark.parametrize(
    "bad_line, problem",
    [("3::x::4::978300760", "line 3"), ("3::7::4", "line 3"), ("3::7::6::978300760", "line 3"),
     ("0::7::4::978300760", "line 3"), ("3::7::4::978300760::1", "line 3")],
)
def test_malformed_line(tmp_path: Path, bad_line: str, problem: str) -> None:
    path = tmp_path / "ml-1m" / "ratings.dat"
    path.parent.mkdir()
    path.write_text(f"1::1::5::978300760\n2::3::4::978300761\n{bad_line}\n4::4::1::978300762\n")
    with pytest.raises(UsageError) as error:
        read_ratings(path)
    assert str(path) in str(error.value) and problem in str(error.value) and "\n" not in str(error.value)


def test_ids_beyond_the_catalogue(tmp_path: Path) -> None:
    write_ml100k(tmp_path, np.array([[1, 1, 5, 0], [944, 2, 3, 0]]))
    with pytest.raises(UsageError, match="user id 944 exceeds"):
        MovieLens100KDataModule(root=str(tmp_path), cache_dir=str(tmp_path / "cache"), download=False).load_splits()


def test_train_batches_cover_every_row_once_per_epoch(module: MovieLens1MDataModule) -> None:
    module.batch_size = 16
    batches = module.train_dataloader()
    assert isinstance(batches, IndexBatches)
    train = module.splits["train"]
    expected = sorted((train["user"] * N_ITEMS + train["item"]).tolist())
    orders = []
    for _ in range(2):
        keys = [(b["user"] * N_ITEMS + b["item"]).tolist() for b in batches]
        orders.append(sum(keys, []))
        assert sorted(orders[-1]) == expected
    assert orders[0] != orders[1]


# --- raw-file fetching (mtmoe.data.download) ---------------------------------------------------------------------


@pytest.fixture
def toy_archive(tmp_path: Path, table: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A zip in the ML-100K layout, served from a file:// URL through a temporary manifest."""
    source = tmp_path / "source"
    u_data = write_ml100k(source, table)
    archive = Path(shutil.make_archive(str(tmp_path / "toy"), "zip", source))
    entry = {"url": archive.as_uri(), "md5": hashlib.md5(archive.read_bytes()).hexdigest(),
             "files": {"ml-100k/u.data": {"size": u_data.stat().st_size}}}
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"toy": entry}))
    monkeypatch.setattr(download, "MANIFEST", manifest)
    return entry


def test_download_verifies_and_extracts(tmp_path: Path, toy_archive: dict) -> None:
    root = tmp_path / "root"
    path = download.ensure_files(root, "toy", download=True)
    assert path == root / "ml-100k" / "u.data"
    assert path.read_bytes() == (tmp_path / "source" / "ml-100k" / "u.data").read_bytes()
    assert sorted(p.name for p in root.iterdir()) == ["ml-100k"]  # no temporary leftovers


def test_present_files_need_no_network(tmp_path: Path, toy_archive: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    write_ml100k(tmp_path / "root", make_ratings())

    def offline(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access")

    monkeypatch.setattr(download.urllib.request, "urlopen", offline)
    assert download.ensure_files(tmp_path / "root", "toy", download=True).is_file()


def test_checksum_mismatch_deletes_download(tmp_path: Path, toy_archive: dict) -> None:
    toy_archive["md5"] = "0" * 32
    download.MANIFEST.write_text(json.dumps({"toy": toy_archive}))
    root = tmp_path / "root"
    with pytest.raises(UsageError, match="corrupt download"):
        download.ensure_files(root, "toy", download=True)
    assert list(root.iterdir()) == []


def test_offline_and_unwritable_root(tmp_path: Path, toy_archive: dict) -> None:
    toy_archive["url"] = (tmp_path / "nowhere.zip").as_uri()
    download.MANIFEST.write_text(json.dumps({"toy": toy_archive}))
    with pytest.raises(UsageError, match="offline") as error:
        download.ensure_files(tmp_path / "root", "toy", download=True)
    assert "unzip it into" in str(error.value)
    assert list((tmp_path / "root").iterdir()) == []
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UsageError, match="cannot write to data root"):
        download.ensure_files(tmp_path / "a_file" / "root", "toy", download=True)


# --- real data --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not (REAL_DATA / "ml-100k" / "u.data").is_file(), reason="shared ml-100k not present")
def test_real_movielens_100k(tmp_path: Path) -> None:
    data = MovieLens100KDataModule(root=str(REAL_DATA), cache_dir=str(tmp_path), download=False, verify=True)
    rows = concat(data.load_splits())
    positive = rows["watch"] == 1
    assert positive.sum() == 100_000 and len(np.unique(rows["user"])) == 943
    n_negative = int((~positive).sum())
    assert 99_000 <= n_negative <= 100_000 and abs(positive.mean() - 0.5) < 0.005
    total = 100_000 + n_negative
    sizes = [len(s["user"]) for s in data.load_splits().values()]
    assert sum(sizes) == len(rows["user"]) == total
    assert sizes[2] == math.ceil(0.1 * total) and sizes[1] == math.ceil(0.125 * (total - sizes[2]))
    raw = np.loadtxt(REAL_DATA / "ml-100k" / "u.data", dtype=np.int64)
    expected = dict(zip((raw[:, 0] - 1) * 1682 + raw[:, 1] - 1, raw[:, 2]))
    keys = rows["user"][positive] * 1682 + rows["item"][positive]
    assert len(expected) == 100_000
    np.testing.assert_array_equal(rows["rating"][positive], [expected[key] for key in keys.tolist()])


@pytest.mark.parametrize("threads", [1, 3])
def test_a_packs_epoch_orders_are_its_trials_orders_on_any_number_of_threads(threads: int) -> None:
    """``epoch_orders`` (a pack's training orders, drawn in place over torch's threads): row p is the order its
    trial's seed and epoch give alone (``shuffled_order``, as ``fit`` draws it), an empty slot's the rows in order."""
    from mtmoe.data.base import epoch_orders, shuffled_order

    draws = [(7, 0), None, (7, 1), (123, 5), (0, 0)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        orders = epoch_orders(1000, draws)
    finally:
        torch.set_num_threads(before)
    assert orders.dtype == torch.int64 and orders.shape == (5, 1000)
    for row, draw in zip(orders, draws):
        assert torch.equal(row, torch.arange(1000) if draw is None else shuffled_order(1000, *draw))
    assert not torch.equal(orders[0], orders[2])  # another epoch, another order
