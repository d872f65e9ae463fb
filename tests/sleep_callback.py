"""Lightning callbacks that sleep, for tests that need a tiny run to last without computing to pass the time
(sleeping changes nothing a run computes; the tests folder on ``PYTHONPATH``, :func:`pythonpath_with_tests`): a
trial stays RUNNING between its epochs long enough to be caught and signalled there
(``--trainer.callbacks+=sleep_callback.SleepAfterFirstEpoch --trainer.callbacks.seconds=3``), a progress bar gets
time to be redrawn within an epoch (:class:`SleepAfterEachBatch`), a ``tune`` worker's pack is held until the test
lets it go (:class:`HoldWhileFileExists`, :func:`hold_args`)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

TESTS = Path(__file__).resolve().parent


class SleepAfterFirstEpoch(Callback):
    """``seconds`` as each epoch but the first starts."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch >= 1:
            time.sleep(self.seconds)


class SleepAfterEachBatch(Callback):
    """``seconds`` as each training batch ends."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)


class HoldWhileFileExists(Callback):
    """Holds the pack at the end of each training batch while ``path`` exists; a SIGTERM ends the hold, as Lightning
    stops a fit after the batch."""

    def __init__(self, path: str, poll: float = 0.05) -> None:
        self.path, self.poll = Path(path), poll

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        while self.path.exists() and not trainer.received_sigterm:
            time.sleep(self.poll)


def hold_args(path: Path) -> list[str]:
    """``tune`` arguments that hold its packs while ``path`` exists (create it first)."""
    return ["--trainer.callbacks+=sleep_callback.HoldWhileFileExists", f"--trainer.callbacks.path={path}"]


def pythonpath_with_tests() -> str:
    """``PYTHONPATH`` with this folder first, for the processes a test starts (to import the test callbacks)."""
    return os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
