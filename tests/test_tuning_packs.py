"""``tune --pack P``: a packed study evaluates the same plan as an unpacked one, with the same results to float32
rounding (dropout on: each trial draws from its own stream), the same user attributes, per-trial logs and learning
curves, and the same fault guarantees per trial: a worker SIGKILLed mid-pack (real PostgreSQL, heartbeats for every
trial of the pack) or interrupted with Ctrl-C loses no configuration, a surviving worker fails the dead one's trials
within the heartbeat grace and interval and runs them before the rest of the plan, a worker frozen past the grace
drops its taken-over trials, and the rerun ends with each configuration complete exactly once."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

from conftest import run_cli
from mtmoe.tuning import packs
from mtmoe.tuning.storage import storage_for
from sleep_callback import hold_args, pythonpath_with_tests
from test_tuning import (SHORT, assert_each_config_once, interrupt_while_running, run_tune, start_tune, subprocess_env,
                         trials_of, tune_args, wait_for_running)

FAST = ["--trainer.max_epochs=3", "--trainer.limit_train_batches=3", "--data.batch_size=64"]


@pytest.fixture(autouse=True)
def quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.mark.parametrize("gate, size, n", [("comet", "2", 3), ("topk+", "4", 5)])
def test_a_packed_study_is_the_unpacked_study(tiny_root: Path, tmp_path: Path, capsys, gate: str, size: str,
                                              n: int) -> None:
    """Same seed, separate storages, ``--pack 1`` and a pack of 2 (comet, 3 trials) or 4 (topk+: local search, 5
    trials), dropout on (each trial draws from its own stream; one trial more than the pack: it refills a slot as
    the first trials end): the same configurations
    under the same config_ids, the same objectives and test losses to float32 rounding, the same user attributes,
    each epoch's validation loss as the trial's intermediate value, and each trial's log and results in its
    folder."""
    extra = [*FAST, *(["--model.perm_epochs=1"] if gate.endswith("+") else [])]
    studies = {}
    for pack in ("1", size):
        url = f"sqlite:///{tmp_path / f'pack{pack}.db'}"
        args = tune_args(url, tiny_root, tmp_path / f"runs{pack}", *extra, "--pack", pack, trials=n, gate=gate)
        assert run_cli(args) == 0, capsys.readouterr().err
        trials = trials_of(url, f"movielens-100k/{gate}")
        assert_each_config_once(trials, n)
        studies[pack] = {t.user_attrs["config_id"]: t for t in trials if t.state == TrialState.COMPLETE}
        assert f"running in a pack of {pack}" in capsys.readouterr().out
        for config_id, trial in studies[pack].items():
            folder = tmp_path / f"runs{pack}" / f"movielens-100k_{gate}" / f"config-{config_id:04d}"
            metrics = pd.read_csv(folder / "metrics.csv", float_precision="round_trip")  # exact on pandas 2 too
            assert len(metrics) == trial.user_attrs["epochs_run"]
            assert trial.value == pytest.approx(metrics["val/loss"].min(), rel=1e-6)
            assert trial.intermediate_values == dict(enumerate(metrics["val/loss"]))
            assert json.loads((folder / "results.json").read_text())["test"]["loss"] == trial.user_attrs["test_loss"]
        # where each pack epoch's time went: a row per epoch, every trial-epoch and every ended trial in them
        epochs = pd.read_csv(tmp_path / f"runs{pack}" / f"movielens-100k_{gate}" / "pack-epochs.csv")
        assert epochs["trained"].sum() == sum(t.user_attrs["epochs_run"] for t in studies[pack].values())
        assert epochs["ended"].sum() == epochs["tested"].sum() == n and (epochs["slots"] <= int(pack)).all()
        assert (epochs.filter(like="_s") >= 0).all().all() and (epochs["train_val_s"] > 0).all()
    for config_id, alone in studies["1"].items():
        packed = studies[size][config_id]
        assert packed.params == alone.params
        assert set(packed.user_attrs) - {"worker"} == set(alone.user_attrs) - {"worker"}
        assert packed.value == pytest.approx(alone.value, rel=1e-5)
        assert packed.user_attrs["test_loss"] == pytest.approx(alone.user_attrs["test_loss"], rel=1e-5)
        for key in ("seed", "epochs_run", "best_epoch", "config_hash"):
            assert packed.user_attrs[key] == alone.user_attrs[key], key


@pytest.mark.parametrize("pack, extra, message", [
    ("0", [], "--pack must be a positive number of trials or auto, got '0'"),
    ("two", [], "--pack must be a positive number of trials or auto, got 'two'"),
    ("2", ["--trainer.accumulate_grad_batches=2"],
     "--trainer.accumulate_grad_batches 2 is not supported by mtmoe's training engine"),
    ("2", ["--trainer.precision=64-true"], "--trainer.precision 64-true is not supported by mtmoe's training engine"),
    ("100000000", [], "a pack of 100000000 trials does not fit in the memory of cpu"),
    ("1", ["--trainer.max_steps=10"], "--trainer.max_steps 10 is not supported by mtmoe's training engine"),
    ("2", ["--checkpoint-every=0"], "--checkpoint-every must be a positive number of seconds, got 0.0"),
    ("2", ["--timeout=-5"], "--timeout must be a positive number of seconds, got -5.0"),
])
def test_bad_pack_input_is_one_line(tiny_root: Path, tmp_path: Path, capsys, pack: str, extra: list[str],
                                    message: str) -> None:
    url = f"sqlite:///{tmp_path / 'bad.db'}"
    assert run_cli(tune_args(url, tiny_root, tmp_path / "runs", *FAST, *extra, "--pack", pack)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "bad.db").exists() or not optuna.get_all_study_names(url)  # the storage is untouched


@pytest.mark.integration
@pytest.mark.parametrize("signum, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_fails_the_packs_trials_and_the_rerun_resumes(root_and_tmp, monkeypatch, signum: int,
                                                                        exit_code: int) -> None:
    """SIGTERM (a scheduler's stop, issue 22.3) is handled as Ctrl-C: the pack's trials are failed as interrupted,
    the exit code says which signal (128 + its number); the rerun evaluates every configuration once."""
    root, tmp = root_and_tmp
    url = f"sqlite:///{tmp / 'int.db'}"
    storage = optuna.storages.RDBStorage(url)
    hold = tmp / "hold"  # the pack sleeps until the signal comes
    hold.touch()
    monkeypatch.setenv("PYTHONPATH", pythonpath_with_tests())
    args = tune_args(url, root, tmp / "runs", *SHORT, *hold_args(hold), "--pack", "3", trials=4, name="int")
    code, err, _ = interrupt_while_running(args, tmp, root, storage, "int", signum=signum, ready=lambda trial: count(
        storage, "int", TrialState.RUNNING) == 3)  # the pack is full
    assert code == exit_code and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("error: interrupted"), err
    trials = trials_of(url, "int")
    interrupted = [t for t in trials if t.state == TrialState.FAIL]
    assert len(interrupted) == 3 and not any("fail_reason" in t.user_attrs for t in interrupted)
    assert all(t.user_attrs.get("interrupted") for t in interrupted)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    if signum == signal.SIGTERM:
        return  # from here on both signals are one KeyboardInterrupt (mtmoe.interrupts): the rerun is tested once
    hold.unlink()
    assert run_cli(args) == 0  # the rerun, in this process
    assert_each_config_once(trials_of(url, "int"), 4)


def test_a_stop_right_after_a_claim_fails_the_claimed_trial_as_interrupted(tiny_root: Path, tmp_path: Path,
                                                                          monkeypatch) -> None:
    """A Ctrl-C that lands just after the storage has made a waiting trial RUNNING, before the worker has recorded it
    as its own (``mtmoe.interrupts.deferred`` holds it until then): the trial is failed as interrupted with the
    others, not left RUNNING with no worker to fail it (CI once caught a SIGTERM there). ``_thread.interrupt_main``
    stands for the signal, at the first claim's return."""
    import _thread

    claim = optuna.storages.RDBStorage.set_trial_state_values
    claims = []

    def claimed_then_stopped(storage, trial_id, state, values=None):
        changed = claim(storage, trial_id, state, values)
        if state == TrialState.RUNNING and not claims:
            claims.append(trial_id)
            _thread.interrupt_main()  # delivered at the next bytecode boundary: inside the claim
        return changed

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", claimed_then_stopped)
    url = f"sqlite:///{tmp_path / 'claim.db'}"
    assert run_cli(tune_args(url, tiny_root, tmp_path / "runs", *FAST, "--pack", "2", trials=3, name="claim")) == 130
    trials = trials_of(url, "claim")
    assert claims and not [t for t in trials if t.state == TrialState.RUNNING], [t.state for t in trials]
    (claimed,) = [t for t in trials if t._trial_id == claims[0]]
    assert claimed.state == TrialState.FAIL and claimed.user_attrs.get("interrupted")


def start_in(host: str, args: list[str], tmp: Path, root: Path, log: str, **env: str):
    """:func:`start_tune` on this host, or on "another host": in a UTS namespace of its own whose host name differs
    (``unshare --uts``, as root), so that no process id tells whether it lives, only its heartbeats."""
    if host == "this host":
        return start_tune(args, tmp, root, log, **env)
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("another host needs unshare --uts, as root")
    command = " ".join(shlex.quote(arg) for arg in [sys.executable, "-m", "mtmoe", *args])
    return subprocess.Popen(["unshare", "--uts", "sh", "-c", f"hostname elsewhere && exec {command}"], cwd=tmp,
                            env=subprocess_env(tmp, root, **env), stdout=open(tmp / f"{log}.out", "w"),
                            stderr=open(tmp / f"{log}.err", "w"))


def wait_until(condition, procs, what: str, timeout: float = 300) -> None:
    """Poll ``condition()`` until it holds, while none of ``procs`` failed (a loaded host takes minutes to start a
    tune)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        assert all(proc.poll() in (None, 0) for proc in procs), f"a tune ended early, waiting until {what}"
        time.sleep(0.5)


def count(storage, name: str, state: TrialState) -> int:
    """How many of the study's trials are in ``state`` (``storage``: one object for all polls, not a URL, whose
    every use would connect again)."""
    return sum(t.state == state for t in trials_of(storage, name))


def pack_of_six_running(storage, name: str, first: str, second: str, root: Path, tmp: Path, args: list[str],
                        env: dict[str, str], host: str = "this host"):
    """Two ``tune --pack 3`` commands, ``first`` (on ``host``) and then ``second``, held (``hold_args``) until six
    trials are RUNNING: (first's process, second's process, the trials then)."""
    one = start_in(host, args, tmp, root, first, **env)
    wait_for_running(storage, name, one, tmp, first, min_age=0.5)
    two = start_tune(args, tmp, root, second, **env)
    wait_until(lambda: count(storage, name, TrialState.RUNNING) == 6, [one, two], "six run")
    return one, two, trials_of(storage, name)


def held_tune(postgres_url: str, root: Path, tmp: Path, name: str, trials: int) -> tuple[list[str], dict, Path, Any]:
    """A ``tune --pack 3`` held until its hold file is deleted, heartbeats every second and a grace of 3 s: (its
    arguments, its environment, the hold file, the storage to read)."""
    hold = tmp / "hold"
    hold.touch()
    env = {"MTMOE_HEARTBEAT_INTERVAL": "1", "MTMOE_HEARTBEAT_GRACE": "3", "PYTHONPATH": pythonpath_with_tests()}
    args = tune_args(postgres_url, root, tmp / "runs", *SHORT, *hold_args(hold), "--pack", "3", trials=trials,
                     name=name)
    return args, env, hold, optuna.storages.RDBStorage(postgres_url)


@pytest.mark.integration
@pytest.mark.parametrize("host", ["this host", "another host"])
def test_a_dead_packing_workers_trials_are_failed_within_grace_and_interval_and_rerun_before_the_plan(
        postgres_url: str, root_and_tmp, host: str) -> None:
    """Two packing workers (``--pack 3``, two ``tune`` commands) on the real PostgreSQL server, 8 configurations;
    one is SIGKILLed holding three RUNNING trials while the survivor's pack is full (held, sleeping:
    ``tests/sleep_callback.py``) and two configurations wait. Before: they were failed only when a survivor's slot
    freed (122-139 s after the kill against a 30 s grace) and re-ran behind the waiting plan. Now the survivor fails
    them within grace + one heartbeat interval of the kill (on this host: at once, its process is gone; on another
    host: when its heartbeats stop) with its pack still held, runs their configurations in its next free slots
    before the two waiting ones once let go, and every configuration completes once."""
    root, tmp = root_and_tmp
    name = f"dead-{host.split()[0]}"
    args, env, hold, storage = held_tune(postgres_url, root, tmp, name, trials=8)
    interval, grace = int(env["MTMOE_HEARTBEAT_INTERVAL"]), int(env["MTMOE_HEARTBEAT_GRACE"])
    doomed, survivor = None, None
    try:
        doomed, survivor, before = pack_of_six_running(storage, name, "doomed", "survivor", root, tmp, args,
                                                       env, host)
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait(timeout=30)
        killed_at = datetime.now()
        wait_until(lambda: count(storage, name, TrialState.FAIL) == 3, [survivor],
                   "the dead worker's trials are failed", timeout=60)
        hold.unlink()
        code = survivor.wait(timeout=300)
    finally:
        for proc in (doomed, survivor):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert code == 0, (tmp / "survivor.err").read_text()[-3000:]
    trials = trials_of(storage, name)
    assert_each_config_once(trials, 8)
    dead = [t for t in trials if t.state == TrialState.FAIL]
    assert len(dead) == 3 and not any("fail_reason" in t.user_attrs for t in dead)
    failed_after = [(t.datetime_complete - killed_at).total_seconds() for t in dead]
    assert max(failed_after) <= grace + interval, failed_after
    lost = {t.user_attrs["config_id"] for t in dead}
    waiting = {t.user_attrs["config_id"] for t in before if t.state == TrialState.WAITING}
    assert len(waiting) == 2
    complete = {t.user_attrs["config_id"]: t for t in trials if t.state == TrialState.COMPLETE}
    assert all(complete[c].user_attrs["worker"].endswith(f":{survivor.pid}") for c in lost)
    reruns_started = max(complete[c].datetime_start for c in lost)
    assert reruns_started <= min(complete[c].datetime_start for c in waiting), \
        ([complete[c].datetime_start for c in lost], [complete[c].datetime_start for c in waiting])


@pytest.mark.integration
def test_a_worker_frozen_past_the_grace_drops_its_taken_over_trials_and_carries_on(postgres_url: str,
                                                                                  root_and_tmp) -> None:
    """A packing worker is frozen (SIGSTOP) holding three RUNNING trials until the other worker has failed them
    and completed their configurations, then thawed (SIGCONT). Before: it trained them on, rewrote their
    ``config-NNNN/`` logs and died with a 58-line ``UpdateFinishedTrialError`` traceback. Now it drops them at its
    next epoch with one ``warning:`` line, leaves their logs alone and finishes the study with exit 0. (Both packs
    are held, sleeping, until the frozen one's trials are failed: ``tests/sleep_callback.py``.)"""
    root, tmp = root_and_tmp
    name = "frozen"
    args, env, hold, storage = held_tune(postgres_url, root, tmp, name, trials=6)
    frozen, other = None, None
    try:
        frozen, other, before = pack_of_six_running(storage, name, "frozen", "other", root, tmp, args, env)
        os.kill(frozen.pid, signal.SIGSTOP)
        held = {t.user_attrs["config_id"] for t in before
                if t.state == TrialState.RUNNING and t.user_attrs.get("worker", "").endswith(f":{frozen.pid}")}
        assert len(held) == 3
        wait_until(lambda: count(storage, name, TrialState.FAIL) == 3, [other],
                   "the frozen worker's trials are failed", timeout=60)
        hold.unlink()
        wait_until(lambda: held <= {t.user_attrs["config_id"] for t in trials_of(storage, name)
                                    if t.state == TrialState.COMPLETE}, [other], "their configurations complete")
        logs = {path: path.stat() for c in held for path in (tmp / "runs" / name / f"config-{c:04d}").iterdir()}
        os.kill(frozen.pid, signal.SIGCONT)
        codes = frozen.wait(timeout=120), other.wait(timeout=120)
    finally:
        for proc in (frozen, other):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
    err = (tmp / "frozen.err").read_text()
    assert codes == (0, 0) and "Traceback" not in err, err[-3000:]
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "dropped here, their logs left alone" in warnings[0], err[-3000:]
    assert sorted(p.name for p in logs) == ["config.yaml"] * 3 + ["metrics.csv"] * 3 + ["results.json"] * 3
    for path, stat in logs.items():  # not rewritten: same file (atomic writes replace it), same time
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns), path
    trials = trials_of(storage, name)
    assert_each_config_once(trials, 6)
    frozen_trials = [t for t in trials if t.user_attrs.get("worker", "").endswith(f":{frozen.pid}")]
    taken = [t for t in frozen_trials if t.user_attrs["config_id"] in held]
    assert len(taken) == 3 and all(t.state == TrialState.FAIL and "test_loss" not in t.user_attrs for t in taken)


