"""Issue 15's tuning faults, each a test that failed on the code before its fix: ``tune`` processes started together
on a fresh storage (5), a configuration that kills its worker (6), trials of dead or remote workers in a journal
(7), the database password (9), an unwritable ``--out`` (10), misleading output (12).

PostgreSQL is the throwaway server of ``tests/pg.py`` (a second one asks for a password); trainings are tiny and
heartbeats short (``MTMOE_HEARTBEAT_INTERVAL`` / ``MTMOE_HEARTBEAT_GRACE``), so a lost trial is noticed in seconds.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState
from sqlalchemy.engine import make_url

from mtmoe.tuning.space import SearchSpace, load_space
from mtmoe.tuning.storage import OrderedWrites, Periodic, display_url, storage_for
from mtmoe.tuning.study import pid_alive
from mtmoe.tuning.objective import config_hash, plan_configurations

from conftest import run_cli
from sleep_callback import hold_args, pythonpath_with_tests
from pg import create_database, find_bin_dir, postgres_server
from test_tuning import (
    SHORT,
    TINY,
    assert_each_config_once,
    one_torch_thread,  # noqa: F401  (the autouse fixture)
    run_tune,
    space_with_one_odd_lr,
    start_tune,
    synthetic_study,
    trials_of,
    tune_args,
    wait_for_running,
)

FAST_HEARTBEAT = {"MTMOE_HEARTBEAT_INTERVAL": "1", "MTMOE_HEARTBEAT_GRACE": "4"}
PASSWORD = "Secret-pw-7"


def finish(procs: list, tmp: Path, logs: list[str], timeout: int = 400) -> list[tuple[int, str, str]]:
    """Wait for each started ``tune``: (exit code, stdout, stderr)."""
    results = []
    deadline = time.monotonic() + timeout
    for proc, log in zip(procs, logs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        results.append((code, (tmp / f"{log}.out").read_text(), (tmp / f"{log}.err").read_text()))
    return results


# ------------------------------------------------------------------------------ 5: simultaneous first start


@pytest.mark.integration
@pytest.mark.parametrize("kind, gates", [("postgresql", ["topk"] * 3), ("sqlite", ["topk", "hash"])])
def test_tune_processes_started_together_on_a_fresh_storage_all_work(request, root_and_tmp, kind: str,
                                                                     gates: list[str]) -> None:
    """Before: "UniqueViolation ... CREATE TYPE studydirection" (PostgreSQL), "UNIQUE constraint failed:
    alembic_version" (SQLite) for some of the processes. Now they set the storage up one at a time, and the plan
    is enqueued once. (SQLite is for one worker per study: there, two studies share the file.)"""
    root, tmp = root_and_tmp
    if kind == "postgresql":
        url = create_database(request.getfixturevalue("postgres_url"), "fresh_first_start")
    else:
        url = f"sqlite:///{tmp / 'fresh.db'}"
    logs = [f"together{i}" for i in range(len(gates))]
    procs = [start_tune(tune_args(url, root, tmp / "runs", *TINY, trials=3, gate=gate, name=f"together-{gate}"),
                        tmp, root, log, **FAST_HEARTBEAT) for gate, log in zip(gates, logs)]
    for code, out, err in finish(procs, tmp, logs):
        assert code == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    for gate in set(gates):
        trials = trials_of(storage_for(url), f"together-{gate}")
        assert_each_config_once(trials, 3)
        assert len([t for t in trials if "config_id" in t.user_attrs]) == 3  # enqueued once: no duplicate to skip


def _first_start(url: str, barrier, results) -> None:
    """What ``tune`` does first to a storage, released at the same instant as the other processes."""
    from mtmoe.tuning.storage import setup_lock
    from mtmoe.tuning.study import prepare_study

    space = load_space("movielens-100k", "topk")
    space = SearchSpace(space.data, space.gate, 4, space.fixed, space.distributions)
    barrier.wait()
    try:
        with setup_lock(url):
            prepare_study(url, "together", space, 0, plan_configurations(space, 4, 0), {}, "0.9")
        results.put("ok")
    except BaseException as error:  # noqa: BLE001  (reported to the test)
        results.put(repr(error))


@pytest.mark.parametrize("kind", ["postgresql", "sqlite", "journal"])
def test_first_starts_released_together_set_the_storage_up_once(request, tmp_path: Path, kind: str) -> None:
    """Six processes released by one barrier (the race the test above leaves to chance: without the lock about a
    third of them failed, on SQLite too) each create the tables and the study and enqueue the plan: all succeed,
    and the 4 configurations are enqueued once."""
    import multiprocessing

    url = {"postgresql": lambda: create_database(request.getfixturevalue("postgres_url"), f"released_{os.getpid()}"),
           "sqlite": lambda: f"sqlite:///{tmp_path / 'fresh.db'}", "journal": lambda: f"journal:{tmp_path / 'j.log'}"
           }[kind]()
    context = multiprocessing.get_context("fork")  # this process has imported everything: the children start at once
    barrier, results = context.Barrier(6), context.Queue()
    processes = [context.Process(target=_first_start, args=(url, barrier, results)) for _ in range(6)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert outcomes == ["ok"] * 6, outcomes
    trials = trials_of(storage_for(url), "together")
    assert sorted(t.user_attrs["config_id"] for t in trials) == [0, 1, 2, 3]


# ------------------------------------------------------------------------ 6: a configuration that kills its worker

@pytest.mark.integration
def test_a_configuration_that_kills_its_worker_is_failed_after_bounded_attempts(postgres_url: str, root_and_tmp,
                                                                                capsys) -> None:
    """Every attempt at one configuration SIGKILLs its worker (as an out-of-memory kill would). Before: it was
    re-enqueued forever and ``tune`` ended unfinished. Now it is failed with a reason after MAX_LOST_ATTEMPTS lost
    attempts, the configurations packed with it complete (each lost at most ALONE_AFTER_LOST_ATTEMPTS times), the
    study finishes with all N accounted for, a rerun adds nothing, and ``report`` shows why."""
    from mtmoe.tuning.objective import ALONE_AFTER_LOST_ATTEMPTS
    from mtmoe.tuning.study import MAX_LOST_ATTEMPTS

    root, tmp = root_and_tmp
    space_path, seed = space_with_one_odd_lr(tmp, 2e-3)
    space = load_space("movielens-100k", "topk", space_path)
    killer = next(i for i, c in enumerate(plan_configurations(space, 3, seed)) if c["model.lr"] == 2e-3)
    url = create_database(postgres_url, "killed_configuration")
    def args(workers: int) -> list[str]:
        return tune_args(url, root, tmp / "runs", *TINY, "--space", str(space_path), "--seed", str(seed),
                         "--workers", str(workers), "--pack", "3",  # packed with the killer, the others are
                         # lost with it until it trains alone (ALONE_AFTER_LOST_ATTEMPTS): then it alone is charged
                         "--trainer.callbacks+=kill_callback.KillAtLearningRate", "--trainer.callbacks.lr=0.002",
                         name="oom")

    code, out, err = run_tune(args(2), tmp, root, "oom", timeout=500, **FAST_HEARTBEAT,
                              PYTHONPATH=pythonpath_with_tests())
    assert code == 0, err[-3000:]
    trials = trials_of(storage_for(url), "oom")
    assert sorted(t.user_attrs["config_id"] for t in trials if t.state == TrialState.COMPLETE) == \
        sorted({0, 1, 2} - {killer})
    attempts = [t for t in trials if t.user_attrs.get("config_id") == killer and t.state == TrialState.FAIL]
    lost = [t for t in attempts if "fail_reason" not in t.user_attrs]
    (failed,) = [t for t in attempts if "fail_reason" in t.user_attrs]
    assert len(lost) == MAX_LOST_ATTEMPTS
    bystanders = [t for t in trials if t.user_attrs.get("config_id") != killer and t.state == TrialState.FAIL]
    assert all("fail_reason" not in t.user_attrs for t in bystanders)  # lost with the killer, never failed
    assert all(sum(t.user_attrs["config_id"] == c for t in bystanders) <= ALONE_AFTER_LOST_ATTEMPTS for c in range(3))
    assert failed.user_attrs["fail_reason"].startswith(f"lost: {MAX_LOST_ATTEMPTS} attempts ended without a result")
    assert not [t for t in trials if t.state in (TrialState.WAITING, TrialState.RUNNING)]
    assert "study 'oom': 2 complete, 1 failed, 0 waiting" in out

    capsys.readouterr()  # finished: the rerun tries nothing (in this process: the parent decides what runs)
    assert run_cli(args(1)) == 0
    assert "study 'oom': 2 complete, 1 failed, 0 waiting" in capsys.readouterr().out
    assert len(trials_of(storage_for(url), "oom")) == len(trials)

    assert run_cli(["report", "--data", "movielens-100k", "--storage", url, "--out", str(tmp / "rep")]) == 0
    table = pd.read_csv(tmp / "rep" / "table_2_3.csv").set_index("study")
    assert table.loc["oom", "trials"] == 3 and table.loc["oom", "failed"] == 1
    assert f"lost ×1 (config {killer}: {MAX_LOST_ATTEMPTS} attempts ended without a result" in \
        (tmp / "rep" / "report.md").read_text()


def test_a_configuration_lost_twice_trains_alone_and_once_lost_still_packed(tiny_root: Path, tmp_path: Path,
                                                                            capsys) -> None:
    """The trials of a pack are lost together when one of them kills the worker; were the configuration that does
    always packed with the same others, its lost attempts would be theirs too, and they would be failed with it. A
    configuration lost ``ALONE_AFTER_LOST_ATTEMPTS`` times trains in a pack of its own (first: lost configurations
    come before the plan); those lost once are packed as before. The lost attempts are added to a study extended
    from 3 to 6 configurations, as a killed worker would leave them (FAIL, no reason)."""
    from mtmoe.tuning.objective import ALONE_AFTER_LOST_ATTEMPTS

    url = f"sqlite:///{tmp_path / 'alone.db'}"
    assert run_cli(tune_args(url, tiny_root, tmp_path / "runs", *TINY, "--pack", "3")) == 0
    study = optuna.load_study(study_name="movielens-100k/topk", storage=url)
    space = load_space("movielens-100k", "topk")
    planned = plan_configurations(space, 6, 0)
    for config_id, times in ((3, ALONE_AFTER_LOST_ATTEMPTS), (4, 1), (5, 1)):
        for _ in range(times):
            study.add_trial(optuna.trial.create_trial(
                state=TrialState.FAIL, params=planned[config_id], distributions=space.distributions,
                user_attrs={"config_id": config_id, "config_hash": config_hash(space, planned[config_id])}))
    capsys.readouterr()
    assert run_cli(tune_args(url, tiny_root, tmp_path / "runs", *TINY, "--pack", "3", trials=6)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "running in a pack of" in line]
    packs = [int(line.rsplit("running in a pack of ", 1)[1].split(",")[0]) for line in lines]
    # 3 alone first, then 4 and 5 together (a pack of 3 shrunk to its 2 trials): without the rule, one pack of 3
    assert packs[0] == 1 and max(packs) == 2 and min(packs[packs.index(2):]) == 2, lines
    assert_each_config_once(trials_of(url, "movielens-100k/topk"), 6)


# --------------------------------------------------------------------- 7 and 12: dead and remote journal workers


@pytest.mark.integration
def test_journal_trials_of_workers_dead_before_recording_or_on_another_host_are_rerun(root_and_tmp) -> None:
    """Before: a journal trial whose worker died between taking it and recording itself, or that ran on another
    host, stayed RUNNING forever and every ``tune`` exited 1. Now journal workers record heartbeats too: a trial
    silent for the grace period is failed and its configuration runs again."""
    root, tmp = root_and_tmp
    url = f"journal:{tmp / 'j.log'}"
    assert run_cli(tune_args(url, root, tmp / "runs", *TINY, trials=1, name="j")) == 0
    space = load_space("movielens-100k", "topk")
    space = SearchSpace(space.data, space.gate, 3, space.fixed, space.distributions)
    storage = storage_for(url)
    study = optuna.load_study(study_name="j", storage=storage)
    for config_id, params in list(enumerate(plan_configurations(space, 3, 0)))[1:]:  # as tune --trials 3 would
        study.enqueue_trial(params, user_attrs={"config_id": config_id, "config_hash": config_hash(space, params)})
    unrecorded = study.ask()  # config 1: its worker died before writing who runs it
    remote = study.ask()  # config 2: runs on another host, silent for an hour
    remote.set_user_attr("worker", "elsewhere:4242")
    remote.set_user_attr("heartbeat", time.time() - 3600)
    time.sleep(int(FAST_HEARTBEAT["MTMOE_HEARTBEAT_GRACE"]))
    code, out, err = run_tune(tune_args(url, root, tmp / "runs", *TINY, trials=3, name="j"), tmp, root, "rerun",
                              **FAST_HEARTBEAT)
    assert code == 0, err[-3000:]
    trials = {t.number: t for t in trials_of(storage, "j")}
    assert trials[unrecorded.number].state == trials[remote.number].state == TrialState.FAIL
    assert_each_config_once(list(trials.values()), 3)


def test_a_journal_trial_with_a_recent_heartbeat_elsewhere_is_kept(tmp_path: Path, monkeypatch) -> None:
    from mtmoe.tuning.storage import fail_stale_trials

    for key, value in FAST_HEARTBEAT.items():
        monkeypatch.setenv(key, value)
    storage = storage_for(f"journal:{tmp_path / 'j.log'}")
    study = optuna.create_study(study_name="j", storage=storage)
    alive, silent = study.ask(), study.ask()
    for trial, beat in ((alive, time.time()), (silent, time.time() - 60)):
        trial.set_user_attr("worker", "elsewhere:4242")
        trial.set_user_attr("heartbeat", beat)
    fail_stale_trials(study, storage)
    states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    assert states == {alive.number: TrialState.RUNNING, silent.number: TrialState.FAIL}


@pytest.mark.integration
def test_a_journal_tune_whose_own_worker_dies_reruns_its_trial(root_and_tmp) -> None:
    """Before: the parent said the dead worker's trial was RUNNING "in other workers" and exited 1. Now it fails
    its own dead worker's trial at once and runs the configuration again. (The workers' trials are held, sleeping,
    until one is killed: ``tests/sleep_callback.py``.)"""
    root, tmp = root_and_tmp
    url = f"journal:{tmp / 'j.log'}"
    storage = storage_for(url)
    hold = tmp / "hold"
    hold.touch()
    args = tune_args(url, root, tmp / "runs", *SHORT, *hold_args(hold), "--workers", "2", trials=2, name="own")
    proc = start_tune(args, tmp, root, "own", **FAST_HEARTBEAT, PYTHONPATH=pythonpath_with_tests())
    try:
        target = wait_for_running(storage, "own", proc, tmp, "own")
        os.kill(int(target.user_attrs["worker"].rpartition(":")[2]), signal.SIGKILL)
        hold.unlink()
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp / "own.err").read_text()
    assert code == 0, err[-3000:]
    assert "other workers" not in err and "Traceback" not in err
    trials = trials_of(storage, "own")
    assert_each_config_once(trials, 2)
    killed = next(t for t in trials if t.number == target.number)
    assert killed.state == TrialState.FAIL and "lost" in killed.user_attrs


# ----------------------------------------------------------------------------------------------- 9: passwords


@pytest.fixture(scope="module")
def password_url() -> str:
    """A second throwaway PostgreSQL server, which asks for ``PASSWORD``: its URL with the password."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        pytest.fail("no PostgreSQL server binaries") if os.environ.get("CI") else pytest.skip("no PostgreSQL")
    with postgres_server(bin_dir, password=PASSWORD) as url:
        yield url.replace("postgresql+psycopg2://", "postgresql://")  # as README writes it


