"""Issue 32's storage faults and bad input (items 5 and 6), each a test that failed on the code before its fix: a disk
that fills during a study, a journal whose last record is torn, ``report`` on a damaged SQLite file, a study name
too long for its log folder, storage URLs and trial counts that cannot be used, a bad heartbeat setting, and the
temporary files of a ``report`` killed while writing. A bad input is one ``error:`` line and exit 2, nothing
created; a fault leaves the study resumable.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from mtmoe.tuning.storage import storage_for

from conftest import run_cli
from test_tuning import (
    TINY,
    assert_each_config_once,
    one_torch_thread,  # noqa: F401  (the autouse fixture)
    run_tune,
    synthetic_study,
    trials_of,
    tune_args,
)


def one_error_line(capsys, code: int) -> str:
    """The command's stderr, checked: exit 2 and a single ``error:`` line."""
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), (code, err)
    return err


# ------------------------------------------------------------------------------------------- 5: a full disk


@pytest.mark.integration
def test_a_disk_full_under_the_logs_is_one_line_and_the_study_resumes(root_and_tmp, capsys) -> None:
    """The trials' logs go to an 8 KiB tmpfs, full after a few files. Before: ``OSError: No space left on device``
    in ``_write_log``, a traceback, exit 1, the trial left RUNNING. Now: one line saying what to do, exit 2, no trial
    RUNNING; once there is room the same command resumes and completes every configuration once."""
    root, tmp = root_and_tmp
    logs = tmp / "small"
    logs.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(logs)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        url = f"sqlite:///{tmp / 'full.db'}"
        args = tune_args(url, root, logs, *TINY, trials=3, name="full")
        err = one_error_line(capsys, run_cli(args))
        assert "No space left on device" in err and "free some space there" in err
        trials = trials_of(url, "full")
        assert not [t for t in trials if t.state == TrialState.RUNNING]
        assert len([t for t in trials if t.state == TrialState.COMPLETE]) < 3
        subprocess.run(["mount", "-o", "remount,size=16m", str(logs)], check=True)
        assert run_cli(args) == 0
        assert_each_config_once(trials_of(url, "full"), 3)
    finally:
        subprocess.run(["umount", "--lazy", str(logs)])  # detached even where this process still holds a log open


# ------------------------------------------------------------------------------------ 5: a torn journal record


@pytest.mark.integration
def test_a_torn_last_journal_record_is_cut_off_with_one_warning_and_the_study_resumes(root_and_tmp, capsys) -> None:
    """A crash mid-append leaves the journal's last record torn (here: its last 9 bytes gone). Before: the resumed
    study appended after it, and the file could no longer be read (``JSONDecodeError``). Now the torn record is cut
    off with one ``warning:`` line, the records before it are kept, and the study completes every configuration."""
    root, tmp = root_and_tmp
    journal = tmp / "j.log"
    url = f"journal:{journal}"
    # a process of its own: the trial its torn record leaves RUNNING is of a worker that is gone, as after a crash
    code, out, err = run_tune(tune_args(url, root, tmp / "runs", *TINY, trials=1, name="torn"), tmp, root, "first")
    assert code == 0, err[-3000:]
    whole = journal.read_bytes()
    journal.write_bytes(whole[:-9])
    capsys.readouterr()
    code = run_cli(tune_args(url, root, tmp / "runs", *TINY, trials=2, name="torn"))
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "last record is torn" in warnings[0], err
    kept = whole[:whole.rindex(b"\n", 0, len(whole) - 1) + 1]
    assert journal.read_bytes().startswith(kept)
    assert_each_config_once(trials_of(storage_for(url), "torn"), 2)


