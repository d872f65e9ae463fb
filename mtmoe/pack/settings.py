"""One typed settings object for a run and a trial: :class:`ModelSettings` holds every ``--model.*`` setting, its
name, type, default and help written once as a field (``fit --help`` reads them; :func:`mtmoe.mmoe.documented`).

It is :class:`~mtmoe.mmoe.NetSettings` (what :func:`~mtmoe.mmoe.build_net` builds a net from),
:class:`OptimSettings` and :class:`EngineSettings` (how the engine trains it: the LightningModule takes a built net
and these), made once from
the command line or a config file (the run builder, :mod:`mtmoe.run`), the Python API (:mod:`mtmoe.api`) or a
study's planned values (:mod:`mtmoe.tuning.packs`); :func:`build_trial` makes the engine's trial of them.
"""

from collections.abc import Mapping
from dataclasses import fields
from functools import partial
from typing import Any, Literal

from mtmoe.dataset_info import DatasetInfo
from mtmoe.discovery import import_object
from mtmoe.errors import SettingError, UsageError
from mtmoe.losses import task_weights
from mtmoe.mmoe import MMoE, NetSettings, build_net, documented, setting
from mtmoe.pack.engine import EarlyStopping, Trial
from mtmoe.pack.precision import MatmulPrecision


@documented
class OptimSettings:
    """What a net is trained for and how fast: Adam's learning rate and the task weights of the loss
    ``sum_t w_t L_t`` (comet-protocol.md §5)."""

    lr: float = setting(1e-4, "Adam's learning rate.", per_trial=True)
    alpha: float | None = setting(None, "weight of task 1 for the two-task recommenders (paper: 0.1 and 0.9; "
                                        "default 0.9).", per_trial=True)


@documented
class EngineSettings:
    """How the training engine (:mod:`mtmoe.pack.engine`) computes a step: Adam's epsilon and kernels, CUDA
    graphs, the precision of float32 matmuls; and which experts its routing statistics count as selected."""

    adam_eps: float = setting(1e-7, "Adam's epsilon; 1e-7 is Keras' default (the official code), 1e-8 PyTorch's.",
                              per_trial=True)
    cuda_graphs: bool = setting(True, "on a GPU, capture the training step in a CUDA graph and replay it (the same "
                                      "results); False runs it eagerly.")
    fused_adam: bool = setting(True, "Adam's update in one kernel (numba on a CPU, Triton on a GPU); False: "
                                     "element-wise torch operations, about ten kernels per parameter (the same "
                                     "update to float32 rounding).")
    matmul_precision: MatmulPrecision = setting(
        "highest", "float32 matmuls in float32 (``highest``) or, on Ampere and later GPUs, in TensorFloat-32 "
        "(``high``: TensorFlow's default there, so the official code's behaviour); applied to the whole run "
        "(:mod:`mtmoe.pack.precision`), and part of a study's identity.")
    dense_selection: Literal["topk", "above_uniform"] = setting(
        "topk", "the experts a dense gate (Softmax) counts as selected in the routing statistics "
        "(``routing_entropy`` aside): ``topk``, its ``k`` largest weights with ``k`` the dataset's cardinality, or "
        "``above_uniform``, the weights above ``1/n`` (:mod:`mtmoe.pack.metrics`). Sparse gates select their nonzero "
        "weights.")


@documented
class ModelSettings(EngineSettings, NetSettings, OptimSettings):
    """A multi-gate MoE on one dataset with one gate type and how it is trained, one trial of the engine: the
    ``--model.*`` settings (fields in the order ``--help`` lists them)."""


def settings_of(values: Mapping[str, Any]) -> ModelSettings:
    """The settings of a ``--model.*`` configuration as a mapping (a ``config.yaml``'s ``model``, a checkpoint's
    hyperparameters): its gate a class path and arguments; a setting it leaves out keeps its default."""
    values = dict(values)
    unknown = sorted(set(values) - {f.name for f in fields(ModelSettings)})
    if unknown:
        raise UsageError(f"unknown model settings {', '.join(unknown)}: not settings of this version of mtmoe")
    gate = values.pop("gate", None)
    factory = None if gate is None else partial(import_object(":".join(gate["class_path"].rsplit(".", 1)), "gate"),
                                                **gate.get("init_args", {}))
    return ModelSettings(gate=factory, **values)


def new_trial(info: DatasetInfo, key: object, net: MMoE, optim: OptimSettings, engine: EngineSettings,
              data_seed: int = 0, max_epochs: int | None = None, stopping: EarlyStopping = EarlyStopping()) -> Trial:
    """The engine's trial of a built ``net`` trained with ``optim`` and ``engine``'s Adam epsilon, to
    ``max_epochs`` (``None``: until early ``stopping``), its batches in the order of ``data_seed``."""
    if not optim.lr > 0:
        raise SettingError("lr", optim.lr, "must be > 0")
    if not engine.adam_eps >= 0:
        raise SettingError("adam_eps", engine.adam_eps, "must be >= 0")
    weights = tuple(task_weights(info, optim.alpha))
    return Trial(key, net, weights, optim.lr, engine.adam_eps, data_seed, max_epochs, stopping.patience,
                 stopping.min_delta)


def build_trial(info: DatasetInfo, key: object, settings: ModelSettings, data_seed: int = 0,
                max_epochs: int | None = None, stopping: EarlyStopping = EarlyStopping()) -> Trial:
    """:func:`new_trial` of the net of ``settings``, built from torch's global generator as it stands (seed it
    first)."""
    return new_trial(info, key, build_net(info, settings), settings, settings, data_seed, max_epochs, stopping)
