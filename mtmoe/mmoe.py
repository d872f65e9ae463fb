"""Multi-gate mixture of experts (MMoE; Ma et al., KDD'18) as used throughout the COMET paper (comet-protocol.md §1).

    z_t(x) = sum_i g_t(x)_i f_i(h(x)),   y_t = tower_t(z_t)

``h`` is the shared bottom, the experts are shared by all tasks, and each task has its own gate of the same type.
A plain ``nn.Module``: it knows nothing of Lightning, losses or metrics.

Random draws in training (dropout, sampling gates) come from the model's own counter-based stream
(:class:`mtmoe.random.Stream`): keyed by its ``seed`` buffer (the run's seed by default) and its ``step`` buffer (the
training forward passes so far), a function of nothing else, so a trial draws the same whether it trains alone or in
a pack, and a resumed run draws what the uninterrupted one draws.
"""

import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn

from mtmoe.dataset_info import DatasetInfo
from mtmoe.errors import SettingError, UsageError
from mtmoe.experts import ConvExperts, DenseExperts, EmbeddingBottom, ImageBottom, Tower
from mtmoe.gates.base import Gate, GateDims, GateOutput, RoutingInput, no_plus_variant
from mtmoe.permutation import LocalSearch
from mtmoe.random import Stream
from mtmoe.shared_input import shared_input

GateFactory = Callable[[GateDims], Gate]


@dataclass
class MMoEOutput:
    predictions: list[Tensor]  # per task: [B] for one-output tasks, [B, C] for multiclass
    gates: list[GateOutput]  # per task gate; weights as the experts receive them (after local search)
    local_search_aux: Tensor | None = None  # the permutation's entropy penalty (training only)

    @property
    def aux_loss(self) -> Tensor:
        """Sum over task gates of their auxiliary losses, plus local search's penalty (zero in eval mode)."""
        total = torch.stack([g.aux_loss for g in self.gates]).sum()
        return total if self.local_search_aux is None else total + self.local_search_aux


class MMoE(nn.Module):
    """Shared bottom, shared experts, one gate and one tower per task.

    The bottom maps a batch to the experts' input ``h``; the experts map it to ``[B, n, ...]``; each gate routes on
    ``h`` flattened (the concatenated embeddings for recommenders, the raw image for vision: official
    ``main_model.py``) and also sees the batch's stable sample ids and the experts' outputs. With
    ``local_search``, the gates' weights are permuted before they reach the experts (the "+" variants); a gate's
    ``output_scale`` (SparseMixer's omega) multiplies its task's mixture element-wise. ``seed`` keys the random
    stream (default: ``torch.initial_seed()``, the run's seed).
    """

    def __init__(
        self,
        bottom: nn.Module,
        experts: nn.Module,
        gates: list[Gate],
        towers: list[nn.Module],
        local_search: LocalSearch | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if len(gates) != len(towers):
            raise ValueError(f"{len(gates)} gates for {len(towers)} towers")
        self.bottom, self.experts = bottom, experts
        if local_search is not None and not all(gate.permutable for gate in gates):
            name = getattr(gates[0], "registry_name", type(gates[0]).__name__)
            raise no_plus_variant(name)
        self.gates, self.towers = nn.ModuleList(gates), nn.ModuleList(towers)
        self.local_search = local_search
        seed = torch.initial_seed() if seed is None else seed
        self.register_buffer("seed", torch.tensor(seed % 2**63, dtype=torch.long))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, batch: dict[str, Tensor]) -> MMoEOutput:
        stream = None
        if self.training:
            stream = Stream(self.seed, self.step.clone())
            self.step.add_(1)
        h = self.bottom(batch)
        # unless a gate reads the experts' outputs, they are made as they are mixed, after the gates
        # (DenseExperts.mixed); their matmul comes first either way, so the gradient of h sums its readers' in the
        # same order
        fused = hasattr(self.experts, "mixed") and not any(gate.needs_expert_outputs for gate in self.gates)
        inputs = self._linear_inputs(h.flatten(1), fused)
        if fused:
            y, expert_outputs = self.experts.matmul(next(inputs) if inputs else h), None
        else:
            expert_outputs = self.experts(h, self._child(stream, 0))  # [B, n, d]
        gate_outputs = [
            gate(RoutingInput(x=h.flatten(1), sample_id=batch.get("sample_id"), expert_outputs=expert_outputs,
                              stream=self._child(stream, 1 + t),
                              linear_inputs=iter([next(inputs) for _ in range(gate.linear_reads)]) if inputs
                              else None))
            for t, gate in enumerate(self.gates)]
        weights = torch.stack([g.weights for g in gate_outputs], dim=1)  # [B, T, n]
        local_search_aux = None
        if self.local_search is not None:
            weights, local_search_aux = self.local_search(weights)
            for t, gate_output in enumerate(gate_outputs):
                gate_output.weights = weights[:, t]
        if fused:
            mixed = self.experts.mixed(y, weights, self._child(stream, 0))
        else:
            mixed = torch.bmm(weights, expert_outputs.flatten(2))  # [B, T, d]: all tasks in one batched matmul
        scales = [gate_output.output_scale for gate_output in gate_outputs]
        return MMoEOutput(self.predict(mixed, scales), gate_outputs, local_search_aux)

    def _linear_inputs(self, x: Tensor, fused: bool) -> Iterator[Tensor] | None:
        """The matmuls' views of the routing features ``x`` (the bottom's output), in reading order: the experts'
        (when ``fused``: their matmul reads ``x``) then each gate's ``linear_reads``, from one cast for them all
        (:func:`mtmoe.shared_input.shared_input`); None where no gate reads ``x`` through its linear maps."""
        readers = int(fused) + sum(gate.linear_reads for gate in self.gates)
        if not any(gate.linear_reads for gate in self.gates) or readers < 2:
            return None
        return iter(shared_input(x, readers))

    @staticmethod
    def _child(stream: Stream | None, index: int) -> Stream | None:
        """In training, the stream of the experts (0) or of task gate t (1 + t): each draws bits of its own."""
        return None if stream is None else stream.child(index)

    def predict(self, mixed: Tensor, output_scales: list[Tensor | None]) -> list[Tensor]:
        """Each task's prediction from its mixture of the experts' outputs, ``mixed`` ``[B, T, d]``."""
        predictions = []
        for z, tower, scale in zip(mixed.unbind(1), self.towers, output_scales):
            out = tower(z if scale is None else z * scale)
            predictions.append(out.squeeze(-1) if out.shape[-1] == 1 else out)
        return predictions


