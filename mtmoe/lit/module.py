"""Lightning over the training engine (:mod:`mtmoe.pack.engine`): one loop for ``fit`` and for ``tune``'s packs.

:class:`EngineModule` is a LightningModule with manual optimisation whose training step is the engine's step
(forward, backward and Adam of every slot, captured in a CUDA graph on a GPU), whose validation and test steps
are the engine's evaluation, and whose epoch end applies the engine's per-trial rules (divergence, early stopping,
best weights). Lightning keeps what it is good at: the loop, ``--trainer.*`` (``max_epochs``,
``limit_{train,val,test}_batches``, ``check_val_every_n_epoch``, precision, accelerator, ...), callbacks, loggers,
checkpoints and the progress bar.

* :class:`MultiTaskMoE` (``fit``, ``validate``, ``test``): one trial, a built net and its training settings;
  it logs every epoch's results, stops when its trial ends, and restores the best epoch's weights at the end of fit;
  checkpoints hold the net's weights and the engine's state (Adam's moments, the trial's progress and best weights),
  so a resumed run continues exactly.
* :class:`PackModule` (``tune --pack P``): P slots filled from a trial source, each finished trial's slot refilled
  at the epoch's end and the trial tested (with others that ended near it) and handed back to the source, until the
  source runs dry.

The loss (comet-protocol.md §5): ``sum_t w_t L_t`` plus the gates' auxiliary losses in training; validation and test
losses are pure task losses, and ``loss`` is the official code's batch-size-weighted mean of per-batch losses
(``loss_dataset`` uses dataset-level task losses). AUROC is exact; the official Keras ``AUC()`` is binned.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from mtmoe.data.base import epoch_orders
from mtmoe.dataset_info import DatasetInfo
from mtmoe.errors import UsageError
from mtmoe.mmoe import MMoE, build_net
from mtmoe.pack.engine import EarlyStopping, PackEngine, Trial, TrialResult, Untested
from mtmoe.pack.settings import EngineSettings, ModelSettings, OptimSettings, new_trial, settings_of


#: Pack epochs the first trial that ended waits for others to share its test pass (:class:`PackModule`).
TEST_EVERY = 8


class EngineStep(torch.optim.Optimizer):
    """The engine's training step as Lightning sees an optimiser: ``step(closure)`` runs the closure, which is the
    whole step (forward, backward and the engine's Adam update of every slot); the state is the engine's Adam state,
    so checkpoints hold it and a resumed run restores it. Lightning counts the steps (``global_step``: checkpoint
    and logging intervals) and runs its precision context and hooks around them."""

    def __init__(self, module: EngineModule, lr: float = 0.0) -> None:
        super().__init__([torch.zeros(0)], {"lr": lr})  # no parameter of its own: the engine's are stacked
        self.module = module

    def step(self, closure: Callable[[], Any]) -> Any:
        return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine zeroes its flat gradient inside the step."""

    def state_dict(self) -> dict[str, Any]:
        return self.module.engine.adam.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.module.engine.adam.load_state_dict(state_dict)


def scalars(stage: str, results: dict[str, Any]) -> dict[str, float]:
    """``results`` as loggable scalars: ``stage/key``, a vector's entries as ``stage/key/i``."""
    out = {}
    for key, value in results.items():
        for i, v in enumerate(value) if isinstance(value, list) else [(None, value)]:
            out[f"{stage}/{key}" + ("" if i is None else f"/{i}")] = v
    return out


class EngineModule(pl.LightningModule):
    """The hooks both drivers share; subclasses make :attr:`engine` and say what happens when trials end."""

    engine: PackEngine | None = None
    val_results: list[dict[str, Any]] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> EngineStep:
        return EngineStep(self)

    def train_step(self, batch: dict[str, Tensor]) -> None:
        """One engine step of every slot, run as Lightning's optimiser step."""
        self.optimizers().step(closure=lambda: self.engine.train_step(batch))

    def on_train_start(self) -> None:
        """The epoch's length is known now (``limit_train_batches`` applied): local search's windows and the
        gates' warm-ups count in it."""
        self.engine.set_steps_per_epoch(int(self.trainer.num_training_batches))

    def on_train_epoch_start(self) -> None:
        self.engine.start_epoch()
        self.val_results = None

    def on_validation_epoch_start(self) -> None:
        fitting = self.trainer.state.fn == TrainerFn.FITTING
        self._start_evaluation(track=fitting and not self.trainer.sanity_checking)

    def on_test_epoch_start(self) -> None:
        self._start_evaluation(track=False)

    def _start_evaluation(self, track: bool) -> None:
        """A validation pass of ``fit`` compares each sample's selected experts with the previous validation's and
        records them (``selection_changed``); the sanity check, ``validate`` and a test pass do neither."""
        self.engine.eval_metrics.reset()
        self.engine.eval_metrics.tracking = track
        self.engine.prepare_evaluation()

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.engine.eval_step(batch)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.engine.eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        results = self.engine.eval_metrics.results()
        if not self.trainer.sanity_checking:
            self.val_results = results
            self.evaluated("val", results)

    def on_test_epoch_end(self) -> None:
        self.evaluated("test", self.engine.eval_metrics.results())

    def evaluated(self, stage: str, results: list[dict[str, Any]]) -> None:
        """Every slot's results of a validation (``val``) or test (``test``) pass, as they are computed."""


class MultiTaskMoE(EngineModule):
    """A built multi-gate MoE (:func:`mtmoe.mmoe.build_net`) on one dataset, trained with Adam at a constant
    learning rate: one trial of the engine (lightning-hydra-template's ``MNISTLitModule`` takes its net likewise).

    Args:
        net: the net to train.
        info: the dataset's description.
        optim: its learning rate and task weights (:class:`mtmoe.pack.settings.OptimSettings`).
        engine: how the engine computes its steps (:class:`mtmoe.pack.settings.EngineSettings`); a
            :class:`~mtmoe.pack.settings.ModelSettings` is both.
        stopping: early stopping on the validation loss (``--early_stopping.*``).
        hparams: the ``--model.*`` configuration the net was built from, saved in checkpoints (``validate`` and
            ``test`` rebuild the model from them).
    """

    def __init__(self, net: MMoE, info: DatasetInfo, optim: OptimSettings = OptimSettings(),
                 engine: EngineSettings = EngineSettings(), stopping: EarlyStopping = EarlyStopping(),
                 hparams: dict[str, Any] | None = None) -> None:
        super().__init__()
        if hparams is not None:
            self.save_hyperparameters(hparams, logger=False)
        self.info, self.engine_settings, self.net = info, engine, net
        self.trial = new_trial(info, None, net, optim, engine, stopping=stopping)
        self.last_results: dict[str, dict[str, float | list[float]]] = {}
        self._engine_state: dict[str, Any] | None = None  # from a checkpoint, applied once the engine exists
        self._frozen_reported = False

    @classmethod
    def build(cls, info: DatasetInfo, settings: ModelSettings, stopping: EarlyStopping = EarlyStopping(),
              hparams: dict[str, Any] | None = None) -> MultiTaskMoE:
        """The module of ``settings``' net, built from torch's global generator as it stands (seed it first)."""
        return cls(build_net(info, settings), info, settings, settings, stopping, hparams)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path, map_location: Any = None, strict: bool = True, *,
                             info: DatasetInfo, stopping: EarlyStopping = EarlyStopping()) -> MultiTaskMoE:
        """The module of a ``fit`` checkpoint for ``info``'s dataset (``datamodule.info``), Lightning's route
        (``MultiTaskMoE.load_from_checkpoint(path, info=...)``): the net built from the ``--model.*`` settings the
        checkpoint holds (its weights then loaded, whatever torch's generator gives), the engine's state restored
        when an engine is made. Lightning's own ``load_from_checkpoint`` would pass those settings to ``__init__``,
        which takes a built net."""
        checkpoint = torch.load(checkpoint_path, map_location=map_location, weights_only=True)
        hparams = {key: value for key, value in checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY, {}).items()
                   if not key.startswith("_")}  # Lightning's ``_instantiator`` (checkpoints before ModelSettings)
        if not hparams:
            raise UsageError(f"{checkpoint_path} holds no model settings: not a checkpoint of python -m mtmoe fit")
        module = cls.build(info, settings_of(hparams), stopping, hparams)
        module.on_load_checkpoint(checkpoint)
        module.load_state_dict(checkpoint["state_dict"], strict=strict)
        return module

    def configure_optimizers(self) -> EngineStep:
        return EngineStep(self, self.trial.lr)

    @property
    def diverged(self) -> str | None:
        """Why the fit failed, once a training or validation loss was NaN or infinite."""
        return self.trial.diverged

    def forward(self, batch: dict[str, Tensor]):
        return self.net(batch)

    # ------------------------------------------------------------------------------------------- the engine
    def _make_engine(self) -> None:
        if self.engine is not None:
            return
        max_epochs = self.trainer.max_epochs
        self.trial.max_epochs = max_epochs if max_epochs is not None and max_epochs > 0 else None
        self.engine = PackEngine(self.net, self.info.tasks, 1, self.device, self.engine_settings.cuda_graphs,
                                 self.engine_settings.fused_adam,
                                 self.engine_settings.dense_selection)
        self.engine.load(0, self.trial)
        if self._engine_state is not None:
            self.engine.load_state_dict(self._engine_state)
            self._engine_state = None

    def on_fit_start(self) -> None:
        self._make_engine()

    def on_validation_start(self) -> None:
        self._make_engine()

    def on_test_start(self) -> None:
        self._make_engine()

    # ------------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.train_step({key: tensor.unsqueeze(0) for key, tensor in batch.items()})
        search = self.net.local_search
        if search is not None and not self._frozen_reported and self.trial.steps >= search.window_steps:
            self._frozen_reported = True
            stats = search.statistics()
            rank_zero_info(f"local search: permutation frozen at step {self.trial.steps}, "
                           f"{stats['moved_experts']:.0f} experts moved from the identity; gate slot -> expert: "
                           f"{search.assignment()}")

    def evaluated(self, stage: str, results: list[dict[str, Any]]) -> None:
        self._log_results(stage, results[0])
        if self.trainer.state.fn != TrainerFn.FITTING:  # validate, test: the results of these weights
            self.last_results[stage] = results[0]

    def on_train_epoch_end(self) -> None:
        ended = self.engine.end_epoch(self.val_results)
        record = self.trial.history[-1]
        self._log_results("train", record["train"], prog_bar=False)
        if self.net.local_search is not None:
            self.log_dict({f"perm/{k}": v for k, v in self.net.local_search.statistics().items()})
        if ended:
            self.trainer.should_stop = True

    def on_fit_end(self) -> None:
        """The best epoch's weights back (Keras' ``restore_best_weights``) with that epoch's validation results:
        ``fit`` then tests them."""
        self.engine.restore_best(0)
        summary = self.engine.summary(0)
        if "val" in summary:
            self.last_results["val"] = summary["val"]

    def _log_results(self, stage: str, results: dict[str, Any], prog_bar: bool = True) -> None:
        if self.trainer.sanity_checking:
            return
        logged = scalars(stage, results)
        self.log(f"{stage}/loss", logged.pop(f"{stage}/loss"), prog_bar=prog_bar)
        self.log_dict(logged)

    # ------------------------------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["dataset"] = self.info.name  # the model's shapes follow the dataset: checked on loading
        if self.engine is not None:
            checkpoint["engine"] = self.engine.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A checkpoint must be of this dataset and its permutation match this model's experts: say so in one
        line, not a size mismatch (the command line checks its flags against the checkpoint before this)."""
        dataset = checkpoint.get("dataset", self.info.name)
        if dataset != self.info.name:
            raise UsageError(f"the checkpoint was trained on {dataset}, not {self.info.name}")
        saved = checkpoint["state_dict"].get("net.local_search.log_weights")
        search = self.net.local_search
        if saved is not None and (search is None or saved.shape != search.log_weights.shape):
            expected = "no local search" if search is None else f"permutations of shape {tuple(search.log_weights.shape)}"
            raise UsageError(
                f"the checkpoint holds permutations of shape {tuple(saved.shape)} but this model has {expected} "
                "(check --gate, --model.n_experts and --model.perm_per_task)"
            )
        self._engine_state = checkpoint.get("engine")


class PackBatches:
    """Training batches of a pack: at step s every slot gets rows ``s*B .. (s+1)*B`` of its own trial's order for
    its own epoch (:func:`mtmoe.data.base.shuffled_order` of its data seed), as ``[P, B, ...]`` tensors; an empty
    slot gets the rows in order. The orders are drawn when an epoch starts, for the trials in the slots then."""

    def __init__(self, module: PackModule) -> None:
        self.module = module

    def __len__(self) -> int:
        return -(-self.module.n_train // self.module.batch_size)

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        module = self.module
        split, n = module.splits["train"], module.n_train
        orders = epoch_orders(n, [None if trial is None else (trial.data_seed, trial.epochs_run)
                                  for trial in module.engine.slots]).to(module.device)
        for start in range(0, n, module.batch_size):
            index = orders[:, start:start + module.batch_size]
            yield {key: tensor[index] for key, tensor in split.items()}


class EvalBatches:
    """A split's batches in order, shared by every slot (evaluation): one loader to Lightning, not a list of them."""

    def __init__(self, split: dict[str, Tensor], size: int) -> None:
        n = len(next(iter(split.values())))
        self.batches = [{key: tensor[start:start + size] for key, tensor in split.items()} for start in range(0, n, size)]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        return iter(self.batches)