@pytest.mark.parametrize("command", ["report", "bootstrap"])
def test_report_and_bootstrap_read_a_torn_journal_and_leave_it_as_it_is(tmp_path: Path, capsys, command: str) -> None:
    """Before: the read-only commands cut a torn last record off, as ``tune`` repairs it, writing to the storage they
    only read. Now the file's bytes are unchanged, one ``warning:`` line names the command that repairs it, and the
    results are those of the whole records before the torn one."""
    journal = tmp_path / "j.log"
    url = f"journal:{journal}"
    rng = np.random.default_rng(0)
    for gate, loss in (("softmax", 0.43), ("topk", 0.42)):
        synthetic_study(storage_for(url), f"movielens-100k/{gate}", gate, 12, loss, rng)
    argv = [command, "--data", "movielens-100k", "--storage", url, "--out", str(tmp_path / "out")]

    def results() -> tuple[list[str], list[str], dict[str, bytes]]:
        """(stdout's lines but bootstrap's timings, stderr's lines, the CSV files)."""
        assert run_cli(argv) == 0
        out, err = capsys.readouterr()
        return ([line for line in out.splitlines() if not line.startswith("bootstrap: ")], err.splitlines(),
                {p.name: p.read_bytes() for p in (tmp_path / "out").glob("*.csv")})

    expected = results()
    assert expected[0] and expected[2] and not expected[1]
    whole = journal.read_bytes()
    study = optuna.load_study(study_name="movielens-100k/topk", storage=storage_for(url))
    study.add_trial(optuna.trial.create_trial(  # the best trial of all, had its record been written whole
        value=0.1, params={"model.lr": 1e-4}, user_attrs={"config_id": 12, "test_loss": 0.1},
        distributions={"model.lr": optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True)}))
    appended = journal.read_bytes()[len(whole):]
    assert appended.count(b"\n") == 1  # one record: tearing it leaves no part of the trial
    torn = whole + appended[:-9]
    journal.write_bytes(torn)
    out, err, csvs = results()
    assert journal.read_bytes() == torn
    assert err == [
        f"warning: journal {journal}: its last record is torn (a crash while writing it); the {len(whole)} bytes of "
        f"whole records before it are read, the file is left as it is (the next `python -m mtmoe tune --storage "
        f"{url}` cuts the torn record off)"]
    assert (out, csvs) == (expected[0], expected[2])
    journal.write_bytes(whole + appended)  # the record whole: the trial leads, and the results show it
    assert results()[0] != expected[0]


#: A process without SQLAlchemy, as on a lent GPU (benchmarks/gpu_check.py), running the command line of argv.
WITHOUT_SQLALCHEMY = ("import sys\nsys.modules.update(dict.fromkeys(('sqlalchemy', 'alembic', 'psycopg2')))\n"
                      "from mtmoe.cli import main\nmain(sys.argv[1:])\n")


@pytest.mark.integration  # a process of its own, without SQLAlchemy
def test_a_journal_damaged_before_its_last_record_is_one_line_even_without_sqlalchemy(tmp_path: Path,
                                                                                     capsys) -> None:
    """A record in the middle of a journal that is no JSON (a disk fault, an edit): not a torn tail to read past.
    Before: where SQLAlchemy is missing (a lent GPU's image), ``report`` answered with a ``ModuleNotFoundError``
    traceback (the error's wording imported it); with it, "cannot open the study storage" and the JSON error. Now one
    line saying the journal is damaged and to restore it, with or without SQLAlchemy; the file left as it is."""
    journal = tmp_path / "j.log"
    synthetic_study(storage_for(f"journal:{journal}"), "movielens-100k/topk", "topk", 4, 0.42,
                    np.random.default_rng(0))
    records = journal.read_bytes().split(b"\n")
    records[3] = records[3][:20]
    damaged = b"\n".join(records)
    journal.write_bytes(damaged)
    expected = "it is damaged; restore it from a backup, or pass another --storage"
    for command in ("report", "bootstrap"):
        argv = [command, "--data", "movielens-100k", "--storage", f"journal:{journal}", "--out", str(tmp_path / "o")]
        assert expected in one_error_line(capsys, run_cli(argv))
        proc = subprocess.run([sys.executable, "-c", WITHOUT_SQLALCHEMY, *argv], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr[-2000:]
    assert journal.read_bytes() == damaged and not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["report", "bootstrap", "tune"])
