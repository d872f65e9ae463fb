"""What a run writes: a log folder of its own and its checkpoints, ``best.ckpt`` and ``last.ckpt``, written atomically.

* :class:`RunLogger` is Lightning's ``CSVLogger`` whose ``version_N`` folder is claimed by creating it: two runs
  started at the same moment in one working directory never share a folder (Lightning's picks the number from a
  listing, so both took the same one).
* :func:`run_checkpoints` keep ``checkpoints/best.ckpt`` (the best validation loss: the weights ``fit`` tests,
  which ``test --ckpt_path`` reproduces) and ``checkpoints/last.ckpt`` (the latest epoch, to resume from).
* :class:`AtomicCheckpointIO` writes every checkpoint to a temporary file renamed over the target once complete
  (:mod:`mtmoe.files`): a disk that fills mid-write leaves the previous checkpoint, not a truncated one.
"""
from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO

from mtmoe.errors import UsageError
from mtmoe.files import atomic_path, save_torch_atomic

SAVE_DIR_FLAG = "--trainer.logger.init_args.save_dir"


class RunLogger(CSVLogger):
    """``CSVLogger`` that claims its ``version_N`` folder by creating it (the next free N); ``claimed`` is that
    folder, ``None`` while no version was picked or when one was given."""

    claimed: Path | None = None

    # A private use of Lightning: CSVLogger picks the next free version in its private _get_next_version, which its
    # public ``version`` calls once; no public hook lets a logger claim the folder it picks.
    # tests/test_checkpoints.py::test_runs_started_together_get_folders_of_their_own fails when Lightning renames it.
    def _get_next_version(self) -> int:
        root = Path(self.root_dir)
        self.made = list(itertools.takewhile(lambda folder: not folder.exists(), [root, *root.parents]))
        version = super()._get_next_version()
        try:
            root.mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    (root / f"version_{version}").mkdir()
                    break
                except FileExistsError:  # another run took this number since the listing
                    version += 1
        except OSError as error:
            raise UsageError(f"cannot create the run's log folder in {root} ({error.strerror or error}): "
                             f"choose another folder with {SAVE_DIR_FLAG}") from None
        self.claimed = root / f"version_{version}"
        return version

    def discard_unfinished(self) -> None:
        """Remove the claimed folder unless it holds a checkpoint or results, then the folders made to hold it
        that are left empty: a run stopped by bad input leaves nothing behind."""
        if self.claimed is None or any(self.claimed.rglob("*.ckpt")) or (self.claimed / "results.json").exists():
            return
        shutil.rmtree(self.claimed, ignore_errors=True)
        for folder in self.made:  # innermost first; one another run uses is not empty
            try:
                folder.rmdir()
            except OSError:
                break


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written to a temporary file and renamed over the target once complete and synced."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        try:
            save_torch_atomic(checkpoint, path)
        except OSError as error:
            raise UsageError(f"cannot write the checkpoint {path} ({error.strerror or error}): free some space "
                             f"there, or choose another folder with {SAVE_DIR_FLAG}") from None


class RunCheckpoint(ModelCheckpoint):
    """``checkpoints/best.ckpt`` (``kind="best"``: at the lowest ``val/loss`` so far) or ``checkpoints/last.ckpt``
    (``kind="last"``: at every epoch's end), overwritten in place.

    A run resumed from another run's checkpoint writes to its own folder; it copies the other run's checkpoint there
    first, so its ``best.ckpt`` is the best epoch of the whole run, as the weights ``fit`` restores are.
    """

    def __init__(self, kind: Literal["best", "last"]) -> None:
        self.kind = kind
        super().__init__(filename=kind, monitor="val/loss" if kind == "best" else None, mode="min", save_top_k=1,
                         auto_insert_metric_name=False, enable_version_counter=False)

    def check_monitor_top_k(self, trainer: Any, current: torch.Tensor | None = None) -> bool:
        """A non-finite ``val/loss`` is never the best (as for the engine's early stopping)."""
        return current is not None and bool(torch.isfinite(current)) and super().check_monitor_top_k(trainer, current)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        previous = state_dict.get("dirpath")
        if previous is not None and self.dirpath is not None and Path(previous) != Path(self.dirpath):
            best = state_dict.get("best_model_path")
            if best and Path(best).is_file():
                state_dict = self._moved_into_this_run(state_dict, Path(previous), Path(best))
        super().load_state_dict(state_dict)

    def _moved_into_this_run(self, state_dict: dict[str, Any], previous: Path, best: Path) -> dict[str, Any]:
        """``state_dict`` with the previous run's best checkpoint copied into this run's folder and every path
        pointing into that folder instead (this run never deletes another run's file)."""
        with atomic_path(os.path.join(self.dirpath, best.name)) as temporary:
            shutil.copyfile(best, temporary)

        def moved(path: Any) -> Any:  # spelled as ModelCheckpoint spells its own paths
            return os.path.join(self.dirpath, Path(path).name) if path and Path(path).parent == previous else path

        state = {key: moved(value) if key.endswith("_path") else value for key, value in state_dict.items()}
        state["best_k_models"] = {moved(path): score for path, score in state_dict.get("best_k_models", {}).items()}
        state["dirpath"] = self.dirpath
        return state


def run_checkpoints() -> list[RunCheckpoint]:
    """The run's two checkpoints, best first: Lightning saves them in this order at an epoch's end, so the state
    ``last.ckpt`` holds of ``best.ckpt`` is that epoch's."""
    return [RunCheckpoint("best"), RunCheckpoint("last")]
