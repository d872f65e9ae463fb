"""Command line: ``python -m mtmoe COMMAND [OPTIONS]``; ``python -m mtmoe`` or ``--help`` lists the commands.

``fit``/``validate``/``test`` are a ``LightningCLI`` built by :mod:`mtmoe.run` (``--config``, ``--print_config``,
``--trainer.*``, ``--model.*``, ``--data.*``, ``--seed_everything``) with two shortcuts: ``--gate NAME`` selects a
registered gate (``--model.gate``) and ``--data NAME`` a registered dataset. ``fit`` trains with early stopping,
restores the best-validation weights and tests them (val and test of the same weights); every command ends with a
table of results on the terminal and the same results as ``results.json`` next to the run's logs. ``tune``,
``report`` and ``bootstrap`` read and write the tuning studies (:mod:`mtmoe.tuning`).

Bad input (unknown names, out-of-range settings, missing data files) prints one ``error:`` line and exits with
code 2; a fit that diverged writes its results, prints one ``error:`` line and exits with code 1. Ctrl-C and SIGTERM
stop every command alike (:mod:`mtmoe.interrupts`): one ``error: interrupted`` line saying what was kept and how
to go on, exit code 130 (Ctrl-C) or 143 (SIGTERM); output piped to a reader that leaves early (``| head``)
ends the command quietly, exit code 141 as for a shell tool. Lightning's account of the seed and the hardware
(``Seed set to 0``, ``GPU available: ...``) is shown only with ``MTMOE_VERBOSE=1`` in the environment
(:data:`VERBOSE`). ``MTMOE_PLAIN_KERNELS`` runs the fused kernels it names as torch operations
(:mod:`mtmoe.plain_kernels`); ``fit`` and ``tune`` say so on stderr, and refuse an unknown name in one line.
"""
from __future__ import annotations

import os
import signal
import sys
from argparse import ArgumentError

from mtmoe import interrupts
from mtmoe.arguments import check_arguments
from mtmoe.data import DATASETS
from mtmoe.errors import OneLineParser, TrainingDiverged, UsageError
from mtmoe.gate_names import split_gate_name

# Each command imports what it needs when it runs: help and the listings import neither Lightning nor Optuna's
# storages, the listing of datasets not even torch, and a fit's mistyped names (mtmoe.arguments) neither.

COMMANDS = {
    "fit": "train a gate on a dataset to early stopping; val and test results of the best epoch's weights",
    "validate": "evaluate a checkpoint (--ckpt_path) on the validation split",
    "test": "evaluate a checkpoint (--ckpt_path) on the test split: a fit's best.ckpt gives its test results",
    "tune": "random search over a gate's search space: an Optuna study, resumable, on one or many machines",
    "report": "the tables of a dataset's studies: top-5% mean ± SE, one-sided Welch t-tests, per-task metrics",
    "bootstrap": "tuning-budget curves and reduction factors from a dataset's studies (the paper's Appendix F)",
    "gates": "list the registered gates and what each dataset's search space tunes for them",
    "datasets": "list the datasets, their DataModules, and whether their files are under the data root",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m mtmoe COMMAND [OPTIONS]", "",
             "Sparse mixture-of-experts gates in multi-task models: train, evaluate, tune, report.", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in COMMANDS.items()]
    lines += ["", "python -m mtmoe COMMAND --help describes a command's options; python -m mtmoe --version prints "
              "the version.", "MTMOE_VERBOSE=1 in the environment also shows Lightning's account of the seed and "
              "the hardware (Seed set to 0, GPU available: ...)."]
    return "\n".join(lines)


def version() -> str:
    """The installed distribution's version (pyproject.toml's)."""
    from mtmoe.code_version import installed_version

    return installed_version() or "(not installed: pip install the checkout to give it a version)"


def listing_parser(command: str) -> OneLineParser:
    return OneLineParser(prog=f"python -m mtmoe {command}", description=COMMANDS[command][0].upper() + COMMANDS[command][1:] + ".")


def searched_settings(datasets: list[str], gates: list[str]) -> dict[str, dict[str, list[str]]]:
    """Per gate of ``gates`` (``comet``, ``comet+``, ...): the settings ``tune`` searches for it on each of
    ``datasets`` (its packaged search space), written ``lr, gate.gamma, ...``, -> the datasets whose space searches
    exactly those."""
    from mtmoe.tuning.space import gate_space, read_space_file

    searched: dict[str, dict[str, list[str]]] = {}
    for data in datasets:
        document, where = read_space_file(data)
        for gate in gates:
            keys = [key.removeprefix("model.") for key in gate_space(document, where, gate, check_keys=False).distributions]
            searched.setdefault(gate, {}).setdefault(", ".join(keys) or "nothing", []).append(data)
    return searched


