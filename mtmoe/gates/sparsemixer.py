"""SparseMixer: sparse backpropagation for the router (Liu et al., 2023, ``002_206970894b0f39c6.txt``;
routing-methods.md §5).

Top-1 routing as in the paper. With router logits ``theta`` (a linear router without bias):

* masked softmax, eq. (9): ``pi_i = exp(theta_i) Delta_i / sum_j exp(theta_j) Delta_j`` with
  ``Delta_i = 1[theta* - theta_i <= r (|theta*| + |theta_i|)]``, ``theta* = max theta`` and ``r = jitter`` (0.1, the
  Switch jitter whose reachable set the mask reproduces, §3.4). The authors' code masks on the slightly looser
  ``(theta* - theta_i) / max(|theta_i|, theta*) > 2r``; the paper's rule is used;
* training samples ``D ~ pi`` (Gumbel-max on the masked logits, as the code); inference takes ``D = argmax pi``;
* the weight of expert ``D`` is ``c * pi_D`` where ``c = 1/2`` (mid-point, §4.1) when ``D != argmax`` and ``c = 1``
  (forward Euler) otherwise: the hybrid estimator of §4.2. The paper applies the mid-point on every such step
  (``midpoint_prob = 1``); the authors' code on half of them (``midpoint_prob = 0.5``);
* gradient: :class:`SparseMixerWeight` passes ``2 * dL/d(c pi_D)`` to ``pi_D`` (the authors' ``SparseMixerCore``),
  so ``dL/dtheta = 2 <omega * f_D, dL/dy> pi_D (e_D - pi)`` at the (halved or not) output. That is twice the paper's
  hybrid estimate on every step (Euler: ``2 dg(pi_D f_D)/dW_r``, §3.3's ``nabla ~ 2 nabla_1``; mid-point:
  ``2 * 2 dg(pi_D f_D / 2)/dW_r``, §4.1), a constant factor that Adam ignores except against the balance loss.
  The experts get ordinary gradients with weight ``omega * c * pi_D``;
* trainable output scale ``omega`` (§4.2), initialised to 1, one entry per element of an expert's output
  (``GateDims.expert_shape``), returned as ``GateOutput.output_scale``: ``y = omega * pi_D * f_D(x)``;
  ``output_scale=False`` drops it (the paper's ablation-1);
* Switch balance loss ``balance_coef * N sum f_i P_i`` (0.01, §5/App. B) with ``f`` from the sampled ``D`` and ``P``
  from the masked softmax, as in the code; training only.

Rows are not on the simplex (``simplex = False``): the single weight is ``pi_D`` (halved on mid-point steps).

Adaptations to per-sample routing with one gate per task [A] (routing-methods.md §5.5): token becomes sample, each
task gate has its own router and its own ``omega``; sampling draws from the gate's own random stream
(``RoutingInput.stream``: reproducible under ``--seed_everything``, like dropout, and the same alone or in a pack). ``top_k = 2`` goes beyond the paper: the second expert is drawn as in the
authors' later ``sparsemixer_v2`` (GRIN): the first choice is removed, the mask is recomputed against the new
maximum and the sampling repeats; the two weights are not renormalised. Unlike ``sparsemixer_v2``, which switches
to a third-order (Heun) mix without the factor 2, both experts here use this paper's estimator and keep ``omega``.
Results with ``top_k = 2`` are an extension, not a reproduction of the paper.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from mtmoe.errors import SettingError, UsageError
from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput, check_non_negative, check_probability
from mtmoe.gates.losses import switch_balance_loss
from mtmoe.gates.registry import register_gate
from mtmoe.gates.softmax import keras_dense
from mtmoe.scalars import cast


class SparseMixerWeight(torch.autograd.Function):
    """Forward ``c * pi_D``; backward ``2 * grad`` to ``pi_D`` whatever ``c`` (the authors' ``SparseMixerCore``).

    Written in torch operations with a separate ``setup_context``, so ``torch.func.vmap`` derives its batching rule
    (trial packs)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(probability: Tensor, scale: Tensor) -> Tensor:
        return probability * scale

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return 2 * grad, None


def sampling_mask(logits: Tensor, r: Tensor | float) -> Tensor:
    """Eq. (9)'s ``Delta``: the experts Switch's jitter can still pick; ``-inf`` logits (removed choices) never."""
    r = cast(torch.as_tensor(r, dtype=torch.float64, device=logits.device), logits)
    best = logits.max(dim=-1, keepdim=True).values
    return ((best - logits) <= r * (best.abs() + logits.abs())) & (logits > float("-inf"))


@register_gate("sparsemixer")
class SparseMixerGate(Gate):
    simplex = False
    #: The mid-point off the argmax always (paper, §4.2) or half the time (authors' code); jitter and the balance
    #: loss are untuned in the paper (§5).
    search_space = {"midpoint_prob": {"choice": [1.0, 0.5]}}
    scalar_names = ("midpoint_prob", "jitter")

    def __init__(
        self,
        dims: GateDims,
        top_k: int = 1,
        jitter: float = 0.1,
        midpoint_prob: float = 1.0,
        output_scale: bool = True,
        balance_coef: float = 0.01,
    ) -> None:
        super().__init__(dims)
        if top_k not in (1, 2):
            raise SettingError("top_k", top_k, "must be 1 (the paper) or 2 (an extension)")
        check_non_negative(jitter=jitter, balance_coef=balance_coef)
        self.top_k, self.balance_coef = top_k, float(balance_coef)
        self.set_scalars(midpoint_prob=check_probability("midpoint_prob", midpoint_prob), jitter=jitter)
        self.router = keras_dense(dims.in_features, dims.n_experts, bias=False)  # the mask is not shift-invariant
        if output_scale and not dims.expert_shape:
            raise UsageError("sparsemixer's output scale needs the experts' output shape (GateDims.expert_shape)")
        self.omega = nn.Parameter(torch.ones(dims.expert_shape)) if output_scale else None

    def max_active(self) -> int:
        return self.top_k

    def forward(self, routing: RoutingInput) -> GateOutput:
        logits = self.router(routing.x)
        weights = torch.zeros_like(logits)
        remaining = logits
        for choice in range(self.top_k):
            keep = sampling_mask(remaining, self.jitter)
            masked = remaining.masked_fill(~keep, float("-inf"))
            probabilities = masked.softmax(dim=-1)
            best = masked.argmax(dim=-1, keepdim=True)
            if self.training:
                if routing.stream is None:
                    raise ValueError("SparseMixerGate samples in training from RoutingInput.stream")
                draws = routing.stream.child(choice)
                gumbel = draws.child(0).gumbel(masked.shape, masked.device, masked.dtype)
                chosen = (masked + gumbel).masked_fill(~keep, float("-inf")).argmax(dim=-1, keepdim=True)
                coin = draws.child(1).uniform(best.shape, masked.device)
                midpoint = (chosen != best) & (coin < self.midpoint_prob)
                scale = 1.0 - 0.5 * midpoint.to(logits.dtype)
                weight = SparseMixerWeight.apply(probabilities.gather(-1, chosen), scale)
            else:
                chosen = best
                weight = probabilities.gather(-1, chosen)
            weights = weights.scatter(-1, chosen, weight)
            if choice == 0:
                first_choice, first_probabilities, unmasked = chosen, probabilities, keep
            remaining = remaining.scatter(-1, chosen, float("-inf"))
        aux, stats = self.zero(logits), {}
        if self.training:
            stats["unmasked_experts"] = unmasked.sum(dim=-1).to(logits.dtype).mean()
            if self.balance_coef > 0:
                balance = switch_balance_loss(first_probabilities, first_choice.squeeze(-1))
                aux, stats["balance_loss"] = self.balance_coef * balance, balance.detach()
        return GateOutput(weights, aux, stats, output_scale=self.omega)
