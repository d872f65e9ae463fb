"""Gate registry (timm-style): ``@register_gate("name")``, ``list_gates()``, ``gate_class()``, ``create_gate()``.

One file per gate plus one ``@register_gate`` line is all a new router needs: the CLI's ``--gate`` names, the
registry-parameterised test suite and the tuning driver all read this table.
"""
from __future__ import annotations

from typing import Any

from mtmoe.errors import UsageError
from mtmoe.gates.base import Gate, GateDims

_GATES: dict[str, type[Gate]] = {}


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