@pytest.mark.integration
def test_the_password_is_never_shown_and_may_come_from_the_environment(password_url: str, root_and_tmp, capfd,
                                                                       monkeypatch) -> None:
    """Before: ``tune``'s output, storage errors, report.md, bootstrap.md and bootstrap.html showed the password.
    Now they show ``***``; ``PGPASSWORD`` or a passfile may hold it instead of the URL, as for PostgreSQL's tools.
    (After the first ``tune``, commands run in this process: ``capfd`` reads what they write to its stdout and
    stderr, Python's or not.)"""
    root, tmp = root_and_tmp
    assert PASSWORD in password_url
    code, out, err = run_tune(tune_args(password_url, root, tmp / "runs", *TINY, trials=2, name="pw"), tmp, root, "pw")
    assert code == 0, err[-3000:]
    assert PASSWORD not in out + err and "mtmoe:***@127.0.0.1" in out

    bare = password_url.replace(f":{PASSWORD}@", "@")
    capfd.readouterr()
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    assert run_cli(tune_args(bare, root, tmp / "runs", *TINY, trials=2, name="pw")) == 0  # resumes: nothing to run
    monkeypatch.delenv("PGPASSWORD")
    printed = capfd.readouterr()
    assert "2 complete" in printed.out and PASSWORD not in printed.out + printed.err, printed
    passfile = tmp / "pgpass"
    passfile.write_text(f"127.0.0.1:*:*:mtmoe:{PASSWORD}\n")
    passfile.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(passfile))
    assert run_cli(["report", "--data", "movielens-100k", "--storage", bare, "--out", str(tmp / "passfile")]) == 0
    monkeypatch.delenv("PGPASSFILE")

    capfd.readouterr()
    for command, *extra in (("report",), ("bootstrap", "--confidence", "0.2")):  # 2 trials: bands at 20% (95%: 8)
        assert run_cli([command, "--data", "movielens-100k", "--storage", password_url, "--out",
                        str(tmp / "rep"), *extra]) == 0
    printed = capfd.readouterr()
    assert PASSWORD not in printed.out + printed.err and "mtmoe:***@127.0.0.1" in printed.out
    written = sorted(path.name for path in (tmp / "rep").iterdir())
    assert {"report.md", "bootstrap.md", "bootstrap.html"} <= set(written)
    for name in written:
        assert PASSWORD.encode() not in (tmp / "rep" / name).read_bytes(), name

    port = password_url.rpartition(":")[2].partition("/")[0]
    for url in (password_url.replace(f":{port}/", ":1/"), password_url.replace(f":{port}/", ":notaport/")):
        for argv in (["tune", "--gate", "topk", "--data", "movielens-100k", "--storage", url, f"--data.root={root}",
                      *TINY], ["report", "--data", "movielens-100k", "--storage", url]):
            assert run_cli(argv) == 2
            printed = capfd.readouterr()
            lines = printed.err.strip().splitlines()
            expected = "error: cannot open the study storage" if ":1/" in url else "error: --storage "  # no port
            assert len(lines) == 1 and lines[0].startswith(expected), lines
            assert PASSWORD not in printed.out + printed.err and "mtmoe:***@" in lines[0]


