"""The run builder: ``fit`` arguments -> the run's DataModule, LightningModule and Trainer.

One place turns arguments as ``python -m mtmoe fit`` takes them (``--gate comet+ --data movielens-100k
--model.lr 5e-4 --trainer.max_epochs 10``, ``--config run.yaml``, ...) into the objects of a run, through a
``LightningCLI`` (:class:`MTMoECLI`). The ``fit``/``validate``/``test`` commands run it (:func:`run_lightning`);
the tuning driver and anything else that needs the objects, trained or not, builds them with :func:`build_run`::

    from mtmoe.run import build_run

    run = build_run(["--gate", "comet", "--data", "movielens-100k", "--trainer.max_epochs=2"])
    run.config.model.lr, run.datamodule.info, run.model.net, run.trainer.max_epochs   # nothing trained yet
    results = run.fit()  # train to early stopping, restore the best epoch's weights, test them

Two shortcuts (:func:`translate_shortcuts`): ``--gate NAME`` selects a registered gate (``NAME+`` with local
search) and ``--data NAME`` a registered dataset. The configuration holds the values in force: a model setting left
to the dataset (``n_experts``, ``k``, ``alpha``, ...) is filled in with the dataset's value before anything is
built, so ``--print_config``, the run's ``config.yaml`` and its checkpoints show it. Bad input raises
:class:`~mtmoe.errors.UsageError` (or the parser's ``ArgumentError``): one line, exit code 2 at the command line.
"""
from __future__ import annotations

import argparse
import copy
import difflib
import json
import logging
import os
import re
import sys
import warnings
from argparse import ArgumentError
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import yaml
from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO

from mtmoe.arguments import MAX_SEED, UNSUPPORTED_TRAINER_SETTINGS, translate_shortcuts
from mtmoe.data import DATASETS
from mtmoe.data.base import InMemoryDataModule
from mtmoe.data.layout import data_root
from mtmoe.dataset_info import DatasetInfo
from mtmoe.errors import SettingError, TrainingDiverged, UsageError, did_you_mean
from mtmoe.files import write_atomic
from mtmoe.gates import gate_class, list_gates
from mtmoe.interrupts import Interrupted
from mtmoe.lit.module import MultiTaskMoE
from mtmoe.lit.outputs import AtomicCheckpointIO, RunCheckpoint, RunLogger, run_checkpoints
from mtmoe.pack.engine import EarlyStopping
from mtmoe.routing_names import routing_history
from mtmoe.pack.precision import matmul_precision
from mtmoe.pack.settings import ModelSettings
from mtmoe.run_settings import (
    check_run_settings, dataset_info, disagreements, given_model_settings, import_class, init_arguments,
    read_checkpoint, resolve_dataset_settings, set_values,
)

LIGHTNING_COMMANDS = ("fit", "validate", "test")
USAGE = {"fit": "--gate NAME --data NAME [--ckpt_path PATH]", "validate": "--ckpt_path PATH [--data NAME]",
         "test": "--ckpt_path PATH [--data NAME]"}
#: The splits of ``--trainer.limit_{split}_batches``, typed integer first (the signature's ``Optional[Union[int,
#: float]]`` reaches jsonargparse float first, where ``1`` would parse as ``1.0``, all batches).
BATCH_LIMITS = ("train", "val", "test", "predict")
SHORTCUTS = """Shortcuts: --gate NAME selects a registered gate (python -m mtmoe gates) or module:Class a gate class
of your own (NAME+ adds permutation local search, --model.perm_epochs 5 unless given) and --data NAME a dataset
(python -m mtmoe datasets). Lightning's
account of the seed and the hardware (Seed set to 0, GPU available: ...) is shown with MTMOE_VERBOSE=1 in the
environment."""
#: Lightning's info lines about the seed and the hardware: shown only with ``MTMOE_VERBOSE=1`` in the environment.
LIGHTNING_ACCOUNT = ("Seed set to ", "GPU available: ", "TPU available: ", "HPU available: ", "LOCAL_RANK: ")
DESCRIPTIONS = {
    "fit": "Train a gate on a dataset with Adam to early stopping on val/loss, restore the best epoch's weights and "
           "test them; their validation (at that epoch) and test results are printed and written as results.json in "
           "the run's folder (runs/lightning_logs/version_N/), its checkpoints as checkpoints/best.ckpt (the weights "
           "tested) and checkpoints/last.ckpt (to resume from: --ckpt_path). " + SHORTCUTS,
    "validate": "Evaluate a checkpoint (--ckpt_path, e.g. runs/lightning_logs/version_N/checkpoints/best.ckpt) on "
                "the validation split. The model is the checkpoint's: --gate and --model.* may be left out, and "
                "must agree with it if given. " + SHORTCUTS,
    "test": "Evaluate a checkpoint (--ckpt_path, e.g. runs/lightning_logs/version_N/checkpoints/best.ckpt) on the "
            "test split: the best.ckpt of a fit reproduces its test results. The model is the checkpoint's: --gate "
            "and --model.* may be left out, and must agree with it if given. " + SHORTCUTS,
}


