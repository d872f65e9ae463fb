"""``studies/ablation_local_search.py`` (Table 1's design): a tiny run stopped by SIGTERM, and its resume."""
from __future__ import annotations

import csv
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtmoe.tuning.study import pid_alive

SCRIPT = Path(__file__).resolve().parents[1] / "studies" / "ablation_local_search.py"


def ablation(root: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--root", str(root), "--out", str(out), "--gates", "hash", "--epochs", "2",
            "--perm-epochs", "1", "--threads", "1", *extra]


def runs(out: Path) -> list[dict]:
    with open(out / "runs.csv") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.integration
def test_sigterm_keeps_the_finished_runs_and_a_rerun_trains_the_rest_and_writes_the_table(tiny_root: Path,
                                                                                          tmp_path: Path) -> None:
    """SIGTERM once a run has finished: the workers stop, exit 143, the finished runs are kept in runs.csv. The rerun
    with a seed more than those kept trains only the runs not kept and writes the table (runs per variant, mean ±
    SE beside the paper's Table 1)."""
    out = tmp_path / "ablation"
    process = subprocess.Popen(ablation(tiny_root, out, "--seeds", "200"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    children_file = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    deadline = time.monotonic() + 300
    while not (out / "runs.csv").exists():  # at least one run finished: the worker is busy with the next
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-2000:]
        time.sleep(0.2)
    workers = [int(pid) for pid in children_file.read_text().split()]
    assert workers
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143 and "rerun the same command to resume" in err  # 128 + SIGTERM
    time.sleep(1)
    for pid in workers:
        assert not pid_alive(pid), pid
    kept = {(r["gate"], r["seed"]) for r in runs(out)}
    assert kept and len(kept) == len(runs(out))

    seeds = max(int(seed) for _, seed in kept) + 2  # at least the two runs of the last seed are left to train
    again = subprocess.run(ablation(tiny_root, out, "--seeds", str(seeds)), capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    every = sorted((gate, str(seed)) for seed in range(seeds) for gate in ("hash", "hash+"))
    assert sorted((r["gate"], r["seed"]) for r in runs(out)) == every
    left = len(every) - len(kept)
    assert again.stdout.count(": test loss") == left and f"[{left}/{left}] hash+ seed {seeds - 1}" in again.stdout
    table = (out / "table.md").read_text()
    assert f"| hash | {seeds} |" in table and f"| hash+ | {seeds} |" in table and "57.434 ± 0.025" in table