def print_gates(data: str | None) -> None:
    """The gates and what ``tune`` searches for each: in ``data``'s search space, else in every dataset's (the
    datasets named where their spaces differ)."""
    from mtmoe.gates import gate_class, gate_variants

    datasets = [data] if data else list(DATASETS)
    variants = gate_variants()
    searched = searched_settings(datasets, variants)
    rows = []
    for variant in variants:
        cls = gate_class(split_gate_name(variant)[0])
        groups = [keys if len(searched[variant]) == 1 else f"{keys} ({', '.join(names)})"
                  for keys, names in searched[variant].items()]
        rows.append((variant, "sparse" if cls.sparse else "dense", f"{cls.__module__}.{cls.__qualname__}",
                     "; ".join(groups)))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    where = (f"on {data} (mtmoe/tuning/spaces/{data}.yaml" if data else
             "on every dataset unless named (mtmoe/tuning/spaces/<dataset>.yaml")
    print(f"{'gate':<{widths[0]}}  {'kind':<{widths[1]}}  {'class':<{widths[2]}}  "
          f"searched by tune {where} over the gate's defaults; model.* settings{'' if data else '; --data NAME: one dataset'})")
    for row in rows:
        print("  ".join(f"{cell:<{width}}" for cell, width in zip(row, widths)) + f"  {row[3]}")


def print_datasets(root: str | None) -> None:
    """Per dataset: its DataModule, the folders of the data root its files go in, and whether they are there
    (:func:`mtmoe.data.layout.files_status`); the header names where the root comes from, and the flag that looks
    elsewhere unless it was given."""
    import os

    from mtmoe.data.layout import data_root, files_status

    where = "MTMOE_DATA" if os.environ.get("MTMOE_DATA") else "MTMOE_DATA unset"
    where = "--data.root" if root else f"{where}; --data.root PATH looks elsewhere"
    root = data_root(root)
    rows = [("dataset", "DataModule", "files go in", "files")]
    rows += [(name, path, *reversed(files_status(name, root))) for name, path in sorted(DATASETS.items())]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    print(f"data root: {root} ({where})")
    for row in rows:
        print("  ".join(f"{cell:<{width}}" for cell, width in zip(row, widths)) + f"  {row[3]}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    interrupts.handle_interrupts()
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(usage())
            return
        if argv[0] == "--version":
            print(f"mtmoe {version()}")
            return
        command, args = argv[0], argv[1:]
        if command == "tune":
            from mtmoe.tuning.study import tune

            tune(args)
        elif command == "report":
            from mtmoe.tuning.report import report

            report(args)
        elif command == "bootstrap":
            from mtmoe.tuning.bootstrap_report import bootstrap

            bootstrap(args)
        elif command == "gates":
            parser = listing_parser(command)
            parser.add_argument("--data", choices=sorted(DATASETS), metavar="NAME",
                                help="list what this dataset's search space tunes (default: every dataset's)")
            print_gates(parser.parse_args(args).data)
        elif command == "datasets":
            parser = listing_parser(command)
            parser.add_argument("--data.root", dest="root", metavar="PATH",
                                help="the data root to look in (default: $MTMOE_DATA, else ~/.cache/mtmoe/data)")
            print_datasets(parser.parse_args(args).root)
        elif command in ("fit", "validate", "test"):
            check_arguments(args)  # a mistyped name is answered before torch and Lightning are imported
            from mtmoe.plain_kernels import announce
            from mtmoe.run import run_lightning

            announce()  # a bad MTMOE_PLAIN_KERNELS is refused before any work

            run_lightning(argv)
        else:
            raise UsageError(f"unknown command {command!r}; commands: {', '.join(COMMANDS)} "
                             "(python -m mtmoe --help describes them)")
    except (UsageError, ArgumentError) as error:
        message = " ".join(str(error).split())  # one line, whatever the parser's formatting
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    except TrainingDiverged as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as stop:
        interrupts.stopping()
        detail = f"; {stop}" if str(stop) else ""
        print(f"error: interrupted ({interrupts.signal_name()}){detail}", file=sys.stderr, flush=True)
        sys.exit(interrupts.exit_code())
    except BrokenPipeError:  # the reader of the output left (`| head`): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the flush at exit fails again
        sys.exit(128 + signal.SIGPIPE)
