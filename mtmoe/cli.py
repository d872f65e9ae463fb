"""Command line: ``python -m mtmoe fit --gate comet --data movielens`` (and ``validate``, ``test``, ``gates``;
``tune``, ``report`` and ``bootstrap`` read and write the tuning studies, :mod:`mtmoe.tuning`).

``fit``/``validate``/``test`` are a ``LightningCLI`` (``--config``, ``--print_config``, ``--trainer.*``,
``--model.*``, ``--data.*``, ``--seed_everything``) with two shortcuts: ``--gate NAME`` selects a registered gate
(``--model.gate``) and ``--data NAME`` a registered dataset. ``fit`` trains with early stopping, restores the
best-validation weights, then tests; every command ends with a table of results on the terminal and the same
results as ``results.json`` next to the run's logs.

Bad input (unknown names, out-of-range hyperparameters, missing data files) prints one line and exits with code 2.
"""
from __future__ import annotations

import json
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Any

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


def lightning_cli_kwargs(args: list[str]) -> dict[str, Any]:
    """``MTMoECLI`` arguments shared by the commands and the tuning driver (which instantiates with ``run=False``)."""
    return {
        "model_class": MultiTaskMoE,
        "datamodule_class": InMemoryDataModule,
        "subclass_mode_data": True,
        "args": args,
        "seed_everything_default": 0,
        "trainer_defaults": {
            "max_epochs": 100,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}},
        },
        "save_config_kwargs": {"overwrite": True},
        "parser_kwargs": {"exit_on_error": False, **{c: {"exit_on_error": False} for c in LIGHTNING_COMMANDS}},
        "auto_configure_optimizers": False,
    }


def run_lightning(argv: list[str]) -> None:
    saved_argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI reads only the translated ``args``
    try:
        MTMoECLI(**lightning_cli_kwargs(translate_shortcuts(argv)))
    finally:
        sys.argv = saved_argv


def print_gates() -> None:
    for name in list_gates():
        cls = gate_class(name)
        kind = "sparse" if cls.sparse else "dense"
        tuned = ", ".join(cls.hyperparameters) or "-"
        print(f"{name:<15} {kind:<7} {cls.__module__}.{cls.__qualname__}  (tuned: {tuned})")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "tune":
            from mtmoe.tuning.study import tune

            tune(argv[1:])
        elif argv and argv[0] == "report":
            from mtmoe.tuning.report import report

            report(argv[1:])
        elif argv and argv[0] == "bootstrap":
            from mtmoe.tuning.bootstrap import bootstrap

            bootstrap(argv[1:])
        elif argv and argv[0] == "gates":
            print_gates()
        elif argv and argv[0] == "datasets":
            width = max(map(len, DATASETS))
            print("\n".join(f"{name:<{width}}  {path}" for name, path in sorted(DATASETS.items())))
        elif not argv or argv[0] in LIGHTNING_COMMANDS or argv[0].startswith("-"):
            run_lightning(argv)
        else:
            raise UsageError(
                f"unknown command {argv[0]!r}; commands: {', '.join(LIGHTNING_COMMANDS)}, "
                "tune, report, bootstrap, gates, datasets"
            )
    except (UsageError, ArgumentError) as error:
        message = " ".join(str(error).split())  # one line, whatever the parser's formatting
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


