"""Books (Book-Crossing): reading, the > 5 filter, labels, the 70/15/15 split, cache, errors (comet-protocol.md
§5.1); the real file's counts (slow, ../shared/data)."""
from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mtmoe.data import BooksDataModule, books, download
from mtmoe.data.books import read_book_ratings
from mtmoe.errors import UsageError

from conftest import REAL_DATA, run_cli
from recsys_fixtures import random_book_ratings, write_book_crossing

REAL_BOOKS = REAL_DATA / "book-crossing" / "BX-CSV-Dump.zip"


def filter_case() -> tuple[list[tuple[int, str, int]], set[tuple[int, str, int]]]:
    """Rows exercising every rule of the filter, and the (user, ISBN, rating) records it must keep.

    Users 11-17 rate B1..B6 (user 11 only implicitly: zeros count), users 11-15 also B7, user 18 rates B1..B5 and
    B7 (6 ratings: kept; B7 then has exactly 6: kept). User 19 has 5 ratings (dropped), one of them of B8, which
    has 6 ratings but only 5 from kept users (16, 17, 20-22): dropped, so the user rule comes first. Users 20-22
    rate B8 and five books nobody else rates: kept by the user rule, they lose every record to the book rule.
    User 23 rates B1, B2 and four lonely books: one pass only, so it stays with 2 records.
    """
    rows = [(user, f"B{b}", 0 if user == 11 else (user + b) % 10 + 1) for user in range(11, 18) for b in range(1, 7)]
    rows += [(user, "B7", user - 10) for user in range(11, 16)]
    rows += [(18, f"B{b}", b) for b in (1, 2, 3, 4, 5, 7)]
    rows += [(19, f"B{b}", 3) for b in range(1, 5)]
    rows += [(user, "B8", 9) for user in (16, 17, 19, 20, 21, 22)]
    rows += [(user, f"L{user}-{i}", 4) for user in (20, 21, 22) for i in range(5)]
    rows += [(23, "B1", 0), (23, "B2", 10)] + [(23, f"L23-{i}", 2) for i in range(4)]
    kept_books = {f"B{b}" for b in range(1, 8)}
    kept = {(u, i, r) for u, i, r in rows if (11 <= u <= 18 or u == 23) and i in kept_books}
    return rows, kept


