"""Gates: one file each, one interface (:mod:`mtmoe.gates.base`), one registry (:mod:`mtmoe.gates.registry`).

The files are found, not listed (:func:`mtmoe.gate_names.gate_paths`), and a gate's module is imported when it is
first used: ``mtmoe.gates.COMETGate`` (PEP 562) imports ``comet.py`` alone.
"""
from mtmoe.discovery import import_object
from mtmoe.gate_names import gate_paths
from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput
from mtmoe.gates.registry import (
    PLUS_PERM_EPOCHS, create_gate, gate_class, gate_variants, list_gates, parse_gate_name, register_gate,
)


def _package_classes() -> dict[str, str]:
    """The package's gate classes: class name -> ``"module:Class"``."""
    return {path.rpartition(":")[2]: path for path in gate_paths().values() if path.startswith(f"{__name__}.")}


def __getattr__(name: str):
    if name in (classes := _package_classes()):
        return import_object(classes[name], "gate")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Gate", "GateDims", "GateOutput", "RoutingInput", *sorted(_package_classes()),
    "PLUS_PERM_EPOCHS", "create_gate", "gate_class", "gate_variants", "list_gates", "parse_gate_name", "register_gate",
]
