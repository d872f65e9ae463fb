"""Experts, shared bottoms and task towers as plain ``nn.Module``s (Supplement S1.2).

All n experts run as one batched operation: for dense experts a single ``Linear(p, n * units)`` whose output is
viewed as ``[B, n, units]``; for CNN experts grouped convolutions and batched matmuls (:class:`ConvExperts`). Either
is the same function as n separate experts. Computing every expert and multiplying by the gate's dense weights is
exact for every gate: zero weights give zero gradient to unselected experts (comet-protocol.md §1).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from mtmoe.epilogue import bias_relu_dropout
from mtmoe.errors import UsageError
from mtmoe.mixing import mixed_experts
from mtmoe.random import Stream


def dropout(h: Tensor, p: float, training: bool, stream: Stream | None) -> Tensor:
    """Inverted dropout of ``h`` in training, with the mask drawn from the trial's ``stream`` (``mtmoe.random``)."""
    if not training or p == 0:
        return h
    if stream is None:
        raise ValueError("dropout in training draws from the model's random stream: pass stream=")
    return stream.dropout(h, p)


def autocast_bias(bias: Tensor) -> Tensor:
    """``bias`` in autocast's dtype when autocast is on (a no-op otherwise).

    ``F.linear`` under autocast casts its bias itself; vmap's batching rule for a trial pack (matmul, then add)
    does not, and the add would promote the layer's whole bf16 output back to float32.
    """
    device = bias.device.type
    return bias.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else bias


class DenseExperts(nn.Module):
    """n experts, each ``Dense(units) -> ReLU -> Dropout(p)``; ``[B, in] -> [B, n, units]``.

    Dropout is ``nn.Dropout``'s inverted dropout with the mask drawn from the trial's random stream (:func:`dropout`).
    The bias add, the ReLU and the dropout run as one pass after the matmul, and their backward as one
    (:func:`mtmoe.epilogue.bias_relu_dropout`): the same values as the three operations (under ``torch.func.vmap``,
    a linear layer is the matmul then the bias add).
    """

    #: Used only cast to autocast's dtype, once a forward pass (``F.linear``'s weight, :func:`autocast_bias`): a
    #: trial pack hands them in bfloat16 under bf16 autocast, copies its Adam writes (:class:`mtmoe.pack.engine`).
    autocast_parameters = ("linear.weight", "linear.bias")

    def __init__(self, in_features: int, units: int, n_experts: int, dropout: float = 0.5,
                 fused_sums: bool = False) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.in_features, self.n_experts, self.units, self.dropout = in_features, n_experts, units, dropout
        self.fused_sums = fused_sums  # the mixing's sums in its kernels (mixed_experts' sums: not bitwise)
        self.out_features = units
        self.linear = nn.Linear(in_features, n_experts * units)

    def forward(self, x: Tensor, stream: Stream | None = None) -> Tensor:
        h = bias_relu_dropout(self.matmul(x), autocast_bias(self.linear.bias), *self._dropout(stream))
        return h.view(-1, self.n_experts, self.units)

    def matmul(self, x: Tensor) -> Tensor:
        """The layer's matmul ``x W^T`` ``[B, n * units]``, before its bias, ReLU and dropout."""
        return F.linear(x, self.linear.weight)

    def mixed(self, y: Tensor, weights: Tensor, stream: Stream | None = None) -> Tensor:
        """The experts' outputs from the matmul's output ``y`` (:meth:`matmul`) weighted by the gates,
        ``bmm(weights, self(x, stream))`` for ``weights`` ``[B, T, n]``: ``[B, T, units]``, the same values, with a
        backward that writes the gradient of ``y`` in one pass (:func:`mtmoe.mixing.mixed_experts`); with
        ``fused_sums`` the experts' outputs are never written, and the mixture and the bias's and the weights'
        gradients come in the kernels' own summation order (to float rounding)."""
        return mixed_experts(y, autocast_bias(self.linear.bias), weights, *self._dropout(stream),
                             sums=self.fused_sums)

    def _dropout(self, stream: Stream | None) -> tuple:
        """The epilogue's dropout arguments in this mode: ``p``, and with ``p > 0`` the stream's seed, step and
        site."""
        p = self.dropout if self.training else 0.0
        if p and stream is None:
            raise ValueError("dropout in training draws from the model's random stream: pass stream=")
        return (p, stream.seed, stream.step, stream.site) if p else (p,)

    @torch.no_grad()
    def keras_init_(self) -> None:
        """Glorot-uniform per expert (fan-in p, fan-out units), zero bias."""
        bound = math.sqrt(6.0 / (self.in_features + self.units))
        self.linear.weight.uniform_(-bound, bound)
        self.linear.bias.zero_()


