"""mtmoe: a reference benchmark suite for sparse mixture-of-experts gates in multi-task models.

The top level is the Python API (docs/training.md, "Python API"): the gate registry (:func:`list_gates`,
:func:`create_gate`, :func:`gate_class`, :func:`parse_gate_name`), a gate's model for a dataset (:func:`build_model`),
a dataset's splits (:func:`load_data`) and the tuning studies' trials (:func:`trials`). Each name is imported when
first used (PEP 562): ``import mtmoe`` imports neither torch nor Lightning.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {  # name -> the module it comes from
    "GateDims": "mtmoe.gates", "create_gate": "mtmoe.gates", "gate_class": "mtmoe.gates", "list_gates": "mtmoe.gates",
    "parse_gate_name": "mtmoe.gates", "build_model": "mtmoe.api", "load_data": "mtmoe.api", "trials": "mtmoe.api",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = ["GateDims", "build_model", "create_gate", "gate_class", "list_gates", "load_data", "parse_gate_name",
           "trials"]
