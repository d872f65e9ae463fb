"""Training a pack: many trials of one structure as one model, each with its own data order, early stopping, best
weights and divergence, and a slot freed by a finished trial refilled with the next one (:class:`PackTrainer`).

Each trial follows what ``fit`` does for it alone (:class:`mtmoe.lit.module.MultiTaskMoE` under Lightning with
``EarlyStopping(patience)`` and ``RestoreBestWeights``): its batches are cut from the in-memory split in the order
:func:`mtmoe.data.base.shuffled_order` draws from its own data seed and epoch; after each epoch its validation loss
(the batch-size-weighted mean of batch losses) updates its patience and, on a strict improvement, its best-weights
snapshot; it stops after ``patience`` epochs without improvement or at ``max_epochs``; then its best weights are
restored and its own module evaluates validation and test with the plain code path (the very metrics ``fit``
reports). A non-finite training or validation loss ends the trial as diverged; the other trials are untouched
(every tensor operation of the pack is per trial).

Within an epoch nothing is read back to the host: losses accumulate on the device and are read once per epoch.
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mtmoe.data.base import shuffled_order
from mtmoe.host_memory import keep_freed_memory
from mtmoe.lit.module import MultiTaskMoE
from mtmoe.pack.adam import PackedAdam
from mtmoe.pack.model import PackedModel

warnings.filterwarnings("ignore", message=".*grad and param do not obey the gradient layout contract.*")


@dataclass
class PackTrial:
    """One configuration to train in a pack: its module (built and initialised under its own seed) and its rules.

    ``key`` is the caller's (a trial number); the other fields after ``patience`` are the trial's progress.
    """

    key: Any
    module: MultiTaskMoE
    data_seed: int
    max_epochs: int
    patience: int
    epochs_run: int = 0
    best_score: float = math.inf
    best_epoch: int = -1
    wait: int = 0
    diverged: str | None = None
    started: float = field(default_factory=time.perf_counter)
    best_own: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class TrialResult:
    """What ``fit`` reports for a trial: ``results`` has ``epochs_run``, ``best_epoch``, ``best_val_loss`` and the
    ``val`` and ``test`` results of the restored best weights; ``diverged`` says why a trial failed."""

    key: Any
    results: dict[str, Any]
    diverged: str | None
    wall_time_s: float


def _batches(split: dict[str, Tensor], size: int) -> list[dict[str, Tensor]]:
    n = len(next(iter(split.values())))
    return [{k: t[start:start + size] for k, t in split.items()} for start in range(0, n, size)]


class PackTrainer:
    """Trains trials ``capacity`` at a time on ``splits`` (train/val/test dicts of tensors).

    Args:
        splits: the dataset's splits; copied to ``device`` once.
        batch_size, eval_batch_size: as the DataModule's (shared by the pack: a structural setting).
        capacity: P, the number of trials trained at once.
        device: where the pack trains.
        precision: ``"32"`` (default, as the paper) or ``"bf16-mixed"`` (autocast to bfloat16 for the forward).
    """

    def __init__(self, splits: dict[str, dict[str, Tensor]], batch_size: int, eval_batch_size: int, capacity: int,
                 device: torch.device | str = "cpu", precision: str = "32") -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if precision not in ("32", "bf16-mixed"):
            raise ValueError(f"precision must be '32' or 'bf16-mixed', got {precision!r}")
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.splits = {name: {k: t.to(self.device) for k, t in split.items()} for name, split in splits.items()}
        self.batch_size, self.capacity, self.precision = batch_size, capacity, precision
        self.eval_batches = {name: _batches(self.splits[name], eval_batch_size) for name in ("val", "test")}
        self.n_train = len(next(iter(self.splits["train"].values())))
        self.steps_per_epoch = -(-self.n_train // batch_size)
        self.model: PackedModel | None = None
        self.adam: PackedAdam | None = None
        self.slots: list[PackTrial | None] = [None] * capacity
        self.best: dict[str, Tensor] | None = None
        self.epochs = 0  # pack epochs run

    # ----------------------------------------------------------------------------------------------------------
    def run(self, next_trial: Callable[[], PackTrial | None], finished: Callable[[TrialResult], None],
            on_epoch: Callable[[PackTrainer], None] | None = None) -> None:
        """Train until ``next_trial`` has no more and every slot is done; ``finished`` receives each trial's result
        as soon as it ends, ``on_epoch`` the trainer after every pack epoch (progress)."""
        exhausted = False
        while True:
            exhausted = exhausted or self._refill(next_trial)
            if not any(self.slots):
                return
            if exhausted and not all(self.slots):
                self._compact()
            self._train_epoch()
            for slot, result in self._end_epoch():
                self.slots[slot] = None
                finished(result)
            if on_epoch is not None:
                on_epoch(self)

    @property
    def running(self) -> list[PackTrial]:
        return [trial for trial in self.slots if trial is not None]

    # ----------------------------------------------------------------------------------------------------------
    def _refill(self, next_trial: Callable[[], PackTrial | None]) -> bool:
        """Fill empty slots; True once ``next_trial`` has run dry."""
        for slot in range(self.capacity):
            if self.slots[slot] is not None:
                continue
            trial = next_trial()
            if trial is None:
                return True
            self._load(slot, trial)
        return False

    def _compact(self) -> None:
        """No trial is left to refill freed slots: continue with a pack of the running trials only (their
        parameters, buffers, Adam moments and best-weights snapshots move along), so no work goes to empty slots."""
        keep = [slot for slot, trial in enumerate(self.slots) if trial is not None]
        model = PackedModel(self.slots[keep[0]].module, len(keep), self.device)
        adam = PackedAdam(model.stack)
        for new, old in enumerate(keep):
            model.load(new, self.slots[old].module)
        adam.take(self.adam, keep)
        index = torch.tensor(keep, device=self.device)
        self.best = None if self.best is None else {name: tensor[index] for name, tensor in self.best.items()}
        self.model, self.adam, self.capacity = model, adam, len(keep)
        self.slots = [self.slots[slot] for slot in keep]

    def _load(self, slot: int, trial: PackTrial) -> None:
        module = trial.module.to(self.device)
        if self.model is None:
            self.model = PackedModel(module, self.capacity, self.device)
            self.adam = PackedAdam(self.model.stack)
        self.model.load(slot, module)
        self.adam.reset(slot, module.lr, module.adam_eps)
        if module.net.local_search is not None:
            module.net.local_search.set_window(self.steps_per_epoch)
        for gate in module.net.gates:
            gate.set_training_steps(self.steps_per_epoch * trial.max_epochs)
        trial.started = time.perf_counter()
        self.slots[slot] = trial

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16-mixed")

    def _train_epoch(self) -> None:
        live = [slot for slot, trial in enumerate(self.slots) if trial is not None]
        orders = torch.stack([
            shuffled_order(self.n_train, trial.data_seed, trial.epochs_run) if trial is not None
            else torch.arange(self.n_train)
            for trial in self.slots
        ]).to(self.device)
        loss_sum = torch.zeros(self.capacity, device=self.device)  # float32 sums, as torchmetrics' MeanMetric
        for start in range(0, self.n_train, self.batch_size):
            index = orders[:, start:start + self.batch_size]
            loss_sum += self._train_step(index, live) * index.shape[1]
        self.train_loss = loss_sum / self.n_train
        self.val_loss = self._validation_loss()
        self.epochs += 1

    def _train_step(self, index: Tensor, live: list[int]) -> Tensor:
        """One optimisation step of every trial on its rows ``index [P, B]`` of the training split; task losses."""
        batch = {key: tensor[index] for key, tensor in self.splits["train"].items()}
        with self._autocast():
            loss, _, aux = self.model.losses(batch, shared_batch=False, training=True)
        self.model.stack.zero_grad()
        (loss + aux).float().sum().backward()
        self.adam.step(live, self.model.unused_parameters())
        return loss.detach().float()

    @torch.no_grad()
    def _validation_loss(self) -> Tensor:
        """Every slot's validation loss ``[P]``: the batch-size-weighted mean of its batch losses, as ``fit``'s."""
        total = torch.zeros(self.capacity, device=self.device)
        count = 0
        for batch in self.eval_batches["val"]:
            size = next(iter(batch.values())).shape[0]
            with self._autocast():
                loss, _, _ = self.model.losses(batch, shared_batch=True, training=False)
            total += loss.float() * size
            count += size
        return total / count

    def _end_epoch(self) -> list[tuple[int, TrialResult]]:
        """Per trial: divergence, early stopping and best-weights bookkeeping; the trials that end."""
        train_loss, val_loss = self.train_loss.tolist(), self.val_loss.tolist()  # the epoch's one host read
        improved, ended = [], []
        for slot, trial in enumerate(self.slots):
            if trial is None:
                continue
            epoch = trial.epochs_run
            trial.epochs_run += 1
            for stage, value in (("val", val_loss[slot]), ("train", train_loss[slot])):  # Lightning's hook order
                if not math.isfinite(value) and trial.diverged is None:
                    trial.diverged = f"{stage} loss {value} at epoch {epoch}"
            if trial.diverged is None and val_loss[slot] < trial.best_score:
                trial.best_score, trial.best_epoch, trial.wait = val_loss[slot], epoch, 0
                improved.append(slot)
            else:
                trial.wait += 1
            if trial.diverged or trial.wait >= trial.patience or trial.epochs_run >= trial.max_epochs:
                ended.append(slot)
        if improved:
            self._snapshot(improved)
        return [(slot, self._finish(slot)) for slot in ended]

    def _snapshot(self, slots: list[int]) -> None:
        self.best = self.model.stack.snapshot(torch.tensor(slots, device=self.device), self.best)
        for slot in slots:
            trial = self.slots[slot]
            trial.best_own = {name: b.clone() for name, b in self.model.stack.own_buffers(trial.module.net).items()}

    def _finish(self, slot: int) -> TrialResult:
        """Restore the trial's best weights into its slot and evaluate them with its own module."""
        trial = self.slots[slot]
        module = trial.module
        results: dict[str, Any] = {"epochs_run": trial.epochs_run}
        if trial.diverged is None and trial.best_epoch >= 0:
            self.model.stack.restore(slot, self.best)
            with torch.no_grad():
                for name, buffer in self.model.stack.own_buffers(module.net).items():
                    buffer.copy_(trial.best_own[name])
            results.update(best_epoch=trial.best_epoch, best_val_loss=trial.best_score)
            for stage in ("val", "test"):
                results[stage] = module.evaluate(self.eval_batches[stage], stage)
            if module.net.local_search is not None:
                results["permutation"] = {"assignment": module.net.local_search.assignment(),
                                          **module.net.local_search.statistics()}
        return TrialResult(trial.key, results, trial.diverged, round(time.perf_counter() - trial.started, 2))


def memory_per_trial(example: MultiTaskMoE, splits: dict[str, dict[str, Tensor]], batch_size: int,
                     eval_batch_size: int, device: torch.device, precision: str = "32") -> int:
    """The GPU memory one more trial adds to a pack, in bytes: the difference of the peaks of a training step and
    an evaluation batch in packs of two and of one throwaway copy of ``example``, plus its best-weights snapshot."""
    def peak(capacity: int) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        trainer = PackTrainer(splits, batch_size, eval_batch_size, capacity, device, precision)
        for slot in range(capacity):
            trainer._load(slot, PackTrial(None, copy.deepcopy(example), 0, 1, 1))
        trainer._train_step(torch.arange(batch_size, device=device).expand(capacity, -1), list(range(capacity)))
        with torch.no_grad(), trainer._autocast():
            trainer.model.losses(trainer.eval_batches["val"][0], shared_batch=True, training=False)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base

    one = peak(1)
    snapshot = sum(t.numel() * t.element_size() for t in (*example.net.parameters(), *example.net.buffers()))
    return max(peak(2) - one, 1) + snapshot
