"""Hash routing, Hash-r (Roller et al., 2021; comet-protocol.md §2.3).

Every stable sample id (the user id for recommenders, the sample index for images) is pre-assigned to one expert
uniformly at random; the gate returns the one-hot vector of that expert (n/s = 1, no trainable parameters).
The table is a buffer, so it is saved with the model. It is drawn from ``torch.Generator(seed)``; ``seed`` defaults
to the run's seed (``torch.initial_seed()``, set by ``--seed_everything``), so the task gates of one model share
one table, as the official code's per-user assignment in the data opener does, and a new run seed draws a new
table. The official code draws it from an unseeded NumPy generator.
"""
from __future__ import annotations

import torch

from mtmoe.errors import UsageError
from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput
from mtmoe.gates.registry import register_gate


@register_gate("hash")
class HashGate(Gate):
    needs_sample_id = True

    def __init__(self, dims: GateDims, seed: int | None = None) -> None:
        super().__init__(dims)
        if dims.n_ids < 1:
            raise UsageError("the hash gate needs stable sample ids (n_ids >= 1); this dataset provides none")
        generator = torch.Generator().manual_seed(torch.initial_seed() if seed is None else seed)
        self.register_buffer("table", torch.randint(0, dims.n_experts, (dims.n_ids,), generator=generator))

    def max_active(self) -> int:
        return 1

    def forward(self, routing: RoutingInput) -> GateOutput:
        if routing.sample_id is None:
            raise ValueError("HashGate needs RoutingInput.sample_id")
        experts = self.table[routing.sample_id].unsqueeze(1)
        weights = torch.zeros_like(routing.x[:, :1]).expand(-1, self.n_experts).scatter(1, experts, 1.0)  # no host sync
        return GateOutput(weights, self.zero(routing.x))
