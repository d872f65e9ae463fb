"""``studies/ablation_local_search.py`` (Table 1's design): a tiny run, its resume, and its stop on SIGTERM."""
from __future__ import annotations

import csv
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "studies" / "ablation_local_search.py"


def ablation(root: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--root", str(root), "--out", str(out), "--gates", "hash", "--epochs", "2",
            "--perm-epochs", "1", "--threads", "1", *extra]


def runs(out: Path) -> list[dict]:
    with open(out / "runs.csv") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.integration
def test_tiny_ablation_writes_runs_and_table_and_resumes(tiny_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "ablation"
    first = subprocess.run(ablation(tiny_root, out, "--seeds", "2"), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted((r["gate"], r["seed"]) for r in runs(out)) == [("hash", "0"), ("hash", "1"), ("hash+", "0"),
                                                                  ("hash+", "1")]
    table = (out / "table.md").read_text()
    assert "| hash | 2 |" in table and "| hash+ | 2 |" in table and "57.434 ± 0.025" in table  # beside the paper's
    again = subprocess.run(ablation(tiny_root, out, "--seeds", "3"), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(runs(out)) == 6 and again.stdout.count(": test loss") == 2 and "[2/2] hash+ seed 2" in again.stdout


@pytest.mark.integration
def test_sigterm_stops_the_workers_and_keeps_finished_runs(tiny_root: Path, tmp_path: Path) -> None:
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
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid
    assert len(runs(out)) >= 1
