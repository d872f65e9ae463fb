"""``benchmarks/reference_runs.py``: the centre of each search space, and a tiny resumable end-to-end run."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reference_runs.py"
spec = importlib.util.spec_from_file_location("reference_runs", SCRIPT)
reference_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference_runs)


@pytest.mark.parametrize("distribution, expected", [
    (FloatDistribution(5e-5, 5e-4, log=True), 1.6e-4),  # sqrt(2.5e-8) = 1.58e-4, two significant digits
    (FloatDistribution(1e-4, 1e-2, log=True), 1e-3),
    (FloatDistribution(0.0, 1.0), 0.5),
    (IntDistribution(1, 10), 5),
    (IntDistribution(1, 3), 2),
    (CategoricalDistribution([0.1, 0.5, 1, 5, 10]), 1),
    (CategoricalDistribution([1, 5, 10, 50, 100]), 10),
    (CategoricalDistribution([2, 4, 8, 16]), 4),  # even: the lower middle
])
def test_centre_of_each_distribution(distribution, expected) -> None:
    assert reference_runs.centre(distribution) == expected


def test_paper_figures_are_read_as_printed() -> None:
    """The paper's tables (comet-protocol.md §8), a line per gate: a figure the paper does not give is absent."""
    paper = reference_runs.PAPER
    assert paper[("books", 0.1)]["softmax"] == {"loss": "244.47", "n_s": "9.00", "task1": "56.70", "task2": "2.6470"}
    assert paper[("books", 0.1)]["hash+"] == {"loss": "247.33", "n_s": "1.00"}  # trailing figures left out
    assert paper[("jester", 0.9)]["softmax"] == {"n_s": "16.00", "task1": "97.350", "task2": "0.7460"}  # "-"
    assert paper[("digits", None)]["comet+"] == {"loss": "17.08", "n_s": "1.06", "task1": "95.45"}
    assert [len(gates) for gates in paper.values()] == [8, 8, 8, 8, 7, 7, 6, 6, 6, 6]
    assert all(list(gates) == [g for g in reference_runs.PAPER_GATES if g in gates] for gates in paper.values())


def test_books_setting_is_the_study_files() -> None:
    space, params = reference_runs.setting("books", "comet+")
    assert space.fixed["data.batch_size"] == 2048 and space.fixed["model.gate.gamma"] == 0.5  # S1.3: fixed for COMET+
    assert params == {"model.lr": 1.6e-4, "model.gate.entropy_reg": 10, "model.perm_epochs": 5}
    assert reference_runs.setting("books", "dselect")[1]["model.gate.gamma"] == 1


def test_tiny_reference_table_resumes(tiny_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("MTMOE_DATA", str(tiny_root))
    out = tmp_path / "reference"
    argv = ["--data", "movielens-100k", "--gates", "topk,topk+", "--alphas", "0.1", "--epochs", "2", "--out", str(out),
            "--perm-epochs", "1", "--trainer.limit_train_batches=2"]
    reference_runs.main(argv)
    files = sorted(p.name for p in out.glob("*.json"))
    assert len(files) == 2 and files[0].startswith("movielens-100k-topk+-alpha0.1-")
    row = json.loads((out / files[1]).read_text())
    assert row["gate"] == "topk" and row["alpha"] == 0.1
    assert row["setting"]["model.lr"] == 1.6e-4 and row["setting"]["trainer.max_epochs"] == 2
    assert row["epochs_run"] == 2 and row["best_epoch"] in (0, 1) and row["test"]["loss"] > 0
    assert "model.perm_epochs" not in row["setting"]  # --perm-epochs leaves the gate without local search alone
    assert json.loads((out / files[0]).read_text())["setting"]["model.perm_epochs"] == 1
    table = (out / "reference-movielens-100k.md").read_text()
    assert "**movielens-100k, alpha 0.1**" in table and "up to 2 epochs" in table and "positive: ours is worse" in table
    assert table.index("| topk |") < table.index("| topk+ |")
    assert "| watch AUC | rating MSE | paper task 1 | paper task 2 |" in table
    csv_text = (out / "reference-movielens-100k.csv").read_text()
    assert csv_text.startswith("data,gate,alpha,seed,") and csv_text.count("movielens-100k,topk") == 2
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    capsys.readouterr()
    reference_runs.main(argv)  # the same values: nothing trains again
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")} == stamps
    assert "test loss" not in capsys.readouterr().err
    reference_runs.main([*argv[:2], "--gates", "topk", *argv[4:7], "1", *argv[8:]])  # another budget: a new run
    assert len(list(out.glob("*.json"))) == 3
    table = (out / "reference-movielens-100k.md").read_text()
    assert "up to 1 epoch," in table and "| topk+ |" not in table  # the table is this command's runs


def test_perm_epochs_outside_the_searched_range_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        reference_runs.main(["--data", "books", "--gates", "comet+", "--epochs", "3", "--perm-epochs", "11"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--perm-epochs 11" in err and "[1, 10]" in err and len(err.splitlines()) == 1


def test_unknown_gate_exits_2_with_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        reference_runs.main(["--data", "books", "--gates", "nonsense"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "nonsense" in err and len(err.splitlines()) == 1
