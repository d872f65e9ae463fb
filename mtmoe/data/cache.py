"""The prepared-splits cache: one ``torch.save`` file per dataset, seed and raw-file version, written atomically.

An unreadable cache (garbage, empty, truncated: a disk fault or an older writer's bug) is reported in one line and
rebuilt; a full disk is one :class:`~mtmoe.errors.UsageError`, with nothing left behind; temporary files of killed
writers are deleted when the cache folder is next used.
"""
from __future__ import annotations

import contextlib
import errno
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from mtmoe.data.base import Splits
from mtmoe.errors import UsageError
from mtmoe.files import remove_orphans, save_torch_atomic


def load_or_prepare(cache: Path, prepare: Callable[[], Splits]) -> Splits:
    """The cached splits, else ``prepare()`` them and write the cache atomically (a temporary file, then a rename).

    An unreadable cache (garbage, empty, truncated) is reported in one line and rebuilt; temporary files that
    killed writers left in the cache folder are deleted first.
    """
    remove_orphans(cache.parent)
    if cache.is_file():
        try:
            splits = torch.load(cache, weights_only=True)
            _check_splits(splits)
            return splits
        except MemoryError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever makes it unreadable (EOFError, KeyError, ...), rebuild
            first_sentence = str(error).split("\n")[0].split(". ")[0][:120]
            reason = f"{type(error).__name__}: {first_sentence}" if first_sentence else type(error).__name__
            print(f"warning: the prepared-data cache {cache} is unreadable ({reason}); rebuilding it", file=sys.stderr)
            with contextlib.suppress(OSError):
                cache.unlink()
    splits = prepare()
    try:
        save_torch_atomic(splits, cache)
    except OSError as error:
        room = error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        raise UsageError(f"cannot write the cache {cache} ({error.strerror or error}): "
                         f"{'free some space there, or ' if room else ''}set MTMOE_CACHE or --data.cache_dir to a "
                         f"writable folder{' with room' if room else ''}") from None
    return splits


def _check_splits(splits: object) -> None:
    """Raise ValueError unless ``splits`` is ``{"train"|"val"|"test": {name: tensor}}`` with one length per split."""
    if not isinstance(splits, dict) or set(splits) != {"train", "val", "test"}:
        raise ValueError("not a dict of train, val and test splits")
    for tensors in splits.values():
        if not isinstance(tensors, dict) or not tensors or not all(isinstance(t, Tensor) for t in tensors.values()):
            raise ValueError("a split is not a dict of tensors")
        if len({len(t) for t in tensors.values()}) != 1:
            raise ValueError("a split holds tensors of different lengths")
