"""Raw data files: use what lies under the data root, else fetch the official archive (checksum, progress bar).

Driven by ``manifest.json`` (package data): per dataset the archive ``url``, its ``sha256`` or ``md5``, and the ``files``
it must provide (paths relative to the data root, main file first), each with its ``size`` in bytes and its
``sha256`` where known. Two optional keys say where a download goes: ``"unpack_into": "FOLDER"`` extracts the
archive into that folder of the root (archives without a top-level folder); ``"unpack": false`` keeps the verified
archive itself as the main file (read in place). A third, ``"by_hand": "WHY"``, says why the files are better placed
by hand (``python -m mtmoe datasets`` shows it). Files already on disk are used without any network access, once
their size and sha256 match the manifest's (``verify=False`` uses them as they are; ``datasets/README.md``). A
file's sha256 is computed once and remembered in the cache folder, keyed on its size, times and inode.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from importlib import resources
from pathlib import Path

from tqdm.auto import tqdm

from mtmoe.errors import UsageError
from mtmoe.files import write_atomic

MANIFEST = resources.files("mtmoe.data") / "manifest.json"


def manifest_entry(name: str) -> dict:
    """The manifest's entry for dataset ``name``."""
    entries = json.loads(MANIFEST.read_text())
    if name not in entries:
        raise KeyError(f"dataset {name!r} is not in {MANIFEST} (known: {', '.join(sorted(entries))})")
    return entries[name]


def ensure_files(
    root: Path, name: str, download: bool, verify: bool | None = True, cache_dir: Path | None = None
) -> Path:
    """Make sure dataset ``name``'s files exist under ``root`` and return the path of its main (first) file.

    Present files are used without network access. Missing ones are fetched from the manifest's URL when
    ``download`` is true (verified, then extracted atomically); otherwise a one-line :class:`UsageError` says
    which file is missing and where it goes. With ``verify`` (None: ``$MTMOE_VERIFY``, else true), a file whose
    size or sha256 differs from the manifest's is a one-line :class:`UsageError` (sha256s remembered in
    ``cache_dir``, see :func:`raw_sha256`).
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
    if verify is None:
        verify = env_flag("MTMOE_VERIFY", default=True)
    if verify:
        for path, expected in zip(paths, entry["files"].values()):
            _verify(path, expected, cache_dir)
    return paths[0]


def env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable ``name`` (true/false, 1/0, yes/no, on/off), ``default`` when unset."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        raise UsageError(f"{name} must be true or false, got {os.environ[name]!r}")
    return value in ("true", "1", "yes", "on")


def _verify(path: Path, expected: dict, cache_dir: Path | None) -> None:
    """A :class:`UsageError` naming ``path`` if its size or sha256 is not the manifest's ``expected`` one."""
    fix = ("delete it and rerun with --data.download true to fetch the official file, or pass --data.verify false "
           "to use it as it is")
    size = path.stat().st_size
    if "size" in expected and size != expected["size"]:
        raise UsageError(f"{path} has {size:,} bytes where the official file has {expected['size']:,} (truncated "
                         f"or modified?): {fix}")
    if "sha256" in expected and (digest := raw_sha256(path, cache_dir)) != expected["sha256"]:
        raise UsageError(f"{path} is not the official file (sha256 {digest}, expected {expected['sha256']}): {fix}")


DIGESTS_FILE = "raw-sha256.json"  # in the cache folder: {path: {"stat": [size, mtime, ctime, inode], "sha256"}}


def raw_sha256(path: Path, cache_dir: Path | None) -> str:
    """``path``'s sha256, computed once and remembered in ``cache_dir`` while its size, modification and change
    times and inode stay the same (any write changes the change time), so later runs read nothing."""
    if cache_dir is None:
        return sha256_file(path)
    status = path.stat()
    key, stamp = str(path.resolve()), [status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino]
    record = Path(cache_dir) / DIGESTS_FILE
    digests = _read_digests(record)
    remembered = digests.get(key)
    if isinstance(remembered, dict) and remembered.get("stat") == stamp:
        return remembered["sha256"]
    digest = sha256_file(path)
    try:  # a concurrent run's new entry may be lost: it is only computed again
        write_atomic(json.dumps({**digests, key: {"stat": stamp, "sha256": digest}}, indent=1) + "\n", record)
    except OSError:  # a read-only cache folder: hash again next time
        pass
    return digest


def _read_digests(record: Path) -> dict:
    """The remembered sha256s; an unreadable record is reported and starts afresh."""
    try:
        digests = json.loads(record.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        print(f"warning: ignoring the unreadable {record} ({error}); it is rebuilt", file=sys.stderr)
        return {}
    return digests if isinstance(digests, dict) else {}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _fetch(entry: dict, root: Path, hint: str) -> None:
    """Download the archive to a temporary file in ``root``, verify its checksum, extract it atomically."""
    url = entry["url"]
    archive_name = Path(urllib.parse.urlparse(url).path).name
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=root, prefix=".download-", suffix=f"-{archive_name}")
    except OSError as error:
        reason = "a file, not a folder" if root.is_file() else error.strerror or error  # mkdir: "File exists"
        raise UsageError(
            f"cannot write to data root {root} ({reason}): pass a writable --data.root (or MTMOE_DATA), or {hint}"
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
