"""The smooth-step function of Hazimeh et al. (The Tree Ensemble Layer), COMET paper Appendix A, eq. (9).

    S_gamma(t) = 0                                  for t <= -gamma/2
               = -2/gamma^3 t^3 + 3/(2 gamma) t + 1/2  for -gamma/2 < t < gamma/2
               = 1                                  for t >= gamma/2

C^1 everywhere and exactly 0 or 1 outside [-gamma/2, gamma/2]: that is what gives DSelect-k and COMET exact zeros.
(The paper's text prints the middle interval as gamma/2 <= t <= gamma/2; the official code uses the one above.)
"""
from __future__ import annotations

import torch
from torch import Tensor

from mtmoe.scalars import cast


def coefficients(t: Tensor, gamma: Tensor | float) -> tuple[Tensor, Tensor, Tensor]:
    """``gamma / 2``, ``-2 / gamma^3`` and ``3 / (2 gamma)``: computed in float64 from ``gamma`` (a float or a 0-d
    float64 tensor, a trial's setting) and cast once to ``t``'s dtype."""
    gamma = torch.as_tensor(gamma, dtype=torch.float64, device=t.device)
    return cast(gamma / 2.0, t), cast(-2.0 / gamma**3, t), cast(1.5 / gamma, t)


def smooth_step(t: Tensor, gamma: Tensor | float) -> Tensor:
    """``S_gamma(t)`` with :func:`coefficients`."""
    half, cubed, linear = coefficients(t, gamma)
    # The cubic is evaluated on t clamped to [-half, half]: torch.where back-propagates 0 * d(cubic)/dt into the
    # unused branch, and for huge |t| (> ~1.8e19 in float32, > ~256 in float16) t**3 overflows so 0 * inf = NaN.
    inner = torch.minimum(torch.maximum(t, -half), half)
    cubic = cubed * inner**3 + linear * inner + 0.5
    return torch.where(t <= -half, 0.0, torch.where(t >= half, 1.0, cubic))  # scalars: no filled tensors
