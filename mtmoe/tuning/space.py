"""Search spaces: ``spaces/<dataset>.yaml`` beside this module (package data, read with :mod:`importlib.resources`),
one section per gate, transcribed from Supplement S1.3. ``tune --space FILE`` reads another file.

Format (keys are the CLI's dotted config keys, so a configuration is a list of ``--key=value`` arguments)::

    data: movielens                  # the dataset (CLI name) the file is for
    trials: 500                      # configurations per gate (the paper's random search)
    fixed:                           # every gate: plain values
      data.batch_size: 512
    gates:
      comet:
        model.lr: {log_uniform: [5.0e-5, 5.0e-4]}
        model.gate.gamma: {choice: [0.01, 0.1, 1, 5, 10]}
        model.gate.k: 2              # a plain value is fixed for that gate
      comet+:
        model.perm_epochs: {int: [1, 10]}

Distributions: ``log_uniform: [lo, hi]``, ``uniform: [lo, hi]``, ``int: [lo, hi]`` (inclusive, uniform) and
``choice: [...]`` (discrete uniform). Every key is checked on load against what it configures (the gate's or the
model's, data module's, trainer's or early stopping's arguments), so a typo fails with the key named.
"""
from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from mtmoe.errors import UsageError
from mtmoe.gate_names import split_gate_name

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

SPACES_DIR = resources.files("mtmoe.tuning") / "spaces"
DISTRIBUTIONS = ("log_uniform", "uniform", "int", "choice")


@dataclass(frozen=True)
class SearchSpace:
    """One gate's search space on one dataset: fixed values and distributions, keyed by dotted CLI keys."""

    data: str
    gate: str
    trials: int
    fixed: dict[str, Any]
    distributions: dict[str, BaseDistribution]

    @property
    def fingerprint(self) -> str:
        """A hash of everything that defines the space: a study refuses to mix configurations of two spaces."""
        payload = {
            "data": self.data, "gate": self.gate, "fixed": self.fixed,
            "distributions": {k: repr(v) for k, v in sorted(self.distributions.items())},
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _valid_keys(gate: str, data: str) -> dict[str, set[str]]:
    """The argument names each config prefix accepts, read from the signatures the CLI reads."""
    import importlib

    import lightning.pytorch as pl

    from mtmoe.pack.engine import EarlyStopping

    from mtmoe.data import DATASETS
    from mtmoe.gates import gate_class
    from mtmoe.lit.module import MultiTaskMoE

    module_name, class_name = DATASETS[data].rsplit(".", 1)
    data_class = getattr(importlib.import_module(module_name), class_name)
    data_keys = set()
    for cls in data_class.__mro__:  # DataModules forward **kwargs to their base classes
        if cls.__module__.startswith("mtmoe"):
            data_keys |= set(inspect.signature(cls.__init__).parameters)

    def names(fn: Any) -> set[str]:
        return set(inspect.signature(fn).parameters) - {"self", "args", "kwargs", "dims", "info", "gate"}

    return {
        "model.gate.": names(gate_class(split_gate_name(gate)[0]).__init__),
        "model.": names(MultiTaskMoE.__init__),
        "data.": data_keys - {"self", "kwargs", "variant"},
        "trainer.": names(pl.Trainer.__init__),
        "early_stopping.": names(EarlyStopping.__init__),
    }


def _check_key(key: str, valid: dict[str, set[str]], where: str) -> None:
    for prefix, names in valid.items():  # "model.gate." is checked before "model."
        if key.startswith(prefix):
            name = key[len(prefix):]
            if name not in names:
                raise UsageError(f"{where}: unknown key {key!r} (valid {prefix}* keys: {', '.join(sorted(names))})")
            return
    raise UsageError(f"{where}: key {key!r} must start with one of {', '.join(valid)}")


def _distribution(key: str, spec: Any, where: str) -> BaseDistribution | None:
    """A distribution for a ``{kind: args}`` mapping; ``None`` for a plain (fixed) value."""
    if not isinstance(spec, dict):
        return None
    if len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        raise UsageError(f"{where}: {key} must be a value or one of {{{', '.join(DISTRIBUTIONS)}: ...}}, got {spec}")
    kind, args = next(iter(spec.items()))
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise UsageError(f"{where}: {key}: choice needs a non-empty list, got {args!r}")
        return CategoricalDistribution(args)
    number = (int,) if kind == "int" else (int, float)  # int: [1, 10.5] would silently become [1, 10]
    if not (isinstance(args, list) and len(args) == 2
            and all(isinstance(a, number) and not isinstance(a, bool) for a in args)):
        raise UsageError(f"{where}: {key}: {kind} needs [low, high]" + (" (integers)" if kind == "int" else "")
                         + f", got {args!r}")
    low, high = args
    if not low < high or (kind == "log_uniform" and low <= 0):
        raise UsageError(f"{where}: {key}: empty or invalid range [{low}, {high}] for {kind}")
    if kind == "int":
        return IntDistribution(int(low), int(high))
    return FloatDistribution(float(low), float(high), log=kind == "log_uniform")


def space_file(data: str) -> Traversable:
    """The packaged search-space file of dataset ``data``."""
    return SPACES_DIR / f"{data}.yaml"


def load_space(data: str, gate: str, path: str | Path | None = None) -> SearchSpace:
    """Read and validate ``gate``'s section of the dataset's search-space file (default: the packaged one)."""
    path = Path(path) if path is not None else space_file(data)
    if not path.is_file():
        raise UsageError(f"no search-space file {path} for dataset {data!r}")
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UsageError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    where = str(path)
    if not isinstance(document, dict) or set(document) - {"data", "trials", "fixed", "gates"}:
        raise UsageError(f"{where}: top-level keys must be data, trials, fixed, gates")
    if document.get("data") != data:
        raise UsageError(f"{where}: is for data {document.get('data')!r}, not {data!r}")
    gates = document.get("gates") or {}
    if gate not in gates:
        raise UsageError(f"{where}: no section for gate {gate!r} (sections: {', '.join(gates)})")
    trials = document.get("trials")
    if not isinstance(trials, int) or trials < 1:
        raise UsageError(f"{where}: trials must be a positive integer, got {trials!r}")
    valid = _valid_keys(gate, data)
    fixed: dict[str, Any] = {}
    distributions: dict[str, BaseDistribution] = {}
    for section, entries in (("fixed", document.get("fixed") or {}), (f"gates.{gate}", gates[gate] or {})):
        if not isinstance(entries, dict):
            raise UsageError(f"{where}: {section} must be a mapping of keys to values or distributions")
        for key, spec in entries.items():
            _check_key(key, valid, f"{where} [{section}]")
            distribution = _distribution(key, spec, f"{where} [{section}]")
            if section == "fixed" and distribution is not None:
                raise UsageError(f"{where} [fixed]: {key} must be a plain value")
            if distribution is None:
                fixed[key] = spec
                distributions.pop(key, None)
            else:
                distributions[key] = distribution
                fixed.pop(key, None)
    return SearchSpace(data, gate, trials, fixed, distributions)
