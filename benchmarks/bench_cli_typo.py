"""Wall time of a mistyped command, ``python -m mtmoe fit --gate comt+`` (one ``error:`` line, exit 2), against a
bare interpreter start and the command that trains nothing yet imports Lightning (``fit --help``).

    python benchmarks/bench_cli_typo.py [--runs 10] [--checkout PATH]

Each command runs ``--runs`` times in a fresh interpreter from this checkout (or ``--checkout``'s, e.g. an older one) (the first run of each is a warm-up
and not counted); prints min / median / max in seconds as a Markdown table. No data is read.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -m mtmoe fit --gate comt+": [sys.executable, "-m", "mtmoe", "fit", "--gate", "comt+"],
    "python -m mtmoe fit --help": [sys.executable, "-m", "mtmoe", "fit", "--help"],
}


def timed(argv: list[str], checkout: Path) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)})
    return time.perf_counter() - start, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--checkout", type=Path, default=CHECKOUT, help="the mtmoe checkout to time")
    args = parser.parse_args()
    print(f"{args.checkout}: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, "
          f"Python {platform.python_version()}, {args.runs} runs each\n")
    print("| command | exit | min (s) | median (s) | max (s) |\n|---|---|---|---|---|")
    for name, argv in COMMANDS.items():
        timed(argv, args.checkout)  # warm-up: the file cache
        times, codes = zip(*(timed(argv, args.checkout) for _ in range(args.runs)))
        print(f"| `{name}` | {codes[0]} | {min(times):.3f} | {statistics.median(times):.3f} | {max(times):.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
