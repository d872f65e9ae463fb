"""Gates: one file each, one interface (:mod:`mtmoe.gates.base`), one registry (:mod:`mtmoe.gates.registry`)."""
from mtmoe.gates import comet, dselect_k, hash, softmax, topk  # noqa: F401  (registers the gates)
from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput
from mtmoe.gates.comet import COMETGate
from mtmoe.gates.dselect_k import DSelectKGate
from mtmoe.gates.hash import HashGate
from mtmoe.gates.registry import create_gate, gate_class, list_gates, register_gate
from mtmoe.gates.softmax import SoftmaxGate
from mtmoe.gates.topk import TopKGate

__all__ = [
    "COMETGate", "DSelectKGate", "Gate", "GateDims", "GateOutput", "HashGate", "RoutingInput", "SoftmaxGate",
    "TopKGate", "create_gate", "gate_class", "list_gates", "register_gate",
]
