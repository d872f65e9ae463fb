"""What a run writes (issue 14: 2, 3; issue 15: 1, 8, 10, 11): ``best.ckpt`` reproduces the fit's test results,
val and test are of the same weights, ``--ckpt_path`` and the flags agree or the command stops, every run gets a
folder of its own, and a damaged or half-written checkpoint is one ``error:`` line, never a truncated file."""
from __future__ import annotations

import csv
import json
import signal
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from conftest import full_disk_for, run_cli
from mtmoe.errors import UsageError
from test_tuning import start_tune

FAST = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--data.batch_size=64"]
#: Three epochs at a learning rate this tiny dataset punishes: the best validation epoch is not the last.
OVERSHOOTING = ["--trainer.max_epochs=3", "--model.lr=3e-3"]
CHECKPOINTS = Path("runs") / "lightning_logs" / "version_0" / "checkpoints"  # where README says they are


def data(root: Path) -> list[str]:
    return ["--data", "movielens-100k", f"--data.root={root}", *FAST]


def results(name: str = "lightning_logs") -> dict:
    [path] = (Path("runs") / name).rglob("results.json")
    return json.loads(path.read_text())


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, lines
    return lines[0]


# ---------------------------------------------------- 14.2: the checkpoint README names reproduces the fit


def test_test_on_best_ckpt_reproduces_the_fits_test_results(tiny_root: Path) -> None:
    assert run_cli(["fit", "--gate", "topk", *data(tiny_root), *OVERSHOOTING]) == 0
    fitted = results()
    assert fitted["best_epoch"] < fitted["epochs_run"] - 1  # the last epoch is not the best one
    assert fitted["checkpoints"] == {"best": str(CHECKPOINTS / "best.ckpt"), "last": str(CHECKPOINTS / "last.ckpt")}
    assert torch.load(CHECKPOINTS / "best.ckpt", weights_only=True)["epoch"] == fitted["best_epoch"]
    assert torch.load(CHECKPOINTS / "last.ckpt", weights_only=True)["epoch"] == fitted["epochs_run"] - 1
    for command, split in (("test", "test"), ("validate", "val")):
        name = f"{command}_best"
        assert run_cli([command, *data(tiny_root), f"--ckpt_path={CHECKPOINTS / 'best.ckpt'}",
                        f"--trainer.logger.init_args.name={name}"]) == 0
        evaluated = results(name)
        assert evaluated[split]["loss"] == fitted[split]["loss"]
        # selection_changed compares a fit's validation with its previous epoch's: one evaluation has none
        assert evaluated[split] == {key: value for key, value in fitted[split].items()
                                    if not key.endswith("/selection_changed")}
        assert evaluated["checkpoint_epoch"] == fitted["best_epoch"]
        assert not list((Path("runs") / name).rglob("*.ckpt"))  # evaluating writes no checkpoint


def test_load_from_checkpoint_rebuilds_the_fitted_model(tiny_root: Path) -> None:
    """Lightning's route, ``MultiTaskMoE.load_from_checkpoint(path, info=...)`` (issue 34): the module of a "+"
    fit's best.ckpt, its weights, permutation and engine state, tests as the fit did; so does a checkpoint of
    before the settings object, whose hyperparameters carry Lightning's ``_instantiator``."""
    import lightning.pytorch as pl

    from mtmoe.data.movielens import MovieLens100KDataModule
    from mtmoe.lit.module import MultiTaskMoE

    assert run_cli(["fit", "--gate", "topk+", "--model.perm_epochs=1", *data(tiny_root), *OVERSHOOTING]) == 0
    fitted, best = results(), CHECKPOINTS / "best.ckpt"
    older = torch.load(best, weights_only=True)
    older["hyper_parameters"]["_instantiator"] = "lightning.pytorch.cli.instantiate_module"
    torch.save(older, "older.ckpt")
    datamodule = MovieLens100KDataModule(root=tiny_root, batch_size=64)
    for path in (best, "older.ckpt"):
        model = MultiTaskMoE.load_from_checkpoint(path, info=datamodule.info)
        assert model.net.local_search.assignment() == fitted["permutation"]["assignment"]
        pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False).test(model, datamodule)
        assert model.last_results["test"] == fitted["test"], path
    older["hyper_parameters"]["banana"] = 1
    torch.save(older, "newer.ckpt")
    with pytest.raises(UsageError, match="unknown model settings banana"):
        MultiTaskMoE.load_from_checkpoint("newer.ckpt", info=datamodule.info)
    torch.save({"state_dict": older["state_dict"]}, "bare.ckpt")
    with pytest.raises(UsageError, match="bare.ckpt holds no model settings"):
        MultiTaskMoE.load_from_checkpoint("bare.ckpt", info=datamodule.info)


