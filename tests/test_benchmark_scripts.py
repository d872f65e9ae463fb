"""Every script in ``benchmarks/`` that no other test runs, run once at a tiny size: a script whose code drifts from
the library's fails here, not on the day someone measures with it. Such rot was found unseen: ``bench_packs.py
--setup`` called a constructor with an argument gone (now test_bench_packs.py's), a ``bench_random.py`` imported a
function the library had dropped (removed), and ``bench_gates.py`` and ``bench_tuning.py`` by default named a "+"
variant of gates that have none (their default is now ``gate_variants()``; the runs here name one gate each, so
the all-gates defaults are not run).

Each runs as a subprocess from the repository's root with its own options cut to seconds (few replications, trials,
repeats, batches; one gate, one dataset), writes its tables into the test's folder (``--out``, never
``benchmarks/out``), exits 0, and prints its table with numbers in it, checked line by line. The figures themselves
are not checked: at these sizes they measure nothing. Those reading real data (MovieLens-100K, Fashion-MNIST) are
``slow`` and skip where ``$MTMOE_DATA`` lacks the files.

Run elsewhere: ``bench_packs.py`` (test_bench_packs.py, test_roofline.py, gpu_check's dry run),
``bench_local_search.py`` (test_local_search.py), ``compare_gates.py``, ``gpu_check.py``, ``pytest_cpu_time.py``,
``reference_runs.py`` and ``lease_plan.py`` (their own test files). Every other script is here; none is left out.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_dataset

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"[0-9][0-9,]*\.?[0-9]*"  # 1,161 or 0.023 or 12


def case(script: str, args: list[str], lines: list[str], written: tuple[str, ...] = (), data: str | None = None,
         timeout: int = 120):
    """One script's tiny run: its options, the regular expressions its output must match (each a whole line), the
    files it must write into ``--out``, and the dataset it reads (``None``: none)."""
    marks = [pytest.mark.timeout(timeout)] + ([pytest.mark.slow] if data else [])
    return pytest.param(script, args, lines, list(written), data, timeout - 10, id=script, marks=marks)


CASES = [
    case("bench_band_coverage", ["--replications", "5", "--sizes", "20", "--resamples", "50", "--draws", "50"],
         [r"\| distribution \| N \| exact \(median\) \| bootstrap \(median\) \| bootstrap \(expected\) \| "
          r"Appendix F spread \(expected\) \|",
          *(rf"\| {name} \| 20 (\| \d+\.\d; \d+\.\d; \d+\.\d \(\d+\) ){{4}}\|"
            for name in ("normal", "gamma", "lomax", "discrete"))],
         ["band_coverage.md", "band_coverage.json"]),
    case("bench_bootstrap", ["--gates", "2", "--trials", "20", "--draws", "50", "--repeats", "1"],
         [r"2 studies x 20 trials, 50 draws x 6 budgets \(1\.\.20\), median of 1; .*",
          *(rf"\| cpu \| {resampling} (\| \d+\.\d{{3}} ){{4}}\| \d+\.\d\d \|"
            for resampling in ("nested", "independent"))],
         ["bootstrap.md", "bootstrap.json"]),
    case("bench_checkpoints", ["--packs", "2"],
         [r"movielens-100k comet: [\d,]+ parameters per trial",
          r"P=2: epoch-end snapshot \d+\.\d{3} s CPU \(\d+\.\d{3} s wall; the trials' states made of it "
          r"\d+\.\d{3} s wall; a fresh host copy \d+\.\d\d s CPU, "
          r"\d+\.\d\d s wall\); file [1-9]\d* MiB \(\d+\.\d MiB a trial\) "
          r"written in \d+\.\d\d s CPU \(\d+\.\d\d s wall\)"]),
    case("bench_cli_typo", ["--runs", "1"],
         [r"\| command \| exit \| min \(s\) \| median \(s\) \| max \(s\) \|",
          r"\| `python -c pass` \| 0( \| \d+\.\d{3}){3} \|",
          r"\| `python -m mtmoe fit --gate comt\+` \| 2( \| \d+\.\d{3}){3} \|",  # the typo: one error line, exit 2
          r"\| `python -m mtmoe fit --help` \| 0( \| \d+\.\d{3}){3} \|"]),
    case("bench_datasets", ["--data", "multifashionmnist", "--epochs", "1", "--batches", "1"],
         [r"gate comet; cpu .*; epochs 1, the last timed; 1 steps an epoch, full epoch extrapolated",
          rf"\| multifashionmnist \| 5 \| 2 \| 512 \| \d+ \| \d+\.\d \| \d+\.\d \(extrapolated\) \| {NUMBER} \| "
          rf"{NUMBER} \| \d+ \|"],
         ["datasets-cpu.md", "datasets-cpu.json"], data="multifashionmnist", timeout=300),
    case("bench_gates", ["--gates", "comet", "--epochs", "1", "--limit-batches", "1"],
         [r"movielens-100k, batch 512, [\d,]+ training rows; cpu .*; epoch times extrapolated from the first 1 of \d+ "
          r"steps",
          rf"\| comet \| \d+\.\d\d \| {NUMBER} \| {NUMBER} \| \d+ \| \d+\.\d \| \d+\.\d \| \d+\.\d\d \| \|"],
         ["gates-cpu.md", "gates-cpu.json"], data="movielens-100k", timeout=300),
    case("bench_importance", ["--trials", "8", "--runs", "1"],
         [r"\| studies \| PED-ANOVA CPU \(wall\) s \| fANOVA CPU \(wall\) s \|",
          r"\| 8 synthetic trials, 4 hyperparameters( \| \d+\.\d{3} \(\d+\.\d{3}\)){2} \|",
          r"import sklearn\.ensemble after report's modules: \d+\.\d\d s CPU \(best of 1\)"]),
    case("bench_parametric_coverage", ["--replications", "3", "--sizes", "32"],
         [r"\| distribution \| N \| coverage % \[Wilson 95%\] \| unbounded \| no fit \| median width ×10⁻² \|",
          *(rf"\| {name} \| 32 \| \d+\.\d \[\d+\.\d, \d+\.\d\] \| [0-3] \| [0-3] \| (\d+\.\d\d|nan) \|"
            for name in ("nq", "nq-c1", "lognormal"))],
         ["parametric_coverage.md", "parametric_coverage.json"]),
    case("bench_precision", ["--trials", "2", "--epochs", "1", "--train-batches", "1", "--val-batches", "1",
                             "--variant", "bf16-fused-sums"],  # a precision and a fit option together
         [r"comet, 2 of 2 configurations \(none diverged in any run\), 1 epochs of 1 batches, 1 validation batches; .*",
          r"\| fp32 vs bf16-fused-sums \(same seeds\) \| \d\.\d\de[-+]\d\d \| \d\.\d\de[-+]\d\d \| (-?\d\.\d{4}|nan) \|",
          r"\| fp32 seed vs fp32 other seed \| \d\.\d\de[-+]\d\d \| \d\.\d\de[-+]\d\d \| -?\d\.\d{4} \|"],
         ["precision.md", "precision.json"], data="movielens-100k", timeout=300),
    case("bench_sinkhorn", ["--n", "4", "--batch", "2", "--iterations", "5", "--repeats", "3"],
         [r"n = 4, R = 5, CPU, \d+ threads, torch .*; 3 rounds",
          *(rf"\| {cell} \| \d+\.\d{{3}} \| \d+\.\d{{3}} \| \d+\.\d\d \|"
            for cell in ("1 matrix", "2 in one call", "vmap, 2 trials")),
          r"\| 2 single calls \| \d+\.\d{3} \| \d+\.\d{3} \| 1\.00 \|"]),
    case("bench_tuning", ["--trials", "1", "--workers", "1", "--gates", "topk", "--epochs", "1", "--limit-batches", "2",
                          "--", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
                          "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2"],
         [r"\| workers \| trials \| wall \(s\) \| trials/h end to end \| trials/h in the study \| mean trial \(s\) \|",
          r"\| 1 \| 1 \| \d+\.\d \| \d+ \| \d+ \| \d+\.\d \|",
          r".* A smoke run: epochs and test cut to 2 batches \(--limit-batches\), so these are not the paper's hours\.",
          r"\| topk \| \d+\.\d\d \| \d+\.\d( \| \d+\.\d){4} \|"],
         ["tuning.md", "tuning.json"], data="movielens-100k", timeout=300),
]


RUN_ELSEWHERE = ("bench_packs", "bench_local_search", "compare_gates", "gpu_check", "pytest_cpu_time", "reference_runs",
                 "lease_plan")  # the module docstring says where


def test_every_benchmark_script_is_run_here_or_by_a_test_file_of_its_own() -> None:
    """A new script in ``benchmarks/`` needs a case here or a test that runs it (and is named above)."""
    scripts = {path.stem for path in (ROOT / "benchmarks").glob("*.py")}
    here = {case.values[0] for case in CASES}
    assert scripts == here | set(RUN_ELSEWHERE), (scripts - here - set(RUN_ELSEWHERE), set(RUN_ELSEWHERE) - scripts)
    tests = [path.read_text() for path in (ROOT / "tests").glob("test_*.py") if path.name != Path(__file__).name]
    assert [name for name in RUN_ELSEWHERE if not any(f"{name}.py" in text or f"import {name}" in text
                                                      for text in tests)] == []


@pytest.mark.integration
@pytest.mark.parametrize("script, args, lines, written, data, seconds", CASES)
def test_the_script_runs_at_a_tiny_size(script: str, args: list[str], lines: list[str], written: list[str],
                                        data: str | None, seconds: int, tmp_path: Path) -> None:
    if data:
        require_dataset(data)
    # --out before "--": bench_tuning passes what follows "--" to its trials
    out = ["--out", str(tmp_path)] if written else []
    argv = [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *out, *args]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    printed = result.stdout.splitlines()
    for line in lines:
        assert any(re.fullmatch(line, printed_line) for printed_line in printed), (line, result.stdout)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(written)
    for name in written:  # the Markdown is the printed table; the JSON copy reads back
        text = (tmp_path / name).read_text()
        if name.endswith(".json"):
            assert json.loads(text)
        else:
            assert text.strip() and text.strip() in result.stdout
