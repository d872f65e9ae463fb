"""Pack checkpoints (:mod:`mtmoe.tuning.checkpoints`): a packed study stopped by SIGTERM after some epochs and run
again continues its interrupted trials from their saved epoch, and computes exactly what the uninterrupted study
computes (bitwise on a CPU: per-epoch metrics, objectives, test results); a checkpoint of other study settings or of
another configuration is ignored with a warning."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from optuna.trial import TrialState

from mtmoe.tuning.checkpoints import PackCheckpoints, checkpoint_folder

from conftest import run_cli
from sleep_callback import hold_args, pythonpath_with_tests
from test_tuning import (assert_each_config_once, interrupt_while_running, one_torch_thread,  # noqa: F401 (autouse)
                         start_tune, trials_of, tune_args, wait_for_running)

# 2 epochs of 4 steps of 16 rows
SHORT = ["--trainer.max_epochs=2", "--data.batch_size=16", "--trainer.limit_train_batches=4",
         "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2"]
# the study to interrupt: each epoch after the first waits 3 s first, so a pack is caught between its epochs
SLEEP = ["--trainer.callbacks+=sleep_callback.SleepAfterFirstEpoch", "--trainer.callbacks.seconds=3"]
NAME = "resume"


def logs(folder: Path) -> dict[str, str]:
    return {path.parent.name: path.read_text() for path in sorted(folder.rglob("metrics.csv"))}


def results(url: str) -> dict[int, tuple]:
    return {t.user_attrs["config_id"]: (t.value, t.user_attrs["test_loss"], t.user_attrs["epochs_run"],
                                        t.intermediate_values)
            for t in trials_of(url, NAME) if t.state == TrialState.COMPLETE}


def sigterm_after_epochs(args: list[str], tmp: Path, root: Path, url: str, epochs: int) -> int:
    """Start ``tune``; SIGTERM once a running trial has reported ``epochs`` validation losses; its exit code."""
    code, _, _ = interrupt_while_running(args, tmp, root, url, NAME, signum=signal.SIGTERM, timeout=300,
                                         ready=lambda trial: len(trial.intermediate_values) >= epochs)
    return code


@pytest.fixture
def tune_here(monkeypatch, capsys):
    """``tune ARGS`` run to its end in this process, with one torch thread (the autouse ``one_torch_thread``) as the
    tune processes the tests start (the uninterrupted reference and the rerun after a stop need no process of their
    own): its stderr. The tests folder goes on the started processes' ``PYTHONPATH`` for :mod:`sleep_callback`."""
    monkeypatch.setenv("PYTHONPATH", pythonpath_with_tests())

    def run(args: list[str]) -> str:
        capsys.readouterr()
        code = run_cli(args)
        err = capsys.readouterr().err
        assert code == 0, err[-3000:]
        return err

    return run


