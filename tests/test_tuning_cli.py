"""Issue 14's tuning items, each a test that failed on the code before its fix: a study never mixes settings (1),
``tune``/``report``/``bootstrap --help`` (4), ``tune`` without the libraries' chatter (6). The dashboard's objective
name (10) is checked in ``test_tuning.py`` against a real optuna-dashboard, the bootstrap figure (9) in
``test_bootstrap.py``.
"""
from __future__ import annotations

import json
import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pandas as pd
import pytest

from conftest import run_cli
from pg import create_database
from sleep_callback import pythonpath_with_tests
from test_tuning import TINY, one_torch_thread, subprocess_env, trials_of, tune_args  # noqa: F401


# ------------------------------------------------------------------------------------ 1: one study, one setting


def test_a_study_refuses_other_settings_and_shows_its_own(postgres_url: str, tiny_root: Path, tmp_path: Path,
                                                         capsys) -> None:
    """docs/studies.md's smoke study and a real one on one storage: before, ``--trainer.limit_train_batches 3`` added its
    trials to the study run with 20. Now the second ``tune`` is refused in one line naming the setting and the way
    out; settings that do not change what a trial computes (folders, spelling, progress display) still resume it;
    the settings are study attributes and ``report`` and ``bootstrap`` show them."""
    name, postgres_url = "identity", create_database(postgres_url, "identity")  # this test's studies alone
    first = tune_args(postgres_url, tiny_root, tmp_path / "runs", *TINY, "--trainer.limit_train_batches", "20",
                      trials=2, name=name)
    assert run_cli(first) == 0
    before = [(t.number, t.state, t.params) for t in trials_of(postgres_url, name)]
    attrs = optuna.load_study(study_name=name, storage=postgres_url).user_attrs
    assert json.dumps(attrs["settings"], sort_keys=True) == json.dumps({  # integers: counts of batches
        "data.batch_size": 64, "trainer.limit_test_batches": 2, "trainer.limit_train_batches": 20,
        "trainer.limit_val_batches": 2, "trainer.max_epochs": 1}, sort_keys=True)
    capsys.readouterr()

    def other(trials: int = 2, study: str = name) -> list[str]:
        return tune_args(postgres_url, tiny_root, tmp_path / "runs", *TINY, "--trainer.limit_train_batches", "3",
                         trials=trials, name=study)

    assert run_cli(other()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: study '{name}' exists with other settings (trainer.limit_train_batches 20 there, 3 now)"
                   ": refusing to mix trials of different settings; pass --study-name NAME to start another "
                   "study, or another --storage"]
    assert run_cli(other(trials=3)) == 2  # more trials: refused all the same
    assert [(t.number, t.state, t.params) for t in trials_of(postgres_url, name)] == before

    copy = tmp_path / "copy"
    shutil.copytree(tiny_root, copy)
    same = tune_args(postgres_url, copy, tmp_path / "other-runs", *TINY, "--trainer.limit_train_batches=20",
                     "--trainer.enable_progress_bar=true", "--data.verify=false", trials=2, name=name)
    assert run_cli(same) == 0  # another data folder and log folder, "=" spelling, a progress bar: the same study
    assert [(t.number, t.state, t.params) for t in trials_of(postgres_url, name)] == before
    assert run_cli(other(study="identity-3")) == 0  # the way out: another study
    capsys.readouterr()

    assert run_cli(["report", "--data", "movielens-100k", "--storage", postgres_url, "--out",
                    str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out
    shown = "data.batch_size=64, trainer.limit_test_batches=2, trainer.limit_train_batches={}, " \
            "trainer.limit_val_batches=2, trainer.max_epochs=1"
    for study, batches in ((name, "20"), ("identity-3", "3")):
        row = rf"^\| {study} \| topk \| 0\.9 \| 0 \| {re.escape(shown.format(batches))} \| - \| cpu ×2 \|$"
        assert re.search(row, printed, re.M), printed
    table = pd.read_csv(tmp_path / "rep" / "table_2_3.csv").set_index("study")
    assert table.loc[name, "settings"] == shown.format("20")
    assert run_cli(["bootstrap", "--data", "movielens-100k", "--storage", postgres_url, "--out",
                    str(tmp_path / "boot"), "--gates", "topk"]) == 2  # two studies of one gate: says so
    assert "has several studies (identity, identity-3)" in capsys.readouterr().err


def test_a_study_resumed_with_the_same_settings_in_another_order_runs_nothing(tiny_root: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    args = tune_args(url, tiny_root, tmp_path / "runs", *TINY, "--model.lr", "1e-3", trials=1)
    assert run_cli(args) == 0
    reordered = tune_args(url, tiny_root, tmp_path / "runs", "--model.lr=0.001", *reversed(TINY), trials=1)
    assert run_cli(reordered) == 0  # the same values in force: the same study, finished
    assert len(trials_of(url, "movielens-100k/topk")) == 1


# -------------------------------------------------------------------------------------------------------- 4: help


@pytest.mark.parametrize("command, expected", [
    ("tune", ["--gate", "--data", "--trials", "--seed", "--storage", "--workers", "--study-name", "--space", "--log-dir",
              "--trainer.*", "--model.*", "--data.*", "--early_stopping.*", "PGPASSWORD"]),
    ("report", ["--data", "--storage", "--out", "Tables 2-3"]),
    ("bootstrap", ["--data", "--storage", "--out", "--gates", "--pairs", "--draws", "--seed", "--max-budget",
                   "--replacement", "--resample", "--device", "--confidence", "Appendix F"]),
])
def test_help_documents_every_option(capsys, command: str, expected: list[str]) -> None:
    assert run_cli([command, "--help"]) == 0
    text = capsys.readouterr().out
    for word in expected:
        assert word in text, word
    lines = text.splitlines()
    for i, line in enumerate(lines):  # every option explained: on its line, or on the next, indented further
        if re.match(r"^  (-\w, )?--", line):
            explained = len(re.split(r"\s{2,}", line.strip(), maxsplit=1)) == 2 or re.match(r"^ {10,}\S", lines[i + 1])
            assert explained, line


# ---------------------------------------------------------------------------------------------------- 6: noise


@pytest.mark.integration
def test_tune_at_a_terminal_shows_a_bar_within_the_first_pack_epoch(tiny_root: Path, tmp_path: Path) -> None:
    """At a terminal (a pseudo-terminal here, where colours would show): a packed tune shows a progress bar, first
    drawn when the first pack epoch starts, and the libraries' chatter stays away. Before: Optuna's "A new study
    created in memory with name: no-name-..." and a coloured "Trial N finished" line per trial, and Lightning's
    LeafSpec deprecation warning once per trial, came between the progress lines; then 4 lines in 665 s."""
    args = tune_args(f"sqlite:///{tmp_path / 's.db'}", tiny_root, tmp_path / "runs", "--trainer.max_epochs=2",
                     "--trainer.limit_train_batches=8", "--trainer.limit_val_batches=2",
                     "--trainer.limit_test_batches=2", "--data.batch_size=8", "--pack", "2",
                     "--trainer.callbacks+=sleep_callback.SleepAfterEachBatch", "--trainer.callbacks.seconds=0.06",
                     trials=2)  # epochs of 8 steps of 0.06 s or more: the bar (every 0.1 s) is redrawn within them
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "mtmoe", *args], cwd=tmp_path, stdout=follower, stderr=follower,
                            env=subprocess_env(tmp_path, tiny_root, TERM="xterm-256color", COLUMNS="160",
                                               PYTHONPATH=pythonpath_with_tests()))
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the pseudo-terminal closed with the process
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, output.decode()[-3000:]
    screens = [line.strip() for line in re.split(r"[\r\n]+", output.decode()) if line.strip()]
    assert screens[0].startswith("study 'movielens-100k/topk': 2 configurations, settings: data.batch_size=8, ")
    bars = [line for line in screens if line.startswith("[movielens-100k/topk]") and "%|" in line]
    assert bars, screens
    first = next(line for line in bars if "pack epoch" in line)  # drawn as the first pack epoch starts
    assert re.fullmatch(r"\[movielens-100k/topk\]   0%\| {10}\| 00:0\d<\?, 0/2 done, 0 failed, best n/a, 2 running "
                        r"in a pack of 2, pack epoch 1 0%", first), first  # and it moves within that epoch:
    assert any(re.search(r"\| 00:\d\d<\d\d:\d\d, 0/2 done, .* pack epoch 1 [1-9]\d%$", line) for line in bars), bars
    assert re.fullmatch(r"\[movielens-100k/topk\] 100%\|█{10}\| \d\d:\d\d<00:00, 2/2 done, 0 failed, best \d\.\d+, "
                        r"0 running in a pack of 2, pack epoch 2 done", bars[-1]), bars[-1]
    assert screens[-1] == "study 'movielens-100k/topk': 2 complete, 0 failed, 0 waiting", screens
    assert not [line for line in screens if line not in bars and line.startswith("[movielens-100k/topk]")]
    assert "\x1b[" not in output.decode()  # no colour codes
