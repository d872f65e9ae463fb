"""Gates: one file each, one interface (:mod:`mtmoe.gates.base`), one registry (:mod:`mtmoe.gates.registry`)."""
from mtmoe.gates import (  # noqa: F401  (registers the gates)
    comet, competesmoe, dselect_k, expert_choice, hash, moesart, softmax, sparsemixer, topany, topk, usmoe,
)
from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput
from mtmoe.gates.comet import COMETGate
from mtmoe.gates.competesmoe import CompeteSMoEGate, CompeteSMoEV2Gate
from mtmoe.gates.dselect_k import DSelectKGate
from mtmoe.gates.expert_choice import ExpertChoiceGate
from mtmoe.gates.hash import HashGate
from mtmoe.gates.moesart import MOESARTGate
from mtmoe.gates.registry import (
    PLUS_PERM_EPOCHS, create_gate, gate_class, list_gates, parse_gate_name, register_gate,
)
from mtmoe.gates.remoe import ReMoEGate
from mtmoe.gates.softmax import SoftmaxGate
from mtmoe.gates.sparsemixer import SparseMixerGate
from mtmoe.gates.topany import TopAnyGate
from mtmoe.gates.topk import LossFreeTopKGate, SigmoidTopKGate, TopKGate
from mtmoe.gates.usmoe import USMoEGate

__all__ = [
    "COMETGate", "CompeteSMoEGate", "CompeteSMoEV2Gate", "DSelectKGate", "ExpertChoiceGate", "Gate", "GateDims",
    "GateOutput", "HashGate", "LossFreeTopKGate", "MOESARTGate", "ReMoEGate", "RoutingInput", "SigmoidTopKGate",
    "SoftmaxGate", "SparseMixerGate", "TopAnyGate", "TopKGate", "USMoEGate",
    "PLUS_PERM_EPOCHS", "create_gate", "gate_class", "list_gates", "parse_gate_name", "register_gate",
]