@pytest.mark.integration
def test_a_pack_resumed_after_sigterm_computes_what_the_uninterrupted_pack_computes(root_and_tmp,
                                                                                     tune_here) -> None:
    """4 configurations in a pack of 3 (one refill), dropout on, ``comet+`` with local search's window of 1 epoch:
    the study SIGTERMed after its first epoch, then run again, gives each configuration the same per-epoch
    metrics (``metrics.csv`` byte for byte), learning curve, objective and test loss as the same study run
    without a stop; the interrupted trials carry their checkpoint, written where ``--checkpoint-dir`` says (not
    beside the storage), and it is removed once the study is done."""
    root, tmp = root_and_tmp
    gate, extra = "comet+", [*SHORT, "--pack", "3", "--model.perm_epochs=1"]
    whole = f"sqlite:///{tmp / 'whole.db'}"
    tune_here(tune_args(whole, root, tmp / "whole", *extra, trials=4, gate=gate, name=NAME))

    url = f"sqlite:///{tmp / 'cut.db'}"
    args = tune_args(url, root, tmp / "cut", *extra, *SLEEP, "--checkpoint-dir", str(tmp / "node"), trials=4,
                     gate=gate, name=NAME)
    assert sigterm_after_epochs(args, tmp, root, url, 1) == 143
    interrupted = [t for t in trials_of(url, NAME) if t.state == TrialState.FAIL]
    assert interrupted and all(t.user_attrs.get("interrupted") for t in interrupted)
    saved = [t for t in interrupted if "checkpoint" in t.user_attrs]
    assert saved, "no interrupted trial was checkpointed"
    assert not (tmp / "checkpoints").exists()
    folder = tmp / "node" / NAME
    [checkpoint] = folder.glob("*.pt")
    assert Path(saved[0].user_attrs["checkpoint"]) == checkpoint
    content = torch.load(checkpoint, weights_only=True)
    assert all(entry["state"]["progress"]["epochs_run"] >= 1 for entry in content["trials"].values())

    err = tune_here(args)
    assert "warning" not in err, err
    assert_each_config_once(trials_of(url, NAME), 4)
    assert results(url) == results(whole)
    assert logs(tmp / "cut") == logs(tmp / "whole")
    assert not list(folder.glob("*.pt"))


@pytest.mark.integration
def test_trials_that_ended_before_a_stop_are_tested_and_told_on_it(root_and_tmp, tune_here) -> None:
    """A pack tests the trials that ended together, a few epochs later (``PackModule.test_every``): 4 configurations
    of 2 epochs in a pack of 3, SIGTERM once the fourth (the refill) has trained an epoch, while the first three
    wait for their test pass. The stop tests and tells them (complete, not rerun); only the fourth is interrupted,
    and the rerun ends with the results of the study run without a stop."""
    root, tmp = root_and_tmp
    extra = [*SHORT, "--pack", "3"]
    whole = f"sqlite:///{tmp / 'whole.db'}"
    tune_here(tune_args(whole, root, tmp / "whole", *extra, trials=4, name=NAME))
    url = f"sqlite:///{tmp / 'cut.db'}"
    args = tune_args(url, root, tmp / "cut", *extra, *SLEEP, trials=4, name=NAME)
    code, _, _ = interrupt_while_running(
        args, tmp, root, url, NAME, signum=signal.SIGTERM, timeout=300,
        ready=lambda trial: trial.user_attrs.get("config_id") == 3 and len(trial.intermediate_values) >= 1)
    assert code == 143
    states = {t.user_attrs["config_id"]: t.state for t in trials_of(url, NAME)}
    assert states == {0: TrialState.COMPLETE, 1: TrialState.COMPLETE, 2: TrialState.COMPLETE, 3: TrialState.FAIL}
    assert {c: v for c, v in results(url).items()} == {c: v for c, v in results(whole).items() if c != 3}
    tune_here(args)
    assert results(url) == results(whole)


@pytest.mark.integration
def test_a_rerun_without_the_checkpoint_dir_says_where_the_saved_states_are(root_and_tmp, tune_here) -> None:
    """Interrupted with ``--checkpoint-dir``, rerun without it: one warning names the files this tune does not read
    and the flag that would continue them; the study still completes (its trials rerun from their first epoch)."""
    root, tmp = root_and_tmp
    url = f"sqlite:///{tmp / 'cut.db'}"
    args = tune_args(url, root, tmp / "cut", *SHORT, *SLEEP, "--pack", "2", trials=2, name=NAME)
    assert sigterm_after_epochs([*args, "--checkpoint-dir", str(tmp / "node")], tmp, root, url, 1) == 143
    [saved] = (tmp / "node" / NAME).glob("*.pt")
    err = tune_here(args)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(saved) in warnings[0], err
    assert f"pass --checkpoint-dir {tmp / 'node'}" in warnings[0]
    assert_each_config_once(trials_of(url, NAME), 2)


