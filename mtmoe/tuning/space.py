"""Search spaces: a gate's hyperparameters and their default ranges beside its class
(:attr:`mtmoe.gates.Gate.search_space`), the learning rate for every gate (:data:`COMMON_SPACE`) and the local
search's settings for a "+" variant (:data:`PLUS_SPACE`), overridden by the dataset's file ``spaces/<dataset>.yaml``
beside this module (package data, read with :mod:`importlib.resources`; ``tune --space FILE`` reads another), whose
sections per gate hold Supplement S1.3's ranges for the dataset. A gate without a section in the file, or a dataset
without a file, is searched over the defaults.

Format (keys are the CLI's dotted config keys, so a configuration is a list of ``--key=value`` arguments)::

    data: movielens                  # the dataset (CLI name) the file is for
    trials: 500                      # configurations per gate (the paper's random search)
    fixed:                           # every gate: plain values
      data.batch_size: 512
    defaults:                        # every gate, unless its section sets the key: values or distributions
      model.lr: {log_uniform: [1.0e-4, 1.0e-3]}
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
from dataclasses import dataclass, fields
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
#: What every gate's study searches unless its dataset's file says otherwise: the learning rate (S1.3's MovieLens
#: range).
COMMON_SPACE = {"model.lr": {"log_uniform": [5.0e-5, 5.0e-4]}}
#: What a "+" variant's study adds: the permutation window E_perm and the local search's zeta (S1.3, COMET+).
PLUS_SPACE = {"model.perm_epochs": {"int": [1, 10]}, "model.zeta": 1.0e-4}
#: Configurations per gate on a dataset without a search-space file: the paper's random search (S1.3).
DEFAULT_TRIALS = 500


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


def _valid_keys(gate: type, data: str) -> dict[str, set[str]]:
    """The argument names each config prefix accepts, read from the signatures the CLI reads."""
    import lightning.pytorch as pl

    from mtmoe.pack.engine import EarlyStopping

    from mtmoe.data import dataset_path
    from mtmoe.pack.settings import ModelSettings
    from mtmoe.run_settings import import_class, init_arguments

    data_keys = init_arguments(import_class(dataset_path(data)))

    def names(fn: Any) -> set[str]:
        return set(inspect.signature(fn).parameters) - {"self", "args", "kwargs", "dims", "info", "gate"}

    return {
        "model.gate.": names(gate.__init__),
        "model.": {setting.name for setting in fields(ModelSettings)} - {"gate"},
        "data.": data_keys - {"variant"},
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


def read_space_file(data: str, path: str | Path | None = None) -> tuple[dict[str, Any], str]:
    """The search-space document of dataset ``data`` (default: the packaged file; a dataset without one has an
    empty file of :data:`DEFAULT_TRIALS` trials) and where it was read, its top-level keys checked."""
    if path is None and not space_file(data).is_file():
        return {"data": data, "trials": DEFAULT_TRIALS}, f"the defaults (no {space_file(data).name} in {SPACES_DIR})"
    path = Path(path) if path is not None else space_file(data)
    if not path.is_file():
        what = f"{path} is a folder, not a search-space file" if path.is_dir() else f"no search-space file {path}"
        raise UsageError(f"{what} for dataset {data!r}: pass --space FILE.yaml (the packaged ones: {SPACES_DIR})")
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UsageError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    where = str(path)
    if not isinstance(document, dict) or set(document) - {"data", "trials", "fixed", "defaults", "gates"}:
        raise UsageError(f"{where}: top-level keys must be data, trials, fixed, defaults, gates")
    if document.get("data") != data:
        raise UsageError(f"{where}: is for data {document.get('data')!r}, not {data!r}")
    trials = document.get("trials")
    if not isinstance(trials, int) or trials < 1:
        raise UsageError(f"{where}: trials must be a positive integer, got {trials!r}")
    return document, where


def load_space(data: str, gate: str, path: str | Path | None = None) -> SearchSpace:
    """``gate``'s search space on dataset ``data``, read from the dataset's search-space file (default: the packaged
    one) and checked against what each key configures."""
    return gate_space(*read_space_file(data, path), gate)


def gate_space(document: dict[str, Any], where: str, gate: str, check_keys: bool = True) -> SearchSpace:
    """``gate``'s search space in a search-space ``document`` read from ``where``: the file's ``fixed`` values,
    then its section for the gate (a "+" variant without one: its gate's), then what neither sets of the file's
    ``defaults``, then of the gate's own :attr:`~mtmoe.gates.Gate.search_space`, :data:`COMMON_SPACE` and, for a
    "+" variant, :data:`PLUS_SPACE`.
    ``check_keys=False`` leaves out the check of the keys against the signatures (no Lightning import)."""
    from mtmoe.gates import list_gates, parse_gate_name

    cls, plus = parse_gate_name(gate)
    sections = document.get("gates") or {}
    for name in sections:
        if split_gate_name(str(name))[0] not in list_gates() and ":" not in str(name):
            raise UsageError(f"{where}: section {name!r} names no registered gate (gates: {', '.join(list_gates())})")
    section = gate if gate in sections else split_gate_name(gate)[0]
    defaults = {**COMMON_SPACE, **{f"model.gate.{key}": spec for key, spec in cls.search_space.items()},
                **(PLUS_SPACE if plus else {})}
    valid = _valid_keys(cls, document["data"]) if check_keys else None
    fixed: dict[str, Any] = {}
    distributions: dict[str, BaseDistribution] = {}

    def add(name: str, entries: Any) -> None:
        if not isinstance(entries, dict):
            raise UsageError(f"{where}: {name} must be a mapping of keys to values or distributions")
        for key, spec in entries.items():
            if valid is not None:
                _check_key(key, valid, f"{where} [{name}]")
            distribution = _distribution(key, spec, f"{where} [{name}]")
            if name == "fixed" and distribution is not None:
                raise UsageError(f"{where} [fixed]: {key} must be a plain value")
            if distribution is None:
                fixed[key] = spec
                distributions.pop(key, None)
            else:
                distributions[key] = distribution
                fixed.pop(key, None)

    add("fixed", document.get("fixed") or {})
    add(f"gates.{section}", sections.get(section) or {})
    for name, entries in (("defaults", document.get("defaults") or {}),
                          (f"{cls.__module__}.{cls.__qualname__}.search_space", defaults)):
        add(name, {key: spec for key, spec in entries.items() if key not in fixed and key not in distributions})
    return SearchSpace(document["data"], gate, document["trials"], fixed, distributions)