# -------------------------------------------------------------- 14.3: val and test of the same weights


def test_fits_val_and_test_are_of_the_best_epochs_weights(tiny_root: Path, capsys) -> None:
    assert run_cli(["fit", "--gate", "topk", *data(tiny_root), *OVERSHOOTING]) == 0
    fitted = results()
    best = fitted["best_epoch"]
    assert best < fitted["epochs_run"] - 1
    assert fitted["val"]["loss"] == pytest.approx(fitted["best_val_loss"], rel=1e-6)  # not the last epoch's
    header = capsys.readouterr().out.splitlines()[0]
    assert header == f"topk on movielens-100k: val and test of epoch {best}'s weights, the best val/loss of the 3 " \
                     "epochs run"


# ------------------------------------------------------------------ 15.1: flags against the checkpoint


def test_flags_that_disagree_with_the_checkpoint_stop_the_command(tiny_root: Path, capsys) -> None:
    assert run_cli(["fit", "--gate", "topk", *data(tiny_root), "--model.n_experts=4", "--trainer.max_epochs=1"]) == 0
    checkpoint = CHECKPOINTS / "best.ckpt"
    capsys.readouterr()
    for command, flags, expected in [
        ("test", ["--gate", "comet"], "--gate comet (the checkpoint holds topk)"),
        ("test", ["--gate", "topk+"], "--gate topk+ (the checkpoint holds topk)"),
        ("test", ["--model.n_experts=8"], "--model.n_experts 8 (the checkpoint has 4)"),
        ("validate", ["--gate", "topk", "--model.gate.k=3"], "--model.gate.k 3 (the checkpoint has 2)"),
        ("fit", ["--gate", "hash"], "--gate hash (the checkpoint holds topk)"),
        ("test", ["--model.n_experts=16", "--model.lr=1e-3"], "--model.lr 0.001 (the checkpoint has 0.0001); "
                                                               "--model.n_experts 16 (the checkpoint has 4)"),
    ]:
        assert run_cli([command, *data(tiny_root), f"--ckpt_path={checkpoint}", *flags]) == 2, flags
        line = one_error_line(capsys)
        assert line.startswith(f"error: {expected}: the checkpoint {checkpoint} decides the model"), line
    assert run_cli(["test", "--data", "movielens", f"--data.root={tiny_root}", f"--ckpt_path={checkpoint}"]) == 2
    assert one_error_line(capsys) == f"error: --data movielens disagrees with the checkpoint {checkpoint}, trained " \
                                     "on movielens-100k"
    assert [p.name for p in Path("runs").iterdir()] == ["lightning_logs"]
    assert len(list(Path("runs/lightning_logs").iterdir())) == 1  # nothing written by the refused commands

    for name, flags in (("absent", []), ("agreeing", ["--gate", "topk", "--model.n_experts=4", "--model.gate.k=2"])):
        assert run_cli(["test", *data(tiny_root), f"--ckpt_path={checkpoint}", *flags,
                        f"--trainer.logger.init_args.name={name}"]) == 0
        assert results(name)["gate"] == "topk" and len(results(name)["test"]["watch/utilisation"]) == 4


# ---------------------------------------------------------------- 15.10: damaged and missing checkpoints


