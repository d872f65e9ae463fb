"""Keras-style ``EarlyStopping(restore_best_weights=True)`` for Lightning (ecosystem.md §1.4)."""
from __future__ import annotations

import copy
import math
import time

import lightning.pytorch as pl
import torch


class RestoreBestWeights(pl.Callback):
    """Keeps an in-memory copy of the weights at the best validation value and restores it when fitting ends.

    Together with ``EarlyStopping(monitor="val/loss", patience=25, min_delta=0)`` this is Keras'
    ``EarlyStopping(patience=25, restore_best_weights=True)``: testing after ``fit`` sees the best epoch's model,
    with no checkpoint file per trial. ``best_score`` and ``best_epoch`` are the Optuna objective's source.
    A non-finite value never counts as an improvement.
    """

    def __init__(self, monitor: str = "val/loss") -> None:
        self.monitor = monitor
        self.best_score = math.inf
        self.best_epoch = -1
        self.best_state: dict[str, torch.Tensor] | None = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        score = float(trainer.callback_metrics[self.monitor])
        if math.isfinite(score) and score < self.best_score:
            self.best_score, self.best_epoch = score, trainer.current_epoch
            self.best_state = copy.deepcopy(pl_module.state_dict())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.best_state is not None:
            pl_module.load_state_dict(self.best_state)

    def state_dict(self) -> dict:
        """Saved in checkpoints, best weights included, so a resumed run still restores the best epoch."""
        return {"best_score": self.best_score, "best_epoch": self.best_epoch, "best_state": self.best_state}

    def load_state_dict(self, state_dict: dict) -> None:
        self.best_score, self.best_epoch = state_dict["best_score"], state_dict["best_epoch"]
        self.best_state = state_dict["best_state"]


class EpochTimer(pl.Callback):
    """Wall time of every training epoch in ``seconds``, waiting at each epoch's end for a GPU's queued work."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self.seconds.append(time.perf_counter() - self.start)
