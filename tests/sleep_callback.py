"""Lightning callbacks that sleep, for tests that need a tiny run to last: a trial stays RUNNING between its epochs
long enough to be caught and signalled there, a progress bar gets time to be redrawn within an epoch, without
computing to pass the time (``--trainer.callbacks+=sleep_callback.SleepAfterFirstEpoch
--trainer.callbacks.seconds=3``; the tests folder on ``PYTHONPATH``). Sleeping changes nothing a run computes."""
from __future__ import annotations

import time

from lightning.pytorch.callbacks import Callback


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
