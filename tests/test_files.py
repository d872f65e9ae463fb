"""``mtmoe.files``: atomic writes leave either the old file or the new one, never a part, and no temporary file."""
from __future__ import annotations

from pathlib import Path

import pytest

from mtmoe.files import atomic_path, write_atomic


def test_write_atomic_text_and_bytes(tmp_path: Path) -> None:
    write_atomic("one\n", tmp_path / "deep" / "a.md")
    write_atomic(b"\x89PNG", tmp_path / "deep" / "b.png")
    assert (tmp_path / "deep" / "a.md").read_text() == "one\n"
    assert (tmp_path / "deep" / "b.png").read_bytes() == b"\x89PNG"
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["a.md", "b.png"]


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "results.json"
    write_atomic("old", target)
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_path(target) as tmp:
            tmp.write_text("half of the ne")
            assert tmp.parent == target.parent and tmp != target
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_written_files_get_the_umask_permissions_and_utf8(tmp_path: Path) -> None:
    import os

    old = os.umask(0o022)
    try:
        write_atomic("loss ×10⁻² ± SE\n", tmp_path / "table.md")
    finally:
        os.umask(old)
    assert (tmp_path / "table.md").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "table.md").read_bytes().decode("utf-8") == "loss ×10⁻² ± SE\n"


def test_write_csv_atomic_takes_every_key_in_order(tmp_path: Path) -> None:
    from mtmoe.files import write_csv_atomic

    write_csv_atomic([{"gate": "topk", "loss": 0.5}, {"gate": "comet", "auc": 0.9, "loss": 0.4}], tmp_path / "t.csv")
    assert (tmp_path / "t.csv").read_text().splitlines() == ["gate,loss,auc", "topk,0.5,", "comet,0.4,0.9"]
