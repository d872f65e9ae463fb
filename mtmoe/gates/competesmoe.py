"""CompeteSMoE: route by competition on the experts' responses, distil it into the router (routing-methods.md §3-4).

``competesmoe`` is the first version (CSv1, Pham et al., ICML'24, ``000_c0babc0904d40e6a.txt`` §3) and
``competesmoe-v2`` the later one (CSv2, ``003_97490da4c9d036cf.txt`` §2). Both route with a Top-K router
``softmax(TopK_{-inf}(theta, K))`` (the SMoE baseline; this suite's Top-k without noise) except on *competition
steps*, drawn in training with probability ``competition_prob`` (CSv1's lambda, CSv2's omega). On such a step every
expert's output ``g_i(x)`` gives it an affinity and the K experts with the highest response win:

* CSv1 §3.1: ``s_i = ||g_i(x)||_2``, weights ``softmax(TopK_{-inf}(s, K))``;
* CSv2 §2.2: ``s_i = mean_d softplus(g_i(x)_d)``, weights ``TopK_0(s, K) / sum`` (linear normalisation).

The task's mixture then uses the competition weights (the winners get gradient through their outputs and through the
weights computed from them), and the router learns on that step only from a distillation loss towards the detached
competition policy (auxiliary, training only; MSE means over the batch and the N experts):

* CSv1 eq. (3): ``router_loss_coef * MSE(softmax(TopK(theta, K)), w_C)``;
* CSv2 eq. (1): ``distill_coef * [MSE(s_R, s_C) + winner_weight * mean_{j in I_C} (s_C^j - s_R^j)^2]`` plus eq. (2),
  ``diversity_coef * L_div``, the mean off-diagonal cosine similarity of the K winners' outputs.

On normal steps CSv2 adds ``balance_coef`` times the Switch balance loss (counting each sample's top-1 router choice,
as GShard and the CSv2 code do; probabilities from the full router softmax) and ``z_loss_coef`` times the router
z-loss (:mod:`mtmoe.gates.losses`). Inference uses the router alone: competition never runs in eval mode.

Adaptations to per-sample routing with one gate per task [A] (routing-methods.md §0, §3.2, §4.6):

* Token becomes sample. MMoE computes all experts densely, so a competition step costs nothing extra; expert
  outputs of any shape are compared over all their elements (``flatten``), so CNN experts work unchanged.
* One coin per step for the whole MoE layer, shared by the task gates: the papers draw one coin per MoE layer per
  step and an MMoE has one MoE layer. The coin of training forward pass ``t`` is a pure function of ``(seed, t)``
  (a precomputed Bernoulli schedule in effect, CSv2 §2.3.2; CSv2's cap A_max on concurrent layers is moot with one
  layer), ``seed`` defaults to the run seed, and the step counter is a buffer, so the schedule survives checkpoints
  and every task gate of a model sees the same draws. Steps count training forward passes (micro-batches). The
  coin is drawn on the gate's device by a counter-based hash (:func:`uniform_hash`) and both kinds of step are
  computed, one selected by ``torch.where``: no host synchronisation, and the gate runs unchanged under
  ``torch.func.vmap`` (trial packs, where every trial draws its own coins).
* The competition is task-agnostic: on a competition step every task gate outputs the same competition weights
  (the papers' mechanism, routing-methods.md §4.6 option (a)). ``competition_output=False`` keeps each task's router
  weights in the output and uses the competition only as the distillation target (option (b), not in the papers).
* The distillation target is detached (the CSv2 code; the CSv1 code leaves it attached). ``distill="paper"``
  compares the top-K policies as eqs. (3) and (1) write them; ``distill="code"`` compares the full router softmax
  with the competition weights (CSv1 code) or with ``softmax(s)`` (CSv2 code).
* CSv1 eq. (5) weights the router's task loss by the "balance factor" alpha; the authors' code instead adds
  ``0.01 * alpha * L_R`` with alpha = 5. Here the task loss is unweighted and ``router_loss_coef`` (alpha') is the
  distillation weight, 0.05 by default (the code's effective 0.01 * 5).
* CSv2's warm-up (plain Top-K for the first ``warmup`` fraction of the run, App. H) needs the run's length:
  :meth:`set_training_steps` receives the planned number of training forward passes from the training engine
  (the gate is a :class:`~mtmoe.schedules.Schedule`); a gate trained outside it has no warm-up.
* CSv2's diversity loss uses cosine similarity (the code) averaged over the K(K-1) off-diagonal entries (eq. (2);
  the code's mean over K x K is (K-1)/K of it); it is 0 for K = 1. The code-only balance loss on the competition
  policy is left out. Balance and z-loss are part of the papers' training setups for every method, SMoE included;
  CSv2's LM setup uses the balance loss (0.01, Table 19) and only its VLM setup adds the z-loss (0.001), so the
  z-loss is off by default.
* Routers: CSv1 uses the Top-k gate's router (Keras Dense with bias), so it differs from Top-k only by competition;
  CSv2's is linear without bias, initialised N(0, 0.02) (App. H).
* No "+" variant (``permutable = False``): competition weights belong to the experts that produced the responses,
  and local search would hand them to other experts.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from mtmoe.errors import SettingError
from mtmoe.gates.base import (
    Gate, GateDims, GateOutput, RoutingInput, check_non_negative, check_probability, resolve_k, topk_softmax,
)
from mtmoe.gates.losses import router_z_loss, switch_balance_loss
from mtmoe.schedules import Schedule
from mtmoe.gates.registry import register_gate
from mtmoe.gates.softmax import keras_dense
from mtmoe.scalars import cast


_MIX = 0x45D9F3B  # the multiplier of a well-tested 32-bit integer hash (products stay below 2^59 in int64)
_LOW32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """An avalanching permutation of 32-bit values held in int64 tensors."""
    x = (((x >> 16) ^ x) * _MIX) & _LOW32
    x = (((x >> 16) ^ x) * _MIX) & _LOW32
    return (x >> 16) ^ x


def uniform_hash(seed: Tensor, step: Tensor) -> Tensor:
    """A float64 uniform in [0, 1) that is a pure function of the int64 tensors ``seed`` (>= 0) and ``step``
    (>= 0): a counter-based draw, computed where the tensors are, that vmaps and never reads a value on the host."""
    key = _mix32(_mix32(seed & _LOW32) ^ ((seed >> 32) & _LOW32))
    return _mix32(_mix32((key + step) & _LOW32) ^ 0x9E3779B9).double() / 2.0**32


class CompetitionGate(Gate):
    """What both versions share: the Top-K router's routing, the competition schedule and the forward pass.

    Subclasses define ``router`` (a module: routing features -> N logits), ``affinity(outputs [B, N, D]) -> s [B, N]``,
    ``competition_weights(s) -> (weights [B, N], winners [B, K])`` and ``competition_loss(...) -> (aux, stats)``.
    """

    needs_expert_outputs = True
    permutable = False

    def __init__(
        self,
        dims: GateDims,
        k: int | None,
        competition_prob: float,
        distill: Literal["paper", "code"],
        competition_output: bool,
        seed: int | None,
    ) -> None:
        super().__init__(dims)
        self.k = resolve_k(k, dims)
        self.set_scalars(competition_prob=check_probability("competition_prob", competition_prob))
        if distill not in ("paper", "code"):
            raise SettingError("distill", distill, "must be paper or code")
        self.distill, self.competition_output = distill, bool(competition_output)
        seed = torch.initial_seed() if seed is None else seed
        self.register_buffer("seed", torch.tensor(seed % 2**63, dtype=torch.long))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def max_active(self) -> int:
        return self.k

    def warming_up(self, step: Tensor) -> Tensor:
        return torch.zeros_like(step, dtype=torch.bool)

    def competes(self) -> Tensor:
        """This training step's coin (a 0-d bool tensor, a function of ``(seed, step)``); advances the step counter."""
        step = self.step.clone()
        self.step += 1
        return (uniform_hash(self.seed, step) < self.competition_prob) & ~self.warming_up(step)

    def normal_step_loss(self, logits: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return self.zero(logits), {}

    def forward(self, routing: RoutingInput) -> GateOutput:
        """In training, both a normal and a competition step are computed and the coin selects one (the other's
        losses and weights get zero gradient): ``stats["competition"]`` is the coin, the other statistics are those
        of the step taken, 0 for the other kind's."""
        logits = self.router(routing.x)
        router_weights, router_index = topk_softmax(logits, self.k)
        if not self.training:
            return GateOutput(router_weights, self.zero(logits))
        if routing.expert_outputs is None:
            raise ValueError(f"{type(self).__name__} needs RoutingInput.expert_outputs")
        compete = self.competes()
        normal_aux, normal_stats = self.normal_step_loss(logits)
        outputs = routing.expert_outputs.flatten(2)
        scores = self.affinity(outputs)
        weights, winners = self.competition_weights(scores)
        competition_aux, competition_stats = self.competition_loss(logits, router_weights, weights, scores, winners,
                                                                   outputs)
        agreement = (router_index.unsqueeze(-1) == winners.unsqueeze(-2)).any(-1).to(logits.dtype).mean()
        zero = self.zero(logits)
        stats = {"competition": compete.to(logits.dtype),
                 **{key: torch.where(compete, zero, value) for key, value in normal_stats.items()},
                 **{key: torch.where(compete, value, zero)
                    for key, value in {"router_agreement": agreement, **competition_stats}.items()}}
        aux = torch.where(compete, competition_aux, normal_aux)
        if self.competition_output:
            router_weights = torch.where(compete, weights, router_weights)
        return GateOutput(router_weights, aux, stats)


@register_gate("competesmoe")
class CompeteSMoEGate(CompetitionGate):
    """CSv1: L2-norm competition, top-K softmax weights, MSE router loss (eq. (3)); no balance loss (§6.1).

    Defaults: lambda = 0.05 (§3.2, Table 4), alpha' = 0.05 (the authors' scripts: 0.01 * alpha with alpha = 5).
    """

    #: lambda robust for 0.03-0.09 (Table 4, §6.4.1); 0.01 x alpha with alpha in {0.1, 1, 5}, robust for alpha <= 5
    #: (Table 5).
    search_space = {"competition_prob": {"choice": [0.03, 0.05, 0.07, 0.09]},
                    "router_loss_coef": {"choice": [0.001, 0.01, 0.05]}}
    scalar_names = ("competition_prob", "router_loss_coef")

    def __init__(
        self,
        dims: GateDims,
        k: int | None = None,
        competition_prob: float = 0.05,
        router_loss_coef: float = 0.05,
        distill: Literal["paper", "code"] = "paper",
        competition_output: bool = True,
        seed: int | None = None,
    ) -> None:
        super().__init__(dims, k, competition_prob, distill, competition_output, seed)
        check_non_negative(router_loss_coef=router_loss_coef)
        self.set_scalars(router_loss_coef=router_loss_coef)
        self.router = keras_dense(dims.in_features, dims.n_experts)

    def affinity(self, outputs: Tensor) -> Tensor:
        return outputs.norm(dim=-1)

    def competition_weights(self, scores: Tensor) -> tuple[Tensor, Tensor]:
        return topk_softmax(scores, self.k)

    def competition_loss(self, logits: Tensor, router_weights: Tensor, weights: Tensor, scores: Tensor,
                         winners: Tensor, outputs: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        prediction = router_weights if self.distill == "paper" else logits.softmax(dim=-1)
        loss = F.mse_loss(prediction, weights.detach())
        return cast(self.router_loss_coef, loss) * loss, {"router_loss": loss.detach()}


@register_gate("competesmoe-v2")
class CompeteSMoEV2Gate(CompetitionGate, Schedule):
    """CSv2: mean-softplus competition, linear winner weights, distillation eq. (1), diversity eq. (2), warm-up.

    Defaults are CSv2 Table 20 / §5.4 (omega 0.07, gamma 0.01, alpha 0.1, beta 0.005, warm-up 5%) and the LM
    setup's balance coefficient 0.01 (Table 19).
    """

    #: omega, alpha, gamma, beta: Tables 5-8 (best 0.07, 0.1, 0.01, 0.005; beta 0 added: the loss targets upcycled,
    #: identical experts); the warm-up 5% and the balance 0.01 stay fixed (Tables 19-20).
    search_space = {"competition_prob": {"choice": [0.03, 0.05, 0.07, 0.09]},
                    "winner_weight": {"choice": [0.0, 0.1, 0.2, 0.3]}, "distill_coef": {"choice": [0.001, 0.01, 0.03]},
                    "diversity_coef": {"choice": [0.0, 0.001, 0.005, 0.01]}}
    scalar_names = ("competition_prob", "distill_coef", "winner_weight", "diversity_coef")

    def __init__(
        self,
        dims: GateDims,
        k: int | None = None,
        competition_prob: float = 0.07,
        distill_coef: float = 0.01,
        winner_weight: float = 0.1,
        diversity_coef: float = 0.005,
        balance_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        warmup: float = 0.05,
        distill: Literal["paper", "code"] = "paper",
        competition_output: bool = True,
        seed: int | None = None,
    ) -> None:
        super().__init__(dims, k, competition_prob, distill, competition_output, seed)
        check_non_negative(distill_coef=distill_coef, winner_weight=winner_weight, diversity_coef=diversity_coef,
                           balance_coef=balance_coef, z_loss_coef=z_loss_coef)
        self.set_scalars(distill_coef=distill_coef, winner_weight=winner_weight, diversity_coef=diversity_coef)
        self.balance_coef, self.z_loss_coef = float(balance_coef), float(z_loss_coef)
        self.warmup = check_probability("warmup", warmup)
        self.register_buffer("warmup_steps", torch.zeros((), dtype=torch.long))
        self.router = nn.Linear(dims.in_features, dims.n_experts, bias=False)
        nn.init.normal_(self.router.weight, 0.0, 0.02)

    def set_training_steps(self, total: int | None) -> None:
        self.warmup_steps.fill_(0 if total is None else round(self.warmup * total))

    def plan(self, steps_per_epoch: int, total_steps: int | None) -> None:
        """The warm-up is a fraction of the run: none for a run until early stopping (App. H)."""
        self.set_training_steps(total_steps)

    def warming_up(self, step: Tensor) -> Tensor:
        return step < self.warmup_steps

    def affinity(self, outputs: Tensor) -> Tensor:
        return F.softplus(outputs).mean(dim=-1)

    def competition_weights(self, scores: Tensor) -> tuple[Tensor, Tensor]:
        top_values, top_index = scores.topk(self.k, dim=-1)
        normalised = top_values / top_values.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
        return torch.zeros_like(scores).scatter(-1, top_index, normalised), top_index

    def distillation(self, logits: Tensor, router_weights: Tensor, target: Tensor, scores: Tensor,
                     winners: Tensor) -> Tensor:
        """Eq. (1) on the top-K policies (``distill="paper"``) or on full softmaxes (``"code"``)."""
        if self.distill == "code":
            router_weights, target = logits.softmax(dim=-1), scores.detach().softmax(dim=-1)
        winners_error = (target - router_weights).gather(-1, winners).square().mean()
        return F.mse_loss(router_weights, target) + cast(self.winner_weight, winners_error) * winners_error

    def competition_loss(self, logits: Tensor, router_weights: Tensor, weights: Tensor, scores: Tensor,
                         winners: Tensor, outputs: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        distill = self.distillation(logits, router_weights, weights.detach(), scores, winners)
        diversity = self.diversity(outputs, winners)
        stats = {"distill_loss": distill.detach(), "diversity_loss": diversity.detach()}
        return cast(self.distill_coef, distill) * distill + cast(self.diversity_coef, diversity) * diversity, stats

    def diversity(self, outputs: Tensor, winners: Tensor) -> Tensor:
        """Eq. (2): mean over samples of the mean off-diagonal cosine similarity of the K winners' outputs."""
        if self.k == 1:
            return outputs.new_zeros(())
        winning = outputs.gather(1, winners.unsqueeze(-1).expand(-1, -1, outputs.shape[-1]))  # [B, K, D]
        unit = F.normalize(winning, dim=-1)
        similarity = unit @ unit.transpose(1, 2)  # [B, K, K]
        off_diagonal = similarity.sum(dim=(1, 2)) - similarity.diagonal(dim1=1, dim2=2).sum(dim=-1)
        return (off_diagonal / (self.k * (self.k - 1))).mean()

    def normal_step_loss(self, logits: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        aux, stats = self.zero(logits), {}
        if self.balance_coef > 0:
            balance = switch_balance_loss(logits.softmax(dim=-1), logits.argmax(dim=-1))
            aux, stats["balance_loss"] = aux + self.balance_coef * balance, balance.detach()
        if self.z_loss_coef > 0:
            z_loss = router_z_loss(logits)
            aux, stats["z_loss"] = aux + self.z_loss_coef * z_loss, z_loss.detach()
        return aux, stats
