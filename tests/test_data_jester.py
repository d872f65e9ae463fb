"""Jester dataset 1: the three .xls sheets, every user-joke pair a record, the explicit mask (0.0 is a rating), the
rating scale, the 70/15/15 split, cache and errors (comet-protocol.md §5.1), on tiny sheets in the official format."""
from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mtmoe.data import JesterDataModule, download, jester
from mtmoe.data.jester import read_jester, read_jester_sheet
from mtmoe.errors import UsageError

from conftest import run_cli
from recsys_fixtures import jester_matrices, write_jester, write_jester_sheet

N_USERS = 6 + 5 + 7


@pytest.fixture
def matrices() -> list[np.ndarray]:
    return jester_matrices()


@pytest.fixture
def root(tmp_path: Path, matrices: list[np.ndarray]) -> Path:
    write_jester(tmp_path / "data", matrices)
    return tmp_path / "data"


def module(root: Path, **kwargs) -> JesterDataModule:
    return JesterDataModule(root=str(root), cache_dir=str(root.parent / "cache"), download=False, **kwargs)


def concat(splits: dict[str, dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    return {key: torch.cat([splits[s][key] for s in ("train", "val", "test")]).numpy() for key in splits["train"]}


def test_read_sheets_in_file_order(root: Path, matrices: list[np.ndarray]) -> None:
    ratings = read_jester(sorted((root / "jester").iterdir()))
    expected = np.concatenate(matrices)
    np.testing.assert_array_equal(ratings.rated, expected != 99)
    np.testing.assert_allclose(ratings.rating, np.where(expected != 99, expected, 0), atol=1e-6)
    assert ratings.rating.dtype == np.float32 and ratings.rated[0, 0] and ratings.rating[0, 0] == 0.0


def test_every_pair_a_record_with_an_explicit_mask(root: Path, matrices: list[np.ndarray]) -> None:
    rows = concat(module(root, rating_scale="raw").load_splits())
    expected = np.concatenate(matrices)
    assert len(rows["user"]) == N_USERS * 100
    keys = rows["user"].astype(np.int64) * 100 + rows["item"]
    assert sorted(keys.tolist()) == list(range(N_USERS * 100))  # each pair exactly once
    raw = expected[rows["user"], rows["item"]]
    np.testing.assert_array_equal(rows["rating_mask"], raw != 99)
    np.testing.assert_array_equal(rows["rated"], (raw != 99).astype(np.float32))
    np.testing.assert_allclose(rows["rating"], np.where(raw != 99, raw, 0), atol=1e-6)
    genuine_zero = (rows["user"] == 0) & (rows["item"] == 0)
    assert rows["rating_mask"][genuine_zero].all() and rows["rating"][genuine_zero] == 0.0  # kept in the MSE
    np.testing.assert_array_equal(rows["sample_id"], rows["user"])


def test_split_sizes_stratification_and_dtypes(root: Path) -> None:
    splits = module(root).load_splits()
    total = N_USERS * 100
    holdout = -(-3 * total // 10)
    assert [len(splits[s]["user"]) for s in ("train", "val", "test")] == [total - holdout, holdout // 2,
                                                                          holdout - holdout // 2]
    overall = concat(splits)["rated"].mean()
    for tensors in splits.values():
        assert tensors["user"].dtype == tensors["item"].dtype == tensors["sample_id"].dtype == torch.int32
        assert tensors["rated"].dtype == tensors["rating"].dtype == torch.float32
        assert tensors["rating_mask"].dtype == torch.bool
        assert abs(tensors["rated"].mean().item() - overall) <= 1 / len(tensors["rated"])


def test_zscore_uses_training_statistics(root: Path) -> None:
    raw_module, scaled_module = module(root, rating_scale="raw"), module(root)
    raw, scaled = raw_module.load_splits(), scaled_module.load_splits()
    train = raw["train"]["rating"][raw["train"]["rating_mask"]].double().numpy()
    assert scaled_module.rating_mean == pytest.approx(train.mean()) and scaled_module.rating_std == pytest.approx(
        train.std())
    assert raw_module.rating_mean is None
    for split in raw:
        mask = raw[split]["rating_mask"]
        expected = (raw[split]["rating"][mask].double() - train.mean()) / train.std()
        torch.testing.assert_close(scaled[split]["rating"][mask].double(), expected, rtol=0, atol=1e-5)
        assert (scaled[split]["rating"][~mask] == 0).all()
        for key in raw[split]:
            if key != "rating":
                assert torch.equal(raw[split][key], scaled[split][key])
    z = scaled["train"]["rating"][scaled["train"]["rating_mask"]].double()
    assert abs(z.mean().item()) < 1e-5 and z.std(correction=0).item() == pytest.approx(1.0, abs=1e-5)
    assert len(list((root.parent / "cache").glob("*.pt"))) == 1  # the scale is applied after the (raw) cache


def test_cache_written_reused_and_atomic(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = module(root).load_splits()
    [cached] = list((root.parent / "cache").glob("*.pt"))
    assert cached.name.startswith("jester-") and cached.name.endswith("-seed0-stratified-v1.pt")

    def no_reading(paths: list[Path]) -> None:
        raise AssertionError("the raw files were parsed again")

    monkeypatch.setattr(jester, "read_jester", no_reading)
    second = module(root).load_splits()
    for split in first:
        for key in first[split]:
            assert torch.equal(first[split][key], second[split][key])
    assert not any(".tmp" in p.name for p in (root.parent / "cache").iterdir())


def test_info_is_the_papers_architecture(tmp_path: Path) -> None:
    info = JesterDataModule(root=str(tmp_path / "absent"), download=False).info
    assert (info.name, info.n_users, info.n_items, info.n_ids) == ("jester", 73_421, 100, 73_421)
    assert [(t.name, t.kind, t.masked) for t in info.tasks] == [("rated", "binary", False),
                                                                 ("rating", "regression", True)]
    assert (info.n_experts, info.k, info.embedding_dim, info.expert_units, info.tower_units) == (16, 2, 64, 128, 256)
    assert JesterDataModule(download=False).batch_size == 2048
    with pytest.raises(UsageError, match="rating_scale must be zscore or raw"):
        JesterDataModule(rating_scale="minmax")


@pytest.mark.parametrize(
    "row, column, value, where",
    [(2, 5, 12.5, "row 3, column 6 holds 12.5"), (0, 100, -10.01, "row 1, column 101"),
     (1, 0, 101, "row 2, column 1 holds 101"), (3, 7, "x", "row 4, column 8 holds 'x'")],
)
def test_malformed_cell(tmp_path: Path, row: int, column: int, value: object, where: str) -> None:
    ratings = jester_matrices()[0]
    cells = np.column_stack([(ratings != 99).sum(axis=1), ratings]).astype(object)
    cells[row, column] = value
    path = write_jester_sheet(tmp_path / "jester-data-1.xls", cells[:, 1:], count=cells[:, 0])
    with pytest.raises(UsageError) as error:
        read_jester_sheet(path)
    message = str(error.value)
    assert str(path) in message and where in message and "\n" not in message


def test_not_a_jester_sheet(tmp_path: Path) -> None:
    path = write_jester_sheet(tmp_path / "narrow.xls", np.zeros((3, 99)))
    with pytest.raises(UsageError, match="3 rows of 100 columns, expected rows of 101"):
        read_jester_sheet(path)
    (tmp_path / "text.xls").write_text("not a spreadsheet")
    with pytest.raises(UsageError, match="not a readable .xls sheet"):
        read_jester_sheet(tmp_path / "text.xls")


def test_more_users_than_dataset_1(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jester, "N_USERS", N_USERS - 1)
    with pytest.raises(UsageError, match=f"hold {N_USERS} users, more than Jester dataset 1's {N_USERS - 1}"):
        module(root).load_splits()


def test_missing_files_offline_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys,
                                               matrices: list[np.ndarray]) -> None:
    monkeypatch.chdir(tmp_path)
    write_jester_sheet(tmp_path / "jester" / "jester-data-2.xls", matrices[1])  # one of three present
    code = run_cli(["fit", "--gate", "topk", "--data", "jester", f"--data.root={tmp_path}",
                    "--data.download=false", f"--data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    for i in (1, 3):
        assert str(tmp_path / "jester" / f"jester-data-{i}.xls") in err and f"jester_dataset_1_{i}.zip" in err
    assert "jester-data-2.xls" not in err and f"unzip it into {tmp_path / 'jester'}" in err
    assert not (tmp_path / "cache").exists()


def test_download_unpacks_into_the_jester_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 matrices: list[np.ndarray]) -> None:
    """``"unpack_into": "jester"``: the official zips hold the bare .xls, which must land in ``<root>/jester``."""
    sheet = write_jester_sheet(tmp_path / "source" / "jester-data-1.xls", matrices[0])
    archive = tmp_path / "jester_dataset_1_1.zip"
    with zipfile.ZipFile(archive, "w") as handle:
        handle.write(sheet, "jester-data-1.xls")
    entry = {"url": archive.as_uri(), "sha256": hashlib.sha256(archive.read_bytes()).hexdigest(),
             "unpack_into": "jester", "files": {"jester/jester-data-1.xls": {}}}
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"jester-1-1": entry}))
    monkeypatch.setattr(download, "MANIFEST", manifest)
    root = tmp_path / "root"
    path = download.ensure_files(root, "jester-1-1", download=True)
    assert path == root / "jester" / "jester-data-1.xls" and path.read_bytes() == sheet.read_bytes()
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == ["jester", "jester/jester-data-1.xls"]
    shutil.rmtree(root)
    with pytest.raises(UsageError, match=f"unzip it into {root / 'jester'}"):
        download.ensure_files(root, "jester-1-1", download=False)