@pytest.mark.integration
def test_two_packing_workers_on_postgres_evaluate_each_configuration_once(postgres_url: str, root_and_tmp) -> None:
    root, tmp = root_and_tmp
    name = "two-packs"
    args = tune_args(postgres_url, root, tmp / "runs", *SHORT, "--pack", "2", "--workers", "2", trials=6, name=name)
    code, out, err = run_tune(args, tmp, root, "workers")
    assert code == 0 and "Traceback" not in err, err[-3000:]
    trials = trials_of(postgres_url, name)
    assert_each_config_once(trials, 6)
    assert len([t for t in trials if "config_id" in t.user_attrs and t.state != TrialState.PRUNED]) == 6
    log = tmp / "runs" / name / "pack-epochs.csv"  # the workers' rows under one header
    assert sum(line.startswith("time,") for line in log.read_text().splitlines()) == 1
    assert pd.read_csv(log)["ended"].sum() == 6


def test_an_epoch_end_leaves_the_trials_results_to_the_writes_thread(tiny_root: Path, tmp_path: Path,
                                                                     monkeypatch) -> None:
    """Each ended trial's results (some forty user attributes), its tell, the intermediate values and each trial's
    ``config.yaml`` are written by the worker's writes' thread, the training thread only claims (its ``RUNNING``
    writes). Before, the results, the tell and the configuration were written at the epoch end, holding the next
    epoch up by some forty storage writes a trial (each an fsync on a journal, a transaction on PostgreSQL) and
    a YAML dump. The study's records and files are complete all the same."""
    journal = optuna.storages.JournalStorage
    main, writes = threading.main_thread(), []

    def noting(name: str, what):
        original = getattr(journal, name)

        def write(self, trial_id, *args):
            writes.append((threading.current_thread() is main, name, what(*args)))
            return original(self, trial_id, *args)

        monkeypatch.setattr(journal, name, write)

    noting("set_trial_user_attr", lambda key, value: key)
    noting("set_trial_state_values", lambda state, values=None: state.name)
    noting("set_trial_intermediate_value", lambda step, value: "intermediate")
    written, write_atomic = [], packs.write_atomic

    def writing(text: str, path: Path) -> None:
        written.append((threading.current_thread() is main, path.name))
        write_atomic(text, path)

    monkeypatch.setattr(packs, "write_atomic", writing)
    url = f"journal:{tmp_path / 'journal.log'}"
    assert run_cli(tune_args(url, tiny_root, tmp_path / "runs", *FAST, "--pack", "2", trials=3)) == 0
    assert_each_config_once(trials_of(storage_for(url), "movielens-100k/topk"), 3)
    in_main = {what for main_thread, _, what in writes if main_thread}
    assert "RUNNING" in in_main  # the claims: the worker trains in this thread
    results = {"seed", "wall_time_s", "epochs_run", "test/loss", "test_loss", "device", "COMPLETE", "intermediate"}
    assert not results & in_main, results & in_main
    assert results <= {what for _, _, what in writes}
    assert sorted(written) == [(False, "config.yaml")] * 3 + [(False, "results.json")] * 3


def test_a_packed_study_on_a_journal_storage(tiny_root: Path, tmp_path: Path, capsys) -> None:
    url = f"journal:{tmp_path / 'journal.log'}"
    assert run_cli(tune_args(url, tiny_root, tmp_path / "runs", *FAST, "--pack", "2", trials=3)) == 0
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "journal.log")))
    assert_each_config_once(trials_of(storage, "movielens-100k/topk"), 3)
