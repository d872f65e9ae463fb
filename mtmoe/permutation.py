"""Permutation-based local search: the "+" variant of any gate (COMET paper, Section 4; comet-protocol.md §3).

A learnable n x n matrix ``U`` (one shared by all task gates, or one per task) sits between the gates and the
experts. During a learning window of the first ``E_perm`` epochs it is turned into a soft permutation by Sinkhorn
in log space (eq. 8) with a temperature going log-linearly from 1e-3 to 1e-7 and iterations linearly from 20 to
150 (§4.3); a row and column entropy penalty (coefficient zeta) discourages fractional blocks. At the end of the
window the last soft matrix is rounded to a hard permutation by linear assignment (eq. 5) and frozen: from then
on training is exactly the base gate with re-indexed experts (a gather of the weights). Evaluation always uses the
rounded matrix, also inside the window (the official code's behaviour; ``eval_rounded`` False evaluates with the
current soft matrix instead).

Convention (the official code's): weights are row vectors and ``w' = w P``, so gate slot ``i`` feeds expert
``col_ind[i]`` of the assignment. Permuting the weights by P is the same as permuting the experts (Section 4.1).
The permuted weights are rescaled to the gate's own row sums: that is the official ``normalise`` for the simplex
gates (Softmax, Top-k, Hash-r, COMET) and keeps DSelect-k's un-normalised sum, so no gate needs code of its own.

State (step counter, window length, last soft matrix, rounded matrix) lives in device buffers, so it is
checkpointed, and a training step reads nothing on the host: the schedule, the window test and the choice between
the soft and the rounded matrix are tensor operations, so the step runs unchanged for a pack of trials each at its
own point of its own window (``torch.func.vmap``) and inside a CUDA graph. The one host computation, the linear
assignment, happens between steps: a plain training loop calls :meth:`LocalSearch.round_` before the step that
ends the window and before evaluating inside it (:meth:`LocalSearch.rounding_due` says when); the training engine
does the same for many trials at once through the :class:`~mtmoe.schedules.Schedule` hooks. The step counts training forward passes
(micro-batches), as the official code does, and stops at the window's end.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from mtmoe.errors import SettingError
from mtmoe.scalars import ScalarSettings
from mtmoe.schedules import Schedule, Trials
from mtmoe.sinkhorn import sinkhorn_and_penalty

TAU_START, TAU_END = 1e-3, 1e-7
ITERATIONS_START, ITERATIONS_END = 20, 150


def round_to_permutation(p: Tensor) -> Tensor | None:
    """Nearest permutation matrices by linear assignment (eq. 5): ``linear_sum_assignment(-P)``, ``I[col_ind]``, for
    ``p`` ``[m, n, n]``; ``None`` for matrices with non-finite entries (a diverged run: there is nothing to round)."""
    matrices = p.detach().double().cpu().numpy()
    if not np.isfinite(matrices).all():
        return None
    out = torch.zeros_like(p)
    for m, matrix in enumerate(matrices):
        rows, cols = linear_sum_assignment(-matrix)
        out[m, torch.as_tensor(rows), torch.as_tensor(cols)] = 1.0
    return out


def round_to_permutations(soft: Tensor, rounded: Tensor) -> Tensor:
    """The rounding of each trial's latest soft matrices ``soft [..., m, n, n]`` (one transfer to the host for all),
    or its previous ``rounded`` where it has none yet (all zeros: before its first training step) or a non-finite
    one (a diverged trial keeps its last rounding)."""
    host = soft.detach().cpu()
    out = rounded.detach().cpu().clone()
    for index in np.ndindex(*host.shape[:-3]):
        if host[index].any() and (new := round_to_permutation(host[index])) is not None:
            out[index] = new.to(out.dtype)
    return out.to(rounded.device)


def schedule(step: Tensor, window: Tensor) -> tuple[Tensor, Tensor]:
    """(tau, R) at a step of the window, as tensors: tau log-linear 1e-3 -> 1e-7 (float64), R = int(20 + 130 t / T)
    (int64), clamped at the window's end (§3.3)."""
    fraction = (step.double() / window.clamp_min(1).double()).clamp(max=1.0)
    log_tau = math.log10(TAU_START) + (math.log10(TAU_END) - math.log10(TAU_START)) * fraction
    iterations = ITERATIONS_START + (ITERATIONS_END - ITERATIONS_START) * fraction
    return torch.pow(10.0, log_tau), iterations.long()


def _refresh_rounded_index(search: LocalSearch, incompatible_keys) -> None:
    search.rounded_index.copy_(search.rounded.argmax(-2))