# Every form a password takes in a storage URL (issue 22.2): the URL as displayed (exactly), and nothing of the
# password, as written or decoded, in a message quoting the URL and the password.
PASSWORD_FORMS = {
    "userinfo": ("postgresql://u:pw-1@h:5432/db", "pw-1", "postgresql://u:***@h:5432/db"),
    "query parameter": ("postgresql://h:5432/db?user=u&password=pw-1", "pw-1",
                        "postgresql://h:5432/db?password=***&user=u"),
    "unencoded @": ("postgresql://u:p@ss@h/db", "p@ss", "postgresql://u:***@h/db"),
    "space": ("postgresql://u:p ss@h/db", "p ss", "postgresql://u:***@h/db"),
    "double quote": ('postgresql://u:p"ss@h/db', 'p"ss', "postgresql://u:***@h/db"),
    "percent-encoded": ("postgresql://u:p%40s%20s@h/db", "p@s s", "postgresql://u:***@h/db"),
    "percent-encoded query": ("postgresql://h/db?user=u&password=p%26s%20s", "p&s s",
                              "postgresql://h/db?password=***&user=u"),
    "port no number": ("postgresql://u:p@ss@h:notaport/db", "p@ss", "postgresql://u:***@h:notaport/db"),
}


@pytest.mark.parametrize("url, password, shown", PASSWORD_FORMS.values(), ids=PASSWORD_FORMS)
def test_every_form_of_password_is_masked(url: str, password: str, shown: str) -> None:
    from urllib.parse import quote

    assert display_url(url) == shown
    message = display_url(url, f"cannot reach {url}: password {password!r} ({quote(password)}) for user u refused")
    assert password not in message and quote(password) not in message and repr(password) not in message
    assert message.startswith(f"cannot reach {shown}: password ") and "for user u refused" in message


