"""A Lightning callback that sleeps as each epoch after the first starts: a tiny trial stays RUNNING between its
epochs long enough to be caught and signalled there, without computing to pass the time (``--trainer.callbacks+=
sleep_callback.SleepAfterFirstEpoch --trainer.callbacks.seconds=3``; the tests folder on ``PYTHONPATH``). Sleeping
changes nothing a trial computes."""
from __future__ import annotations

import time

from lightning.pytorch.callbacks import Callback


class SleepAfterFirstEpoch(Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch >= 1:
            time.sleep(self.seconds)
