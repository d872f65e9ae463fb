"""``tune --pack P``: a packed study evaluates the same plan as an unpacked one, with the same results to float
rounding (dropout off), the same user attributes, and the same fault guarantees per trial: a worker SIGKILLed
mid-pack (real PostgreSQL, heartbeats for every trial of the pack) or interrupted with Ctrl-C loses no
configuration, and the rerun ends with each configuration complete exactly once."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from conftest import run_cli
from test_tuning import (assert_each_config_once, interrupt_while_running, run_tune, start_tune, trials_of, tune_args,
                         wait_for_running)

FAST = ["--trainer.max_epochs=3", "--data.batch_size=64", "--model.expert_dropout=0"]
# a pack that stays RUNNING for a while: 3 epochs of ~140 steps of 8 rows
SLOW = ["--trainer.max_epochs=3", "--data.batch_size=8"]


@pytest.fixture(autouse=True)
def quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.mark.parametrize("gate", ["comet", "topk+"])
def test_a_packed_study_is_the_unpacked_study(tiny_root: Path, tmp_path: Path, capsys, gate: str) -> None:
    """Same seed, two storages, ``--pack 3`` and ``--pack 1``: the same configurations under the same config_ids,
    the same objectives and test losses (dropout off: to float rounding), the same user attributes."""
    extra = [*FAST, *(["--model.perm_epochs=1"] if gate.endswith("+") else [])]
    studies = {}
    for pack in ("3", "1"):
        url = f"sqlite:///{tmp_path / f'pack{pack}.db'}"
        args = tune_args(url, tiny_root, tmp_path / f"runs{pack}", *extra, "--pack", pack, trials=5, gate=gate)
        assert run_cli(args) == 0, capsys.readouterr().err
        trials = trials_of(url, f"movielens-100k/{gate}")
        assert_each_config_once(trials, 5)
        studies[pack] = {t.user_attrs["config_id"]: t for t in trials}
    out = capsys.readouterr().out
    assert "running in a pack of 3" in out, out
    for config_id, unpacked in studies["1"].items():
        packed = studies["3"][config_id]
        assert packed.params == unpacked.params
        assert set(packed.user_attrs) == set(unpacked.user_attrs)
        assert packed.value == pytest.approx(unpacked.value, rel=1e-5)
        assert packed.user_attrs["test_loss"] == pytest.approx(unpacked.user_attrs["test_loss"], rel=1e-4)
        for key in ("seed", "epochs_run", "best_epoch", "config_hash"):
            assert packed.user_attrs[key] == unpacked.user_attrs[key], key


@pytest.mark.parametrize("pack, extra, message", [
    ("0", [], "--pack must be a positive number of trials or auto, got '0'"),
    ("two", [], "--pack must be a positive number of trials or auto, got 'two'"),
    ("2", ["--trainer.limit_train_batches=5"], "--trainer.limit_train_batches is not supported by trial packs"),
    ("2", ["--trainer.precision=64-true"], "trial packs train in precision 32 or bf16-mixed"),
    ("100000000", [], "a pack of 100000000 trials does not fit in the memory of cpu"),
    ("2", ["--early_stopping.min_delta=0.01"], "--early_stopping.min_delta is not supported by trial packs"),
])
def test_bad_pack_input_is_one_line(tiny_root: Path, tmp_path: Path, capsys, pack: str, extra: list[str],
                                    message: str) -> None:
    url = f"sqlite:///{tmp_path / 'bad.db'}"
    assert run_cli(tune_args(url, tiny_root, tmp_path / "runs", *FAST, *extra, "--pack", pack)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "bad.db").exists() or not optuna.get_all_study_names(url)  # the storage is untouched


def test_ctrl_c_fails_the_packs_trials_and_the_rerun_resumes(root_and_tmp) -> None:
    root, tmp = root_and_tmp
    url = f"sqlite:///{tmp / 'int.db'}"
    optuna.storages.RDBStorage(url)
    args = tune_args(url, root, tmp / "runs", *SLOW, "--pack", "3", trials=4, name="int")
    code, err, _ = interrupt_while_running(args, tmp, root, url, "int", min_age=3)
    assert code == 130 and "Traceback" not in err, err
    trials = trials_of(url, "int")
    interrupted = [t for t in trials if t.state == TrialState.FAIL]
    assert len(interrupted) == 3 and not any("fail_reason" in t.user_attrs for t in interrupted)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    code, out, err = run_tune(args, tmp, root, "second")
    assert code == 0, err[-3000:]
    assert_each_config_once(trials_of(url, "int"), 4)


def test_a_sigkilled_pack_is_failed_by_heartbeats_and_retried(postgres_url: str, root_and_tmp) -> None:
    """Every trial of the killed pack had its heartbeat recorded: all are failed after the grace period and their
    configurations re-run, each exactly once."""
    root, tmp = root_and_tmp
    name = "killed-pack"
    args = tune_args(postgres_url, root, tmp / "runs", *SLOW, "--pack", "3", trials=4, name=name)
    heartbeat = {"MTMOE_HEARTBEAT_INTERVAL": "1", "MTMOE_HEARTBEAT_GRACE": "3"}
    proc = start_tune(args, tmp, root, "first", **heartbeat)
    try:
        wait_for_running(postgres_url, name, proc, tmp, "first", min_age=3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    running = [t for t in trials_of(postgres_url, name) if t.state == TrialState.RUNNING]
    assert len(running) == 3  # the whole pack was left RUNNING by the SIGKILL
    time.sleep(4)  # past the grace period: a trial is stale only if a heartbeat of it was recorded
    storage = optuna.storages.RDBStorage(postgres_url, heartbeat_interval=1, grace_period=3)
    study_id = storage.get_study_id_from_name(name)
    assert set(storage._get_stale_trial_ids(study_id)) == {t._trial_id for t in running}  # noqa: SLF001

    code, out, err = run_tune(args, tmp, root, "second", **heartbeat)
    assert code == 0, err[-3000:]
    trials = trials_of(postgres_url, name)
    assert_each_config_once(trials, 4)
    killed = {t.number for t in running}
    assert all(t.state == TrialState.FAIL and "fail_reason" not in t.user_attrs for t in trials if t.number in killed)


def test_two_packing_workers_on_postgres_evaluate_each_configuration_once(postgres_url: str, root_and_tmp) -> None:
    root, tmp = root_and_tmp
    name = "two-packs"
    args = tune_args(postgres_url, root, tmp / "runs", *FAST, "--pack", "2", "--workers", "2", trials=6, name=name)
    code, out, err = run_tune(args, tmp, root, "workers")
    assert code == 0 and "Traceback" not in err, err[-3000:]
    trials = trials_of(postgres_url, name)
    assert_each_config_once(trials, 6)
    assert len([t for t in trials if "config_id" in t.user_attrs and t.state != TrialState.PRUNED]) == 6


def test_a_packed_study_on_a_journal_storage(tiny_root: Path, tmp_path: Path, capsys) -> None:
    url = f"journal:{tmp_path / 'journal.log'}"
    assert run_cli(tune_args(url, tiny_root, tmp_path / "runs", *FAST, "--pack", "2", trials=3)) == 0
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "journal.log")))
    assert_each_config_once(trials_of(storage, "movielens-100k/topk"), 3)