@pytest.mark.parametrize("url", ["sqlite:////tmp/a@b/optuna.db", "sqlite:///:memory:", "postgresql://u@h:5432/db",
                                 "journal:/tmp/a@b/journal.log"])
def test_a_url_without_password_is_shown_as_given(url: str) -> None:
    assert display_url(url) == url


@pytest.mark.integration
def test_a_query_password_is_masked_on_the_real_server(password_url: str, root_and_tmp, capsys) -> None:
    """The query form (``?user=u&password=...``) of the password server's URL: ``tune``'s and ``report``'s output,
    report.md and every stored attribute and file hold no password; wrong passwords of every form are one error
    line holding none of them (an unencoded ``@`` is refused before connecting)."""
    root, tmp = root_and_tmp
    server = make_url(password_url)
    base = f"postgresql://{server.host}:{server.port}/{server.database}"
    url = f"{base}?user={server.username}&password={PASSWORD}"
    assert run_cli(tune_args(url, root, tmp / "runs", *TINY, trials=1, name="query")) == 0
    assert run_cli(["report", "--data", "movielens-100k", "--storage", url, "--out", str(tmp / "rep")]) == 0
    printed = capsys.readouterr()
    assert PASSWORD not in printed.out + printed.err and f"{base}?password=***&user=mtmoe" in printed.out
    assert f"`{base}?password=***&user=mtmoe`" in (tmp / "rep" / "report.md").read_text()
    study = optuna.load_study(study_name="query", storage=storage_for(password_url))
    stored = [study.user_attrs, *(trial.user_attrs for trial in study.get_trials())]
    assert PASSWORD not in repr(stored)
    for path in tmp.rglob("*"):
        assert not path.is_file() or PASSWORD.encode() not in path.read_bytes(), path

    wrong = {"userinfo": "Wrong-pw-1", "query": "Wrong-pw-2", "space": "wr ong", "double quote": 'wr"ong',
             "percent-encoded": "wr%40%20ng", "unencoded @": "wr@ong"}
    for form, password in wrong.items():
        given = f"{base}?user=mtmoe&password={password}" if form == "query" else \
            base.replace("://", f"://mtmoe:{password}@")
        assert run_cli(["report", "--data", "movielens-100k", "--storage", given]) == 2, form
        printed = capsys.readouterr()
        lines = printed.err.strip().splitlines()
        assert len(lines) == 1 and not printed.out, (form, lines)
        expected = "holds an unencoded '@'" if form == "unencoded @" else "password authentication failed"
        assert expected in lines[0] and "***" in lines[0], (form, lines)
        assert password not in lines[0] and unquote(password) not in lines[0], (form, lines)


