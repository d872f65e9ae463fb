"""Raw data files: use what lies under the data root, else fetch the official archive (checksum, progress bar).

Driven by ``manifest.json`` (package data): per dataset the archive ``url``, its ``sha256`` or ``md5``, and the ``files``
it must provide (paths relative to the data root, main file first), each with its ``size`` in bytes where known.
Two optional keys say where a download goes: ``"unpack_into": "FOLDER"`` extracts the archive into that folder of
the root (archives without a top-level folder); ``"unpack": false`` keeps the verified archive itself as the main
file (read in place). Files already on disk are used as they are, without any network access
(``datasets/README.md``).
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from importlib import resources
from pathlib import Path

from tqdm.auto import tqdm

from mtmoe.errors import UsageError

MANIFEST = resources.files("mtmoe.data") / "manifest.json"


def manifest_entry(name: str) -> dict:
    """The manifest's entry for dataset ``name``."""
    entries = json.loads(MANIFEST.read_text())
    if name not in entries:
        raise KeyError(f"dataset {name!r} is not in {MANIFEST} (known: {', '.join(sorted(entries))})")
    return entries[name]


def ensure_files(root: Path, name: str, download: bool) -> Path:
    """Make sure dataset ``name``'s files exist under ``root`` and return the path of its main (first) file.

    Present files are used without network access. Missing ones are fetched from the manifest's URL when
    ``download`` is true (verified, then extracted atomically); otherwise a one-line :class:`UsageError` says
    which file is missing and where it goes.
    """
    entry = manifest_entry(name)
    root = Path(root)
    paths = [root / relative for relative in entry["files"]]
    missing = [path for path in paths if not path.is_file()]
    if missing:
        if entry.get("unpack", True):
            hint = f"download {entry['url']} and unzip it into {root / entry.get('unpack_into', '')}"
        else:
            hint = f"download {entry['url']} to {paths[0]}"
        if not download:
            raise UsageError(f"missing {missing[0]}: {hint} (or pass --data.download true)")
        _fetch(entry, root, hint)
        _check_extracted(entry, root, missing)
    return paths[0]


def _fetch(entry: dict, root: Path, hint: str) -> None:
    """Download the archive to a temporary file in ``root``, verify its checksum, extract it atomically."""
    url = entry["url"]
    archive_name = Path(urllib.parse.urlparse(url).path).name
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=root, prefix=".download-", suffix=f"-{archive_name}")
    except OSError as error:
        raise UsageError(
            f"cannot write to data root {root} ({error.strerror or error}): pass a writable --data.root "
            f"(or MTMOE_DATA), or {hint}"
        ) from None
    archive = Path(name)
    algorithm = "sha256" if "sha256" in entry else "md5"
    try:
        try:
            digest = _download(url, fd, archive_name, algorithm)
        except (OSError, http.client.HTTPException) as error:
            reason = getattr(error, "reason", None) or error
            raise UsageError(f"could not download {url} ({reason}); offline? {hint}") from None
        if digest != entry[algorithm]:
            raise UsageError(
                f"corrupt download of {url}: {algorithm} {digest} != {entry[algorithm]} (partial file deleted); "
                f"retry, or {hint}"
            )
        if entry.get("unpack", True):
            _extract(archive, root / entry.get("unpack_into", ""), url)
        else:
            target = root / next(iter(entry["files"]))
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(archive, target)
    finally:
        archive.unlink(missing_ok=True)


def _download(url: str, fd: int, label: str, algorithm: str) -> str:
    """Stream ``url`` into the open file ``fd`` with a progress bar; return the hex digest of the bytes."""
    digest = hashlib.new(algorithm, usedforsecurity=False)
    with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label) as bar:
            while block := response.read(1 << 20):
                out.write(block)
                digest.update(block)
                bar.update(len(block))
    return digest.hexdigest()


def _extract(archive: Path, root: Path, url: str) -> None:
    """Unpack into a temporary folder inside ``root``, then rename the entries into place."""
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".extract-"))
    try:
        shutil.unpack_archive(archive, staging)
        for child in staging.iterdir():
            _move_missing(child, root / child.name)
    except shutil.ReadError as error:
        raise UsageError(f"cannot unpack the archive downloaded from {url}: {error}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_missing(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target``; into an existing folder, move only the entries it lacks."""
    if not target.exists():
        os.replace(source, target)
    elif source.is_dir() and target.is_dir():
        for child in source.iterdir():
            _move_missing(child, target / child.name)


def _check_extracted(entry: dict, root: Path, expected: list[Path]) -> None:
    for path in expected:
        if not path.is_file():
            raise UsageError(f"the archive {entry['url']} did not provide {path.relative_to(root)}")
        size = entry["files"][path.relative_to(root).as_posix()].get("size")
        if size is not None and path.stat().st_size != size:
            raise UsageError(f"{path} has {path.stat().st_size} bytes, the manifest expects {size}")
