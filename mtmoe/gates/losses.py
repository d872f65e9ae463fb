"""Auxiliary router losses shared by several gates (routing-methods.md §1.2-1.3), reduced over the batch.

* Switch load balancing (Fedus et al., 2022): ``N * sum_i f_i P_i`` with ``f_i`` the fraction of samples whose
  (first) choice is expert ``i`` (no gradient) and ``P_i`` the mean routing probability. It equals 1 when both are
  uniform, the value to expect under balanced routing; the returned value is unscaled (the gate multiplies it by its
  coefficient), so logs show ``N sum f P`` itself.
* Router z-loss (ST-MoE, Zoph et al., 2022): ``mean_b (logsumexp_i theta_bi)^2``.
"""
from __future__ import annotations

import torch
from torch import Tensor


def switch_balance_loss(probabilities: Tensor, choice: Tensor) -> Tensor:
    """``N sum_i f_i P_i`` for probabilities ``[B, N]`` and each sample's counted choice ``[B]`` (long)."""
    n = probabilities.shape[-1]
    # scatter_add (not index_add): it has a batching rule, so a pack of trials counts in one kernel
    counts = torch.zeros_like(probabilities[0]).scatter_add(0, choice, torch.ones_like(choice, dtype=probabilities.dtype))
    return n * (counts / choice.numel() * probabilities.mean(dim=0)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    return logits.logsumexp(dim=-1).square().mean()
