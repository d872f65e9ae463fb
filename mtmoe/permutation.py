"""Permutation-based local search: the "+" variant of any gate (COMET paper, Section 4; comet-protocol.md §3).

A learnable n x n matrix ``U`` (one shared by all task gates, or one per task) sits between the gates and the
experts. During a learning window of the first ``E_perm`` epochs it is turned into a soft permutation by Sinkhorn
in log space (eq. 8) with a temperature going log-linearly from 1e-3 to 1e-7 and iterations linearly from 20 to
150 (§4.3); a row and column entropy penalty (coefficient zeta) discourages fractional blocks. At the end of the
window the last soft matrix is rounded to a hard permutation by linear assignment (eq. 5) and frozen: from then
on training is exactly the base gate with re-indexed experts (a cached matrix, no Sinkhorn, no assignment solve).
Evaluation always uses the rounded matrix, also inside the window (the official code's behaviour; ``eval_rounded``
False evaluates with the current soft matrix instead).

Convention (the official code's): weights are row vectors and ``w' = w P``, so gate slot ``i`` feeds expert
``col_ind[i]`` of the assignment. Permuting the weights by P is the same as permuting the experts (Section 4.1).
The permuted weights are rescaled to the gate's own row sum: that is the official ``normalise`` for the simplex
gates (Softmax, Top-k, Hash-r, COMET) and keeps DSelect-k's un-normalised sum, so no gate needs code of its own.

State (step counter, window length, last soft matrix, rounded matrix) lives in buffers, so it is checkpointed:
resuming inside the window continues the schedules; resuming after it keeps the same permutation. The step counts
training forward passes (micro-batches under gradient accumulation), as the official code does.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from mtmoe.counters import HostCounters
from mtmoe.errors import UsageError
from mtmoe.sinkhorn import sinkhorn, sinkhorn_and_penalty

TAU_START, TAU_END = 1e-3, 1e-7
ITERATIONS_START, ITERATIONS_END = 20, 150


def round_to_permutation(p: Tensor) -> Tensor | None:
    """Nearest permutation matrix by linear assignment (eq. 5): ``linear_sum_assignment(-P)``, ``I[col_ind]``;
    ``None`` for a matrix with non-finite entries (a diverged run: there is nothing to round)."""
    matrices = p.detach().double().cpu().numpy()
    if not np.isfinite(matrices).all():
        return None
    out = torch.zeros_like(p)
    for m, matrix in enumerate(matrices):
        rows, cols = linear_sum_assignment(-matrix)
        out[m, torch.as_tensor(rows), torch.as_tensor(cols)] = 1.0
    return out


def schedule(step: int, window: int) -> tuple[float, int]:
    """(tau, R) at a step of the window: tau log-linear 1e-3 -> 1e-7, R = int(20 + 130 t / T) (§3.3)."""
    fraction = min(step / max(window, 1), 1.0)
    tau = 10 ** (math.log10(TAU_START) + (math.log10(TAU_END) - math.log10(TAU_START)) * fraction)
    return tau, int(ITERATIONS_START + (ITERATIONS_END - ITERATIONS_START) * fraction)


def _refresh_rounded_index(search: LocalSearch, incompatible_keys) -> None:
    search.rounded_index.copy_(search.rounded.argmax(-2))


class LocalSearch(HostCounters):
    """Learned expert permutation for ``n_tasks`` task gates (shared by default; ``per_task`` gives one each).

    The counters ``step``, ``window`` and ``rounded_at`` stay on the CPU (:class:`mtmoe.counters.HostCounters`).

    Args:
        n_experts: n.
        n_tasks: number of task gates.
        epochs: E_perm, the learning window in epochs (paper: 1..10; Table 1: 5).
        zeta: coefficient of the row/column entropy penalty (paper: 1e-4; Table 1: 1e-5).
        per_task: one permutation per task gate instead of one shared by all (the official code shares one).
        eval_rounded: evaluate with the rounded permutation inside the window (official); False: the soft one.
    """

    host_buffers = ("step", "window", "rounded_at")

    def __init__(
        self,
        n_experts: int,
        n_tasks: int,
        epochs: int = 5,
        zeta: float = 1e-4,
        per_task: bool = False,
        eval_rounded: bool = True,
    ) -> None:
        super().__init__()
        if epochs < 1:
            raise UsageError(f"perm_epochs must be >= 1, got {epochs}")
        if zeta < 0:
            raise UsageError(f"zeta must be >= 0, got {zeta}")
        self.n_experts, self.epochs, self.zeta = n_experts, epochs, float(zeta)
        self.per_task, self.eval_rounded = per_task, eval_rounded
        m = n_tasks if per_task else 1
        self.log_weights = nn.Parameter(torch.empty(m, n_experts, n_experts).uniform_(-0.05, 0.05))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.register_buffer("window", torch.zeros((), dtype=torch.long))  # E_perm * steps per epoch, set at fit
        self.register_buffer("soft", torch.zeros(m, n_experts, n_experts))  # latest soft matrix (zeros: none yet)
        self.register_buffer("rounded", torch.eye(n_experts).repeat(m, 1, 1))
        self.register_buffer("rounded_at", torch.full((), -1, dtype=torch.long))  # step ``rounded`` belongs to
        # rounded.argmax(-2), so that w P = w[..., index]: derived from ``rounded``, not saved, refreshed on loading
        self.register_buffer("rounded_index", torch.arange(n_experts).repeat(m, 1), persistent=False)
        self.register_load_state_dict_post_hook(_refresh_rounded_index)
        self.last_stats: dict[str, float] = {}

    def set_window(self, steps_per_epoch: int) -> None:
        self.window.fill_(self.epochs * steps_per_epoch)

    @property
    def frozen(self) -> bool:
        """True once the window is over: the permutation is the cached rounded matrix for good."""
        return int(self.window) > 0 and int(self.step) >= int(self.window)

    def hard(self) -> Tensor:
        """The rounded permutation of the latest soft matrix, solved once per training step (cached)."""
        if int(self.rounded_at) != int(self.step):
            rounded = round_to_permutation(self.soft) if self.soft.any() else None  # no soft matrix yet: identity
            if rounded is not None:  # (a diverged, non-finite one keeps the last rounding)
                self.rounded.copy_(rounded)
                self.rounded_index.copy_(self.rounded.argmax(-2))
            self.rounded_at.fill_(int(self.step))
        return self.rounded

    def permutes_by_rounding(self) -> bool:
        """Whether the next forward pass permutes by the rounded matrix alone (a gather that advances no schedule):
        after the window, and in evaluation unless ``eval_rounded`` is off inside the window."""
        if self.training:
            return self.frozen
        return self.eval_rounded or self.frozen or not self.soft.any()

    def matrices(self) -> tuple[Tensor, Tensor | None]:
        """The permutation matrices ``[m, n, n]`` for this forward pass (:meth:`hard`'s buffer itself when it is
        the rounded one) and the entropy penalty (``None`` outside training steps of the window, or with zeta 0)."""
        if self.permutes_by_rounding():
            return self.hard(), None
        if not self.training:
            with torch.no_grad():
                return sinkhorn(self.log_weights, *schedule(int(self.step), int(self.window))), None
        if int(self.window) == 0:
            raise RuntimeError("LocalSearch.set_window(steps_per_epoch) must be called before training")
        self.step += 1
        if int(self.step) >= int(self.window):  # transition: round the last soft matrix once and freeze it
            return self.hard(), None
        tau, iterations = schedule(int(self.step), int(self.window))
        p, penalty = sinkhorn_and_penalty(self.log_weights, tau, iterations, self.zeta)
        self.soft.copy_(p.detach())
        self.last_stats = {"tau": tau, "iterations": float(iterations)}
        return p, penalty if self.zeta > 0 else None

    def forward(self, weights: Tensor) -> tuple[Tensor, Tensor | None]:
        """Permute all task gates' weights ``[B, T, n]`` at once: ``w P`` (per task ``w_t P_t`` with ``per_task``).

        With the rounded permutation that is a gather of the weights (exact, and the only added operation after the
        window). With a soft matrix the product is rescaled to each gate's own row sums. Weights are non-negative
        and every row of a Sinkhorn matrix sums to at least 1/n, so a row of ``w P`` sums to 0 only where ``w``'s
        does: the 1e-30 added to the sum keeps such rows 0 (with zero gradient) and is below float32's precision
        for any row of weights summing to more than ~1e-23.
        """
        p, penalty = self.matrices()
        if p is self.rounded:
            return weights.gather(-1, self.rounded_index.expand(weights.shape)), penalty
        if self.per_task:
            permuted = torch.bmm(weights.transpose(0, 1), p).transpose(0, 1)  # [T, B, n] x [T, n, n]
        else:
            permuted = weights @ p[0]
        scale = weights.sum(-1, keepdim=True) / (permuted.sum(-1, keepdim=True) + 1e-30)
        return permuted * scale, penalty

    def assignment(self) -> list[list[int]]:
        """Per permutation matrix: the expert each gate slot feeds (``col_ind``) under the rounded matrix."""
        return self.hard().argmax(-1).tolist()

    def statistics(self) -> dict[str, float]:
        """Distance of the soft matrix from its rounding, experts moved from the identity, and schedule position."""
        hard = self.hard()
        moved = (hard.argmax(-1) != torch.arange(self.n_experts, device=hard.device)).sum(-1).float().mean()
        stats = {
            "step": float(self.step),
            "frozen": float(self.frozen),
            "moved_experts": float(moved),
            "soft_to_rounded_max_abs": float((self.soft - hard).abs().max()) if self.soft.any() else 0.0,
        }
        stats.update({k: float(v) for k, v in self.last_stats.items()})
        return stats
