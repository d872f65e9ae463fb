"""Covering arrays for test parameters: every pair of factor values in some row, not every combination.

Faults that need more than two factors to show are rare (Kuhn, Wallace and Gallo, "Software fault interactions and
implications for software testing", IEEE TSE 2004); a pairwise array of factors with n values each has about n^2
rows where the full product has n^k. ``each_once`` is timm's rule for its model tests: every registered item gets
each check, the other factors are spread over the items pairwise.
"""
from __future__ import annotations

from itertools import combinations, cycle, islice
from typing import Any, Sequence


def pairwise(*factors: Sequence[Any]) -> list[tuple]:
    """Rows over ``factors`` in which every value pair of every two factors occurs at least once (greedy, in the
    manner of AETG: each row starts from the first uncovered pair and takes, factor by factor, the value that covers
    most uncovered pairs, the earlier value on a tie). Deterministic; one factor gives its values."""
    def pair(f: int, v: int, g: int, w: int) -> tuple[int, int, int, int]:
        return (f, v, g, w) if f < g else (g, w, f, v)

    uncovered = {(f, v, g, w) for f, g in combinations(range(len(factors)), 2)
                 for v in range(len(factors[f])) for w in range(len(factors[g]))}
    rows = [{0: v} for v in range(len(factors[0]))] if len(factors) == 1 else []
    while uncovered:
        f, v, g, w = min(uncovered)
        row = {f: v, g: w}
        for h in range(len(factors)):
            if h not in row:
                row[h] = max(range(len(factors[h])),
                             key=lambda u: (sum(pair(h, u, e, row[e]) in uncovered for e in row), -u))
        rows.append(row)
        uncovered -= {pair(f, row[f], g, row[g]) for f, g in combinations(range(len(factors)), 2)}
    return [tuple(factors[f][row[f]] for f in range(len(factors))) for row in rows]


def each_once(items: Sequence[Any], *factors: Sequence[Any]) -> list[tuple]:
    """``(item, *row)`` rows: every item at least once, every pair of values of the other ``factors`` at least once
    (the rows of :func:`pairwise`, taken in turn)."""
    rows = pairwise(*factors)
    count = max(len(items), len(rows))
    return [(item, *row) for item, row in islice(zip(cycle(items), cycle(rows)), count)]
