"""ReMoE: ReLU routing with adaptive L1 regularisation (Wang, Zhu and Chen, ICLR 2025, arXiv 2412.14711, §3;
official code github.com/thu-ml/ReMoE, ``ReLURouter`` in ``megatron/core/transformer/moe/router.py`` and the
coefficient update in ``megatron/training/training.py``).

* Router: ``R(x) = ReLU(x W_r)``, a linear router without bias; the weights are ``R(x)`` itself, neither selected
  nor normalised: a sample uses the experts whose ReLU is positive, a varying number (none included), and rows are
  not on the simplex.
* Sparsity regulariser (training only), the gate's auxiliary loss ``lambda_i * L_reg``. By default the
  load-balanced L1 (as the official code, which always uses it):
  ``L_reg = sum_e f_e (1/T) sum_t R(x_t)_e`` with ``f_e = E/(k T) sum_t 1[R(x_t)_e > 0]`` (no gradient through
  ``f``); ``load_balance=False`` gives the plain L1 ``(1/T) sum_t ||R(x_t)||_1``.
* Adaptive coefficient: with the batch's sparsity ``S_i = 1 - (1/(T E)) sum_{t,e} 1[R(x_t)_e > 0]``,
  ``lambda_{i+1} = lambda_i * alpha`` when ``S_i < 1 - k/E`` and ``lambda_i / alpha`` otherwise (the code's rule;
  the paper's ``alpha^sign(...)`` leaves it unchanged at equality), from ``lambda_0 = l1_init = 1e-8`` with
  ``alpha = l1_multiplier = 1.2`` (the authors' defaults). ``k`` targets ``k`` active experts of ``E`` on average.

Adaptations to per-sample routing with one gate per task [A]: token becomes sample (``T`` is the mini-batch), and
each task gate has its own ``lambda`` driven by its own sparsity (the paper shares one ``lambda`` over the layers
and averages their sparsity). ``lambda`` is a persistent float32 buffer (the code keeps it float32 too), updated in
the training forward pass after it has scaled that step's loss, as the code updates it after the step: an in-place
tensor operation, so no host read and each trial of a pack has its own. The authors' router has no input jitter
by default and none is used here. The router is initialised as every gate here (Keras' Glorot uniform), not with
the authors' N(0, 0.01) (``--init-method-std``): that scale is for LayerNorm'd hidden states of width >= 768, and on
the small, Keras-initialised routing features here it makes every weight, and so each task's mixture, tiny at the
start (ReLU weights are not normalised, unlike a softmax's).
"""
from __future__ import annotations

import torch

from mtmoe.errors import SettingError
from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput, resolve_k
from mtmoe.gates.registry import register_gate
from mtmoe.gates.softmax import keras_dense
from mtmoe.scalars import cast


@register_gate("remoe")
class ReMoEGate(Gate):
    simplex = False
    min_active = 0
    #: alpha: the authors run 1.2; one step either side (it sets how fast lambda follows the target).
    search_space = {"l1_multiplier": {"choice": [1.1, 1.2, 1.3]}}
    scalar_names = ("l1_multiplier",)

    def __init__(self, dims: GateDims, k: int | None = None, l1_init: float = 1e-8, l1_multiplier: float = 1.2,
                 load_balance: bool = True) -> None:
        super().__init__(dims)
        if not l1_init > 0:
            raise SettingError("l1_init", l1_init, "must be > 0")
        if not l1_multiplier > 1:
            raise SettingError("l1_multiplier", l1_multiplier, "must be > 1")
        self.k, self.load_balance = resolve_k(k, dims), bool(load_balance)
        self.router = keras_dense(dims.in_features, dims.n_experts, bias=False)
        self.register_buffer("l1_coef", torch.tensor(l1_init, dtype=torch.float32))
        self.set_scalars(l1_multiplier=l1_multiplier)

    def forward(self, routing: RoutingInput) -> GateOutput:
        weights = torch.relu(self.router(routing.x))
        if not self.training:
            return GateOutput(weights, self.zero(weights))
        active = weights > 0
        tokens, experts = weights.shape
        if self.load_balance:  # the code's switch_load_balancing_loss_func, its coefficient in float64 as there
            scale = self.l1_coef.double() * experts / (tokens * tokens * self.k)
            regulariser = (weights.sum(dim=0) * active.sum(dim=0).to(weights.dtype)).sum()
        else:
            scale = self.l1_coef.double() / tokens
            regulariser = weights.sum()
        aux = regulariser * scale.to(weights.dtype)
        sparsity = 1 - active.sum().float() / active.numel()
        stats = {"sparsity": sparsity, "l1_coef": self.l1_coef.clone()}
        with torch.no_grad():
            alpha = cast(self.l1_multiplier, self.l1_coef)
            self.l1_coef.copy_(torch.where(sparsity < 1 - self.k / experts, self.l1_coef * alpha,
                                           self.l1_coef / alpha))
        return GateOutput(weights, aux, stats)
