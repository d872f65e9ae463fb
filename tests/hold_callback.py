"""A Lightning callback that holds a ``tune`` worker's pack at the end of each training batch while a file exists,
sleeping (no CPU), so that a test keeps trials RUNNING as long as it needs and then lets them finish by deleting
the file: ``hold_args(path)`` adds it to a ``tune`` command, ``pythonpath_with_tests()`` is the ``PYTHONPATH`` of
the processes it starts. A SIGTERM ends the hold, as Lightning stops a fit after the batch."""
from __future__ import annotations

import os
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

TESTS = Path(__file__).resolve().parent


class HoldWhileFileExists(Callback):
    def __init__(self, path: str, poll: float = 0.05) -> None:
        self.path, self.poll = Path(path), poll

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        while self.path.exists() and not trainer.received_sigterm:
            time.sleep(self.poll)


def hold_args(path: Path) -> list[str]:
    """``tune`` arguments that hold its packs while ``path`` exists (create it first)."""
    return ["--trainer.callbacks+=hold_callback.HoldWhileFileExists", f"--trainer.callbacks.path={path}"]


def pythonpath_with_tests() -> str:
    """``PYTHONPATH`` with this folder first, for the processes a test starts (to import the test callbacks)."""
    return os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
