"""Pack checkpoints: a packed tune worker stopped by SIGTERM or Ctrl-C (a lease's or a scheduler's end) saves its
running trials' state, and the next ``tune`` on the same storage continues them from the epoch they reached
instead of from their first.

* **What.** At every pack epoch's end the worker keeps a copy of each running trial's state on the pack's device
  (:meth:`mtmoe.pack.engine.PackEngine.checkpoint`: parameters, buffers with the random stream's counters and local
  search's state, Adam's moments and step, early stopping's best and wait, best weights, metric history, epochs): on
  a GPU a device-to-device copy, with no transfer to the host until a write. Interrupted, it writes the latest of
  them to ``<folder>/<host>-<pid>.pt`` atomically (:func:`checkpoint_folder`: ``tune --checkpoint-dir``, else
  beside a file storage, ``checkpoints/<study>/``), and marks the interrupted trials with a ``checkpoint``
  attribute; ``--checkpoint-every S`` also writes it at the first epoch end ``S`` seconds after the last write.
* **Resume.** A worker reads the study's checkpoints when it starts, claims their configurations before the rest
  of the plan (each trial back into its saved slot order) and loads each into its slot as saved: it computes what
  the uninterrupted trial computes. A checkpoint whose study identity (space, seed, settings), structure or
  configuration hash differs from the study's is ignored with a warning, as is one that cannot be read.
* **Clean-up.** A worker that writes its checkpoint takes over the states it read and did not resume yet (they go
  into its file, and the files they came from are removed); one that runs out of trials removes them all.
* **Without checkpoints.** ``tune --no-checkpoints`` on a study whose folder holds saved states is refused
  (:func:`refuse_saved_states`): its trials would rerun from their first epoch while the states stayed behind, to be
  resumed by a later ``tune`` with checkpoints in place of the trials' last attempt.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mtmoe.errors import UsageError
from mtmoe.files import save_torch_atomic

FORMAT = 1


def checkpoint_folder(url: str, study_name: str, log_dir: Path, base: Path | None = None) -> Path:
    """``<base>/<study>/`` (``tune --checkpoint-dir``), else ``checkpoints/<study>/`` beside a file storage (SQLite,
    journal), else in the study's log folder."""
    if base is not None:
        return Path(base) / study_name.replace("/", "_")
    path = None
    if url.startswith("journal:"):
        path = url.removeprefix("journal:")
    elif url.startswith("sqlite:///"):
        path = url.removeprefix("sqlite:///")
    base = Path(path).parent if path else log_dir
    return base / "checkpoints" / study_name.replace("/", "_")


def refuse_saved_states(folder: Path) -> None:
    """``tune --no-checkpoints``: refused (one error line, before the storage is touched) where ``folder`` holds
    checkpoint files of an earlier, interrupted ``tune``."""
    saved = sorted(folder.glob("*.pt")) if folder.is_dir() else []
    if saved:
        raise UsageError(f"--no-checkpoints: {folder} holds {len(saved)} checkpoint file(s) of trials an earlier tune "
                         "left interrupted; run without --no-checkpoints to continue them from their saved epoch, or "
                         "delete that folder to rerun them from their first epoch")


