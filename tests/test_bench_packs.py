"""``benchmarks/bench_packs.py``'s modes that no other test runs (``--ops``, ``--setup``, ``--study``, ``--floor``,
``--profile`` of several P, ``--test-pass``; ``--packs``, ``--profile`` of one P and ``--profile-epoch`` run in
``gpu_check.py --dry-run``, ``--roofline`` in test_roofline.py), on tiny trials: a mode whose code drifts from the
library's fails here, not on the day someone measures with it (``--setup`` once called ``PackWorker`` with an
argument gone)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_dataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402  (its tiny trials: the dry run's)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_counting_set_up_study_floor_and_profile_modes_run(tmp_path: Path) -> None:
    require_dataset("movielens-100k")
    limits = "--trainer.limit_train_batches=2 --trainer.limit_val_batches=2 --trainer.limit_test_batches=2"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_packs.py"), "--ops", "--packs", "1",
                             "--setup", "2", "--study", "2x1", "--study-pack", "2", "--floor",
                             "--profile", "1,2", "--profile-steps", "1", "--adam-repeats", "2", "--test-pass", "1,2",
                             f"--trial-args={gpu_check.TINY} {limits}", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for phase in ("train", "eval"):
        assert re.search(rf"^ops gate=comet P=1 phase={phase} ops=[1-9]\d* host_reads=0$", out, re.M), out
    assert re.search(r"^Per-trial set-up .*comet: \d+\.\d ms \(mean of 2\)$", out, re.M), out
    # the packed and the unpacked study train the same two configurations to the same objectives
    assert re.search(r"2 trials x 1 epochs .* objectives of the 2 configurations: largest relative difference "
                     r"0\.0e\+00$", out, re.M), out
    assert re.search(r"^Floor: .* take \d+\.\d{3} s per trial-epoch in fp32 and \d+\.\d{3} s in bf16", out, re.M), out
    for pack in (1, 2):  # one line per P profiled, each with the step's time
        assert re.search(rf"^profile gate=comet P={pack} device=cpu precision=fp32 step_ms=\d+\.\d{{3}} ", out,
                         re.M), out
    for k in (1, 2):  # a test pass of K trials that ended
        assert re.search(rf"^test-pass gate=comet K={k} device=cpu batches=\d+ ms=\d+\.\d$", out, re.M), out
    rows = json.loads((tmp_path / "packs.json").read_text())["rows"]
    assert [row["profile_P"] for row in rows if "profile_P" in row] == [1, 2]
    assert [row["test_pass_K"] for row in rows if "test_pass_K" in row] == [1, 2]
    assert [row["setup_ms"] > 0 for row in rows if "setup_ms" in row] == [True]
    (study,) = [row for row in rows if "study" in row]
    assert study["objectives"]["packed"] == study["objectives"]["unpacked"] and len(study["objectives"]["packed"]) == 2
