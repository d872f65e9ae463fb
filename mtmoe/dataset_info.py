"""What the model is built from: a dataset's tasks and the paper's architecture for it (Supplement S1.2).

Plain dataclasses with no Lightning, pandas or torchvision behind them: :mod:`mtmoe.mmoe` builds a model from a
:class:`DatasetInfo` alone, and every DataModule of :mod:`mtmoe.data` describes its dataset with one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The recommenders' task weight alpha where a run sets none (comet-protocol.md §5:
#: ``alpha · BCE + (1 - alpha) · MSE`` with alpha in {0.1, 0.9}).
DEFAULT_ALPHA = 0.9


@dataclass(frozen=True)
class TaskSpec:
    name: str  # key of the target in the batch
    kind: Literal["binary", "regression", "multiclass"]
    n_classes: int = 1
    masked: bool = False  # the batch carries a bool ``<name>_mask``


@dataclass(frozen=True)
class DatasetInfo:
    """Static description of a dataset and the paper's architecture for it (Supplement S1.2).

    Available right after the DataModule's ``__init__`` (no data is read), so the CLI can link it to the model.
    """

    name: str
    tasks: tuple[TaskSpec, ...]
    n_ids: int  # number of distinct ``sample_id`` values
    n_users: int = 0  # embedding table sizes (recommenders)
    n_items: int = 0
    image_shape: tuple[int, ...] | None = None  # images: the model's input [C, H, W] (the gates route on it flat)
    n_experts: int = 16
    k: int = 2
    embedding_dim: int = 128
    expert_units: int = 256
    tower_units: int = 256
    expert_dropout: float = 0.5
    task_weighting: Literal["alpha", "equal"] = "alpha"  # alpha: (alpha, 1 - alpha) for two tasks
    conv_layers: tuple[tuple[int, int], ...] = ()  # images: (kernel, filters) of each conv -> ReLU -> max-pool block
    expert_layers: int = 1  # dense layers of ``expert_units`` in an expert (after the convolutions, for images)
    tower_layers: int = 1  # hidden dense layers of ``tower_units`` in a tower
    overlay_shift: int = 0  # > 0: ``image`` holds two layers, summed at offsets 0 and this shift (MultiMNIST)


def default_alpha(task_weighting: str) -> float | None:
    """The task weight alpha of a dataset weighted ``task_weighting`` where a run sets none (``None``: equal
    weights)."""
    return DEFAULT_ALPHA if task_weighting == "alpha" else None