def test_saved_elsewhere_lists_the_existing_files_of_unfinished_configurations(tmp_path: Path) -> None:
    import optuna
    from optuna.distributions import FloatDistribution

    from mtmoe.tuning.checkpoints import saved_elsewhere

    here, there = tmp_path / "here", tmp_path / "there"
    for folder in (here, there):
        folder.mkdir()
        (folder / "host-1.pt").write_bytes(b"")
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")

    def attempt(state, config_id: int, checkpoint: Path | None) -> None:
        attrs = {"config_id": config_id, **({"checkpoint": str(checkpoint)} if checkpoint else {})}
        study.add_trial(optuna.trial.create_trial(state=state, user_attrs=attrs, params={"x": 0.5},
                                                  distributions={"x": FloatDistribution(0, 1)},
                                                  value=1.0 if state == TrialState.COMPLETE else None))

    attempt(TrialState.FAIL, 0, there / "host-1.pt")  # listed: elsewhere, exists, config 0 unfinished
    attempt(TrialState.FAIL, 1, there / "host-1.pt")
    attempt(TrialState.COMPLETE, 1, None)  # config 1 finished since: its file is no loss
    attempt(TrialState.FAIL, 2, here / "host-1.pt")  # in the folder this tune reads
    attempt(TrialState.FAIL, 3, there / "gone.pt")  # on a machine that is gone
    assert saved_elsewhere(study, here) == [there / "host-1.pt"]
    assert saved_elsewhere(study, there) == [here / "host-1.pt"]


@pytest.mark.integration
def test_without_checkpoints_an_interrupted_trial_reruns_from_its_first_epoch(root_and_tmp, tune_here) -> None:
    """``--no-checkpoints``: SIGTERM after the first epoch leaves no checkpoint and no ``checkpoint`` attribute; the
    rerun trains the interrupted trials from their first epoch, to the results of the study run without a stop."""
    root, tmp = root_and_tmp
    extra = [*SHORT, "--pack", "2"]
    whole = f"sqlite:///{tmp / 'whole.db'}"
    tune_here(tune_args(whole, root, tmp / "whole", *extra, trials=2, name=NAME))
    url = f"sqlite:///{tmp / 'cut.db'}"
    args = tune_args(url, root, tmp / "cut", *extra, *SLEEP, "--no-checkpoints", trials=2, name=NAME)
    assert sigterm_after_epochs(args, tmp, root, url, 1) == 143
    interrupted = [t for t in trials_of(url, NAME) if t.state == TrialState.FAIL]
    assert interrupted and not any("checkpoint" in t.user_attrs for t in interrupted)
    assert not (tmp / "checkpoints").exists()
    tune_here(args)
    assert results(url) == results(whole)


@pytest.mark.parametrize("given, value", [("--checkpoint-every", "60"), ("--checkpoint-dir", "node")])
def test_no_checkpoints_and_a_checkpoint_setting_are_refused_together(root_and_tmp, capsys, given: str,
                                                                     value: str) -> None:
    root, tmp = root_and_tmp
    url = f"sqlite:///{tmp / 'refused.db'}"
    code = run_cli(tune_args(url, root, tmp / "runs", "--no-checkpoints", given, value, trials=2, name=NAME))
    err = capsys.readouterr().err
    assert code == 2 and err.strip().startswith(f"error: {given} and --no-checkpoints"), err
    assert not (tmp / "refused.db").exists()


def test_a_checkpoint_dir_that_is_a_file_is_one_line(root_and_tmp, capsys) -> None:
    root, tmp = root_and_tmp
    (tmp / "a-file").write_text("")
    url = f"sqlite:///{tmp / 'refused.db'}"
    code = run_cli(tune_args(url, root, tmp / "runs", "--checkpoint-dir", str(tmp / "a-file" / "x"), trials=2,
                             name=NAME))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: cannot write the checkpoints to {tmp / 'a-file' / 'x'}: ")
    assert "--checkpoint-dir" in err
    assert not (tmp / "refused.db").exists()


