"""The settings of a run as the command line gives them, checked and completed before anything is built.

* :func:`resolve_dataset_settings`: the model settings left ``None`` take the dataset's values (Supplement S1.2),
  filled in so that ``--print_config``, the run's ``config.yaml`` and its checkpoints show the values in force;
* :func:`model_settings`: a parsed ``model`` configuration as its settings object;
* :func:`read_checkpoint`, :func:`given_model_settings` and :func:`disagreements`: ``--ckpt_path``'s checkpoint
  decides the model; the settings a user gave must agree with it;
* :func:`check_run_settings`: settings Lightning accepts that make a command meaningless, and the trainer settings
  the training engine does not honour (:data:`mtmoe.arguments.UNSUPPORTED_TRAINER_SETTINGS`; the same list for
  ``fit`` and ``tune``).
* :func:`check_loggers`: a logger whose package is not installed (TensorBoard: mtmoe's ``tensorboard`` extra).

Each problem is a :class:`~mtmoe.errors.UsageError`: one line, exit code 2 at the command line.
"""
from __future__ import annotations

import importlib
import inspect
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace

from mtmoe.arguments import UNSUPPORTED_TRAINER_SETTINGS, unsupported_setting
from mtmoe.dataset_info import DatasetInfo
from mtmoe.errors import UsageError
from mtmoe.losses import task_weights
from mtmoe.pack.settings import ModelSettings, settings_of

#: Model settings whose ``None`` stands for the dataset's value (Supplement S1.2; ``mtmoe.mmoe.build_mmoe``).
DATASET_SETTINGS = ("n_experts", "embedding_dim", "expert_units", "tower_units", "expert_dropout")
ENGINE_PRECISIONS = ("32", "32-true", "bf16-mixed")
TENSORBOARD_EXTRA = "pip install 'mtmoe[tensorboard]'"


def import_class(path: str) -> type:
    """The class at a dotted path (``mtmoe.gates.TopKGate``)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def init_arguments(cls: type) -> set[str]:
    """The argument names ``cls`` takes: its ``__init__``'s and those of its mtmoe base classes, to which mtmoe's
    DataModules forward ``**kwargs``."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base is cls or base.__module__.startswith("mtmoe"):
            names |= set(inspect.signature(base.__init__).parameters)
    return names - {"self", "args", "kwargs"}


def dataset_info(data: Namespace | None) -> DatasetInfo | None:
    """The dataset description of the ``data`` configuration (a DataModule's ``__init__`` reads no data; its
    checks of its arguments fail here, as one line)."""
    if data is None:
        return None
    return import_class(data.class_path)(**data.get("init_args", Namespace()).as_dict()).info


def resolve_dataset_settings(model: Namespace, info: DatasetInfo) -> None:
    """Fill in the model settings left ``None`` that take the dataset's value: the values in force."""
    if model.alpha is None and info.task_weighting == "alpha":
        model.alpha = task_weights(info, None)[0]
    for name in DATASET_SETTINGS:
        if model[name] is None and not (name == "embedding_dim" and info.image_shape is not None):
            model[name] = getattr(info, name)
    gate = model.gate
    if gate is not None and "k" in gate.get("init_args", Namespace()) and gate.init_args.k is None:
        gate.init_args.k = info.k  # a gate's k defaults to the dataset's (mtmoe.gates.base.resolve_k)


def config_key(name: str) -> str:
    """A search-space key (``model.gate.k``, ``data.batch_size``) as the parsed configuration's
    (``model.gate.init_args.k``, ``data.init_args.batch_size``)."""
    for group in ("model.gate.", "data."):
        if name.startswith(group):
            return f"{group}init_args.{name.removeprefix(group)}"
    return name


def set_values(config: Namespace, values: dict[str, Any]) -> None:
    """Set ``values`` keyed as a search space keys them (``model.lr``, ``model.gate.k``, ``data.batch_size``: a
    study's planned values) over a parsed configuration, as they are: no command-line strings."""
    for name, value in values.items():
        config[config_key(name)] = value


def model_settings(model: Namespace) -> ModelSettings:
    """The settings object of a parsed ``model`` configuration (its gate as a class path and arguments; a setting
    it leaves out keeps its default), as the command line instantiates it."""
    return settings_of(model.as_dict())


def gate_name(model: Namespace) -> str:
    """``topk``, ``comet+``, ...: the registered name of the configured gate, "+" with local search."""
    cls = import_class(model.gate.class_path)
    return getattr(cls, "registry_name", cls.__name__) + ("+" if model.perm_epochs is not None else "")


def given_model_settings(model: Namespace, defaults: Namespace, named: set[str]) -> set[str]:
    """The ``model.*`` keys the user chose: named on the command line, or other than their default (a config file).
    A chosen gate counts as ``gate`` (its "+" included); its own arguments as ``gate.init_args.NAME``."""
    given = set()
    for key, value in model.items():
        if key.startswith("gate."):
            continue
        if f"model.{key}" in named or value != defaults.get(key):
            given.add(key)
    if model.gate is not None:
        given.add("gate")
        parameters = inspect.signature(import_class(model.gate.class_path)).parameters
        for name, value in model.gate.get("init_args", Namespace()).items():
            if f"model.gate.{name}" in named or name not in parameters or value != parameters[name].default:
                given.add(f"gate.init_args.{name}")
    return given