class EmbeddingBottom(nn.Module):
    """Recommender shared bottom: user and item embeddings, concatenated; experts and gates both read it."""

    def __init__(self, n_users: int, n_items: int, dim: int) -> None:
        super().__init__()
        self.user = nn.Embedding(n_users, dim)
        self.item = nn.Embedding(n_items, dim)
        self.out_features = 2 * dim

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return torch.cat([self.user(batch["user"]), self.item(batch["item"])], dim=-1)

    @torch.no_grad()
    def keras_init_(self) -> None:
        """Keras' Embedding default, U(-0.05, 0.05)."""
        self.user.weight.uniform_(-0.05, 0.05)
        self.item.weight.uniform_(-0.05, 0.05)


class GroupedLinear(nn.Module):
    """n independent ``Linear(in, out)`` layers, ``[B, n, in] -> [B, n, out]``, in one batched matmul.

    Initialised as ``nn.Linear`` is, per expert: weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)).
    """

    def __init__(self, n: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(n, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(n, out_features))
        bound = 1.0 / math.sqrt(in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return torch.baddbmm(self.bias.unsqueeze(1), x.transpose(0, 1), self.weight).transpose(0, 1)


class ConvExperts(nn.Module):
    """n CNN experts on the same image, ``[B, C, H, W] -> [B, n, d]`` (S1.2, official ``conv_expert.py``).

    Each expert is, per ``(kernel, filters)`` of ``conv_layers``, ``Conv(kernel, 'valid') -> ReLU -> MaxPool(2)``
    (Keras' defaults: stride-2 pooling that drops an odd last row/column), then flatten, then ``dense_layers`` times
    ``Dense(units) -> ReLU``; ``d`` is ``units``, or the flattened size without dense layers (CelebA). S1.2 names no
    dropout for the image experts; ``dropout > 0`` applies :func:`dropout` to the output as
    :class:`DenseExperts` does.

    All experts run at once: the first convolution is one ``Conv2d(C, n * filters)`` (every expert reads the same
    image), each later one a ``Conv2d(n * f, n * f', groups=n)`` whose block-diagonal weight lets expert i's
    channels see only expert i's channels, and the dense layers are :class:`GroupedLinear`. Channels are
    expert-major, so expert i's flatten is PyTorch's flatten of its own ``[f, h, w]`` map: the same function as n
    separate CNNs (tested), in a handful of kernels instead of a Python loop over experts.
    """

    def __init__(
        self,
        image_shape: tuple[int, int, int],
        conv_layers: tuple[tuple[int, int], ...],
        units: int,
        dense_layers: int,
        n_experts: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        channels, height, width = image_shape
        self.n_experts, self.dropout = n_experts, dropout
        convs = []
        for i, (kernel, filters) in enumerate(conv_layers):
            in_channels = channels if i == 0 else n_experts * channels
            convs.append(nn.Conv2d(in_channels, n_experts * filters, kernel, groups=1 if i == 0 else n_experts))
            channels, height, width = filters, (height - kernel + 1) // 2, (width - kernel + 1) // 2
            if height < 1 or width < 1:
                raise UsageError(f"a {image_shape[1]}x{image_shape[2]} image is too small for the expert's "
                                 f"{len(conv_layers)} convolution and pooling layers")
        self.convs = nn.ModuleList(convs)
        self.flat_features = channels * height * width
        sizes = [self.flat_features] + [units] * dense_layers
        self.dense = nn.ModuleList(GroupedLinear(n_experts, a, b) for a, b in zip(sizes, sizes[1:]))
        self.out_features = sizes[-1]

    def forward(self, x: Tensor, stream: Stream | None = None) -> Tensor:
        h = x
        for conv in self.convs:
            # max-pooling before the ReLU: the same values and gradients (max commutes with the monotone ReLU), the
            # ReLU on a quarter of the values
            h = F.max_pool2d(F.conv2d(h, self._layout(conv.weight), conv.bias, groups=conv.groups), 2).relu_()
        h = h.reshape(h.shape[0], self.n_experts, self.flat_features)
        for dense in self.dense:
            h = dense(h).relu_()
        return dropout(h, self.dropout, self.training, stream)

    @staticmethod
    def _layout(weight: Tensor) -> Tensor:
        """On CPU, the weight copied to channels-last (NHWC) layout, which makes oneDNN run the convolution, and
        the pooling after it, in NHWC: faster MultiMNIST and MultiFashionMNIST training steps (``bench_datasets.py``;
        benchmarks/README.md, "Channels-last convolutions on CPU"). On other devices the weight as it is (NCHW;
        channels-last is not measured there), and under ``torch.func.vmap`` (trial packs), whose convolution folds
        the trials into groups. An explicit copy, because ``contiguous(memory_format=...)`` leaves a one-channel
        weight as it is."""
        if weight.device.type != "cpu" or torch._C._functorch.is_batchedtensor(weight):
            return weight
        return torch.empty_like(weight, memory_format=torch.channels_last).copy_(weight)

    @torch.no_grad()
    def keras_init_(self) -> None:
        """Glorot-uniform per expert (a convolution's fans are kernel area times its per-expert channels), zero bias."""
        for conv in self.convs:
            area = conv.kernel_size[0] * conv.kernel_size[1]
            fan_in, fan_out = area * conv.in_channels // conv.groups, area * conv.out_channels // self.n_experts
            conv.weight.uniform_(-math.sqrt(6.0 / (fan_in + fan_out)), math.sqrt(6.0 / (fan_in + fan_out)))
            conv.bias.zero_()
        for dense in self.dense:
            bound = math.sqrt(6.0 / (dense.in_features + dense.out_features))
            dense.weight.uniform_(-bound, bound)
            dense.bias.zero_()


class ImageBottom(nn.Module):
    """Vision shared bottom: the identity (comet-protocol.md §1) on the batch's uint8 ``image``, scaled to [0, 1]
    on the model's device (``/ 255``, as the official opener does), so batches travel as bytes.

    With ``overlay_shift`` s > 0 (MultiMNIST): ``image`` holds the two source images ``[B, 2, h, w]`` and the input
    is their sum on an ``(h + s) x (w + s)`` canvas, the first at the top-left and the second shifted by s both
    ways: the official generator's composite, where overlapping strokes add up to 2.0 (no clipping).
    """

    def __init__(self, overlay_shift: int = 0) -> None:
        super().__init__()
        self.overlay_shift = overlay_shift

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        image = batch["image"]
        if self.overlay_shift:
            s = self.overlay_shift
            image = F.pad(image[:, :1].float(), (0, s, 0, s)) + F.pad(image[:, 1:].float(), (s, 0, s, 0))
        return image.float() / 255


class Tower(nn.Sequential):
    """Task tower: ``layers`` times ``Dense(units) -> ReLU``, then ``Dense(out)`` (S1.2); a logit, class logits or a
    raw regression value (sigmoid and softmax live in the losses).

    Recommenders: one hidden layer (256 units); MultiMNIST, MultiFashionMNIST and Digits: two (50 units) before 10
    logits; CelebA: none, ``Dense(1)`` on the mixed expert output.

    A hidden layer's bias add and ReLU run as one pass after its matmul, and their backward as one
    (:func:`mtmoe.epilogue.bias_relu_dropout` without dropout), the bias in autocast's dtype (:func:`autocast_bias`):
    under autocast a hidden layer's output is in autocast's dtype, as ``nn.Linear``'s is, also under
    ``torch.func.vmap`` (where a linear layer is a matmul then the bias add, which a float32 bias would promote).
    """

    def __init__(self, in_features: int, units: int, out_features: int, layers: int = 1) -> None:
        modules: list[nn.Module] = []
        for _ in range(layers):
            modules += [nn.Linear(in_features, units), nn.ReLU()]
            in_features = units
        super().__init__(*modules, nn.Linear(in_features, out_features))
        #: The hidden layers' weights and biases, used only cast to autocast's dtype (as
        #: :attr:`DenseExperts.autocast_parameters`).
        self.autocast_parameters = tuple(f"{2 * i}.{name}" for i in range(layers) for name in ("weight", "bias"))

    def forward(self, x: Tensor) -> Tensor:
        *hidden, out = self
        for linear in hidden[::2]:
            x = bias_relu_dropout(F.linear(x, linear.weight), autocast_bias(linear.bias))
        return out(x)

    @torch.no_grad()
    def keras_init_(self) -> None:
        """Glorot-uniform kernels, zero biases."""
        for layer in self:
            if isinstance(layer, nn.Linear):
                nn.init.xavier_uniform_(layer.weight)
                layer.bias.zero_()