def test_a_file_that_is_no_journal_given_as_one_is_refused_and_left_as_it_is(tiny_root: Path, tmp_path: Path, capsys,
                                                                             command: str) -> None:
    """Before: ``--storage journal:studies/optuna.db`` (a SQLite file) was "repaired" as a torn journal: cut back to
    its last newline byte, the database destroyed, even by ``report``. Now it is one line and the file is intact."""
    database = tmp_path / "studies.db"
    synthetic_study(storage_for(f"sqlite:///{database}"), "movielens-100k/topk", "topk", 12, 0.42,
                    np.random.default_rng(0))
    before = database.read_bytes()
    args = ["--gate", "topk", "--trials", "1", f"--data.root={tiny_root}", "--log-dir", str(tmp_path / "runs"),
            *TINY] if command == "tune" else ["--out", str(tmp_path / "out")]
    code = run_cli([command, "--data", "movielens-100k", "--storage", f"journal:{database}", *args])
    assert "the file is no Optuna journal (left as it is)" in one_error_line(capsys, code)
    assert database.read_bytes() == before and not (tmp_path / "runs").exists()


def test_a_journal_given_as_a_sqlite_file_names_the_journal_url(tmp_path: Path, capsys) -> None:
    """Before: "it is damaged; restore it from a backup (`sqlite3 FILE .recover`)"."""
    journal = tmp_path / "studies.log"
    synthetic_study(storage_for(f"journal:{journal}"), "movielens-100k/topk", "topk", 4, 0.42,
                    np.random.default_rng(0))
    before = journal.read_bytes()
    code = run_cli(["report", "--data", "movielens-100k", "--storage", f"sqlite:///{journal}", "--out",
                    str(tmp_path / "out")])
    assert f"the file is an Optuna journal, not a SQLite database: pass --storage journal:{journal}" in \
        one_error_line(capsys, code)
    assert journal.read_bytes() == before


# ------------------------------------------------------------------------------------ 5: a damaged SQLite file


