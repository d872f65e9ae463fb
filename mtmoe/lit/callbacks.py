"""Callbacks: Keras-style ``EarlyStopping(restore_best_weights=True)`` for Lightning (ecosystem.md §1.4), the
global random states in checkpoints, epoch timing."""
from __future__ import annotations

import copy
import math
import random
import time

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn


class RestoreBestWeights(pl.Callback):
    """Keeps an in-memory copy of the weights at the best validation value and restores it when fitting ends.

    Together with ``EarlyStopping(monitor="val/loss", patience=25, min_delta=0)`` this is Keras'
    ``EarlyStopping(patience=25, restore_best_weights=True)``: testing after ``fit`` sees the best epoch's model,
    with no checkpoint file per trial. ``best_score`` and ``best_epoch`` are the Optuna objective's source.
    A non-finite value never counts as an improvement. The module's validation results of that epoch
    (``MultiTaskMoE.last_results["val"]``) are kept and restored with the weights: after ``fit`` a module reports
    validation and test of the same weights.
    """

    def __init__(self, monitor: str = "val/loss") -> None:
        self.monitor = monitor
        self.best_score = math.inf
        self.best_epoch = -1
        self.best_state: dict[str, torch.Tensor] | None = None
        self.best_results: dict | None = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not fitting or trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        score = float(trainer.callback_metrics[self.monitor])
        if math.isfinite(score) and score < self.best_score:
            self.best_score, self.best_epoch = score, trainer.current_epoch
            self.best_state = copy.deepcopy(pl_module.state_dict())
            self.best_results = copy.deepcopy(getattr(pl_module, "last_results", {}).get("val"))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.best_state is not None:
            pl_module.load_state_dict(self.best_state)
        if self.best_results is not None:
            pl_module.last_results["val"] = self.best_results

    def state_dict(self) -> dict:
        """Saved in checkpoints, best weights included, so a resumed run still restores the best epoch."""
        return {"best_score": self.best_score, "best_epoch": self.best_epoch, "best_state": self.best_state,
                "best_results": self.best_results}

    def load_state_dict(self, state_dict: dict) -> None:
        self.best_score, self.best_epoch = state_dict["best_score"], state_dict["best_epoch"]
        self.best_state, self.best_results = state_dict["best_state"], state_dict.get("best_results")


class RandomStates(pl.Callback):
    """The global random states (Python's, NumPy's, torch's on the CPU and on every CUDA device) saved in each
    checkpoint and restored on resuming, so a resumed run draws (dropout, noisy gates) what the uninterrupted run
    draws. Stored as plain lists and tensors: checkpoints still load with ``weights_only=True``."""

    def state_dict(self) -> dict:
        numpy = np.random.get_state(legacy=False)
        return {
            "python": random.getstate(),
            "numpy": {**numpy, "state": {**numpy["state"], "key": numpy["state"]["key"].tolist()}},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        random.setstate(state_dict["python"])
        numpy = state_dict["numpy"]
        np.random.set_state({**numpy, "state": {**numpy["state"], "key": np.array(numpy["state"]["key"], np.uint32)}})
        torch.set_rng_state(state_dict["torch"])
        if state_dict["cuda"] and len(state_dict["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state_dict["cuda"])


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
