"""A gate's name as the CLI, studies and reports spell it: a registered gate, or ``module:Class`` for a gate class
outside the registry, and "+" for its permutation local search (COMET paper, Section 4). One parser, read everywhere
(as timm's ``split_model_name_tag``), and one list of the registered names (:func:`gate_paths`); neither imports
torch, so reports, ``--help`` and a mistyped name answer without it. :func:`mtmoe.gates.parse_gate_name` adds the
registry's checks."""
from __future__ import annotations

from collections.abc import Collection
from functools import cache

from mtmoe.discovery import registered
from mtmoe.errors import UsageError, suggestion

PLUS = "+"
#: E_perm of a "+" gate unless one is given: Table 1's value.
PLUS_PERM_EPOCHS = 5


def split_gate_name(name: str) -> tuple[str, bool]:
    """``"comet+"`` -> ``("comet", True)``, ``"comet"`` -> ``("comet", False)``."""
    return name.removesuffix(PLUS), name.endswith(PLUS)


def plus_variant(base: str) -> str:
    """``"comet"`` -> ``"comet+"``."""
    return base + PLUS


@cache
def gate_paths() -> dict[str, str]:
    """Every registered gate's name -> ``"module:Class"``: the files of ``mtmoe/gates/`` with an
    ``@register_gate("name")`` class, and the entry points of the group ``mtmoe.gates``; nothing is imported."""
    return registered("mtmoe.gates", "register_gate", "mtmoe.gates")


def check_gate_name(name: str, gates: Collection[str] | None = None, plus: bool = True) -> None:
    """A UsageError naming the gates unless ``name`` is one of ``gates`` (default: the registered ones,
    :func:`gate_paths`) or ``module:Class``, with "+" where ``plus``; nothing is imported."""
    gates = gate_paths() if gates is None else gates
    base, has_plus = split_gate_name(name)
    if (has_plus and not plus) or (base not in gates and ":" not in base):
        raise UsageError(f"unknown gate {name!r}; valid gates: {', '.join(sorted(gates))} (append '+' for "
                         "permutation local search, e.g. comet+; module:Class names a gate class of your own)"
                         f"{suggestion(base, gates, PLUS if has_plus and plus else '')}")