def build_mmoe(
    info: DatasetInfo,
    gate: GateFactory,
    n_experts: int | None = None,
    embedding_dim: int | None = None,
    expert_units: int | None = None,
    tower_units: int | None = None,
    expert_dropout: float | None = None,
    keras_init: bool = True,
    local_search: dict | None = None,
    fused_mixing_sums: bool = False,
) -> MMoE:
    """The paper's architecture for ``info``'s dataset (S1.2); any argument left ``None`` takes the paper's value.

    Recommenders: embedding bottom, dense experts, gates on the concatenated embeddings. Images: no bottom (the
    uint8 image scaled on the device), CNN experts (:class:`ConvExperts`; ``expert_units`` sizes their dense
    layers), gates on the raw image flattened (official ``main_model.py``). ``keras_init`` (default, faithful to
    the official TensorFlow code) re-initialises bottom, experts and towers with Keras' defaults; gates always use
    their own papers' initialisations. ``local_search`` holds the keyword arguments of
    :class:`mtmoe.permutation.LocalSearch` for a "+" model (``None``: the base gate alone).
    ``fused_mixing_sums``: the dense experts' ``fused_sums`` (:class:`DenseExperts`; recommenders only).
    """
    n_experts = n_experts or info.n_experts
    dropout = info.expert_dropout if expert_dropout is None else expert_dropout
    units = expert_units or info.expert_units
    if info.image_shape is None:
        bottom: nn.Module = EmbeddingBottom(info.n_users, info.n_items, embedding_dim or info.embedding_dim)
        experts: nn.Module = DenseExperts(bottom.out_features, units, n_experts, dropout, fused_mixing_sums)
        routing_features = bottom.out_features
        initialised = [bottom, experts]
    else:
        if embedding_dim is not None:
            raise UsageError(f"embedding_dim applies to the recommenders only; {info.name} has no embeddings")
        if fused_mixing_sums:
            raise UsageError(f"fused_mixing_sums applies to the recommenders' dense experts only; {info.name} has "
                             "convolutional experts: leave it false")
        bottom = ImageBottom(info.overlay_shift)
        experts = ConvExperts(info.image_shape, info.conv_layers, units, info.expert_layers, n_experts, dropout)
        routing_features = math.prod(info.image_shape)
        initialised = [experts]
    dims = GateDims(in_features=routing_features, n_experts=n_experts, n_ids=info.n_ids, k=info.k,
                    expert_shape=(experts.out_features,))
    try:
        gates = [gate(dims) for _ in info.tasks]
    except SettingError as error:  # an argument of the gate's: its setting is the model's gate.NAME
        raise error.within("gate") from None
    towers = [
        Tower(experts.out_features, tower_units or info.tower_units, task.n_classes, info.tower_layers)
        for task in info.tasks
    ]
    if keras_init:
        for module in (*initialised, *towers):
            module.keras_init_()
    search = None if local_search is None else LocalSearch(n_experts, len(info.tasks), **local_search)
    return MMoE(bottom, experts, gates, towers, search)


