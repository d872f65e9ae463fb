"""Gates: one file each, one interface (:mod:`mtmoe.gates.base`), one registry (:mod:`mtmoe.gates.registry`)."""
from mtmoe.gates import (  # noqa: F401  (registers the gates)
    comet, competesmoe, dselect_k, expert_choice, hash, softmax, sparsemixer, topk, usmoe,
)
from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput
from mtmoe.gates.comet import COMETGate
from mtmoe.gates.competesmoe import CompeteSMoEGate, CompeteSMoEV2Gate
from mtmoe.gates.dselect_k import DSelectKGate
from mtmoe.gates.expert_choice import ExpertChoiceGate
from mtmoe.gates.hash import HashGate
from mtmoe.gates.remoe import ReMoEGate
from mtmoe.gates.registry import create_gate, gate_class, list_gates, register_gate
from mtmoe.gates.softmax import SoftmaxGate
from mtmoe.gates.sparsemixer import SparseMixerGate
from mtmoe.gates.topk import LossFreeTopKGate, SigmoidTopKGate, TopKGate
from mtmoe.gates.usmoe import USMoEGate

__all__ = [
    "COMETGate", "CompeteSMoEGate", "CompeteSMoEV2Gate", "DSelectKGate", "ExpertChoiceGate", "Gate", "GateDims",
    "GateOutput", "HashGate", "RoutingInput", "SoftmaxGate", "SparseMixerGate", "TopKGate", "USMoEGate",
    "LossFreeTopKGate", "ReMoEGate", "SigmoidTopKGate",
    "create_gate", "gate_class", "list_gates", "register_gate",
]
