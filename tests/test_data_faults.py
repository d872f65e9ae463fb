"""Faulty data files and caches (issue 15): a truncated or modified raw file, a resumed run's batch order, a corrupt
or unwritable prepared-data cache, orphaned temporary files, a corrupt ``.gz``. Bad input is one ``error:`` line and
exit code 2 with nothing half-written; a broken cache is one ``warning:`` line and is rebuilt."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import full_disk_for, run_cli
from image_fixtures import write_mnist
from mtmoe.data import MovieLens100KDataModule, download
from mtmoe.data.multimnist import MultiMNISTDataModule
from mtmoe.errors import UsageError
from mtmoe.files import atomic_path

FAST = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--data.batch_size=64"]
U_DATA = Path("ml-100k") / "u.data"


def fit(root: Path, *extra: str, data: str = "movielens-100k") -> list[str]:
    return ["fit", "--gate", "topk", "--data", data, f"--data.root={root}", "--trainer.max_epochs=1", *FAST, *extra]


def one_line(capsys: pytest.CaptureFixture, prefix: str) -> str:
    """The single line of stderr, which starts with ``prefix``."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    return lines[0]


def written_nothing(tmp_path: Path) -> bool:
    return not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("*.tmp")) and not list(
        tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("results.json"))


# ------------------------------------------------------------------------- 15.2: raw files against the manifest


def test_a_file_of_another_size_than_the_manifests_is_one_error_line(tiny_root: Path, capsys) -> None:
    """The tiny fixture stands for a truncated u.data: refused by default, used with --data.verify false."""
    assert run_cli(fit(tiny_root, "--data.verify=true")) == 2
    line = one_line(capsys, "error: ")
    size = (tiny_root / U_DATA).stat().st_size
    assert f"{tiny_root / U_DATA} has {size:,} bytes where the official file has 1,979,173" in line
    assert "--data.download true" in line and "--data.verify false" in line
    assert written_nothing(tiny_root.parent)
    assert run_cli(fit(tiny_root, "--data.verify=false")) == 0


def test_a_file_of_the_right_size_and_other_content_is_refused(tmp_path: Path) -> None:
    (tmp_path / U_DATA).parent.mkdir(parents=True)
    (tmp_path / U_DATA).write_bytes(b"1\t1\t5\t881250949\n".ljust(1_979_173, b" "))
    data = MovieLens100KDataModule(root=str(tmp_path), cache_dir=str(tmp_path / "cache"), download=False, verify=True)
    with pytest.raises(UsageError, match=r"u\.data is not the official file \(sha256 [0-9a-f]{64}, expected 06416e"):
        data.load_splits()
    assert not list((tmp_path / "cache").glob("*.pt"))


def test_the_sha256_is_computed_once_and_remembered(tiny_root: Path, monkeypatch, capsys) -> None:
    path = tiny_root / U_DATA
    entry = {"url": "file:///nowhere.zip", "md5": "0" * 32,
             "files": {"ml-100k/u.data": {"size": path.stat().st_size, "sha256": download.sha256_file(path)}}}
    monkeypatch.setattr(download, "manifest_entry", lambda name: entry)
    hashed, sha256_file = [], download.sha256_file
    monkeypatch.setattr(download, "sha256_file", lambda file: hashed.append(file) or sha256_file(file))

    def load() -> None:
        MovieLens100KDataModule(root=str(tiny_root), download=False, verify=True).load_splits()

    load()
    assert hashed == [path]
    load()
    assert hashed == [path]  # the second run reads no raw byte to verify it or to name its cache
    record = Path(os.environ["MTMOE_CACHE"]) / "raw-sha256.json"
    record.write_text("{not json")
    load()
    assert hashed == [path, path]
    assert one_line(capsys, "warning: ").startswith(f"warning: ignoring the unreadable {record}")
    path.write_bytes(path.read_bytes().replace(b"\t5\t", b"\t4\t", 1))  # same size, other content
    with pytest.raises(UsageError, match="is not the official file"):
        load()
    assert hashed == [path, path, path]


