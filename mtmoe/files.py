"""Atomic file writes: a temporary file in the target's folder, flushed to disk and renamed over the target once
complete, so a reader (or a rerun after a crash) never sees a half-written cache, report or result.

The writer holds an exclusive ``flock`` on its temporary file while it writes: a temporary file nobody holds is an
orphan of a killed writer, which :func:`remove_orphans` deletes (on any host sharing the folder, PIDs aside).
"""
from __future__ import annotations

import csv
import fcntl
import io
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO


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


TEMPORARY_NAME = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")  # mkstemp's names in atomic_path: .<target>.<8 chars>.tmp


def _try_lock(fd: int, block: bool) -> bool:
    """Take an exclusive ``flock`` on ``fd``; False if another process holds one (without ``block``) or the
    filesystem cannot lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


def _locked_temporary(folder: Path, name: str) -> tuple[int, str]:
    """A new temporary file for ``name`` in ``folder``, open and locked; retried if an orphan sweep removed it
    between its creation and the lock."""
    while True:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        _try_lock(fd, block=True)  # a filesystem without locks: write unlocked
        try:
            if os.path.samestat(os.fstat(fd), os.stat(tmp)):
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path to write ``path``'s content to, locked while in use; on success it gets the permissions a
    new file would get (``mkstemp`` makes it private), is synced to disk and renamed to ``path``; on any error it is
    removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _locked_temporary(path.parent, path.name)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def remove_orphans(folder: str | Path) -> list[Path]:
    """Delete the temporary files :func:`atomic_path` left in ``folder`` when their writer died (no process holds
    their lock); return them. Files in use, and folders that cannot be read or written, are left alone."""
    removed = []
    try:
        names = [entry.name for entry in os.scandir(folder) if TEMPORARY_NAME.fullmatch(entry.name)]
    except OSError:
        return removed
    for name in names:
        path = Path(folder) / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if _try_lock(fd, block=False) and os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                path.unlink()
                removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def write_atomic(content: str | bytes, path: str | Path) -> None:
    """Write ``content`` (text as UTF-8, or bytes) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))


class _KeepWriteError:
    """A binary file for ``torch.save`` that keeps the OSError of a failed write (torch reports only 'unexpected
    pos')."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.error = handle, None

    def write(self, data: bytes) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


def save_torch_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save(obj)`` to ``path`` atomically; a failed write (a full disk) raises its OSError."""
    import torch  # here: the reports' writers (write_atomic) are imported by commands that need no torch

    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        writer = _KeepWriteError(handle)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None


def write_csv_atomic(rows: list[dict], path: str | Path) -> None:
    """``rows`` as a CSV file with a header (every key of every row, in order of first appearance), atomically."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(buffer.getvalue(), path)