def _shown(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    verbose = os.environ.get("MTMOE_VERBOSE", "") not in ("", "0")
    return (not message.startswith("💡 Tip") and "Detected KeyboardInterrupt" not in message
            and (verbose or not any(text in message for text in LIGHTNING_ACCOUNT)))


def quiet_lightning() -> None:
    """Drop what says nothing about the run: Lightning's adverts for its other products, its account of the seed
    and the hardware (unless ``MTMOE_VERBOSE=1``), its line on Ctrl-C (the command's ``error: interrupted`` line
    says what was kept), a deprecation inside Lightning, and the ``log_every_n_steps`` warning (every metric here is
    logged per epoch)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.seed"):
        logging.getLogger(name).addFilter(_shown)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r"The number of training batches .* is smaller than the logging")


class MTMoECLI(LightningCLI):
    """The CLI; ``results`` holds the last run's results, ``quiet`` suppresses the table (tuning trials).

    ``print_config`` (``--print_config``'s flags, ``""`` for none) prints the configuration in force once the
    dataset's values are filled in, and exits.
    """

    quiet = False
    results: dict[str, Any] | None = None

    def __init__(self, *args: Any, print_config: str | None = None, values: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        self.print_config, self.values = print_config, values or {}
        self.checkpoint: dict[str, Any] | None = None  # --ckpt_path's, read before Lightning applies it
        super().__init__(*args, **kwargs)

    # Private uses of argparse and jsonargparse: an option already added (Lightning adds the trainer's and --data)
    # is reached through argparse's _option_string_actions, and its type set through jsonargparse's _typehint; neither
    # library has a public way to change an added option. tests/test_tuning_overrides.py::
    # test_limit_batches_count_or_fraction_in_fit and tests/test_cli.py::
    # test_fit_help_lists_the_shortcuts_with_their_choices fail when they change.
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for split in BATCH_LIMITS:  # Lightning's rule: an integer is a count of batches, a float a fraction
            parser._option_string_actions[f"--trainer.limit_{split}_batches"]._typehint = Optional[Union[int, float]]
        parser.add_class_arguments(EarlyStopping, "early_stopping", help="Early stopping on the validation loss, "
                                   "Keras' EarlyStopping(patience, min_delta, restore_best_weights=True)")
        gates = ", ".join(f"{name}{'[+]' if gate_class(name).permutable else ''}" for name in list_gates())
        parser.add_argument_group("shortcuts").add_argument(
            "--gate", action=Shortcut, metavar="NAME",
            help=f"a registered gate, one of {gates} (python -m mtmoe gates), or module:Class; NAME+ adds "
                 "permutation local search (--model.perm_epochs 5 unless given). Sets --model.gate.")
        parser._option_string_actions["--data"].help = (
            f"NAME: a registered dataset, one of {', '.join(sorted(DATASETS))} (python -m mtmoe datasets); or a "
            "DataModule's class path, or a config. Its arguments: --data.ARG VALUE.")

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Lightning's, but ``--model.*`` are the fields of :class:`~mtmoe.pack.settings.ModelSettings` (each
        setting written once there), which :meth:`instantiate_classes` builds the model from."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({f"trainer.{key}": value for key, value in self.trainer_defaults.items()})
        parser.add_class_arguments(ModelSettings, "model", fail_untyped=False, sub_configs=True)
        parser.add_lightning_class_args(self.datamodule_class, "data", subclass_mode=self.subclass_mode_data)

    def instantiate_classes(self) -> None:
        """The DataModule, the model (its net built from the settings under the run's seed, with
        ``--early_stopping.*``; the model settings in force as its checkpoints' hyperparameters) and the trainer."""
        with flags_of("data", self.values):
            self.config_init = self.parser.instantiate_classes(self.config)
        built = self.of_command(self.config_init)
        self.datamodule = built.data
        with flags_of("model", self.values):
            self.model = MultiTaskMoE.build(self.datamodule.info, built.model, built.early_stopping,
                                            self.of_command(self.config).model.as_dict())
        self.trainer = self.instantiate_trainer()

    def of_command(self, config: Namespace) -> Namespace:
        """``config``'s (the parsed or the instantiated configuration) section of the command run, or all of it
        for a CLI built without one (:func:`build_run`)."""
        return config[self.subcommand] if self.subcommand else config

    # A private use of Lightning: the subcommands' parsers are made in LightningCLI's private _add_subcommands, after
    # the public add_arguments_to_parser hook (--ckpt_path and --weights_only come later, from Trainer.fit's
    # signature) and before parse_arguments, which answers --help; no public hook sees the finished parsers.
    # tests/test_cli.py::test_run_help_lists_what_a_run_honours_shortcuts_first fails when Lightning renames it.
    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        for subparser in parser._subcommands_action._name_parser_map.values():
            honoured_help(subparser)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self.named = {arg[2:].partition("=")[0] for arg in args if arg.startswith("--")}
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as error:
            raise UsageError(describe_parse_error(str(error), parser, args)) from None
        command = self.config.get("subcommand")
        seed = (self.config[command] if command else self.config).get("seed_everything")  # seeded before a hook
        if not isinstance(seed, bool) and isinstance(seed, int) and not 0 <= seed <= MAX_SEED:
            raise UsageError(f"--seed_everything must be between 0 and {MAX_SEED} (or true: a random seed), got {seed}")

    # A private use of Lightning: LightningCLI applies a checkpoint's hyperparameters in its private
    # _parse_ckpt_path, between the public parse_arguments and before_instantiate_classes hooks, and has no public
    # hook around it; overriding it is the one way to keep the settings as given (to check them against the
    # checkpoint's) and answer a bad checkpoint with one line. tests/test_checkpoints.py::
    # test_lightning_cli_parses_ckpt_path_between_its_hooks fails when Lightning renames or moves it.
    def _parse_ckpt_path(self) -> None:
        """Read ``--ckpt_path``'s checkpoint (a bad file is one error line) and keep the model settings as given;
        Lightning's own method (private) then applies the checkpoint's over them, checked against the given ones in
        :meth:`before_instantiate_classes`."""
        command = self.config.get("subcommand")
        if not command or not self.config[command].get("ckpt_path"):
            return
        path = self.config[command].ckpt_path
        self.checkpoint = read_checkpoint(path)  # without hyperparameters, the flags decide the model
        self.user_model = copy.deepcopy(self.config[command].model)
        try:
            super()._parse_ckpt_path()
        except (ArgumentError, SystemExit) as error:
            raise UsageError(f"{path}: its model settings do not fit this version of mtmoe ({error})") from None

    def before_instantiate_classes(self) -> None:
        config = self.of_command(self.config)
        set_values(config, self.values)
        with flags_of("data", self.values):
            info = dataset_info(config.data)
        if info is not None:
            with flags_of("model", self.values):
                resolve_dataset_settings(config.model, info)
        if self.checkpoint is not None:
            self.check_checkpoint(config, info)
        if self.print_config is not None:
            flags = {flag: True for flag in self.print_config.split(",") if flag}
            if set(flags) - {"skip_default", "skip_unset"}:
                raise UsageError(f"--print_config takes skip_default, skip_unset, got {self.print_config!r}")
            sys.stdout.write(self._parser(self.subcommand).dump(shown_config(config), **{"skip_unset": False,
                                                                                         **flags}))
            sys.exit(0)
        check_run_settings(config, self.subcommand)

    def check_checkpoint(self, config: Namespace, info: DatasetInfo | None) -> None:
        """The dataset and the model settings given must be the checkpoint's: one line naming both values."""
        path, saved_on = config.ckpt_path, self.checkpoint.get("dataset")
        if info is not None and saved_on is not None and saved_on != info.name:
            raise UsageError(f"--data {info.name} disagrees with the checkpoint {path}, trained on {saved_on}")
        parser_defaults = self._parser(self.subcommand).get_defaults()
        given = given_model_settings(self.user_model, parser_defaults.model, self.named)
        if info is not None:
            resolve_dataset_settings(self.user_model, info)
        found = disagreements(self.user_model, config.model, given)
        if found:
            raise UsageError(f"{'; '.join(found)}: the checkpoint {path} decides the model; "
                             "drop the disagreeing flags, or pass another checkpoint")

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """The trainer; a fit's with the run's checkpoints (unless ``enable_checkpointing`` is false or another
        ``ModelCheckpoint`` is given), written atomically, and the random states in them. A setting this machine
        cannot run (an accelerator, a device count, a precision) is one error line."""
        config = self.of_command(self.config_init).get("trainer", {})
        given = config.get("callbacks") or []
        callbacks = [*(given if isinstance(given, list) else [given])]
        checkpointing = config.get("enable_checkpointing") is not False and self.subcommand in (None, "fit")
        if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
            callbacks += run_checkpoints()
        try:
            trainer = super().instantiate_trainer(**{"callbacks": callbacks, **kwargs})
        except UsageError:
            raise
        except (MisconfigurationException, ValueError, ImportError) as error:  # Trainer.__init__: its arguments
            raise UsageError(f"the trainer settings cannot run here: {error}") from None
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def fit(self, model: MultiTaskMoE, datamodule: InMemoryDataModule, **kwargs: Any) -> None:
        """Train to early stopping, restore the best-validation weights (and that epoch's validation results),
        then test them."""
        search = model.net.local_search
        max_epochs = self.trainer.max_epochs
        if search is not None and max_epochs not in (None, -1) and search.epochs > max_epochs:
            raise UsageError(
                f"perm_epochs={search.epochs} is longer than the run (--trainer.max_epochs={max_epochs}): the "
                f"permutation would never be rounded and frozen; pass --model.perm_epochs {max_epochs} or less, or "
                f"--trainer.max_epochs {search.epochs} or more"
            )
        with self.run_folder(), matmul_precision(model.engine_settings.matmul_precision):
            self.trainer.fit(model, datamodule=datamodule, **kwargs)
            self.trainer.test(model, datamodule=datamodule, verbose=False)
            self.report(model, datamodule, self.fit_summary(model))
            self.log_settings(self.results)

    def log_settings(self, results: dict[str, Any]) -> None:
        """The run's settings (as ``--print_config`` shows them) as every logger's hyperparameters (its
        ``hparams.yaml``); TensorBoard also gets the final validation and test results as the metrics of its HPARAMS
        tab (``hparams/val/loss``, ``hparams/test/loss``, ...)."""
        from lightning.fabric.loggers import TensorBoardLogger
        from lightning.pytorch.core.saving import save_hparams_to_yaml

        config = self.of_command(self.config)
        settings = yaml.safe_load(self._parser(self.subcommand).dump(shown_config(config)))
        params = {"gate": results["gate"], "dataset": results["dataset"], **settings}
        metrics = {f"hparams/{split}/{key}": value for split in ("val", "test")
                   for key, value in results.get(split, {}).items() if isinstance(value, float)}
        for logger in self.trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.log_hyperparams(params, metrics)
            else:
                logger.log_hyperparams(params)
            logger.finalize("success")  # write them: the loggers were finalised when the test ended
            if isinstance(logger, TensorBoardLogger):  # its save() keeps the hparams.yaml written then, empty
                save_hparams_to_yaml(Path(logger.log_dir) / "hparams.yaml", logger.hparams)

    def validate(self, model: MultiTaskMoE, datamodule: InMemoryDataModule, **kwargs: Any) -> None:
        self.evaluate(self.trainer.validate, model, datamodule, **kwargs)

    def test(self, model: MultiTaskMoE, datamodule: InMemoryDataModule, **kwargs: Any) -> None:
        self.evaluate(self.trainer.test, model, datamodule, **kwargs)

    def evaluate(self, stage: Any, model: MultiTaskMoE, datamodule: InMemoryDataModule, **kwargs: Any) -> None:
        """``validate`` or ``test`` (``stage``) the checkpoint's weights and report them. The fit's checkpoint
        callbacks are not needed to evaluate its checkpoint: Lightning's warning that they are missing is dropped."""
        with self.run_folder(), warnings.catch_warnings(), matmul_precision(model.engine_settings.matmul_precision):
            warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used")
            stage(model, datamodule=datamodule, **{**kwargs, "verbose": False})
            self.report(model, datamodule, self.checkpoint_summary())

    @contextmanager
    def run_folder(self) -> Iterator[None]:
        """On bad input met while running, or Ctrl-C or SIGTERM (:mod:`mtmoe.interrupts`), remove the run's log
        folder again unless it holds a checkpoint or results (Lightning makes it once the data is prepared); an
        interrupted fit says how to resume from its ``last.ckpt``."""
        try:
            yield
        except (UsageError, MisconfigurationException, KeyboardInterrupt, SystemExit) as error:
            if isinstance(error, SystemExit) and not self.trainer.interrupted:  # Lightning's answer to Ctrl-C
                raise  # (exit 1) and to SIGTERM (SIGTERMException) leave it interrupted; other exits pass
            if isinstance(self.trainer.logger, RunLogger):
                self.trainer.logger.discard_unfinished()
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise Interrupted(self.resume_hint()) from None
            if isinstance(error, UsageError):
                raise
            raise UsageError(f"the trainer settings cannot run here: {error}") from None

    def resume_hint(self) -> str:
        """How an interrupted run goes on: from its ``last.ckpt`` if an epoch ended, else from the start."""
        last = next((Path(c.best_model_path) for c in self.trainer.callbacks
                     if isinstance(c, RunCheckpoint) and c.kind == "last" and c.best_model_path), None)
        fit = self.subcommand in (None, "fit")  # None: a run built by build_run
        if fit and last is not None and last.is_file():
            return f"to resume, run the same command with --ckpt_path {last}"
        return ("no epoch ended, " if fit else "") + "nothing was kept: run the same command again"

    def fit_summary(self, model: MultiTaskMoE) -> dict[str, Any]:
        """What ``fit`` adds to the results: epochs, the best epoch (whose weights were tested, and validated at
        that epoch), each validated epoch's routing statistics (``routing``), the checkpoints, and why it diverged
        if it did."""
        summary = {key: value for key, value in model.engine.summary(0).items() if key != "val"}
        summary["routing"] = routing_history(model.trial.history)
        paths = {c.kind: c.best_model_path for c in self.trainer.callbacks if isinstance(c, RunCheckpoint)}
        if any(paths.values()):
            summary["checkpoints"] = {kind: path for kind, path in paths.items() if path}
        if model.diverged is not None:
            summary["diverged"] = model.diverged
        return summary

    def checkpoint_summary(self) -> dict[str, Any]:
        config = self.config[self.subcommand]
        return {"checkpoint": config.ckpt_path, "checkpoint_epoch": self.checkpoint.get("epoch")}

    def report(self, model: MultiTaskMoE, datamodule: InMemoryDataModule, summary: dict[str, Any]) -> None:
        results: dict[str, Any] = {
            "dataset": datamodule.info.name,
            "gate": getattr(model.net.gates[0], "registry_name", type(model.net.gates[0]).__name__)
            + ("+" if model.net.local_search is not None else ""),
            "seed": self.of_command(self.config).get("seed_everything"),
            **summary,
            **model.last_results,
        }
        if model.net.local_search is not None:
            results["permutation"] = {"assignment": model.net.local_search.assignment(),
                                      **model.net.local_search.statistics()}
        self.results = results
        path = Path(self.trainer.log_dir or ".") / "results.json"
        try:
            write_atomic(json.dumps(results, indent=2) + "\n", path)
        except OSError as error:
            raise UsageError(f"cannot write {path} ({error.strerror or error})") from None
        if not self.quiet:
            print(format_results(results))
            print(f"results written to {path}")
            meaning = {"best": "these weights", "last": "the last epoch, to resume from"}
            for which, checkpoint in results.get("checkpoints", {}).items():
                print(f"{which} checkpoint: {checkpoint} ({meaning[which]})")


@contextmanager
def flags_of(group: str, planned: dict[str, Any] | None = None) -> Iterator[None]:
    """A :class:`~mtmoe.errors.SettingError` of a ``group`` setting (``model``, ``data``) raised inside, as the one
    line naming its flag (``--model.gate.k``), what it allows, and the flags that bound it; one of the ``planned``
    values (a study's, :func:`build_run`'s ``values``) is raised as it is, for the planner to name."""
    try:
        yield
    except SettingError as error:
        if f"{group}.{error.setting}" in (planned or {}):
            raise
        raise error.flagged(f"--{group}.") from None


def shown_config(config: Namespace) -> Namespace:
    """The configuration as ``--print_config`` shows it: a data root left unset (``$MTMOE_DATA``, else the user's
    cache) as the folder in force. The run's own ``config.yaml`` keeps it unset, to follow ``$MTMOE_DATA`` where it
    runs again."""
    shown = copy.deepcopy(config)
    data = shown.get("data")
    if data is not None and "root" in data.get("init_args", Namespace()) and data.init_args.root is None:
        data.init_args.root = str(data_root())
    return shown


def weights_evaluated(results: dict[str, Any]) -> str:
    """Which weights the results are of, in words."""
    if "checkpoint" in results:
        return f"the weights of {results['checkpoint']} (epoch {results['checkpoint_epoch']})"
    run = f"{results['epochs_run']} epoch{'' if results['epochs_run'] == 1 else 's'} run"
    if "best_epoch" in results:
        return f"epoch {results['best_epoch']}'s weights, the best val/loss of the {run}"
    return f"the last weights of the {run} (no finite val/loss)"


def format_results(results: dict[str, Any]) -> str:
    """A small table: one row per scalar metric, one column per evaluated split."""
    splits = [s for s in ("val", "test") if s in results]
    keys = sorted({k for s in splits for k, v in results[s].items() if isinstance(v, float)})
    width = max([len(k) for k in keys] + [6])
    lines = [f"{results['gate']} on {results['dataset']}: {' and '.join(splits)} of {weights_evaluated(results)}"]
    lines.append(f"{'metric':<{width}}  " + "  ".join(f"{s:>10}" for s in splits))
    for key in keys:
        cells = [f"{results[s][key]:>10.4f}" if key in results[s] else f"{'':>10}" for s in splits]
        lines.append(f"{key:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def honoured_help(parser: LightningArgumentParser) -> None:
    """``--help`` lists what a run honours, the shortcuts first: the trainer settings the engine does not honour
    (refused unless left at the honoured value), the dataset description the data links to the model and
    ``--verbose`` (the results table replaces Lightning's) are not shown; the trainer's group comes last.

    Private uses of argparse (``_option_string_actions``, ``_action_groups``, ``_group_actions``): it has no public
    way to change an added option's help or the order of the groups; ``tests/test_cli.py::
    test_run_help_lists_what_a_run_honours_shortcuts_first`` fails when they change."""
    hidden = ("--verbose", *(f"--trainer.{key}" for key in UNSUPPORTED_TRAINER_SETTINGS))
    for option, action in parser._option_string_actions.items():
        if option.removesuffix("+").removesuffix(".help") in hidden:
            action.help = argparse.SUPPRESS
    checkpoint = parser._option_string_actions["--ckpt_path"]
    checkpoint.help = ("the checkpoint to evaluate (validate, test) or to resume a fit from "
                       "(runs/lightning_logs/version_N/checkpoints/best.ckpt or last.ckpt)")
    parser._option_string_actions["--weights_only"].help = ("torch.load's weights_only for --ckpt_path (mtmoe's "
                                                            "checkpoints load with true)")
    groups = parser._action_groups
    shortcuts = next(group for group in groups if group.title == "shortcuts")
    checkpoint_group = next(group for group in groups if checkpoint in group._group_actions)
    checkpoint_group.title = "checkpoint"
    trainer = next(group for group in groups if any(a.dest.startswith("trainer.") for a in group._group_actions))
    trainer.title = "trainer: Lightning's settings that a run honours"
    rest = [group for group in groups if group not in (shortcuts, checkpoint_group, trainer)]
    groups[:] = [shortcuts, checkpoint_group, *rest, trainer]


class Shortcut(argparse.Action):
    """A shortcut in the options list (``--gate NAME``): :func:`translate_shortcuts` replaces it before parsing."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        raise ArgumentError(self, "is translated before parsing")


def _type_names(text: str) -> list[str]:
    """jsonargparse's rendering of a type as words: ``<class 'int'>`` -> ``int``, ``NoneType`` -> ``null``, a
    ``Literal[...]``'s members as themselves."""
    text = text.strip()
    if text.startswith(("Literal[", "typing.Literal[")):
        return [member.strip("'\"") for member in _top_level_items(text[text.index("[") + 1:-1])]
    name = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text).replace("typing.", "")
    return ["null" if name == "NoneType" else name]


def _top_level_items(text: str) -> list[str]:
    """``a, b[c, d], e`` -> ``[a, b[c, d], e]``."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [item.strip() for item in items + [text[start:]]]


def _config_files(args: list[str]) -> list[str]:
    files = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in ("--config", "-c"):
            files.append(value if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return files


def _keys(document: Any, prefix: str = "") -> set[str]:
    """The dotted keys of a configuration file's mapping (``trainer.max_epochs``, ...)."""
    if not isinstance(document, dict):
        return set()
    found = set()
    for key, value in document.items():
        found |= {f"{prefix}{key}"} | _keys(value, f"{prefix}{key}.")
    return found


def describe_parse_error(message: str, parser: Any, args: list[str]) -> str:
    """jsonargparse's parse error as one line: a value of the wrong type names the key and the types it takes; an
    unknown option (on the command line or in a ``--config`` file, then named) its closest valid key.

    Regular expressions over jsonargparse's wording: its ``ArgumentError`` carries the message only (no key, type or
    value), so no public API gives these; ``tests/test_cli.py::test_a_bad_value_or_option_names_the_key_in_one_line``
    and ``test_an_unknown_key_of_a_config_file_names_the_file_and_the_closest_key`` fail when the wording changes
    (the message would then pass through whole). The options a command takes are its parser's, reached through
    argparse's private ``_subcommands_action`` and ``_option_string_actions`` (no public listing exists)."""
    message = " ".join(message.split())
    keys = re.findall(r'Parser key "([^"]+)"', message)
    not_accepted = re.search(r"Option '([^']+)' is not accepted", message)
    class_path = re.search(r"class_path[= ]'([\w.]+)'", message)
    if keys and not_accepted and class_path:  # --data.NAME or --model.gate.NAME that the class does not take
        return unknown_argument(".".join(keys), not_accepted.group(1), class_path.group(1), args)
    if keys:  # a value of the wrong type: the innermost key (model.gate -> k), the types it takes, the value given
        innermost = message.rsplit('Parser key "', 1)[1]
        union = re.search(r"Subtypes: \[(.*?)\] Errors:", innermost)
        single = re.search(r"Expected a (<class '[\w.]+'>)", innermost)
        given = re.search(r"(?:Given|Got) value: (.*?)(?:\. Got value:|$)", innermost)
        if union or single:
            types = list(dict.fromkeys(name for item in (_top_level_items(union.group(1)) if union else
                                                          [single.group(1)]) for name in _type_names(item)))
            wanted = " or ".join(types) if len(types) < 4 else f"one of {', '.join(types)}"
            return f"--{'.'.join(keys)} takes {wanted}, got {given.group(1) if given else 'another type'}"
    command = args[0] if args and args[0] in LIGHTNING_COMMANDS else None
    options = (parser._subcommands_action._name_parser_map[command] if command else parser)._option_string_actions
    in_file = re.search(r"does not accept option '([^']+)'", message)
    if in_file:
        key, where = in_file.group(1), ""
        for path in _config_files(args):
            try:
                if key in _keys(yaml.safe_load(Path(path).read_text())):
                    where = f" in {path}"
            except (OSError, yaml.YAMLError):
                continue
        close = difflib.get_close_matches(key, [o.removeprefix("--") for o in options if o.startswith("--")], n=1)
        return (f"{command or 'the command'} has no setting {key!r}{where or ' (a --config file)'}"
                + (f": did you mean {close[0]!r}?" if close else ""))
    required = re.search(r"the following arguments are required: (.+)$", message)
    if required:  # jsonargparse names them by key (fit.data): as the flags to pass
        flags = [f"--{name.strip().removeprefix(f'{command}.')}" for name in required.group(1).split(",")]
        return (f"{command or 'the command'}: the following arguments are required: {', '.join(flags)}"
                + (" (NAME: python -m mtmoe datasets lists them)" if "--data" in flags else ""))
    unknown = re.search(r"nrecognized arguments: (--\S+)", message)
    return message + (did_you_mean(unknown.group(1), options) if unknown else "")


def unknown_argument(key: str, name: str, class_path: str, args: list[str]) -> str:
    """``--KEY.NAME`` where the class of ``--KEY`` (a DataModule, a gate) takes no argument ``NAME``, as one line:
    given before any option that chooses the class (``--model.gate.k 2 --gate topk``: jsonargparse gives ``k`` to
    the base class ``Gate``), that order; else the closest argument the class takes, or the option that lists them."""
    flags = [arg.partition("=")[0] for arg in args]
    given = flags.index(f"--{key}.{name}") if f"--{key}.{name}" in flags else None
    if given is not None and f"--{key}" in flags[given:] and f"--{key}" not in flags[:given]:
        chooser = {"model.gate": "--gate"}.get(key, f"--{key}")
        return (f"--{key}.{name} is given before {chooser}, which chooses the class it is an argument of: give "
                f"{chooser} first, then its arguments")
    close = difflib.get_close_matches(name, sorted(init_arguments(import_class(class_path)) - {"dims"}), n=1)
    return (f"--{key}.{name}: {class_path.rpartition('.')[2]} takes no argument {name!r}; "
            + (f"did you mean --{key}.{close[0]}?" if close else f"--{key}.help {class_path} lists its arguments"))


def checkpoint_dataset(args: list[str]) -> list[str]:
    """``validate``/``test`` of a ``--ckpt_path`` without ``--data`` (or a ``--config``): the checkpoint's dataset,
    as ``--data`` right after the command (so that any later ``--data.*`` applies to it)."""
    if not args or args[0] not in ("validate", "test"):
        return args
    flags = [arg.partition("=")[0] for arg in args]
    if "--data" in flags or "--config" in flags or "-c" in flags or "--ckpt_path" not in flags:
        return args
    i = flags.index("--ckpt_path")
    path = args[i].partition("=")[2] if "=" in args[i] else (args[i + 1] if i + 1 < len(args) else "")
    dataset = read_checkpoint(path).get("dataset")
    return args if dataset not in DATASETS else [args[0], f"--data={DATASETS[dataset]}", *args[1:]]


def _cli(argv: list[str], run: bool, values: dict[str, Any] | None = None) -> MTMoECLI:
    """The ``MTMoECLI`` of ``argv`` (shortcuts allowed) with ``values`` set over its parsed configuration;
    ``run=True`` runs its subcommand, ``False`` only builds."""
    quiet_lightning()
    args = checkpoint_dataset(translate_shortcuts(argv))
    print_config = next((a.partition("=")[2] for a in args if a.partition("=")[0] == "--print_config"), None)
    if not any(a.partition("=")[0] in ("--data", "--config", "-c") for a in args):
        print_config = None  # no dataset, no values of its to fill in: jsonargparse prints the template as it is
    saved_argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI reads only the translated ``args``
    try:
        return MTMoECLI(
            model_class=MultiTaskMoE,
            datamodule_class=InMemoryDataModule,
            subclass_mode_data=True,
            args=[a for a in args if print_config is None or a.partition("=")[0] != "--print_config"],
            run=run,
            print_config=print_config,
            values=values,
            seed_everything_default=0,
            trainer_defaults={
                "max_epochs": 100,
                "logger": {"class_path": f"{RunLogger.__module__}.{RunLogger.__name__}",
                           "init_args": {"save_dir": "runs"}},
            },
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"exit_on_error": False, "allow_abbrev": False, "prog": "python -m mtmoe",
                           **{c: {"exit_on_error": False, "allow_abbrev": False, "description": DESCRIPTIONS[c],
                                  "usage": f"python -m mtmoe {c} {USAGE[c]} [-c CONFIG] [--print_config]\n       [--model.* ...] "
                                           "[--data.* ...] [--early_stopping.* ...] [--trainer.* ...] "
                                           "[--seed_everything N]"} for c in LIGHTNING_COMMANDS}},
            auto_configure_optimizers=False,
        )
    finally:
        sys.argv = saved_argv


def run_lightning(argv: list[str]) -> None:
    """``python -m mtmoe fit|validate|test ARGS``: build the run and run the subcommand; the results are printed.
    A fit that diverged raises :class:`~mtmoe.errors.TrainingDiverged` once its results are written."""
    cli = _cli(argv, run=True)
    if cli.subcommand == "fit" and cli.model.diverged is not None:
        raise TrainingDiverged(f"the fit diverged ({cli.model.diverged}); its results are marked so in "
                               f"{Path(cli.trainer.log_dir or '.') / 'results.json'}")


@dataclass(frozen=True)
class Run:
    """A run built from ``fit`` arguments and not started: its configuration and the objects it trains with.

    The global seed (``seed_everything``) is set before the objects are made, so ``model`` is initialised exactly
    as ``python -m mtmoe fit`` with the same arguments initialises it.
    """

    config: Namespace  # the parsed configuration: seed_everything, trainer, model, data, early_stopping, ...
    datamodule: InMemoryDataModule
    model: MultiTaskMoE
    trainer: pl.Trainer
    cli: MTMoECLI = field(repr=False)  # the LightningCLI that built them (its parser, its ``config_init``)

    def fit(self) -> dict[str, Any]:
        """Train to early stopping, restore the best-validation weights and test them (``fit``); the results, also
        written as ``results.json`` in the trainer's log folder. Nothing is printed."""
        self.cli.fit(self.model, self.datamodule)
        return self.cli.results


def build_run(args: list[str], values: dict[str, Any] | None = None) -> Run:
    """Build (but do not start) the run of ``fit`` arguments: ``build_run(args).fit()`` trains as ``fit`` would.
    ``values`` (search-space keys: ``model.lr``, ``model.gate.k``, ``data.batch_size``) are set over the parsed
    arguments, as they are, before anything is built (a study's planned values)."""
    cli = _cli(args, run=False, values=values)
    cli.quiet = True
    return Run(cli.config, cli.datamodule, cli.model, cli.trainer, cli)
