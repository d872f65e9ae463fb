"""The run builder: ``fit`` arguments -> the run's DataModule, LightningModule and Trainer.

One place turns arguments as ``python -m mtmoe fit`` takes them (``--gate comet+ --data movielens-100k
--model.lr 5e-4 --trainer.max_epochs 10``, ``--config run.yaml``, ...) into the objects of a run, through a
``LightningCLI`` (:class:`MTMoECLI`). The ``fit``/``validate``/``test`` commands run it (:func:`run_lightning`);
the tuning driver and anything else that needs the objects, trained or not, builds them with :func:`build_run`::

    from mtmoe.run import build_run

    run = build_run(["--gate", "comet", "--data", "movielens-100k", "--trainer.max_epochs=2"])
    run.config.model.lr, run.datamodule.info, run.model.net, run.trainer.max_epochs   # nothing trained yet
    results = run.fit()  # train to early stopping, restore the best weights, test; also written as results.json

Two shortcuts (:func:`translate_shortcuts`): ``--gate NAME`` selects a registered gate (``NAME+`` with local
search) and ``--data NAME`` a registered dataset. Bad input raises :class:`~mtmoe.errors.UsageError` (or the
parser's ``ArgumentError``): one line, exit code 2 at the command line.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from mtmoe.data import DATASETS
from mtmoe.data.base import InMemoryDataModule
from mtmoe.errors import UsageError
from mtmoe.files import write_atomic
from mtmoe.gates import gate_class, list_gates
from mtmoe.gates.base import no_plus_variant
from mtmoe.lit.callbacks import RestoreBestWeights
from mtmoe.lit.module import MultiTaskMoE

LIGHTNING_COMMANDS = ("fit", "validate", "test")


class MTMoECLI(LightningCLI):
    """The CLI; ``results`` holds the last run's results, ``quiet`` suppresses the table (tuning trials)."""

    quiet = False
    results: dict[str, Any] | None = None

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.info", "model.info", apply_on="instantiate")
        parser.add_lightning_class_args(EarlyStopping, "early_stopping")
        parser.set_defaults(
            {"early_stopping.monitor": "val/loss", "early_stopping.patience": 25, "early_stopping.mode": "min"}
        )
        parser.add_lightning_class_args(RestoreBestWeights, "restore_best")

    def fit(self, model: MultiTaskMoE, datamodule: InMemoryDataModule, **kwargs: Any) -> None:
        """Train to early stopping, restore the best-validation weights, then test them."""
        search = model.net.local_search
        max_epochs = self.trainer.max_epochs
        if search is not None and max_epochs not in (None, -1) and search.epochs > max_epochs:
            raise UsageError(
                f"perm_epochs={search.epochs} is longer than the run (--trainer.max_epochs={max_epochs}); "
                "the permutation would never be rounded and frozen"
            )
        self.trainer.fit(model, datamodule=datamodule, **kwargs)
        self.trainer.test(model, datamodule=datamodule, verbose=False)
        self.report(model, datamodule)

    def validate(self, model: MultiTaskMoE, datamodule: InMemoryDataModule, **kwargs: Any) -> None:
        self.trainer.validate(model, datamodule=datamodule, **{**kwargs, "verbose": False})
        self.report(model, datamodule)

    def test(self, model: MultiTaskMoE, datamodule: InMemoryDataModule, **kwargs: Any) -> None:
        self.trainer.test(model, datamodule=datamodule, **{**kwargs, "verbose": False})
        self.report(model, datamodule)

    def report(self, model: MultiTaskMoE, datamodule: InMemoryDataModule) -> None:
        restore = next((c for c in self.trainer.callbacks if isinstance(c, RestoreBestWeights)), None)
        results: dict[str, Any] = {
            "dataset": datamodule.info.name,
            "gate": getattr(model.net.gates[0], "registry_name", type(model.net.gates[0]).__name__)
            + ("+" if model.net.local_search is not None else ""),
            "seed": (self.config[self.subcommand] if self.subcommand else self.config).get("seed_everything"),
            "epochs_run": self.trainer.current_epoch,
            **(
                {"best_epoch": restore.best_epoch, "best_val_loss": restore.best_score}
                if restore is not None and restore.best_epoch >= 0
                else {}
            ),
            **model.last_results,
        }
        if model.net.local_search is not None:
            results["permutation"] = {"assignment": model.net.local_search.assignment(),
                                      **model.net.local_search.statistics()}
        self.results = results
        log_dir = Path(self.trainer.log_dir or ".")
        write_atomic(json.dumps(results, indent=2) + "\n", log_dir / "results.json")
        if not self.quiet:
            print(format_results(results))
            print(f"results written to {log_dir / 'results.json'}")


