"""Gate registry (timm-style): ``@register_gate("name")``, ``list_gates()``, ``gate_class()``, ``create_gate()``, and
``parse_gate_name()`` for the names the CLI and the Python API take ("comet", "comet+", "my_module:MyGate+").

A new router is one file of ``mtmoe/gates/`` with an ``@register_gate("name")`` class, found without an import list
(:func:`mtmoe.gate_names.gate_paths`), or a class in the researcher's own package, named by an entry point of the
group ``mtmoe.gates`` or as ``module:Class``. The CLI's ``--gate`` names, the registry-parameterised test suite and
the tuning driver all read this table; a gate's module is imported when the gate is first used.
"""
from __future__ import annotations

from typing import Any

from mtmoe.discovery import import_object
from mtmoe.errors import UsageError
from mtmoe.gate_names import PLUS_PERM_EPOCHS  # noqa: F401  (mtmoe.gates exports it from here)
from mtmoe.gate_names import check_gate_name, gate_paths, plus_variant, split_gate_name
from mtmoe.gates.base import Gate, GateDims, no_plus_variant

_GATES: dict[str, type[Gate]] = {}  # the gates registered in this process (their modules imported)


def register_gate(name: str):
    def decorator(cls: type[Gate]) -> type[Gate]:
        if name in _GATES:
            raise RuntimeError(f"gate {name!r} registered twice")
        _GATES[name] = cls
        cls.registry_name = name
        return cls

    return decorator


def list_gates() -> list[str]:
    """The registered gates: the package's and the entry points' (:func:`gate_paths`), and any other class
    registered in this process."""
    return sorted({*gate_paths(), *_GATES})


def gate_variants() -> list[str]:
    """Every registered gate, each followed by its "+" where local search may permute its weights (``permutable``):
    what ``tune`` may study."""
    return [variant for name in list_gates()
            for variant in (name, plus_variant(name)) if variant == name or gate_class(name).permutable]


def gate_class(name: str) -> type[Gate]:
    """The class of a registered gate, or of ``module:Class``; anything else is a UsageError naming the gates."""
    if name in _GATES:
        return _GATES[name]
    check_gate_name(name, list_gates(), plus=False)
    path = gate_paths().get(name, name)
    cls = import_object(path, "gate")
    if not (isinstance(cls, type) and issubclass(cls, Gate)):
        raise UsageError(f"gate {name!r}: {path} is not a subclass of mtmoe.gates.Gate")
    if name in gate_paths() and name not in _GATES:  # an entry point's class without its own @register_gate
        register_gate(name)(cls)
    return cls


def create_gate(name: str, dims: GateDims, **hparams: Any) -> Gate:
    return gate_class(name)(dims, **hparams)


def parse_gate_name(name: str) -> tuple[type[Gate], bool]:
    """The class of gate ``name`` and whether the name asks for local search: ``"comet"`` -> ``(COMETGate, False)``,
    ``"comet+"`` -> ``(COMETGate, True)`` (the "+" variant, COMET paper Section 4), ``"my_module:MyGate+"`` ->
    ``(MyGate, True)``. An unknown name, or "+" on a gate that is not ``permutable``, is a UsageError."""
    check_gate_name(name, list_gates())
    base, plus = split_gate_name(name)
    cls = gate_class(base)
    if plus and not cls.permutable:
        raise no_plus_variant(base)
    return cls, plus
