"""``tests/covering.py``: the pairwise arrays cover every value pair, variants_over every gate variant."""
from __future__ import annotations

from itertools import combinations, product

import pytest

from covering import pairwise, variants_over
from mtmoe.gates import gate_variants

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


def test_variants_over_takes_every_variant_once_and_spreads_the_values() -> None:
    values = ["a", "b", "c", "d"]
    rows = variants_over(values)
    assert [variant for variant, _ in rows] == gate_variants()
    for plus in (False, True):  # the plain gates and the "+" variants each meet every value
        assert {value for variant, value in rows if variant.endswith("+") == plus} == set(values)
    where = dict(rows)
    assert all(where[variant] != where[variant.removesuffix("+")] for variant in where if variant.endswith("+"))


def test_every_gate_meets_every_value_through_its_variants() -> None:
    from mtmoe.gates import list_gates

    values = [0.0, 0.5]
    rows = variants_over(values, every_gate_meets_every_value=True)
    assert {variant for variant, _ in rows} == set(gate_variants())
    for name in list_gates():
        met = [value for variant, value in rows if variant.removesuffix("+") == name]
        assert sorted(met) == values, name  # each value once per gate
