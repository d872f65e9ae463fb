"""Command line: ``python -m mtmoe fit --gate comet --data movielens`` (and ``validate``, ``test``, ``gates``;
``tune``, ``report`` and ``bootstrap`` read and write the tuning studies, :mod:`mtmoe.tuning`).

``fit``/``validate``/``test`` are a ``LightningCLI`` built by :mod:`mtmoe.run` (``--config``, ``--print_config``,
``--trainer.*``, ``--model.*``, ``--data.*``, ``--seed_everything``) with two shortcuts: ``--gate NAME`` selects a
registered gate (``--model.gate``) and ``--data NAME`` a registered dataset. ``fit`` trains with early stopping,
restores the best-validation weights, then tests; every command ends with a table of results on the terminal and
the same results as ``results.json`` next to the run's logs.

Bad input (unknown names, out-of-range hyperparameters, missing data files) prints one line and exits with code 2.
"""
from __future__ import annotations

import sys
from argparse import ArgumentError

from mtmoe.errors import UsageError

# Each command imports what it needs when it runs: listing the gates does not import Lightning.


def print_gates() -> None:
    from mtmoe.gates import gate_class, list_gates

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
            from mtmoe.tuning.bootstrap_report import bootstrap

            bootstrap(argv[1:])
        elif argv and argv[0] == "gates":
            print_gates()
        elif argv and argv[0] == "datasets":
            from mtmoe.data import DATASETS

            width = max(map(len, DATASETS))
            print("\n".join(f"{name:<{width}}  {path}" for name, path in sorted(DATASETS.items())))
        else:
            from mtmoe.run import LIGHTNING_COMMANDS, run_lightning

            if argv and argv[0] not in LIGHTNING_COMMANDS and not argv[0].startswith("-"):
                raise UsageError(
                    f"unknown command {argv[0]!r}; commands: {', '.join(LIGHTNING_COMMANDS)}, "
                    "tune, report, bootstrap, gates, datasets"
                )
            run_lightning(argv)
    except (UsageError, ArgumentError) as error:
        message = " ".join(str(error).split())  # one line, whatever the parser's formatting
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