class PackModule(EngineModule):
    """``tune --pack P``: trains the trials ``next_trial`` gives, P at a time, each slot refilled at the end of the
    epoch its trial ended in; ``finished`` receives every trial's result (its test results those of its best
    weights, on ``limit_test_batches`` of the test split), ``on_epoch`` the module after each epoch, its free slots
    refilled (progress). ``next_trial`` is asked at every epoch's end for every free slot (a trial a dead worker left may have come
    back); when it has none and a quarter of the slots stand empty, the pack shrinks to its running trials (each
    shrink captures the step's CUDA graphs again), and the fit stops when no trial is left.

    The trials that ended are tested together (:meth:`test_untested`: one evaluation pass, whose host cost is the
    same for one trial or many), once the first of them has waited ``test_every`` pack epochs, or when no trial is
    left running; their results reach ``finished`` then. A trial's results are its own whatever the trials tested
    beside it; its slot is refilled at once.

    Args:
        info: the dataset's description.
        splits: the dataset's train/val/test tensors.
        batch_size, eval_batch_size: as the DataModule's (shared by the pack).
        capacity: P.
        next_trial: the next trial to train (built on the CPU), or ``None`` when there is none.
        cuda_graphs, fused_adam, dense_selection: as :class:`mtmoe.pack.settings.EngineSettings`'.
        test_every: pack epochs the first trial that ended waits for others to be tested with (1: each epoch's).
    """

    def __init__(self, info: DatasetInfo, splits: dict[str, dict[str, Tensor]], batch_size: int,
                 eval_batch_size: int, capacity: int, next_trial: Callable[[], Trial | None],
                 finished: Callable[[TrialResult], None], on_epoch: Callable[[PackModule], None] | None = None,
                 cuda_graphs: bool = True, fused_adam: bool = True, dense_selection: str = "topk",
                 test_every: int = TEST_EVERY) -> None:
        super().__init__()
        self.test_every, self.epochs_done = test_every, 0
        self.untested: list[tuple[int, Untested]] = []  # (the pack epoch it ended in, the trial)
        self.info, self.splits, self.capacity = info, splits, capacity
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.next_trial, self.finished, self.on_epoch = next_trial, finished, on_epoch
        self.cuda_graphs, self.fused_adam, self.dense_selection = cuda_graphs, fused_adam, dense_selection
        self.n_train = len(next(iter(splits["train"].values())))

    def train_dataloader(self) -> PackBatches:
        return PackBatches(self)

    def val_dataloader(self) -> EvalBatches:
        return EvalBatches(self.splits["val"], self.eval_batch_size)

    def test_batches(self) -> list[dict[str, Tensor]]:
        """The test split's batches ``limit_test_batches`` keeps (Lightning's rule: a count, or a fraction)."""
        batches = EvalBatches(self.splits["test"], self.eval_batch_size).batches
        limit = self.trainer.limit_test_batches
        keep = min(len(batches), limit) if isinstance(limit, int) else max(1, int(len(batches) * limit))
        return batches[:keep]

    def on_fit_start(self) -> None:
        self.splits = {name: {key: t.to(self.device) for key, t in split.items()} for name, split in self.splits.items()}
        first = self.next_trial()
        if first is None:
            self.trainer.should_stop = True
            return
        self.engine = PackEngine(first.net, self.info.tasks, self.capacity, self.device, self.cuda_graphs,
                                 self.fused_adam, self.dense_selection)
        self.engine.load(0, first)
        self._refill()

    def test_untested(self) -> list[TrialResult]:
        """The trials that ended and wait for their test pass, tested together now: their results."""
        untested, self.untested = [trial for _, trial in self.untested], []
        return self.engine.test(untested, self.test_batches()) if untested else []

    def _refill(self) -> None:
        for slot in self.engine.free_slots():
            trial = self.next_trial()
            if trial is None:
                break
            self.engine.load(slot, trial)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.train_step(batch)

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self.epoch_started = time.perf_counter()

    def on_train_epoch_end(self) -> None:
        start = time.perf_counter()
        ended = self.engine.end_epoch(self.val_results)
        self.untested += [(self.epochs_done, trial) for trial in self.engine.release(ended)]
        trained = len(self.engine.running) + len(ended)
        released = time.perf_counter()
        self._refill()
        refilled = time.perf_counter()
        due = self.untested and (not self.engine.running
                                 or self.epochs_done - self.untested[0][0] + 1 >= self.test_every)
        results = self.test_untested() if due else []
        tested = time.perf_counter()
        for result in results:
            self.finished(result)
        self.epochs_done += 1
        # where this epoch's wall time went (host clock; the epoch end reads device values, so each part includes
        # the device work it waited for): tune's pack-epochs.csv
        self.epoch_seconds = {"slots": self.engine.capacity, "trained": trained, "ended": len(ended),
                              "tested": len(results), "train_val_s": start - self.epoch_started,
                              "end_s": released - start, "refill_s": refilled - released, "test_s": tested - refilled,
                              "results_s": time.perf_counter() - tested}
        if self.on_epoch is not None:
            self.on_epoch(self)
        if not self.engine.running:
            self.trainer.should_stop = True
        elif 4 * len(self.engine.free_slots()) >= self.engine.capacity:
            self.engine = self.engine.compacted()
