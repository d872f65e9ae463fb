"""``tests/covering.py``: the pairwise arrays cover every value pair, and each_once every item."""
from __future__ import annotations

from itertools import combinations, product

import pytest

from covering import each_once, pairwise

FACTORS = [
    ([1, 2, 3],),
    (list(range(15)), [2, 3, 5, 8, 9, 16], ["batch", "one"]),
    (list(range(15)), [2, 3, 5, 8, 9, 16], list("abcde")),
    ([0, 1], [0, 1], [0, 1], [0, 1]),
    (list("abc"), list("xyz"), [1, 2, 3], [4, 5, 6]),
]


@pytest.mark.parametrize("factors", FACTORS, ids=lambda f: "x".join(str(len(v)) for v in f))
def test_every_pair_is_covered_in_fewer_rows_than_the_product(factors) -> None:
    rows = pairwise(*factors)
    assert all(len(row) == len(factors) for row in rows)
    for i, j in combinations(range(len(factors)), 2):
        assert {(row[i], row[j]) for row in rows} == set(product(factors[i], factors[j]))
    assert len(rows) <= len(list(product(*factors)))
    if len(factors) > 2:
        assert len(rows) < len(list(product(*factors)))
    assert rows == pairwise(*factors)  # the same rows every run: test ids do not move


def test_each_once_takes_every_item_and_every_row() -> None:
    items = ["a", "b", "c", "d", "e", "f", "g"]
    rows = each_once(items, [0, 1], ["x", "y"], [True, False])
    assert sorted({row[0] for row in rows}) == items and len(rows) == len(items)
    assert set(pairwise([0, 1], ["x", "y"], [True, False])) == {row[1:] for row in rows}
    assert len(each_once(["a"], [0, 1], [0, 1])) == 4  # more rows than items: the items repeat