def test_lightning_cli_parses_ckpt_path_between_its_hooks() -> None:
    """mtmoe.run overrides LightningCLI's private ``_parse_ckpt_path`` (no public hook is around it): it must still
    exist, take no argument and be called after ``parse_arguments`` and before ``before_instantiate_classes``."""
    import inspect

    from lightning.pytorch.cli import LightningCLI

    assert list(inspect.signature(LightningCLI._parse_ckpt_path).parameters) == ["self"]
    source = inspect.getsource(LightningCLI.__init__)
    calls = [source.find(call) for call in ("self.parse_arguments(", "self._parse_ckpt_path()",
                                            "self.before_instantiate_classes()")]
    assert -1 not in calls and calls == sorted(calls), "LightningCLI.__init__ no longer calls _parse_ckpt_path " \
        "between parse_arguments and before_instantiate_classes: revisit MTMoECLI._parse_ckpt_path"


def test_a_damaged_or_missing_checkpoint_is_one_error_line(tiny_root: Path, capsys) -> None:
    assert run_cli(["fit", "--gate", "topk", *data(tiny_root), "--trainer.max_epochs=1"]) == 0
    content = (CHECKPOINTS / "best.ckpt").read_bytes()
    damaged = {"garbage": b"not a checkpoint\n" * 50, "empty": b"", "truncated": content[: len(content) // 2]}
    for damage, payload in damaged.items():
        Path(f"{damage}.ckpt").write_bytes(payload)
    torch.save({"a": torch.zeros(2)}, "foreign.ckpt")
    capsys.readouterr()
    for name, expected in [(f"{damage}.ckpt", "is not a complete checkpoint (empty, truncated, or another kind of "
                            "file)") for damage in damaged] + [("foreign.ckpt", "is not a checkpoint of python -m "
                                                                "mtmoe fit"), ("missing.ckpt", "no checkpoint file")]:
        for command in ("test", "fit"):
            assert run_cli([command, *data(tiny_root), f"--ckpt_path={name}"]) == 2
            assert expected in one_error_line(capsys)
    assert len(list(Path("runs/lightning_logs").iterdir())) == 1


# ------------------------------------------------------------------- 15.8: a folder of its own per run


def test_runs_started_together_get_folders_of_their_own(tmp_path: Path, monkeypatch) -> None:
    """Two loggers that both list the folder before either creates one (as two runs started at the same moment
    do): Lightning's CSVLogger gives both version_0; each RunLogger claims its folder by creating it."""
    from mtmoe.lit.outputs import RunLogger

    monkeypatch.setattr(CSVLogger, "_get_next_version", lambda self: 0)  # what a listing before either run says
    first, second = RunLogger(tmp_path), RunLogger(tmp_path)
    assert (first.version, second.version) == (0, 1)
    assert first.claimed == tmp_path / "lightning_logs" / "version_0" and first.claimed.is_dir()
    assert second.log_dir == str(tmp_path / "lightning_logs" / "version_1")


# ------------------------------------------------------------------- 15.11: checkpoints written atomically


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_checkpoint_written_to_a_full_disk_leaves_the_previous_one(tmp_path: Path, monkeypatch) -> None:
    from mtmoe.lit.outputs import AtomicCheckpointIO

    target = tmp_path / "best.ckpt"
    AtomicCheckpointIO().save_checkpoint({"epoch": 0, "weights": torch.ones(1000)}, target)
    full_disk_for("best.ckpt.", monkeypatch)
    with pytest.raises(UsageError, match=f"cannot write the checkpoint {target} \\(No space left on device\\)"):
        AtomicCheckpointIO().save_checkpoint({"epoch": 1, "weights": torch.zeros(1000)}, target)
    assert torch.load(target, weights_only=True)["epoch"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["best.ckpt"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_fit_on_a_full_disk_is_one_error_line_and_leaves_no_run(tiny_root: Path, monkeypatch, capsys) -> None:
    full_disk_for(("best.ckpt.", "last.ckpt."), monkeypatch)
    assert run_cli(["fit", "--gate", "topk", *data(tiny_root), "--trainer.max_epochs=1"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: cannot write the checkpoint {CHECKPOINTS / 'best.ckpt'} (No space left on "
                           "device): free some space there")
    assert not Path("runs").exists()


# ------------------------------------------------------------------------------------- 22.3: SIGTERM, as Ctrl-C


def stop_when(args: list[str], tmp: Path, root: Path, log: str, path: Path, timeout: float = 240,
              signum: int = signal.SIGTERM) -> tuple[int, str]:
    """Start ``python -m mtmoe ARGS``, send it ``signum`` once ``path`` exists: its exit code and stderr's last
    line."""
    proc = start_tune(args, tmp, root, log)
    deadline = time.monotonic() + timeout
    try:
        while not path.exists():
            assert proc.poll() is None, f"it ended ({proc.returncode}) before {path} appeared"
            assert time.monotonic() < deadline, f"no {path}"
            time.sleep(0.1)
        proc.send_signal(signum)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, (tmp / f"{log}.err").read_text().strip().splitlines()[-1]


@pytest.mark.integration
def test_sigterm_stops_a_fit_which_resumes_from_its_last_checkpoint(root_and_tmp) -> None:
    """Before: a fit sent SIGTERM (a scheduler's stop) exited 0, leaving a run folder with only config.yaml. Now,
    as Ctrl-C: exit 143 and one line; stopped before an epoch ended, no folder is left; stopped later, the folder
    keeps the ended epochs' checkpoints and log (no results), and the command the line gives resumes from
    last.ckpt: the remaining epochs, not the first again."""
    root, tmp = root_and_tmp
    args = ["fit", "--gate", "topk", *data(root), "--data.batch_size=8", "--trainer.limit_train_batches=30",
            "--trainer.max_epochs=4"]
    folder = tmp / "runs" / "lightning_logs" / "version_0"

    code, line = stop_when(args, tmp, root, "early", folder / "config.yaml")
    assert code == 143 and line == "error: interrupted (SIGTERM); no epoch ended, nothing was kept: run the same " \
                                   "command again", line
    assert not (tmp / "runs").exists()

    code, line = stop_when(args, tmp, root, "late", folder / "checkpoints" / "last.ckpt")
    last = folder / "checkpoints" / "last.ckpt"
    assert code == 143 and line == f"error: interrupted (SIGTERM); to resume, run the same command with " \
                                   f"--ckpt_path {last.relative_to(tmp)}", line
    assert sorted(p.name for p in folder.rglob("*")) == ["best.ckpt", "checkpoints", "config.yaml", "last.ckpt",
                                                         "metrics.csv"]
    ended = torch.load(last, weights_only=True)["epoch"]  # the last epoch that ended before the stop
    assert val_epochs(folder) == list(range(ended + 1))

    assert run_cli([*args, f"--ckpt_path={last}"]) == 0
    resumed = tmp / "runs" / "lightning_logs" / "version_1"
    assert json.loads((resumed / "results.json").read_text())["epochs_run"] == 4
    assert val_epochs(resumed) == list(range(ended + 1, 4))  # the remaining epochs, not the first again


@pytest.mark.integration
def test_ctrl_c_in_a_fit_is_one_line(root_and_tmp) -> None:
    """Before: Ctrl-C in a fit's epoch printed Lightning's "Detected KeyboardInterrupt, attempting graceful shutdown
    ..." above the ``error: interrupted`` line. Now only that line, exit 130."""
    root, tmp = root_and_tmp
    args = ["fit", "--gate", "topk", *data(root), "--data.batch_size=8", "--trainer.limit_train_batches=30",
            "--trainer.max_epochs=4", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    last = tmp / "runs" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    code, line = stop_when(args, tmp, root, "ctrl-c", last, signum=signal.SIGINT)
    assert code == 130 and line.startswith("error: interrupted (Ctrl-C); to resume, run the same command with "), line
    assert (tmp / "ctrl-c.err").read_text().strip().splitlines() == [line]


def val_epochs(folder: Path) -> list[int]:
    """The epochs a run's ``metrics.csv`` holds a validation loss of."""
    with open(folder / "metrics.csv") as handle:
        return [int(row["epoch"]) for row in csv.DictReader(handle) if row.get("val/loss")]
