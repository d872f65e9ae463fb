"""Gate registry (timm-style): ``@register_gate("name")``, ``list_gates()``, ``gate_class()``, ``create_gate()``, and
``parse_gate_name()`` for the names the CLI and the Python API take ("comet", "comet+").

One file per gate plus one ``@register_gate`` line is all a new router needs: the CLI's ``--gate`` names, the
registry-parameterised test suite and the tuning driver all read this table.
"""
from __future__ import annotations

from typing import Any

from mtmoe.errors import UsageError
from mtmoe.gate_names import split_gate_name
from mtmoe.gates.base import Gate, GateDims, no_plus_variant

_GATES: dict[str, type[Gate]] = {}
#: E_perm of a "+" gate unless one is given: Table 1's value.
PLUS_PERM_EPOCHS = 5


def register_gate(name: str):
    def decorator(cls: type[Gate]) -> type[Gate]:
        if name in _GATES:
            raise RuntimeError(f"gate {name!r} registered twice")
        _GATES[name] = cls
        cls.registry_name = name
        return cls

    return decorator


def list_gates() -> list[str]:
    return sorted(_GATES)


def gate_class(name: str) -> type[Gate]:
    try:
        return _GATES[name]
    except KeyError:
        raise UsageError(f"unknown gate {name!r}; valid gates: {', '.join(list_gates())}") from None


def create_gate(name: str, dims: GateDims, **hparams: Any) -> Gate:
    return gate_class(name)(dims, **hparams)


def parse_gate_name(name: str) -> tuple[type[Gate], bool]:
    """The class of gate ``name`` and whether the name asks for local search: ``"comet"`` -> ``(COMETGate, False)``,
    ``"comet+"`` -> ``(COMETGate, True)`` (the "+" variant, COMET paper Section 4). An unknown name, or "+" on a gate
    that is not ``permutable``, is a UsageError."""
    base, plus = split_gate_name(name)
    if base not in _GATES:
        raise UsageError(f"unknown gate {name!r}; valid gates: {', '.join(list_gates())} "
                         "(append '+' for permutation local search, e.g. comet+)")
    if plus and not _GATES[base].permutable:
        raise no_plus_variant(base)
    return _GATES[base], plus
