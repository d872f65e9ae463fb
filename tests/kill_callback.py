"""A Lightning callback that SIGKILLs its own process when a trial of the pack (``tune``'s engine) has the given
learning rate, as an epoch starts: a trial whose every attempt is killed, as an out-of-memory kill would (``--trainer.callbacks+=kill_callback.KillAtLearningRate
--trainer.callbacks.lr=0.002``; the tests folder on ``PYTHONPATH``)."""
from __future__ import annotations

import math
import os
import signal

from lightning.pytorch.callbacks import Callback


class KillAtLearningRate(Callback):
    def __init__(self, lr: float) -> None:
        self.lr = lr

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if any(math.isclose(trial.lr, self.lr) for _, trial in pl_module.engine.running):
            os.kill(os.getpid(), signal.SIGKILL)