def disagreements(user: Namespace, saved: Namespace, given: set[str]) -> list[str]:
    """The chosen settings of ``user`` that differ from the checkpoint's ``saved`` ones, as flag / saved value."""
    if "gate" in given and gate_name(user) != gate_name(saved):
        return [f"--gate {gate_name(user)} (the checkpoint holds {gate_name(saved)})"]
    found = []
    for key in sorted(given - {"gate"}):
        if key == "perm_epochs" and "gate" in given:
            continue  # part of the gate's name
        if user[key] != saved.get(key):
            flag = key.replace("gate.init_args.", "gate.")
            found.append(f"--model.{flag} {user[key]} (the checkpoint has {saved.get(key)})")
    return found


def read_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint at ``path``; a missing, unreadable or foreign file is one error line."""
    if Path(path).is_dir():
        raise UsageError(f"--ckpt_path {path} is a folder: pass a checkpoint file in it (a fit's "
                         "runs/lightning_logs/version_N/checkpoints/best.ckpt or last.ckpt)")
    if not Path(path).is_file():
        raise UsageError(f"no checkpoint file {path} (--ckpt_path)")
    if not zipfile.is_zipfile(path):  # torch.save's format; torch's own errors for these files are long and vague
        raise UsageError(f"{path} is not a complete checkpoint (empty, truncated, or another kind of file)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UsageError(f"{path} is not a readable checkpoint ({str(error).splitlines()[0]})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise UsageError(f"{path} is not a checkpoint of python -m mtmoe fit")
    return checkpoint


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (x86: AVX512-BF16 or AMX-BF16; Arm: BF16); True where
    ``/proc/cpuinfo`` cannot tell."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def warn_about_precision(trainer: Namespace) -> None:
    """bf16-mixed on a CPU without native bf16 runs its matmuls emulated, far slower than float32 (figures in
    ``benchmarks/README.md``): one warning line."""
    if str(trainer.precision) != "bf16-mixed":
        return
    accelerator = str(trainer.accelerator)
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu and not cpu_has_native_bf16():
        print("warning: --trainer.precision bf16-mixed on a CPU without native bf16 (no avx512_bf16 or amx_bf16): "
              "its matmuls are emulated and far slower than in precision 32", file=sys.stderr, flush=True)


def check_trainer_settings(trainer: Namespace) -> None:
    """The trainer settings the training engine cannot honour: one line naming the setting."""
    for key in UNSUPPORTED_TRAINER_SETTINGS:
        problem = unsupported_setting(key, trainer[key]) if key in trainer else None
        if problem:
            raise UsageError(problem)
    if str(trainer.precision) not in (*ENGINE_PRECISIONS, "None"):
        raise UsageError(f"--trainer.precision {trainer.precision} is not supported by mtmoe's training engine: "
                         f"train in {' or '.join(ENGINE_PRECISIONS)}")


def check_loggers(loggers: Any) -> None:
    """``--trainer.logger`` (one logger or a list): a TensorBoard logger needs the ``tensorboard`` package (or
    ``tensorboardX``), which mtmoe installs only as its ``tensorboard`` extra; without it, one line naming the extra,
    before anything is built (Lightning's own answer is a long traceback, at the logger or at its first scalar)."""
    from lightning.fabric.loggers import TensorBoardLogger  # Lightning is loaded by the run that checks its settings

    for logger in loggers if isinstance(loggers, list) else [loggers]:
        class_path = logger.get("class_path") if isinstance(logger, (dict, Namespace)) else None
        if class_path is None or not issubclass(import_class(class_path), TensorBoardLogger):
            continue
        if not any(importable(module) for module in ("torch.utils.tensorboard", "tensorboardX")):
            raise UsageError(f"--trainer.logger {class_path.rpartition('.')[2]} needs the tensorboard package, which "
                             f"is not installed: {TENSORBOARD_EXTRA}")


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def check_run_settings(config: Namespace, command: str | None) -> None:
    """Settings that are valid for Lightning but make the command meaningless, or that the engine does not honour."""
    trainer = config.trainer
    check_trainer_settings(trainer)
    check_loggers(trainer.logger)
    warn_about_precision(trainer)
    if command in (None, "fit"):
        if trainer.max_epochs is not None and (trainer.max_epochs == 0 or trainer.max_epochs < -1):
            raise UsageError("--trainer.max_epochs must be >= 1 (or -1: until early stopping), "
                             f"got {trainer.max_epochs}")
        if config.early_stopping.patience < 0:
            raise UsageError(f"--early_stopping.patience must be >= 0, got {config.early_stopping.patience}")
        if not config.early_stopping.min_delta >= 0:
            raise UsageError(f"--early_stopping.min_delta must be >= 0 (the least improvement that counts), got "
                             f"{config.early_stopping.min_delta}")
    splits = {"fit": ("train", "val", "test"), "validate": ("val",), "test": ("test",), None: ("train", "val", "test")}
    for split in splits[command]:
        if trainer[f"limit_{split}_batches"] == 0:
            raise UsageError(f"--trainer.limit_{split}_batches 0 leaves no {split} batch: "
                             f"{command or 'fit'} needs {', '.join(splits[command])} batches")
    if command in ("validate", "test") and not config.ckpt_path:
        raise UsageError(f"{command} evaluates a checkpoint: pass --ckpt_path "
                         "(runs/lightning_logs/version_N/checkpoints/best.ckpt; fit tests its best weights itself)")