def saved_elsewhere(study: Any, folder: Path) -> list[Path]:
    """The checkpoint files outside ``folder`` that the study's interrupted trials name (their ``checkpoint``
    attribute) and that still exist, for configurations not yet complete: states a ``tune`` reading ``folder``
    would not continue (an earlier run's ``--checkpoint-dir`` not given again)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    complete = {t.user_attrs.get("config_id") for t in trials if t.state == TrialState.COMPLETE}
    files = {Path(t.user_attrs["checkpoint"]) for t in trials
             if t.state == TrialState.FAIL and "checkpoint" in t.user_attrs
             and t.user_attrs.get("config_id") not in complete}
    return sorted(path for path in files if path.parent.resolve() != folder.resolve() and path.is_file())


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class PackCheckpoints:
    """The checkpoints of one worker of a study: those it found (:attr:`saved`, by config_id) and its own file."""

    def __init__(self, folder: Path, identity: dict[str, Any], every: float | None = None) -> None:
        self.folder, self.identity, self.every = folder, identity, every
        self.path = folder / f"{socket.gethostname()}-{os.getpid()}.pt"
        # the pack's last epoch end: (config_id, structure, hash, state) per trial, when called
        self.latest: Callable[[], list[tuple[int, str, str, dict[str, Any]]]] = list
        self.written = time.monotonic()
        self.read: list[Path] = []
        self.saved = self._load()

    def _load(self) -> dict[int, dict[str, Any]]:
        """The entries of the study's checkpoint files by config_id (the furthest trained where several hold one)."""
        saved: dict[int, dict[str, Any]] = {}
        for path in sorted(self.folder.glob("*.pt")) if self.folder.is_dir() else []:
            try:
                content = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as error:  # a torn or foreign file: the trials run from their start
                warn(f"checkpoint {path} cannot be read ({type(error).__name__}: {error}): ignored, its trials run "
                     "from their first epoch")
                continue
            if content.get("format") != FORMAT or content.get("identity") != self.identity:
                warn(f"checkpoint {path} is of other study settings (search space, seed or settings): ignored, "
                     "its trials run from their first epoch")
                continue
            self.read.append(path)
            for config_id, entry in content["trials"].items():
                if config_id not in saved or epochs(entry) > epochs(saved[config_id]):
                    saved[config_id] = entry
        return saved

    def resume(self, config_id: int, structure: str, config_hash: str) -> dict[str, Any] | None:
        """The saved state configuration ``config_id`` continues from, if a checkpoint holds one of this
        structure and hash (else a warning, and it runs from its start)."""
        entry = self.saved.pop(config_id, None)
        if entry is None:
            return None
        if entry["structure"] != structure or entry["config_hash"] != config_hash:
            warn(f"the checkpoint of config_id {config_id} is of another configuration: ignored, it runs from its "
                 "first epoch")
            return None
        return entry["state"]

    def keep(self, trials: Callable[[], list[tuple[int, str, str, dict[str, Any]]]]) -> bool:
        """The pack's state at an epoch's end, kept to be written: ``trials()`` gives (config_id, structure, hash,
        state) per trial (:meth:`mtmoe.pack.engine.PackEngine.snapshot`: called only for a write); written now if
        ``--checkpoint-every`` is due. Whether it was written."""
        self.latest = trials
        if self.every is not None and time.monotonic() - self.written >= self.every:
            self.write()
            return True
        return False

    def write(self) -> list[int]:
        """Write the latest epoch end's states and the saved ones not resumed yet to this worker's file; the files
        read are then removed. The config_ids written."""
        latest = {config_id: {"structure": structure, "config_hash": config_hash, "state": state}
                  for config_id, structure, config_hash, state in self.latest()}
        trials = {**self.saved, **latest}
        if not trials:
            self.path.unlink(missing_ok=True)
        else:
            content = {"format": FORMAT, "identity": self.identity,
                       "trials": {config_id: clone(entry) for config_id, entry in trials.items()}}
            save_torch_atomic(content, self.path)
        for path in self.read:
            if path != self.path:
                path.unlink(missing_ok=True)
        self.read = [self.path] if trials else []
        self.written = time.monotonic()
        return sorted(trials)

    def clear(self) -> None:
        """No trial left to resume (the worker ran out of trials): every file read and this worker's removed."""
        for path in {*self.read, self.path}:
            path.unlink(missing_ok=True)


def epochs(entry: dict[str, Any]) -> int:
    return entry["state"]["progress"]["epochs_run"]


def clone(value: Any) -> Any:
    """``value`` with every tensor a copy of its own on the host (a view saved alone would save its whole pack's
    storage; a GPU's snapshot is moved here)."""
    if isinstance(value, torch.Tensor):
        return value.to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: clone(item) for key, item in value.items()}
    return value