IDENTITY = {"space_fingerprint": "abc", "seed": 0, "settings": {"trainer.max_epochs": 2}}


def state(epochs: int) -> dict:
    return {"slot": 0, "tensors": {"w": torch.arange(4.0)[1:3]}, "adam": {}, "best": None,
            "progress": {"epochs_run": epochs, "history": [{"epoch": 0, "train": {"loss": 0.5}}]}}


def test_a_checkpoint_is_resumed_only_by_the_same_settings_and_configuration(tmp_path: Path, capsys) -> None:
    """Written by one worker, read by the next: the same study identity resumes its trials (the furthest trained
    copy of each, a view saved as its own values), and the files read are removed once the reader writes its own;
    other settings, another configuration (structure or hash) or a torn file are ignored with one warning each."""
    writer, older = PackCheckpoints(tmp_path, IDENTITY), PackCheckpoints(tmp_path, IDENTITY)
    older.path = tmp_path / "older.pt"  # another worker's file, one epoch behind for config 3
    writer.keep(lambda: [(3, "structure", "hash3", state(2)), (5, "structure", "hash5", state(1))])
    assert writer.write() == [3, 5] and writer.path.exists()
    older.keep(lambda: [(3, "structure", "hash3", state(1))])
    older.write()

    other = PackCheckpoints(tmp_path, {**IDENTITY, "settings": {"trainer.max_epochs": 3}})
    assert other.saved == {}
    assert capsys.readouterr().err.count("is of other study settings") == 2

    reader = PackCheckpoints(tmp_path, IDENTITY)
    assert capsys.readouterr().err == ""
    assert reader.resume(5, "structure", "other hash") is None
    assert "config_id 5 is of another configuration" in capsys.readouterr().err
    resumed = reader.resume(3, "structure", "hash3")
    assert resumed["progress"]["epochs_run"] == 2 and torch.equal(resumed["tensors"]["w"], torch.tensor([1.0, 2.0]))
    assert reader.resume(3, "structure", "hash3") is None  # resumed once
    reader.path = tmp_path / "reader.pt"
    reader.write()  # nothing left to resume: no file of its own; those read are removed
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    (tmp_path / "torn.pt").write_bytes(b"PK\x03\x04 cut short")
    assert PackCheckpoints(tmp_path, IDENTITY).saved == {}
    assert "checkpoint " + str(tmp_path / "torn.pt") + " cannot be read" in capsys.readouterr().err


def test_checkpoints_live_in_checkpoint_dir_else_beside_a_file_storage_else_in_the_log_folder(tmp_path: Path) -> None:
    assert checkpoint_folder(f"journal:{tmp_path}/s.journal", "ml/comet", tmp_path / "runs") == \
        tmp_path / "checkpoints" / "ml_comet"
    assert checkpoint_folder(f"sqlite:///{tmp_path}/o.db", "x", tmp_path / "runs") == tmp_path / "checkpoints" / "x"
    assert checkpoint_folder("postgresql://u@h/db", "x", tmp_path / "runs") == tmp_path / "runs" / "checkpoints" / "x"
    assert checkpoint_folder("postgresql://u@h/db", "ml/comet", tmp_path / "runs", tmp_path / "node") == \
        tmp_path / "node" / "ml_comet"


