"""``benchmarks/pytest_cpu_time.py``: the per-test CPU seconds it records are the test's own and its children's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TESTS = '''
import subprocess, sys, time

SPIN = "import time\\nend = time.process_time() + 0.3\\nwhile time.process_time() < end: pass"

def test_spins_here():
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass

def test_spins_in_a_child():
    subprocess.run([sys.executable, "-c", SPIN], check=True)

def test_sleeps():
    time.sleep(0.3)
'''


def test_each_test_gets_its_own_and_its_childrens_cpu_seconds(tmp_path: Path) -> None:
    (tmp_path / "test_three.py").write_text(TESTS)
    out = tmp_path / "cpu"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "pytest_cpu_time", "--cpu-time-out", str(out), "-q",
                          "-n", "0", "-p", "no:cacheprovider", "test_three.py"], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
    assert run.returncode == 0, run.stdout[-2000:]
    rows = {row["id"].split("::")[1]: row for row in map(json.loads, (out / "cpu-main.jsonl").read_text().splitlines())}
    assert rows["test_spins_here"]["own"] >= 0.29 and rows["test_spins_here"]["children"] < 0.05
    assert rows["test_spins_in_a_child"]["children"] >= 0.29
    assert rows["test_sleeps"]["own"] + rows["test_sleeps"]["children"] < 0.1 <= rows["test_sleeps"]["wall"]
    table = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pytest_cpu_time.py"), str(out), "--tests", "2"],
                           capture_output=True, text=True, check=True).stdout
    assert table.startswith("3 tests: ") and "| `test_three.py` |" in table
    assert len([line for line in table.splitlines() if "`test_three.py::" in line]) == 2
    empty = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pytest_cpu_time.py"), str(tmp_path)],
                           capture_output=True, text=True)
    assert (empty.returncode, empty.stdout) == (2, "") and empty.stderr.startswith("error: no cpu-*.jsonl under ")
