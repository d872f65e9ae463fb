"""Routing statistics as a torchmetrics ``Metric`` (per task gate, per split)."""
from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

SIMPLEX_TOLERANCE = 1e-5
#: Per-task test metrics as the reports show them: (label, scale); AUC and accuracy x100, MSE as is (Table 7).
TASK_METRICS = {"auroc": ("AUC", 100.0), "accuracy": ("accuracy", 100.0), "mse": ("MSE", 1.0)}


class RoutingStats(Metric):
    """Accumulates, over an epoch, what the paper and the official code log about a gate's weights ``[B, n]``.

    * ``experts_per_sample``: mean number of weights > 0, counted exactly (the paper's n/s);
    * ``utilisation``: per-expert mean weight (a vector of n, summing to ~1);
    * ``selection_rate``: per-expert fraction of samples routed to it (weight > 0);
    * ``unused_experts``: experts that no sample of the epoch selected;
    * ``simplex_violations``: fraction of samples whose weights sum differs from 1 by more than 1e-5, for gates
      whose rows should sum to 1 (``simplex``; the batch-level routers' and SparseMixer's do not, by design);
    * ``zero_expert_fraction``: fraction of samples with no expert at all (batch-level routers can do that).
    """

    full_state_update = False

    def __init__(self, n_experts: int, simplex: bool = True) -> None:
        super().__init__()
        self.n_experts, self.simplex = n_experts, simplex
        self.add_state("weight_sum", torch.zeros(n_experts, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("selected", torch.zeros(n_experts, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("violations", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("empty", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, weights: Tensor) -> None:
        weights = weights.detach()
        active = weights > 0
        self.weight_sum += weights.sum(0).double()
        self.selected += active.sum(0).double()
        self.violations += ((weights.sum(-1) - 1).abs() > SIMPLEX_TOLERANCE).sum().double()
        self.empty += (~active.any(-1)).sum().double()
        self.count += weights.shape[0]

    def compute(self) -> dict[str, Tensor]:
        count = self.count.clamp_min(1)
        stats = {
            "experts_per_sample": self.selected.sum() / count,
            "utilisation": self.weight_sum / count,
            "selection_rate": self.selected / count,
            "unused_experts": (self.selected == 0).sum().double(),
            "zero_expert_fraction": self.empty / count,
        }
        if self.simplex:
            stats["simplex_violations"] = self.violations / count
        return stats
