"""Callbacks: epoch timing (the benchmarks')."""
from __future__ import annotations

import time

import lightning.pytorch as pl
import torch


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
