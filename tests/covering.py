"""Covering arrays for test parameters: every pair of factor values in some row, not every combination.

Faults that need more than two factors to show are rare (Kuhn, Wallace and Gallo, "Software fault interactions and
implications for software testing", IEEE TSE 2004); a pairwise array of factors with n values each has about n^2
rows where the full product has n^k. ``variants_over`` is timm's rule for its model tests: every registered gate
gets each check once, the other factor (the dataset) spread over the gates.
"""
from __future__ import annotations

from itertools import combinations
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


def variants_over(values: Sequence[Any], every_gate_meets_every_value: bool = False) -> list[tuple[str, Any]]:
    """``(variant, value)`` rows: every gate and "+" variant (``gate_variants()``) once, gate i on value i and its
    "+" on value i + 1 (cyclically): a gate and its "+" meet different values, the plain gates and the "+" variants
    each meet every value when there are at least as many of them as values. With ``every_gate_meets_every_value``,
    gate i meets values i, i + 1, ... each once, its variants taking them in turn: a gate without "+" meets them
    all itself."""
    from mtmoe.gates import gate_variants, list_gates

    variants = set(gate_variants())
    rows = []
    for i, name in enumerate(list_gates()):
        own = [variant for variant in (name, name + "+") if variant in variants]
        count = max(len(own), len(values)) if every_gate_meets_every_value else len(own)
        rows += [(own[r % len(own)], values[(i + r) % len(values)]) for r in range(count)]
    return rows
