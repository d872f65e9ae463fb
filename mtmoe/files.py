"""Atomic file writes: a temporary file in the target's folder, flushed to disk and renamed over the target once
complete, so a reader (or a rerun after a crash) never sees a half-written cache, report or result."""
from __future__ import annotations

import csv
import io
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``os.umask`` sets it: a race with
    threads that create files meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path to write ``path``'s content to; on success it gets the permissions a new file would get
    (``mkstemp`` makes it private), is synced to disk and renamed to ``path``; on any error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(content: str | bytes, path: str | Path) -> None:
    """Write ``content`` (text as UTF-8, or bytes) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))


def write_csv_atomic(rows: list[dict], path: str | Path) -> None:
    """``rows`` as a CSV file with a header (every key of every row, in order of first appearance), atomically."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(buffer.getvalue(), path)
