"""The Python API that ``import mtmoe`` exports (docs/training.md, "Python API"): a gate's model for a dataset, a
dataset's splits as tensors, the tuning studies' trials as a table.

Each is built by the code the commands run: :func:`build_model` builds the net with
:func:`mtmoe.pack.settings.build_trial` from the ``--model.*`` settings, as ``fit`` does (the same seed gives the same
weights); :func:`load_data` reads the splits as the DataModule of ``--data NAME`` reads them; :func:`trials` is the
table ``report`` and ``bootstrap`` compute from (:mod:`mtmoe.tuning.trials`). Bad input raises
:class:`~mtmoe.errors.UsageError` with the command line's one-line message.
"""
from __future__ import annotations

import inspect
from dataclasses import fields
from functools import partial
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from mtmoe.data import DATASETS
from mtmoe.data.base import InMemoryDataModule
from mtmoe.errors import UsageError
from mtmoe.gates import PLUS_PERM_EPOCHS, parse_gate_name
from mtmoe.mmoe import MMoE
from mtmoe.pack.settings import ModelSettings, build_trial
from mtmoe.run_settings import import_class
from mtmoe.tuning.trials import collect

#: The ``--model.*`` settings (:class:`~mtmoe.pack.settings.ModelSettings`' fields) but the gate.
MODEL_SETTINGS = tuple(setting.name for setting in fields(ModelSettings) if setting.name != "gate")


def datamodule(data: str, **settings: Any) -> InMemoryDataModule:
    """The DataModule of dataset ``data`` (``python -m mtmoe datasets``); ``settings`` are its ``--data.*`` ones."""
    if data not in DATASETS:
        raise UsageError(f"unknown dataset {data!r}; valid datasets: {', '.join(sorted(DATASETS))}")
    return import_class(DATASETS[data])(**settings)


def load_data(data: str, **settings: Any) -> dict[str, dict[str, Tensor]]:
    """Dataset ``data``'s splits, ``{"train"|"val"|"test": {name: tensor}}`` in the batch convention of
    :mod:`mtmoe.data.base`, read (prepared and cached the first time) as ``fit --data NAME`` reads them; ``settings``
    are the DataModule's (``root``, ``cache_dir``, ``download``, ...: ``--data.*``)."""
    return datamodule(data, **settings).load_splits()


def build_model(gate: str, data: str, seed_everything: int | None = 0, **settings: Any) -> MMoE:
    """The multi-gate MoE of gate ``gate`` ("comet", "comet+", ...: ``python -m mtmoe gates``) on dataset ``data``,
    with the paper's architecture for it (Supplement S1.2), untrained: a plain ``nn.Module``.

    ``settings`` are ``fit``'s ``--model.NAME`` (``n_experts``, ``expert_units``, ``perm_epochs``, ...) and the
    gate's own ``--model.gate.NAME`` (``k``, ``gamma``, ...); "NAME+" sets ``perm_epochs`` to 5 unless given.
    ``seed_everything``: the weights are those ``fit --seed_everything`` initialises (the caller's random state is
    left as it was); ``None`` draws them from torch's global generator as it stands.
    """
    cls, plus = parse_gate_name(gate)
    gate_settings = [name for name in inspect.signature(cls).parameters if name != "dims"]
    unknown = sorted(set(settings) - set(MODEL_SETTINGS) - set(gate_settings))
    if unknown:
        raise UsageError(f"unknown setting{'s' * (len(unknown) > 1)} {', '.join(unknown)}; the model's: "
                         f"{', '.join(MODEL_SETTINGS)}; the {cls.registry_name} gate's: "
                         f"{', '.join(gate_settings) or 'none'}")
    model = {name: value for name, value in settings.items() if name in MODEL_SETTINGS}
    if plus:
        model.setdefault("perm_epochs", PLUS_PERM_EPOCHS)
    elif model.get("perm_epochs") is not None:
        raise UsageError(f"perm_epochs adds local search to {gate}: build_model({gate + '+'!r}, ...) for that")
    info = datamodule(data).info
    gate_factory = partial(cls, **{name: value for name, value in settings.items() if name not in MODEL_SETTINGS})
    with torch.random.fork_rng(devices=[], enabled=seed_everything is not None):
        if seed_everything is not None:
            torch.manual_seed(seed_everything)
        return build_trial(info, None, ModelSettings(gate=gate_factory, **model)).net


def trials(storage: str | None = None, data: str | None = None, study: str | None = None) -> pd.DataFrame:
    """The evaluated trials of the tuning studies in ``storage`` (an RDB URL or ``journal:PATH``; ``None``:
    ``studies/optuna.db`` under the current directory), one row per configuration (columns:
    :mod:`mtmoe.tuning.trials`), of dataset ``data``, of the study named ``study``, or of every study."""
    return collect(storage, data, study)[1]