def test_no_checkpoints_is_refused_while_an_earlier_tunes_checkpoints_are_kept(root_and_tmp, capsys) -> None:
    """A study's checkpoint folder holds a file that an interrupted ``tune`` wrote: ``--no-checkpoints`` (whose
    trials would rerun from their first epoch, leaving the stale state for a later resume) is refused with one
    error line before the storage is created, and the file is kept; once the folder is deleted it runs."""
    root, tmp = root_and_tmp
    url = f"sqlite:///{tmp / 'refused.db'}"
    folder = checkpoint_folder(url, NAME, tmp / "runs" / NAME)
    folder.mkdir(parents=True)
    written = PackCheckpoints(folder, IDENTITY)
    written.keep(lambda: [(0, "structure", "hash0", state(1))])
    written.write()
    args = tune_args(url, root, tmp / "runs", "--no-checkpoints", *SHORT[1:], "--trainer.max_epochs=1", trials=1,
                     name=NAME)
    code = run_cli(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.splitlines() == [f"error: --no-checkpoints: {folder} holds 1 checkpoint file(s) of trials an earlier "
                                "tune left interrupted; run without --no-checkpoints to continue them from their "
                                "saved epoch, or delete that folder to rerun them from their first epoch"]
    assert not (tmp / "refused.db").exists() and [written.path] == list(folder.glob("*.pt"))

    written.path.unlink()
    assert run_cli(args) == 0
    assert_each_config_once(trials_of(url, NAME), 1)


def test_timeout_claims_no_trial_after_it_and_the_running_ones_finish(tiny_root: Path, tmp_path: Path,
                                                                       capsys) -> None:
    """``tune --timeout 8``: the first pack's trials are claimed at once and held at their first batch until a
    second after the timeout (a file a timer deletes), so when they finish no slot is refilled and ``tune`` ends,
    exit 0, saying what waits; every trial it started finished, none failed. The same command without the timeout
    (the file gone, nothing held) resumes the study to its end."""
    url = f"sqlite:///{tmp_path / 'timeout.db'}"
    hold = tmp_path / "hold"
    hold.touch()
    args = tune_args(url, tiny_root, tmp_path / "runs", *SHORT, *hold_args(hold), "--pack", "2", trials=4, name=NAME)
    capsys.readouterr()
    timer = threading.Timer(9, hold.unlink)
    timer.start()
    try:
        assert run_cli([*args, "--timeout", "8"]) == 0
    finally:
        timer.cancel()
    out = capsys.readouterr().out
    assert f"study {NAME!r}: --timeout reached, no trial claimed since; 2 waiting" in out, out
    trials = trials_of(url, NAME)
    assert sorted(t.state for t in trials if t.state != TrialState.WAITING) == [TrialState.COMPLETE] * 2
    assert run_cli(args) == 0
    assert_each_config_once(trials_of(url, NAME), 4)


@pytest.mark.integration
@pytest.mark.timeout(180)  # without the deadline the in-process tune would wait for the held trials
def test_timeout_stops_waiting_for_other_workers_trials(tiny_root: Path, tmp_path: Path, capsys) -> None:
    """A worker with ``--timeout`` and nothing left to claim, while another worker's trials run (held here until the
    test ends them), stops waiting for them at its deadline: exit 0, saying what runs elsewhere (a job's time limit
    is not overrun by waiting). The other worker then finishes the study alone."""
    url = f"sqlite:///{tmp_path / 'waiting.db'}"
    hold = tmp_path / "hold"
    hold.touch()
    args = tune_args(url, tiny_root, tmp_path / "runs", *SHORT, *hold_args(hold), "--pack", "2", trials=2, name=NAME)
    other = start_tune(args, tmp_path, tiny_root, "other", PYTHONPATH=pythonpath_with_tests())
    try:
        wait_for_running(url, NAME, other, tmp_path, "other",
                         ready=lambda _: sum(t.state == TrialState.RUNNING for t in trials_of(url, NAME)) == 2)
        capsys.readouterr()
        started = time.monotonic()
        assert run_cli([*args, "--timeout", "3"]) == 0
        waited = time.monotonic() - started
        out = capsys.readouterr().out
        assert f"study {NAME!r}: --timeout reached, no trial claimed since; 0 waiting, 2 running in other workers" \
            in out, out
        assert waited < 60, waited  # without the deadline it would wait for the held trials: until the test ends
        assert other.poll() is None  # still held
        hold.unlink()
        assert other.wait(timeout=120) == 0, (tmp_path / "other.err").read_text()[-3000:]
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    assert_each_config_once(trials_of(url, NAME), 2)