def test_mtmoe_verify_is_the_default_of_the_flag(tiny_root: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MTMOE_VERIFY", "true")
    assert run_cli(fit(tiny_root)) == 2 and "bytes where the official file has" in one_line(capsys, "error: ")
    monkeypatch.setenv("MTMOE_VERIFY", "perhaps")
    assert run_cli(fit(tiny_root)) == 2
    assert one_line(capsys, "error: ") == "error: MTMOE_VERIFY must be true or false, got 'perhaps'"


# ------------------------------------------------------------------------------- 15.3: resuming the batch order


def test_a_resumed_run_ends_as_the_uninterrupted_one(tiny_root: Path) -> None:
    """Two epochs, then two more resumed from ``last.ckpt``, equal four uninterrupted epochs: the batch order and,
    with dropout on, the global random states resume; the resumed run's ``best.ckpt`` is the whole run's best.
    Each epoch trains the first 4 of its shuffled batches (the order differs by epoch: a resume that lost it would
    train other rows)."""
    common = fit(tiny_root, "--model.lr=3e-3", "--trainer.limit_train_batches=4")
    runs = {}
    for name, epochs, resume in (("whole", 4, []), ("first", 2, []), ("resumed", 4, ["first"])):
        ckpt = [f"--ckpt_path={runs[r][1] / 'last.ckpt'}" for r in resume]
        assert run_cli([*common, f"--trainer.max_epochs={epochs}", f"--trainer.logger.init_args.name={name}",
                        *ckpt]) == 0
        folder = next((Path("runs") / name).glob("version_*"))
        runs[name] = json.loads((folder / "results.json").read_text()), folder / "checkpoints"
    whole, resumed = runs["whole"], runs["resumed"]
    assert resumed[0]["epochs_run"] == 4 and resumed[0]["best_epoch"] == whole[0]["best_epoch"]
    assert resumed[0]["val"]["loss"] == pytest.approx(whole[0]["val"]["loss"], rel=1e-6)
    assert resumed[0]["test"]["loss"] == pytest.approx(whole[0]["test"]["loss"], rel=1e-6)
    for checkpoint in ("last.ckpt", "best.ckpt"):
        saved = [torch.load(run[1] / checkpoint, weights_only=True) for run in (whole, resumed)]
        assert saved[0]["epoch"] == saved[1]["epoch"]
        for name, tensor in saved[0]["state_dict"].items():
            torch.testing.assert_close(saved[1]["state_dict"][name], tensor, msg=name)


# ---------------------------------------------------------------------- 15.10: corrupt and unwritable caches


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated"])
def test_a_corrupt_cache_is_reported_and_rebuilt(tiny_root: Path, damage: str, capsys) -> None:
    def module() -> MovieLens100KDataModule:
        return MovieLens100KDataModule(root=str(tiny_root), download=False)

    expected = module().load_splits()
    [cache] = Path(os.environ["MTMOE_CACHE"]).glob("*.pt")
    content = cache.read_bytes()
    cache.write_bytes({"garbage": b"not a torch file\n" * 9, "empty": b"", "truncated": content[:-100]}[damage])
    capsys.readouterr()
    splits = module().load_splits()
    assert one_line(capsys, "warning: ").startswith(f"warning: the prepared-data cache {cache} is unreadable (")
    assert all(torch.equal(splits[s][k], expected[s][k]) for s in expected for k in expected[s])
    assert cache.read_bytes() == content  # repaired: the next run reads it, silently
    module().load_splits()
    assert capsys.readouterr().err == ""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_while_writing_the_cache_is_one_error_line(tiny_root: Path, monkeypatch, capsys) -> None:
    """The cache's temporary file is /dev/full, where every write fails with ENOSPC as on a full disk."""
    full_disk_for("movielens-", monkeypatch)
    assert run_cli(fit(tiny_root)) == 2
    line = one_line(capsys, "error: cannot write the cache ")
    assert "(No space left on device): free some space there, or set MTMOE_CACHE" in line
    cache_dir = Path(os.environ["MTMOE_CACHE"])
    assert not [p for p in cache_dir.iterdir() if p.suffix in (".pt", ".tmp")] and written_nothing(tiny_root.parent)


# ---------------------------------------------------------------------------- 15.11: orphaned temporary files


def test_temporary_files_of_killed_writers_are_removed_live_ones_kept(tiny_root: Path) -> None:
    cache_dir = Path(os.environ["MTMOE_CACHE"])
    killed = subprocess.run(
        [sys.executable, "-c", "import os, signal, sys\nfrom mtmoe.files import atomic_path\n"
         f"with atomic_path({str(cache_dir / 'multimnist-seed0-v1.pt')!r}) as tmp:\n"
         "    tmp.write_bytes(b'half a cache')\n    os.kill(os.getpid(), signal.SIGKILL)"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}, timeout=60,
    )
    assert killed.returncode == -signal.SIGKILL
    [orphan] = cache_dir.glob(".*.tmp")
    with atomic_path(cache_dir / "books-seed0-v1.pt") as live:
        live.write_bytes(b"being written")
        MovieLens100KDataModule(root=str(tiny_root), download=False).load_splits()
        assert not orphan.exists() and live.exists()
    assert [p.name for p in cache_dir.glob(".*.tmp")] == []


# ------------------------------------------------------------------------ 15.12: the right file, named once


def test_a_corrupt_gz_is_named_and_nothing_is_extracted(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "data"
    write_mnist(root, gz=True)
    raw = root / "MNIST" / "raw"
    labels = raw / "train-labels-idx1-ubyte.gz"
    labels.write_bytes(labels.read_bytes()[:20])
    assert run_cli(fit(root, f"--data.cache_dir={tmp_path / 'cache'}", "--data.download=false",
                       data="multimnist")) == 2
    line = one_line(capsys, f"error: {labels} is not a complete gzip file (")
    assert "train-images" not in line
    assert sorted(p.name for p in raw.iterdir()) == sorted(p.name for p in raw.glob("*.gz"))  # nothing extracted


def test_a_truncated_idx_file_is_named(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_mnist(root)
    labels = root / "MNIST" / "raw" / "train-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:30])
    data = MultiMNISTDataModule(root=str(root), cache_dir=str(tmp_path / "cache"), download=False)
    with pytest.raises(UsageError, match=f"^{labels} is not a complete uint8 IDX file "
                                         r"\(30 bytes where its header says 68\)"):
        data.load_splits()


def test_a_malformed_file_is_named_once(tiny_root: Path, capsys) -> None:
    path = tiny_root / U_DATA
    path.write_text(path.read_text() + "1\tx\t3\t4\n")
    assert run_cli(fit(tiny_root)) == 2
    line = one_line(capsys, f"error: {path} is malformed: line 721 ")
    assert line.count(str(path)) == 1
