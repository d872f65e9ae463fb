"""What each test costs in CPU time: a pytest plugin, and the table it gives.

Wall time per test (``--durations``) misleads on a loaded 2-core machine, and most of this suite's CPU time is spent
in the ``python -m mtmoe`` processes its integration tests start. The plugin records, per test, the CPU seconds of
the pytest process (an xdist worker) and of the child processes it waited for (``RUSAGE_CHILDREN``: a ``tune``
command, a PostgreSQL server stopped by a fixture), as JSON lines, one file per worker::

    PYTHONPATH=benchmarks python -m pytest -p pytest_cpu_time --cpu-time-out /tmp/cpu -q
    python benchmarks/pytest_cpu_time.py /tmp/cpu [--tests 40]

The table: CPU seconds per test file (own, children, wall), then the tests that cost the most. A fixture's cost
falls to the first test that uses it (its teardown to the last).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-time-out", metavar="DIR", help="folder for the per-test CPU times (JSON lines)")


def _cpu_seconds() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    folder = item.config.getoption("cpu_time_out")
    if folder is None:
        yield
        return
    own, children = _cpu_seconds()
    start = time.monotonic()
    yield
    own_after, children_after = _cpu_seconds()
    Path(folder).mkdir(parents=True, exist_ok=True)
    # xdist's worker id, not PYTEST_XDIST_WORKER: a pytest that a test starts inherits its worker's environment
    worker = getattr(item.config, "workerinput", {}).get("workerid", "main")
    with open(Path(folder) / f"cpu-{worker}.jsonl", "a") as out:
        out.write(json.dumps({"id": item.nodeid, "own": own_after - own, "children": children_after - children,
                              "wall": time.monotonic() - start}) + "\n")


def table(folder: Path, tests: int) -> str:
    rows = [json.loads(line) for path in sorted(folder.glob("cpu-*.jsonl")) for line in path.read_text().splitlines()]
    if not rows:
        print(f"error: no cpu-*.jsonl under {folder}; run pytest with -p pytest_cpu_time --cpu-time-out {folder}",
              file=sys.stderr)
        sys.exit(2)
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for row in rows:
        total = files[row["id"].split("::")[0]]
        total[0] += row["own"]
        total[1] += row["children"]
        total[2] += row["wall"]
        total[3] += 1
    own, children = sum(r["own"] for r in rows), sum(r["children"] for r in rows)
    lines = [f"{len(rows)} tests: {own + children:.0f} CPU-s ({own:.0f} in pytest's processes, {children:.0f} in "
             f"their children), {sum(r['wall'] for r in rows):.0f} s of test wall time", "",
             "| CPU-s | own | children | wall (s) | tests | file |", "|---|---|---|---|---|---|"]
    for name, (own_s, child_s, wall_s, n) in sorted(files.items(), key=lambda item: -(item[1][0] + item[1][1])):
        lines.append(f"| {own_s + child_s:.1f} | {own_s:.1f} | {child_s:.1f} | {wall_s:.1f} | {n} | `{name}` |")
    lines += ["", "| CPU-s | own | wall (s) | test |", "|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: -(r["own"] + r["children"]))[:tests]:
        lines.append(f"| {row['own'] + row['children']:.1f} | {row['own']:.1f} | {row['wall']:.1f} | `{row['id']}` |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="CPU seconds per test file and per test, from --cpu-time-out's files")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--tests", type=int, default=40, help="how many of the costliest tests to list")
    args = parser.parse_args()
    print(table(args.folder, args.tests))


if __name__ == "__main__":
    main()