# --------------------------------------------------------------------------------------- 10: an unwritable --out


@pytest.mark.parametrize("command", ["report", "bootstrap"])
@pytest.mark.parametrize("where", ["a file", "under a file", "unwritable"])
def test_an_unwritable_or_file_valued_out_is_one_line(tmp_path: Path, capsys, command: str, where: str) -> None:
    """Before: a traceback (FileExistsError, NotADirectoryError, ...). Now one line, exit 2, nothing written."""
    if where == "unwritable" and not Path("/proc/self").is_dir():
        pytest.skip("needs /proc (Linux), where nobody may create a folder, root included")
    url = f"sqlite:///{tmp_path / 'synthetic.db'}"
    synthetic_study(url, "movielens-100k/topk", "topk", 8, 0.4, np.random.default_rng(1))  # 8: the exact bands
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    out = {"a file": a_file, "under a file": a_file / "rep", "unwritable": Path("/proc/mtmoe-report")}[where]
    assert run_cli([command, "--data", "movielens-100k", "--storage", url, "--out", str(out)]) == 2
    printed = capsys.readouterr()
    lines = printed.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write the outputs to {out}"), lines
    assert "Traceback" not in printed.err and a_file.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "synthetic.db"]


# ------------------------------------------------------------------------------------------ 12: misleading output


