"""Tiny Book-Crossing and Jester data roots in the official formats (a zip of ``;``-separated latin-1 CSV with CRLF;
Jester dataset 1's three ``.xls`` sheets, 99 = not rated), written by the tests."""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import xlwt


def write_book_crossing(root: Path, rows: list[tuple[int, str, int]]) -> Path:
    """``<root>/book-crossing/BX-CSV-Dump.zip`` holding ``BX-Book-Ratings.csv`` with ``rows`` (user, ISBN, rating)."""
    lines = ['"User-ID";"ISBN";"Book-Rating"'] + [f'"{user}";"{isbn}";"{rating}"' for user, isbn, rating in rows]
    path = root / "book-crossing" / "BX-CSV-Dump.zip"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("BX-Book-Ratings.csv", "\r\n".join(lines).encode("latin-1") + b"\r\n")
        archive.writestr("BX-Users.csv", '"User-ID";"Location";"Age"\r\n')  # the dump's other members
    return path


def random_book_ratings(n_users: int = 40, n_books: int = 30, per_user: int = 12, seed: int = 0) -> list:
    """Every user rates ``per_user`` books (about a third explicitly, 1..10, as the real file), so all survive the
    > 5 filter when ``per_user * n_users / n_books > 5``; ISBNs are 10-character strings with leading zeros."""
    rng = np.random.default_rng(seed)
    rows = []
    for user in range(1, n_users + 1):
        for book in rng.choice(n_books, size=per_user, replace=False):
            explicit = rng.random() < 0.35
            rows.append((1000 + user, f"{book:09d}X", int(rng.integers(1, 11)) if explicit else 0))
    return rows


def write_jester_sheet(path: Path, ratings: np.ndarray, count: np.ndarray | None = None) -> Path:
    """One ``jester-data-N.xls``: per user the number of rated jokes, then the 100 ratings (99 = not rated); a
    string cell is written as text (malformed-file tests)."""
    count = (ratings != 99).sum(axis=1) if count is None else count
    book = xlwt.Workbook()
    sheet = book.add_sheet("jester-data")
    for row, (n_rated, values) in enumerate(zip(count, ratings)):
        sheet.write(row, 0, int(n_rated))
        for column, value in enumerate(values, start=1):
            sheet.write(row, column, value if isinstance(value, str) else float(value))
    path.parent.mkdir(parents=True, exist_ok=True)
    book.save(str(path))
    return path


def jester_matrices(users: tuple[int, ...] = (6, 5, 7), seed: int = 0) -> list[np.ndarray]:
    """Rating matrices for the three sheets: ratings in [-10, 10] with two decimals (as the real data), about 40%
    not rated (99), and a genuine 0.0 rating at user 0, joke 0 of the first sheet."""
    rng = np.random.default_rng(seed)
    matrices = []
    for n in users:
        ratings = np.round(rng.uniform(-10, 10, size=(n, 100)), 2)
        ratings[rng.random((n, 100)) < 0.4] = 99
        matrices.append(ratings)
    matrices[0][0, 0] = 0.0
    matrices[0][0, 1], matrices[0][1, 1] = -10.0, 10.0
    return matrices


def write_jester(root: Path, matrices: list[np.ndarray]) -> list[Path]:
    return [write_jester_sheet(root / "jester" / f"jester-data-{i}.xls", m) for i, m in enumerate(matrices, 1)]