def _round(state: dict[str, Tensor], index: Tensor | None = None) -> None:
    """Round the latest soft matrices in ``state`` (a module's buffers, or trials' ``index`` of stacked ones) to
    the permutations the next forward passes use (eq. 5, on the host)."""
    rounded = state["rounded"] if index is None else state["rounded"][index]
    rounded = round_to_permutations(state["soft"] if index is None else state["soft"][index], rounded)
    if index is None:
        state["rounded"].copy_(rounded)
        state["rounded_index"].copy_(rounded.argmax(-2))
    else:
        state["rounded"][index] = rounded
        state["rounded_index"][index] = rounded.argmax(-2)


class LocalSearch(ScalarSettings, Schedule):
    """Learned expert permutation for ``n_tasks`` task gates (shared by default; ``per_task`` gives one each).

    Args:
        n_experts: n.
        n_tasks: number of task gates.
        epochs: E_perm, the learning window in epochs (paper: 1..10; Table 1: 5).
        zeta: coefficient of the row/column entropy penalty (paper: 1e-4; Table 1: 1e-5).
        per_task: one permutation per task gate instead of one shared by all (the official code shares one).
        eval_rounded: evaluate with the rounded permutation inside the window (official); False: the soft one.

    ``may_search`` (default True) is a promise the training loop may make on the host: False says the window of
    every trial run through this module is over, and the forward pass is then the rounded matrix's gather alone
    (the same values, without computing the soft branch that the window test would discard).

    As a :class:`~mtmoe.schedules.Schedule` the engine drives it: :meth:`plan` sets the window, :meth:`before_step`
    and :meth:`before_evaluation` round the trials that are due and set ``may_search``, :meth:`frozen_parameters`
    leaves ``U`` out of Adam's update once a trial's window is over.
    """

    scalar_names = ("zeta",)
    host_attributes = frozenset({"may_search", "window_set", "epochs", "window_steps", "rounded_at"})

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
            raise SettingError("perm_epochs", epochs, "must be >= 1")
        if zeta < 0:
            raise SettingError("zeta", zeta, "must be >= 0")
        self.n_experts, self.epochs = n_experts, epochs
        self.per_task, self.eval_rounded = per_task, eval_rounded
        self.may_search, self.window_set = True, False
        self.window_steps, self.rounded_at = 0, -1  # host mirrors: the window in steps, the step last rounded at
        self.set_scalars(zeta=zeta)
        m = n_tasks if per_task else 1
        self.log_weights = nn.Parameter(torch.empty(m, n_experts, n_experts).uniform_(-0.05, 0.05))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.register_buffer("window", torch.zeros((), dtype=torch.long))  # E_perm * steps per epoch, set at fit
        self.register_buffer("soft", torch.zeros(m, n_experts, n_experts))  # latest soft matrix (zeros: none yet)
        self.register_buffer("rounded", torch.eye(n_experts).repeat(m, 1, 1))
        # rounded.argmax(-2), so that w P = w[..., index]: derived from ``rounded``, not saved, refreshed on loading
        self.register_buffer("rounded_index", torch.arange(n_experts).repeat(m, 1), persistent=False)
        self.register_load_state_dict_post_hook(_refresh_rounded_index)

    def set_window(self, steps_per_epoch: int) -> None:
        self.window_steps = self.epochs * steps_per_epoch
        self.window.fill_(self.window_steps)
        self.window_set = True

    def plan(self, steps_per_epoch: int, total_steps: int | None) -> None:
        self.set_window(steps_per_epoch)

    def flags(self) -> tuple:
        return (self.may_search,)

    def before_step(self, state: dict[str, Tensor], trials: Trials) -> None:
        """Round the trials whose next step ends their window; search only while some trial's window goes on."""
        self._round_slots(state, trials, [slot for slot, (search, steps) in trials.items()
                                          if steps + 1 == search.window_steps])
        self.may_search = any(steps + 1 < search.window_steps for search, steps in trials.values())

    def before_evaluation(self, state: dict[str, Tensor], trials: Trials | None) -> None:
        """Inside their window, trials evaluate the rounding of their latest soft matrix (the official evaluation),
        or with ``eval_rounded`` off the soft matrix; a snapshot keeps the rounding of its epoch's validation."""
        if trials is None:
            self.may_search = not self.eval_rounded
            return
        inside = [slot for slot, (search, steps) in trials.items() if 0 < steps < search.window_steps]
        if self.eval_rounded:
            due = [slot for slot in inside if trials[slot][0].rounded_at != trials[slot][1]]
            self._round_slots(state, trials, due)
        self.may_search = not self.eval_rounded and bool(inside)

    @staticmethod
    def _round_slots(state: dict[str, Tensor], trials: Trials, due: list[int]) -> None:
        """:func:`_round` on ``due``'s trials of the stacked ``state`` (one transfer for all of them)."""
        if not due:
            return
        _round(state, torch.tensor(due, device=state["soft"].device))
        for slot in due:
            search, steps = trials[slot]
            search.rounded_at = steps

    def frozen_parameters(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Past the window the step used the rounded matrix: ``U`` has no gradient, as alone."""
        return {"log_weights": state["step"] >= state["window"]}

    @property
    def frozen(self) -> bool:
        """True once the window is over (reads the counters on the host: for reports and tests)."""
        return int(self.window) > 0 and int(self.step) >= int(self.window)

    def rounding_due(self, training: bool) -> bool:
        """Whether the next forward pass needs :meth:`round_` first (reads the counters on the host): a training step
        that ends the window, or an evaluation inside the window with ``eval_rounded``."""
        step, window = int(self.step), int(self.window)
        return step + 1 == window if training else self.eval_rounded and 0 < step < window

    def round_(self) -> None:
        """Round the latest soft matrix to the permutation the next forward passes use (eq. 5, on the host)."""
        _round(dict(self.named_buffers(recurse=False)))

    def forward(self, weights: Tensor) -> tuple[Tensor, Tensor | None]:
        """Permute all task gates' weights ``[B, T, n]`` at once: ``w P`` (per task ``w_t P_t`` with ``per_task``), and
        the entropy penalty (``None`` in evaluation).

        Inside the window (training) P is the soft matrix of this step's schedule and the product is rescaled to each
        gate's own row sums; weights are non-negative and every row of a Sinkhorn matrix sums to at least 1/n, so a
        row of ``w P`` sums to 0 only where ``w``'s does: the 1e-30 added to the sum keeps such rows 0 (with zero
        gradient) and is below float32's precision for any row of weights summing to more than ~1e-23. Outside it
        P is the rounded matrix, applied as a gather of the weights (exact).
        """
        hard = weights.gather(-1, self.rounded_index.expand(weights.shape))
        if not self.training:
            if self.eval_rounded or not self.may_search:
                return hard, None
            searching = (self.step < self.window) & self.soft.any()
            with torch.no_grad():
                p, _ = sinkhorn_and_penalty(self.log_weights, *self._schedule(self.step, searching),
                                            torch.zeros_like(self.zeta))
            return torch.where(searching, self._apply_soft(weights, p), hard), None
        if not self.window_set:
            raise RuntimeError("LocalSearch.set_window(steps_per_epoch) must be called before training")
        step = torch.where(self.step < self.window, self.step + 1, self.step)  # stops at the window's end
        self.step.copy_(step)
        if not self.may_search:
            return hard, weights.new_zeros(())
        searching = step < self.window
        p, penalty = sinkhorn_and_penalty(self.log_weights, *self._schedule(step, searching), self.zeta)
        self.soft.copy_(torch.where(searching, p.detach(), self.soft))
        permuted = torch.where(searching, self._apply_soft(weights, p), hard)
        return permuted, torch.where(searching, penalty, 0.0).to(weights.dtype)

    def _schedule(self, step: Tensor, searching: Tensor) -> tuple[Tensor, Tensor]:
        """tau and R of ``step``; one iteration where the soft matrix is not used (its value is discarded)."""
        tau, iterations = schedule(step, self.window)
        return tau, torch.where(searching, iterations, 1)

    def _apply_soft(self, weights: Tensor, p: Tensor) -> Tensor:
        if self.per_task:
            permuted = torch.bmm(weights.transpose(0, 1), p.to(weights.dtype)).transpose(0, 1)  # [T, B, n] x [T, n, n]
        else:
            permuted = weights @ p[0].to(weights.dtype)
        return permuted * (weights.sum(-1, keepdim=True) / (permuted.sum(-1, keepdim=True) + 1e-30))

    def assignment(self) -> list[list[int]]:
        """Per permutation matrix: the expert each gate slot feeds (``col_ind``) under the rounded matrix."""
        return self.rounded.argmax(-1).tolist()

    def statistics(self) -> dict[str, float]:
        """Distance of the soft matrix from its rounding, experts moved from the identity, and the schedule of the
        last soft step (tau, R; none before the first)."""
        hard = self.rounded
        moved = (hard.argmax(-1) != torch.arange(self.n_experts, device=hard.device)).sum(-1).float().mean()
        stats = {
            "step": float(self.step),
            "frozen": float(self.frozen),
            "moved_experts": float(moved),
            "soft_to_rounded_max_abs": float((self.soft - hard).abs().max()) if self.soft.any() else 0.0,
        }
        if int(self.step) > 0:
            tau, iterations = schedule(torch.minimum(self.step, self.window - 1), self.window)
            stats.update(tau=float(tau), iterations=float(iterations))
        return stats