def format_results(results: dict[str, Any]) -> str:
    """A small table: one row per scalar metric, one column per evaluated split."""
    splits = [s for s in ("val", "test") if s in results]
    keys = sorted({k for s in splits for k, v in results[s].items() if isinstance(v, float)})
    width = max([len(k) for k in keys] + [6])
    lines = [f"{results['gate']} on {results['dataset']}"]
    lines.append(f"{'metric':<{width}}  " + "  ".join(f"{s:>10}" for s in splits))
    for key in keys:
        cells = [f"{results[s][key]:>10.4f}" if key in results[s] else f"{'':>10}" for s in splits]
        lines.append(f"{key:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def translate_shortcuts(argv: list[str]) -> list[str]:
    """``--gate NAME`` -> ``--model.gate CLASS``, ``--data NAME`` -> ``--data CLASS``; unknown names fail here."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in ("--gate", "--data") and not eq:
            if i + 1 >= len(argv):
                raise UsageError(f"{flag} needs a value")
            value, i = argv[i + 1], i + 1
        if flag == "--gate":  # "NAME+": the gate with local search (E_perm = 5 unless --model.perm_epochs is given)
            base = value.removesuffix("+")
            if base not in list_gates():
                raise UsageError(
                    f"unknown gate {value!r}; valid gates: {', '.join(list_gates())} "
                    "(append '+' for permutation local search, e.g. comet+)"
                )
            cls = gate_class(base)
            if value.endswith("+") and not cls.permutable:
                raise no_plus_variant(base)
            out.append(f"--model.gate={cls.__module__}.{cls.__qualname__}")
            if value.endswith("+") and not any(a.startswith("--model.perm_epochs") for a in argv):
                out.append("--model.perm_epochs=5")
        elif flag == "--data" and "." not in value:
            if value not in DATASETS:
                raise UsageError(f"unknown dataset {value!r}; valid datasets: {', '.join(sorted(DATASETS))}")
            out.append(f"--data={DATASETS[value]}")
        elif flag == "--data":
            out.append(f"--data={value}")
        else:
            out.append(arg)
        i += 1
    return out


def _cli(argv: list[str], run: bool) -> MTMoECLI:
    """The ``MTMoECLI`` of ``argv`` (shortcuts allowed); ``run=True`` runs its subcommand, ``False`` only builds."""
    saved_argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI reads only the translated ``args``
    try:
        return MTMoECLI(
            model_class=MultiTaskMoE,
            datamodule_class=InMemoryDataModule,
            subclass_mode_data=True,
            args=translate_shortcuts(argv),
            run=run,
            seed_everything_default=0,
            trainer_defaults={
                "max_epochs": 100,
                "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}},
            },
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"exit_on_error": False, **{c: {"exit_on_error": False} for c in LIGHTNING_COMMANDS}},
            auto_configure_optimizers=False,
        )
    finally:
        sys.argv = saved_argv


def run_lightning(argv: list[str]) -> None:
    """``python -m mtmoe fit|validate|test ARGS``: build the run and run the subcommand; the results are printed."""
    _cli(argv, run=True)


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


def build_run(args: list[str]) -> Run:
    """Build (but do not start) the run of ``fit`` arguments: ``build_run(args).fit()`` trains as ``fit`` would."""
    cli = _cli(args, run=False)
    cli.quiet = True
    return Run(cli.config, cli.datamodule, cli.model, cli.trainer, cli)