def test_report_on_a_damaged_sqlite_file_is_one_line(tmp_path: Path, capsys) -> None:
    """Every 4 KiB page of a study's SQLite file in turn overwritten with noise. Before: some pages gave
    ``StorageInternalError: database disk image is malformed`` as a traceback. Now each damaged file is one line
    saying what to do (or a report, where the page was not in use); ``bootstrap`` answers alike."""
    clean = tmp_path / "clean.db"
    synthetic_study(storage_for(f"sqlite:///{clean}"), "movielens-100k/topk", "topk", 12, 0.42,
                    np.random.default_rng(0))
    rng = np.random.default_rng(1)
    damaged = tmp_path / "damaged.db"
    codes = []
    for page in range(1, clean.stat().st_size // 4096):
        content = bytearray(clean.read_bytes())
        content[page * 4096:(page + 1) * 4096] = rng.bytes(4096)
        damaged.write_bytes(bytes(content))
        code = run_cli(["report", "--data", "movielens-100k", "--storage", f"sqlite:///{damaged}", "--out",
                        str(tmp_path / "out")])
        codes.append(code)
        if code == 0:
            capsys.readouterr()
            continue
        assert "it is damaged; restore it from a backup" in one_error_line(capsys, code)
        last_damaged = bytes(content)
    assert 2 in codes, codes
    damaged.write_bytes(last_damaged)
    code = run_cli(["bootstrap", "--data", "movielens-100k", "--storage", f"sqlite:///{damaged}", "--out",
                    str(tmp_path / "out")])
    assert "it is damaged" in one_error_line(capsys, code)


# --------------------------------------------------------------------------------- 5 and 6: bad tune input


BAD_TUNE_INPUT = {
    "a 600-character study name": (["--study-name", "s" * 600], "--study-name is 600 bytes long"),
    "an empty study name": (["--study-name", ""], "--study-name is empty"),
    "an empty storage": (["--storage", ""], "--storage is empty"),
    "an unparsable sqlite URL": (["--storage", "sqlite:/nonexistent/dir/x.db"], "is not a storage URL"),
    "a missing folder": (["--storage", "sqlite:////nonexistent/dir/x.db"], "there is no folder /nonexistent/dir"),
    "a journal of no file": (["--storage", "journal:"], "--storage 'journal:' names no file: write journal:PATH"),
    "a trillion trials": (["--trials", "1000000000000"], "--trials must be between 1 and 100000"),
    "a negative seed": (["--seed", "-1"], "--seed must be between 0 and 4294967292 (configuration i trains with "
                                          "seed + i, at most 4294967295), got -1"),
    "a log folder under a file": (["--log-dir", "/dev/null/runs"],
                                  "cannot write the trials' logs to /dev/null/runs: /dev/null is a file, not a folder"),
}


@pytest.mark.parametrize("storage", ["sqlite", "postgresql"])
@pytest.mark.parametrize("case", BAD_TUNE_INPUT)
def test_bad_tune_input_is_one_line_before_the_storage_is_touched(request, tiny_root: Path, tmp_path: Path, capsys,
                                                                  case: str, storage: str) -> None:
    """Before: a 600-character name failed deep in PostgreSQL (varchar(512)) or in making its SQLite study's log
    folder (file name too long), ``sqlite:/...`` with SQLAlchemy's 26-line ``ArgumentError``, ``--trials 10**12``
    ran for minutes while its plan filled the memory, an empty name or storage silently meant the default, and a
    ``--log-dir`` under a file was a ``NotADirectoryError`` traceback once the study was created.
    Now each is one line at once, and no storage or log folder is created."""
    flags, message = BAD_TUNE_INPUT[case]
    if storage == "postgresql" and "--storage" in flags:
        pytest.skip("the case is its own storage")
    url = request.getfixturevalue("postgres_url") if storage == "postgresql" else f"sqlite:///{tmp_path / 'x.db'}"
    options = {"--storage": url, "--trials": "3", **dict(zip(flags[::2], flags[1::2]))}
    argv = ["tune", "--gate", "topk", "--data", "movielens-100k", f"--data.root={tiny_root}", "--log-dir",
            str(tmp_path / "runs"), *TINY, *(item for option in options.items() for item in option)]
    start = time.monotonic()
    code = run_cli(argv)
    assert message in one_error_line(capsys, code)
    assert time.monotonic() - start < 30
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "runs").exists() and not (tmp_path / "studies").exists()
    if storage == "postgresql":
        assert not [name for name in optuna.get_all_study_names(storage_for(url)) if name.startswith("sss")]


def tune_on(storage: str, root: Path, tmp_path: Path) -> list[str]:
    return ["tune", "--gate", "topk", "--data", "movielens-100k", "--trials", "1", "--storage", storage,
            f"--data.root={root}", "--log-dir", str(tmp_path / "runs"), *TINY]


@pytest.mark.parametrize("scheme, name", [("journal:", "optuna.journal"), ("sqlite:///", "optuna.db")])
def test_a_storage_that_is_a_folder_says_so_and_names_a_file_in_it(tiny_root: Path, tmp_path: Path, capsys,
                                                                    scheme: str, name: str) -> None:
    """Before: ``tune --storage journal:FOLDER`` (or ``sqlite:///FOLDER``) said "cannot read it (Is a directory)"
    and ``report``/``bootstrap`` "no journal file FOLDER", as if it were missing. Now each says it is a folder and
    names a file in it to pass instead; nothing is created."""
    folder = tmp_path / "studies"
    folder.mkdir()
    for argv in (tune_on(f"{scheme}{folder}", tiny_root, tmp_path),
                 ["report", "--data", "movielens-100k", "--storage", f"{scheme}{folder}"],
                 ["bootstrap", "--data", "movielens-100k", "--storage", f"{scheme}{folder}"]):
        line = one_error_line(capsys, run_cli(argv))
        assert f"{folder} is a folder, not a file: name the study file, e.g. --storage {scheme}{folder / name}" in line
    assert list(folder.iterdir()) == [] and not (tmp_path / "runs").exists()