def setting(default: Any, help: str, per_trial: bool = False) -> Any:
    """A field of a settings dataclass: its default and its help, which ``--help`` shows (:func:`documented`);
    ``per_trial``: each trial of a pack may have its own value (the engine keeps it per slot), so trials that differ
    in it still share a pack (:func:`per_trial_settings`)."""
    return field(default=default, metadata={"help": help, "per_trial": per_trial})


def per_trial_settings(cls: type) -> frozenset[str]:
    """The names of the fields of the settings dataclass ``cls`` declared ``per_trial``."""
    return frozenset(f.name for f in fields(cls) if f.metadata.get("per_trial"))


def documented(cls: type) -> type:
    """``cls`` as a dataclass whose docstring ends with an ``Args:`` section of its fields' help: the form
    jsonargparse reads a class's argument help from, so that a setting's name, type, default and help are written
    once, in its field."""
    cls = dataclass(cls)
    args = "\n".join(f"    {f.name}: {f.metadata['help']}" for f in fields(cls))
    cls.__doc__ = f"{inspect.cleandoc(cls.__doc__ or '')}\n\nArgs:\n{args}\n"
    return cls


@documented
class NetSettings:
    """The settings :func:`build_net` builds a net from (``--model.*``); a size left ``None`` takes the paper's
    value for the dataset (Supplement S1.2)."""

    gate: Callable[[GateDims], Gate] | None = setting(
        None, "the gate type, a callable ``GateDims -> Gate`` (on the command line: ``--gate comet`` or "
        "``--model.gate mtmoe.gates.COMETGate --model.gate.gamma 1``); one instance per task.")
    n_experts: int | None = setting(None, "experts (default: the paper's for the dataset, Supplement S1.2).")
    embedding_dim: int | None = setting(None, "user and item embedding size of the recommenders (default: the "
                                              "paper's).")
    expert_units: int | None = setting(None, "units of an expert's dense layer (default: the paper's).")
    tower_units: int | None = setting(None, "units of a task tower's hidden layer (default: the paper's).")
    expert_dropout: float | None = setting(None, "dropout after an expert (default: the paper's, 0.5 on the "
                                                 "recommenders).")
    keras_init: bool = setting(True, "initialise bottom, experts and towers as Keras does (the official code); "
                                     "False: PyTorch's.")
    perm_epochs: int | None = setting(
        None, "E_perm, the permutation-learning window in epochs; set, it makes the \"+\" variant of the gate "
        "(``--gate comet+`` sets it to 5, Table 1's value; the paper searches 1..10). ``None``: no local search.",
        per_trial=True)
    zeta: float = setting(1e-4, "the permutation's row/column entropy coefficient (paper: 1e-4; Table 1: 1e-5).",
                         per_trial=True)
    perm_per_task: bool = setting(False, "one permutation per task gate instead of one shared by all (the official "
                                         "code shares one).")
    perm_eval_rounded: bool = setting(True, "evaluate with the rounded permutation inside the window (official); "
                                            "False: soft.")
    fused_mixing_sums: bool = setting(
        False, "the dense experts' outputs are never written: the gates' weighted sum is taken as each row's "
        "outputs are made, and the backward makes them again and sums the expert bias's gradient over the batch "
        "and the gates' weights' gradient over the units in its one kernel (numba/Triton), in the kernels' own "
        "order: the same values to float rounding, not bitwise torch's ``bmm`` and ``sum``; fewer bytes moved a "
        "step. Off by default; recommenders only; part of a study's identity. A gate that reads the experts' "
        "outputs (CompeteSMoE) does not mix through these kernels.")


def build_net(info: DatasetInfo, settings: NetSettings) -> MMoE:
    """The net of ``settings`` for ``info``'s dataset (:func:`build_mmoe`), initialised from torch's global
    generator as it stands (seed it first); a "+" net (``perm_epochs`` set) has local search (comet-protocol.md
    §3)."""
    if settings.gate is None:
        raise UsageError("no gate chosen: pass --gate NAME (see `python -m mtmoe gates`)")
    for name, least in (("n_experts", 2), ("embedding_dim", 1), ("expert_units", 1), ("tower_units", 1)):
        if getattr(settings, name) is not None and getattr(settings, name) < least:
            raise SettingError(name, getattr(settings, name), f"must be >= {least}")
    if settings.expert_dropout is not None and not 0 <= settings.expert_dropout < 1:
        raise SettingError("expert_dropout", settings.expert_dropout, "must be in [0, 1)")
    local_search = None if settings.perm_epochs is None else {
        "epochs": settings.perm_epochs, "zeta": settings.zeta, "per_task": settings.perm_per_task,
        "eval_rounded": settings.perm_eval_rounded}
    return build_mmoe(info, settings.gate, settings.n_experts, settings.embedding_dim, settings.expert_units,
                      settings.tower_units, settings.expert_dropout, settings.keras_init, local_search,
                      settings.fused_mixing_sums)
