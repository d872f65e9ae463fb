"""TensorBoard (issue 22, item 7): the optional ``tensorboard`` extra gets the CSV log's scalars, and its absence is
one line naming the extra."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_cli

FIT = ["fit", "--gate", "comet+", "--model.perm_epochs=1", "--data", "movielens-100k", "--data.batch_size=64",
       "--trainer.max_epochs=2", "--trainer.limit_train_batches=5", "--trainer.enable_progress_bar=false"]
TENSORBOARD = "lightning.pytorch.loggers.TensorBoardLogger"


def test_tensorboard_logs_the_scalars_of_the_csv_log(tiny_root: Path, tmp_path: Path) -> None:
    """One fit with both loggers: every CSV column but ``step`` (TensorBoard's x axis) is a scalar tag, with the same
    values at the same steps (train, val, test, local search's ``perm/*`` and ``epoch``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loggers = (f'[{{"class_path": "mtmoe.lit.outputs.RunLogger", "init_args": {{"save_dir": "runs"}}}}, '
               f'{{"class_path": "{TENSORBOARD}", "init_args": {{"save_dir": "runs", "name": "tb"}}}}]')
    assert run_cli([*FIT, f"--data.root={tiny_root}", "--trainer.logger", loggers]) == 0
    with open(tmp_path / "runs" / "lightning_logs" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    events = EventAccumulator(str(tmp_path / "runs" / "tb" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"test/loss", "val/loss", "train/loss", "perm/moved_experts", "epoch"} <= set(tags)
    final = {tag for tag in tags if tag.startswith("hparams/")}  # the HPARAMS tab's metrics
    assert set(tags) - final == set(rows[0]) - {"step"}
    for tag in set(tags) - final:
        logged = [(int(row["step"]), pytest.approx(float(row[tag]), rel=1e-6)) for row in rows if row[tag] != ""]
        assert [(event.step, event.value) for event in events.Scalars(tag)] == logged, tag


def test_tensorboard_hparams_hold_the_settings_and_the_final_results(tiny_root: Path, tmp_path: Path) -> None:
    """Before: hparams.yaml was empty and the HPARAMS tab showed nothing. Now the run's settings are its hparams (in
    hparams.yaml, the CSV log's too) and its final validation and test results (results.json's) the tab's metrics."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    loggers = (f'[{{"class_path": "mtmoe.lit.outputs.RunLogger", "init_args": {{"save_dir": "runs"}}}}, '
               f'{{"class_path": "{TENSORBOARD}", "init_args": {{"save_dir": "runs", "name": "tb"}}}}]')
    assert run_cli([*FIT, f"--data.root={tiny_root}", "--trainer.logger", loggers]) == 0
    results = json.loads((tmp_path / "runs" / "lightning_logs" / "version_0" / "results.json").read_text())
    for folder in (tmp_path / "runs" / "tb" / "version_0", tmp_path / "runs" / "lightning_logs" / "version_0"):
        hparams = yaml.safe_load((folder / "hparams.yaml").read_text())
        assert (hparams["gate"], hparams["dataset"]) == ("comet+", "movielens-100k")
        assert hparams["model"]["perm_epochs"] == 1 and hparams["trainer"]["max_epochs"] == 2
        assert hparams["data"]["init_args"]["root"] == str(tiny_root)
    events = EventAccumulator(str(tmp_path / "runs" / "tb" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    for split in ("val", "test"):
        for key, value in results[split].items():
            if isinstance(value, float):
                (event,) = events.Scalars(f"hparams/{split}/{key}")
                assert event.value == pytest.approx(value, rel=1e-6), (split, key)
    content = events.PluginTagToContent("hparams")["_hparams_/experiment"]
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content).experiment
    shown = {info.name.tag for info in experiment.metric_infos}
    assert {"hparams/val/loss", "hparams/test/loss"} <= shown
    assert {"gate", "dataset", "model/lr"} <= {info.name for info in experiment.hparam_infos}


@pytest.mark.integration
def test_without_tensorboard_one_line_names_the_extra(tiny_root: Path, tmp_path: Path) -> None:
    """tensorboard made unimportable (``sys.modules`` entry ``None``: an ImportError for Python, as if not installed);
    before, the fit trained and failed at its first logged scalar in a long traceback."""
    code = f"import sys; sys.modules['tensorboard'] = None; from mtmoe.cli import main; main({FIT!r} + sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, f"--data.root={tiny_root}", "--trainer.logger", TENSORBOARD],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --trainer.logger TensorBoardLogger needs the tensorboard package, which is not installed: "
        "pip install 'mtmoe[tensorboard]'")
    assert not (tmp_path / "runs").exists()  # nothing written