@pytest.mark.integration
@pytest.mark.parametrize("scheme", ["journal:", "sqlite:///"])
def test_a_storage_in_a_read_only_folder_is_refused_before_a_trial(tiny_root: Path, tmp_path: Path, capsys,
                                                                    scheme: str) -> None:
    """The folder is a read-only tmpfs (unwritable even to root). Before: ``tune`` planned and built a trial's
    model, then failed opening the storage with "[Errno 30] Read-only file system" and no advice. Now it is
    refused with the other bad input, before the model is built, saying to pass a writable folder."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=8k", "tmpfs",
                                            str(folder)]).returncode:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        start = time.monotonic()
        line = one_error_line(capsys, run_cli(tune_on(f"{scheme}{folder / 'studies.db'}", tiny_root, tmp_path)))
        assert f"{folder} is not writable, and tune writes the study there: pass a --storage in a writable folder" \
            in line
        assert time.monotonic() - start < 10 and not (tmp_path / "runs").exists()
    finally:
        subprocess.run(["umount", str(folder)])


def test_a_bad_heartbeat_setting_creates_no_database(tiny_root: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Before: ``MTMOE_HEARTBEAT_INTERVAL=x`` was refused after ``studies/optuna.db`` was created, empty. Now
    nothing is created."""
    monkeypatch.setenv("MTMOE_HEARTBEAT_INTERVAL", "x")
    code = run_cli(["tune", "--gate", "topk", "--data", "movielens-100k", "--trials", "1", f"--data.root={tiny_root}"])
    assert "MTMOE_HEARTBEAT_INTERVAL" in one_error_line(capsys, code)
    assert not (tmp_path / "studies").exists()


@pytest.mark.parametrize("flags, message", [
    (["--pack", "0"], "--pack must be a positive number of trials or auto"),
    (["--model.lr=abc"], "model.lr"),
    (["--trainer.max_epochs=-5"], "--trainer.max_epochs must be >= 1"),
], ids=["pack", "override-type", "override-range"])
def test_bad_tune_input_with_the_default_storage_leaves_no_studies_folder(tiny_root: Path, tmp_path: Path, capsys,
                                                                          flags: list[str], message: str) -> None:
    """Before: ``tune`` without ``--storage`` made ``studies/`` before it checked ``--pack`` and the overrides, so
    their error left an empty ``studies/`` in the current folder. Now nothing is created."""
    code = run_cli(["tune", "--gate", "topk", "--data", "movielens-100k", "--trials", "1", f"--data.root={tiny_root}",
                    *flags])
    assert message in one_error_line(capsys, code)
    assert not (tmp_path / "studies").exists()


# ------------------------------------------------------------------------ 6: a report killed while writing


ORPHAN = """
import sys, time
from mtmoe.files import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    tmp.write_text("half a report")
    print(tmp, flush=True)
    time.sleep(600)
"""


@pytest.mark.integration
@pytest.mark.parametrize("command", ["report", "bootstrap"])
def test_temporary_files_of_a_killed_writer_are_removed_by_the_next_run(tmp_path: Path, capsys, command: str) -> None:
    """A writer SIGKILLed while writing ``report.md`` leaves its hidden ``.report.md.*.tmp``. Before: no later run
    removed it. Now the next ``report`` or ``bootstrap`` into that folder does (a file still being written by a live
    writer is kept)."""
    url = f"journal:{tmp_path / 'j.log'}"
    synthetic_study(storage_for(url), "movielens-100k/topk", "topk", 12, 0.42, np.random.default_rng(0))
    out = tmp_path / "out"
    out.mkdir()
    writers = [subprocess.Popen([sys.executable, "-c", ORPHAN, str(out / "report.md")], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
               for _ in range(2)]
    killed, live = (Path(writer.stdout.readline().strip()) for writer in writers)
    try:
        os.kill(writers[0].pid, signal.SIGKILL)
        writers[0].wait(timeout=30)
        assert killed.exists()
        assert run_cli([command, "--data", "movielens-100k", "--storage", url, "--out", str(out)]) == 0
        assert not killed.exists() and live.exists()
    finally:
        writers[1].kill()
        writers[1].wait()
