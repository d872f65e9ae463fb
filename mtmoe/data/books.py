"""Books (Book-Crossing): task 1 "read" (explicit vs implicit rating), task 2 "rating" (1-10, masked to explicit
rows, raw scale); Supplement S1.1 and comet-protocol.md §5.1.

The raw file is ``BX-Book-Ratings.csv`` (1,149,780 ratings, 0 = implicit), read in place from the official
``BX-CSV-Dump.zip``. Users with more than 5 ratings (implicit ones included) are kept, then, among their records,
books with more than 5 ratings: 556,724 records, 18,960 users, 31,070 books, the paper's counts (its "at least 5"
is loose). The records are split 70/15/15 (389,706 / 83,509 / 83,509). No negative sampling: both labels come
from the records.
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from mtmoe.data.base import DatasetInfo, InMemoryDataModule, Splits, register_dataset
from mtmoe.data.cache import load_or_prepare
from mtmoe.data.download import ensure_files, raw_sha256
from mtmoe.data.layout import RAW_FILES
from mtmoe.data.recsys import rating_splits, rating_tasks
from mtmoe.errors import UsageError

TASKS = rating_tasks("read")
N_USERS, N_BOOKS = 18_960, 31_070  # after the filter (S1.1); the embedding tables' sizes (S1.2)
MORE_THAN = 5  # a user, then a book, needs more than this many ratings (comet-protocol.md §5.1)
RATINGS_MEMBER = "BX-Book-Ratings.csv"
COLUMNS = ["User-ID", "ISBN", "Book-Rating"]


class BookRatings(NamedTuple):
    user: np.ndarray  # int64, the file's User-ID
    isbn: np.ndarray  # str objects, the file's ISBN as written (no normalisation, as the paper's counts need)
    rating: np.ndarray  # int64, 0 (implicit) or 1..10


def read_book_ratings(path: Path) -> BookRatings:
    """Read ``BX-Book-Ratings.csv`` from the Book-Crossing zip at ``path`` (``;``-separated, quoted, latin-1).

    Anything but the header ``User-ID;ISBN;Book-Rating`` followed by rows of an integer id >= 1, a non-empty
    ISBN and an integer rating in 0..10 is a :class:`UsageError` naming the file and the line.
    """
    path = Path(path)
    where = f"{path}:{RATINGS_MEMBER}"
    try:
        with zipfile.ZipFile(path) as archive, archive.open(RATINGS_MEMBER) as handle:
            frame = pd.read_csv(handle, sep=";", encoding="latin-1", dtype={"ISBN": str}, keep_default_na=False)
    except zipfile.BadZipFile:
        raise UsageError(f"{path} is not a zip archive (expected the official BX-CSV-Dump.zip)") from None
    except KeyError:
        raise UsageError(f"{path} holds no {RATINGS_MEMBER} (expected the official BX-CSV-Dump.zip)") from None
    except pd.errors.EmptyDataError:
        raise UsageError(f"{where} is empty") from None
    except pd.errors.ParserError as error:
        raise UsageError(f"{where} is malformed: {str(error).split('C error: ')[-1].strip()}") from None
    if list(frame.columns) != COLUMNS:
        raise UsageError(f"{where} is malformed: header {list(frame.columns)}, expected {COLUMNS}")
    user = pd.to_numeric(frame["User-ID"], errors="coerce").to_numpy(dtype=np.float64)
    rating = pd.to_numeric(frame["Book-Rating"], errors="coerce").to_numpy(dtype=np.float64)
    isbn = frame["ISBN"].to_numpy(dtype=object)
    bad = np.isnan(user) | (user != np.round(user)) | (user < 1) | (isbn == "")
    bad |= np.isnan(rating) | (rating != np.round(rating)) | (rating < 0) | (rating > 10)
    if bad.any():
        row = int(np.argmax(bad))
        content = ";".join(str(frame[column].iloc[row]) for column in COLUMNS)
        raise UsageError(
            f"{where} is malformed: line {row + 2} is not user;isbn;rating (an integer id >= 1, an ISBN, "
            f"a rating 0..10): {content!r}"
        )
    return BookRatings(user=user.astype(np.int64), isbn=isbn, rating=rating.astype(np.int64))


def filter_books(ratings: BookRatings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keep users with > 5 ratings, then books with > 5 of the remaining ratings; return ``(user, book, rating)``.

    Ids are 0-based ranks of the original User-ID and of the ISBN string (sorted), so the numbering does not depend
    on the file's row order.
    """
    _, user_code, user_count = np.unique(ratings.user, return_inverse=True, return_counts=True)
    keep = user_count[user_code] > MORE_THAN
    isbn_code, _ = pd.factorize(ratings.isbn[keep])
    keep[keep] = np.bincount(isbn_code)[isbn_code] > MORE_THAN
    _, user = np.unique(ratings.user[keep], return_inverse=True)
    book, _ = pd.factorize(ratings.isbn[keep], sort=True)
    return user.astype(np.int64), book.astype(np.int64), ratings.rating[keep]


def prepare_books(ratings: BookRatings, seed: int, stratify: bool = True) -> Splits:
    """Filter (S1.1), label (read = explicit rating; rating 1..10 on read rows) and split 70/15/15."""
    user, book, rating = filter_books(ratings)
    for name, ids, limit in (("user", user, N_USERS), ("book", book, N_BOOKS)):
        if len(ids) and ids.max() >= limit:
            raise UsageError(f"the filtered ratings hold {ids.max() + 1:,} {name}s, more than the paper's "
                             f"{limit:,}: not the official {RATINGS_MEMBER}?")
    return rating_splits(user, book, rating, rating > 0, "read", seed, stratify)


@register_dataset("books")
class BooksDataModule(InMemoryDataModule):
    """Book-Crossing as the paper's Books (S1.1-S1.3): ``<root>/book-crossing/BX-CSV-Dump.zip``, read in place.

    Args:
        split_seed: seed of the 70/15/15 split (fixed across trials).
        stratify: stratify the split on task 1's label (our choice; the paper gives only the sizes).
        batch_size: 2048, the paper's (S1.3).
        root, cache_dir, eval_batch_size, seed, download: see :class:`InMemoryDataModule`.
    """

    task_weighting = "alpha"

    def __init__(self, split_seed: int = 0, stratify: bool = True, batch_size: int = 2048, **kwargs) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        self.split_seed, self.stratify = split_seed, stratify

    @property
    def info(self) -> DatasetInfo:
        return DatasetInfo(
            name="books", tasks=TASKS, n_ids=N_USERS, n_users=N_USERS, n_items=N_BOOKS,
            n_experts=9, k=4, embedding_dim=64, expert_units=128, tower_units=256, expert_dropout=0.5,
            task_weighting=self.task_weighting,
        )

    def load_splits(self) -> Splits:
        path = ensure_files(self.root, *RAW_FILES["books"], self.download, self.verify, self.cache_dir)
        split = "stratified" if self.stratify else "random"
        cache = self.cache_dir / f"books-{raw_sha256(path, self.cache_dir)[:16]}-seed{self.split_seed}-{split}-v1.pt"

        def prepare() -> Splits:
            ratings = read_book_ratings(path)
            try:
                return prepare_books(ratings, self.split_seed, self.stratify)
            except UsageError as error:
                raise UsageError(f"{path}: {error}") from None

        return load_or_prepare(cache, prepare)