def test_report_shows_no_test_results_for_diverged_trials(tmp_path: Path, capsys) -> None:
    """A study whose every trial diverged (their test metrics recorded before the NaN was seen): before, report
    showed their n/s and task metrics; now n/a."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    synthetic_study(url, "movielens-100k/topk", "topk", 3, 0.4, np.random.default_rng(2), diverged=3)
    assert run_cli(["report", "--data", "movielens-100k", "--storage", url, "--out", str(tmp_path / "rep")]) == 0
    table = pd.read_csv(tmp_path / "rep" / "table_2_3.csv").iloc[0]
    table7 = pd.read_csv(tmp_path / "rep" / "table_7.csv").iloc[0]
    assert table.failed == 3 and table.selected == 1
    assert math.isnan(table.n_s_mean) and math.isnan(table.test_loss_x100_mean)
    assert all(math.isnan(table7[c]) for c in table7.index if c.endswith(" mean"))
    assert "| movielens-100k/topk | topk | 0.9 | 3 | 3 | 1 | n/a | n/a | - | n/a |" in capsys.readouterr().out


@pytest.mark.integration  # a child process
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads a process's state in /proc")
def test_a_worker_that_exited_unreaped_is_not_alive() -> None:
    """A ``tune --workers`` child that died stays a zombie until its parent waits for it, and ``os.kill(pid, 0)``
    still finds it: ``pid_alive`` (which decides whether a local worker's trials are failed at once) does not count
    it alive."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(child.pid)
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has exited; left unreaped
        os.kill(child.pid, 0)  # still found by kill
        assert not pid_alive(child.pid)
    finally:
        child.wait()


@pytest.mark.integration  # a child process
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads a process's state in /proc")
def test_a_worker_reaped_between_kill_and_proc_is_not_alive(monkeypatch) -> None:
    """The race CI met (stop 48): ``os.kill(pid, 0)`` finds the process, its parent reaps it before ``/proc`` is
    read. ``pid_alive`` says not alive (it said alive, and a test reading ``/proc/<pid>/status`` raised)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # exited and reaped: gone from /proc
    monkeypatch.setattr(os, "kill", lambda pid, sig: None)  # as if kill had looked just before the reaping
    assert not pid_alive(child.pid)


# ------------------------------------------------------------------------------------------- threads that write
@pytest.mark.timeout(60)
def test_ordered_writes_hand_a_failed_write_to_the_caller_instead_of_hanging() -> None:
    """The worker's intermediate values are written by a thread (:class:`OrderedWrites`). Before: a write that raised
    (a full disk, a database gone for a moment) killed that thread silently, and the next finished trial's ``tell``,
    which first waits for the queued writes, waited forever. Now the calls run in order, the error reaches the caller
    at its next ``join`` or ``put``, and the calls queued after the failed one do not run."""
    writes, done = OrderedWrites(), []
    writes.put(lambda: done.append(1))
    writes.join()
    assert done == [1]

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    for call in (lambda: done.append(2), full_disk, lambda: done.append(3)):
        writes.put(call)
    with pytest.raises(OSError, match="No space left"):
        writes.join()
    assert done == [1, 2]
    with pytest.raises(OSError, match="No space left"):  # and stays failed: nothing is written after it
        writes.put(lambda: done.append(4))
    assert done == [1, 2]


@pytest.mark.timeout(60)
def test_a_periodic_call_that_fails_is_warned_once_and_tried_again(monkeypatch, capfd) -> None:
    """Heartbeats and the reclaiming of dead workers' trials run in :class:`Periodic`. Before: one failed call (the
    storage unreachable for a moment) ended the thread, so a live worker's trials stopped beating and were taken
    for dead. Now the call is tried again at the next interval, with one warning per kind of error."""
    monkeypatch.setenv("MTMOE_HEARTBEAT_INTERVAL", "1")
    calls = []

    def action() -> None:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise ConnectionError("server closed the connection unexpectedly")

    ticker = Periodic(action)
    deadline = time.monotonic() + 30
    while len(calls) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    ticker.stop()
    assert len(calls) >= 4
    err = capfd.readouterr().err
    assert err.count("warning: a periodic storage call failed (ConnectionError: server closed") == 1, err
