"""A gate's name as the CLI, studies and reports spell it: a registered gate, and "+" for its permutation local
search (COMET paper, Section 4). One parser, read everywhere (as timm's ``split_model_name_tag``); it imports nothing,
so reports and ``--help`` stay free of torch. :func:`mtmoe.gates.parse_gate_name` adds the registry's checks."""
from __future__ import annotations

PLUS = "+"


def split_gate_name(name: str) -> tuple[str, bool]:
    """``"comet+"`` -> ``("comet", True)``, ``"comet"`` -> ``("comet", False)``."""
    return name.removesuffix(PLUS), name.endswith(PLUS)


def plus_variant(base: str) -> str:
    """``"comet"`` -> ``"comet+"``."""
    return base + PLUS