@pytest.fixture
def tiny_books(tmp_path: Path) -> BooksDataModule:
    write_book_crossing(tmp_path / "data", random_book_ratings())
    return BooksDataModule(root=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"), download=False)


def concat(splits: dict[str, dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    return {key: torch.cat([splits[s][key] for s in ("train", "val", "test")]).numpy() for key in splits["train"]}


def test_read_official_format(tmp_path: Path) -> None:
    rows = [(276725, "034545104X", 0), (276726, "0155061224", 5), (276727, "0446520802", 10)]
    ratings = read_book_ratings(write_book_crossing(tmp_path, rows))
    assert ratings.user.tolist() == [276725, 276726, 276727] and ratings.rating.tolist() == [0, 5, 10]
    assert ratings.isbn.tolist() == ["034545104X", "0155061224", "0446520802"]  # leading zeros kept


def test_filter_known_answer(tmp_path: Path) -> None:
    rows, kept = filter_case()
    write_book_crossing(tmp_path / "data", rows)
    data = BooksDataModule(root=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"), download=False)
    got = concat(data.load_splits())
    users = sorted({u for u, _, _ in kept})
    isbns = sorted({i for _, i, _ in kept})
    assert (len(users), len(isbns), len(kept)) == (9, 7, 42 + 5 + 6 + 2)
    records = {(users[u], isbns[b], int(r)) for u, b, r in zip(got["user"], got["item"], got["rating"])}
    assert len(got["user"]) == len(kept) and records == kept
    np.testing.assert_array_equal(got["read"], (got["rating"] > 0).astype(np.float32))
    np.testing.assert_array_equal(got["rating_mask"], got["rating"] > 0)
    np.testing.assert_array_equal(got["sample_id"], got["user"])


def test_labels_split_and_dtypes(tiny_books: BooksDataModule) -> None:
    splits = tiny_books.load_splits()
    sizes = [len(splits[s]["user"]) for s in ("train", "val", "test")]
    total = sum(sizes)
    holdout = -(-3 * total // 10)
    assert total == 480 and sizes == [total - holdout, holdout // 2, holdout - holdout // 2]
    rows = concat(splits)
    overall = rows["read"].mean()
    for tensors in splits.values():
        assert tensors["user"].dtype == tensors["item"].dtype == tensors["sample_id"].dtype == torch.int32
        assert tensors["read"].dtype == tensors["rating"].dtype == torch.float32
        assert tensors["rating_mask"].dtype == torch.bool
        assert abs(tensors["read"].mean().item() - overall) <= 1 / len(tensors["read"])  # stratified on read
        explicit = tensors["rating"][tensors["rating_mask"]]
        assert ((explicit >= 1) & (explicit <= 10) & (explicit == explicit.round())).all()
        assert (tensors["rating"][~tensors["rating_mask"]] == 0).all()
    keys = rows["user"].astype(np.int64) * 100 + rows["item"]
    assert len(np.unique(keys)) == total  # each record once, in exactly one split


def test_unstratified_split_has_the_same_sizes(tmp_path: Path, tiny_books: BooksDataModule) -> None:
    stratified = tiny_books.load_splits()
    plain = BooksDataModule(root=tiny_books.root, cache_dir=tiny_books.cache_dir, stratify=False,
                            download=False).load_splits()
    assert [len(plain[s]["user"]) for s in plain] == [len(stratified[s]["user"]) for s in stratified]
    assert not torch.equal(plain["test"]["user"], stratified["test"]["user"])
    assert len(list(tiny_books.cache_dir.glob("*.pt"))) == 2  # one cache entry per split variant


def test_info_is_the_papers_architecture(tmp_path: Path) -> None:
    info = BooksDataModule(root=str(tmp_path / "absent"), download=False).info
    assert (info.name, info.n_users, info.n_items, info.n_ids) == ("books", 18_960, 31_070, 18_960)
    assert [(t.name, t.kind, t.masked) for t in info.tasks] == [("read", "binary", False),
                                                                 ("rating", "regression", True)]
    assert (info.n_experts, info.k, info.embedding_dim, info.expert_units, info.tower_units) == (9, 4, 64, 128, 256)
    assert (info.expert_dropout, info.task_weighting) == (0.5, "alpha")
    assert BooksDataModule(download=False).batch_size == 2048


def test_cache_written_reused_and_atomic(tiny_books: BooksDataModule, monkeypatch: pytest.MonkeyPatch) -> None:
    first = tiny_books.load_splits()
    [cached] = list(tiny_books.cache_dir.glob("*.pt"))
    assert cached.name.startswith("books-") and cached.name.endswith("-seed0-stratified-v1.pt")

    def no_reading(path: Path) -> None:
        raise AssertionError("the raw file was parsed again")

    monkeypatch.setattr(books, "read_book_ratings", no_reading)
    second = BooksDataModule(root=tiny_books.root, cache_dir=tiny_books.cache_dir, download=False).load_splits()
    for split in first:
        for key in first[split]:
            assert torch.equal(first[split][key], second[split][key])
    assert not any(".tmp" in p.name for p in tiny_books.cache_dir.iterdir())


@pytest.mark.parametrize(
    "line, problem",
    [('"12";"B1";"11"', "line 3"), ('"12";"B1";"x"', "line 3"), ('"0";"B1";"3"', "line 3"),
     ('"12";"";"3"', "line 3"), ('"12";"B1";"3";"4"', "line 3")],
)
def test_malformed_line(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "BX-CSV-Dump.zip"
    text = f'"User-ID";"ISBN";"Book-Rating"\r\n"11";"B2";"0"\r\n{line}\r\n"13";"B3";"7"\r\n'
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("BX-Book-Ratings.csv", text)
    with pytest.raises(UsageError) as error:
        read_book_ratings(path)
    message = str(error.value)
    assert str(path) in message and problem in message and "\n" not in message


def test_not_the_dump(tmp_path: Path) -> None:
    (tmp_path / "plain.zip").write_text("not a zip")
    with pytest.raises(UsageError, match="not a zip archive"):
        read_book_ratings(tmp_path / "plain.zip")
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as archive:
        archive.writestr("BX-Books.csv", "x")
    with pytest.raises(UsageError, match="holds no BX-Book-Ratings.csv"):
        read_book_ratings(tmp_path / "other.zip")
    with zipfile.ZipFile(tmp_path / "header.zip", "w") as archive:
        archive.writestr("BX-Book-Ratings.csv", '"User";"ISBN";"Rating"\r\n"1";"B";"3"\r\n')
    with pytest.raises(UsageError, match="header"):
        read_book_ratings(tmp_path / "header.zip")


def test_more_users_than_the_paper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(books, "N_USERS", 39)  # the fixture keeps 40 users
    write_book_crossing(tmp_path / "data", random_book_ratings())
    data = BooksDataModule(root=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"), download=False)
    with pytest.raises(UsageError, match="hold 40 users, more than the paper's 39"):
        data.load_splits()


def test_missing_file_offline_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code = run_cli(["fit", "--gate", "comet", "--data", "books", f"--data.root={tmp_path}",
                    "--data.download=false", f"--data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert str(tmp_path / "book-crossing" / "BX-CSV-Dump.zip") in err and "BX-CSV-Dump.zip" in err.split(":", 2)[2]
    assert not (tmp_path / "cache").exists()


def test_download_keeps_the_verified_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``"unpack": false``: the archive itself is the main file (the layout of ../shared/data/book-crossing)."""
    source = write_book_crossing(tmp_path / "source", random_book_ratings(n_users=3))
    manifest = tmp_path / "manifest.json"
    entry = {"url": source.as_uri(), "md5": hashlib.md5(source.read_bytes()).hexdigest(), "unpack": False,
             "files": {"book-crossing/BX-CSV-Dump.zip": {}}}
    manifest.write_text(json.dumps({"book-crossing": entry}))
    monkeypatch.setattr(download, "MANIFEST", manifest)
    root = tmp_path / "root"
    path = download.ensure_files(root, "book-crossing", download=True)
    assert path == root / "book-crossing" / "BX-CSV-Dump.zip" and path.read_bytes() == source.read_bytes()
    assert sorted(p.name for p in root.rglob("*")) == ["BX-CSV-Dump.zip", "book-crossing"]  # nothing else left
    shutil.rmtree(root)
    with pytest.raises(UsageError) as error:
        download.ensure_files(root, "book-crossing", download=False)
    assert f"download {source.as_uri()} to {path}" in str(error.value)


# --- real data --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not REAL_BOOKS.is_file(), reason="shared book-crossing not present")
def test_real_books_counts(tmp_path: Path) -> None:
    """The paper's counts (S1.1): 556,724 records of 18,960 users and 31,070 books; 389,706 / 83,509 / 83,509."""
    raw = read_book_ratings(REAL_BOOKS)
    assert len(raw.user) == 1_149_780
    data = BooksDataModule(root=str(REAL_DATA), cache_dir=str(tmp_path), download=False)
    splits = data.load_splits()
    rows = concat(splits)
    assert (len(rows["user"]), len(np.unique(rows["user"])), len(np.unique(rows["item"]))) == (556_724, 18_960, 31_070)
    assert [len(splits[s]["user"]) for s in ("train", "val", "test")] == [389_706, 83_509, 83_509]
    explicit = rows["rating"][rows["rating_mask"]]
    assert rows["read"].mean() == pytest.approx(0.345, abs=5e-4)  # §5.1: about 34.5% explicit
    assert (explicit.mean(), explicit.var()) == (pytest.approx(7.72, abs=5e-3), pytest.approx(3.23, abs=5e-3))


@pytest.mark.slow
@pytest.mark.skipif(not REAL_BOOKS.is_file(), reason="shared book-crossing not present")
def test_real_books_fit_comet_plus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = run_cli(["fit", "--gate", "comet+", "--data", "books", f"--data.root={REAL_DATA}",
                    f"--data.cache_dir={tmp_path / 'cache'}", "--model.perm_epochs=1", "--trainer.max_epochs=1",
                    "--trainer.limit_train_batches=5", "--trainer.limit_val_batches=2",
                    "--trainer.limit_test_batches=2", "--trainer.enable_progress_bar=false"])
    assert code == 0
    results = json.loads(next(Path("runs").rglob("results.json")).read_text())
    assert results["dataset"] == "books" and results["gate"] == "comet+"
    assert 0 < results["test"]["read/auroc"] < 1 and np.isfinite(results["test"]["rating/mse"])
    assert len(results["test"]["read/utilisation"]) == 9
