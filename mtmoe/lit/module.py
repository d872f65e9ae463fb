"""``MultiTaskMoE``: the LightningModule around :class:`mtmoe.mmoe.MMoE` (losses, metrics, optimiser).

Loss (comet-protocol.md §5): ``sum_t w_t L_t + sum over task gates of their auxiliary losses`` where, for the
recommenders, ``w = (alpha, 1 - alpha)`` over (BCE of task 1, MSE of task 2 on rated rows only, via the batch's
explicit mask), and for the other datasets the tasks are equally weighted. Auxiliary losses exist only in training
mode, so ``val/loss`` and ``test/loss`` are pure task losses (what early stopping and model selection read).

Two test-loss definitions are logged (comet-protocol.md §7.4): ``loss`` is the official code's batch-size-weighted
mean of per-batch losses (masked MSE within each batch), ``loss_dataset`` uses dataset-level task losses.
AUROC is exact (torchmetrics ``BinaryAUROC(thresholds=None)``); the official Keras ``AUC()`` is binned.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric, MeanSquaredError, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, MulticlassAccuracy

from mtmoe.dataset_info import DatasetInfo, TaskSpec
from mtmoe.errors import UsageError
from mtmoe.gates.base import Gate, GateDims
from mtmoe.lit.metrics import RoutingStats
from mtmoe.losses import multitask_loss, task_rows, task_weights
from mtmoe.mmoe import MMoE, MMoEOutput, build_mmoe

STAGES = ("train", "val", "test")


def task_metrics(task: TaskSpec) -> MetricCollection:
    if task.kind == "binary":
        return MetricCollection({"auroc": BinaryAUROC(thresholds=None), "accuracy": BinaryAccuracy()})
    if task.kind == "regression":
        return MetricCollection({"mse": MeanSquaredError()})
    return MetricCollection({"accuracy": MulticlassAccuracy(num_classes=task.n_classes, average="micro")})


class MultiTaskMoE(pl.LightningModule):
    """A multi-gate MoE on one dataset with one gate type, trained with Adam at a constant learning rate.

    Args:
        gate: the gate type, a callable ``GateDims -> Gate`` (on the command line: ``--gate comet`` or
            ``--model.gate mtmoe.gates.COMETGate --model.gate.gamma 1``); one instance per task.
        info: the dataset's description, linked from the DataModule by the CLI.
        lr: Adam's learning rate.
        alpha: weight of task 1 for the two-task recommenders (paper: 0.1 and 0.9; default 0.9).
        n_experts, embedding_dim, expert_units, tower_units, expert_dropout: architecture overrides
            (``None``: the paper's value for the dataset, Supplement S1.2).
        keras_init: initialise bottom, experts and towers as Keras does (the official code); False: PyTorch's.
        adam_eps: Adam's epsilon; 1e-7 is Keras' default (the official code), 1e-8 PyTorch's.
        perm_epochs: E_perm, the permutation-learning window in epochs; set, it makes the "+" variant of the gate
            (``--gate comet+`` sets it to 5, Table 1's value; the paper searches 1..10). ``None``: no local search.
        zeta: the permutation's row/column entropy coefficient (paper: 1e-4; Table 1: 1e-5).
        perm_per_task: one permutation per task gate instead of one shared by all (the official code shares one).
        perm_eval_rounded: evaluate with the rounded permutation inside the window (official); False: soft.
    """

    def __init__(
        self,
        gate: Callable[[GateDims], Gate] | None = None,
        info: DatasetInfo | None = None,
        lr: float = 1e-4,
        alpha: float | None = None,
        n_experts: int | None = None,
        embedding_dim: int | None = None,
        expert_units: int | None = None,
        tower_units: int | None = None,
        expert_dropout: float | None = None,
        keras_init: bool = True,
        adam_eps: float = 1e-7,
        perm_epochs: int | None = None,
        zeta: float = 1e-4,
        perm_per_task: bool = False,
        perm_eval_rounded: bool = True,
    ) -> None:
        super().__init__()
        if gate is None:
            raise UsageError("no gate chosen: pass --gate NAME (see `python -m mtmoe gates`)")
        if info is None:
            raise UsageError("no dataset description: pass --data NAME")
        if not lr > 0:
            raise UsageError(f"lr must be > 0, got {lr}")
        if n_experts is not None and n_experts < 2:
            raise UsageError(f"n_experts must be >= 2, got {n_experts}")
        # ``info`` is derived from the data (linked by the CLI), so checkpoints stay loadable with weights_only=True;
        # ``MultiTaskMoE.load_from_checkpoint(path, info=datamodule.info)`` rebuilds the model.
        self.save_hyperparameters(ignore=["info"], logger=False)
        self.info, self.lr, self.adam_eps = info, lr, adam_eps
        self.weights = task_weights(info, alpha)
        local_search = (
            None
            if perm_epochs is None
            else {"epochs": perm_epochs, "zeta": zeta, "per_task": perm_per_task, "eval_rounded": perm_eval_rounded}
        )
        self.net: MMoE = build_mmoe(
            info, gate, n_experts, embedding_dim, expert_units, tower_units, expert_dropout, keras_init, local_search
        )
        n = self.net.experts.n_experts
        for stage in STAGES:  # separate metric objects per split and task (torchmetrics' rule)
            collections = {
                task.name: MetricCollection(
                    {**task_metrics(task), "loss": MeanMetric(), "routing": RoutingStats(n, self.net.gates[0].simplex)},
                    compute_groups=False,
                )
                for task in info.tasks
            }
            setattr(self, f"{stage}_metrics", nn.ModuleDict(collections))
            setattr(self, f"{stage}_batch_loss", MeanMetric())  # batch-size-weighted mean of batch losses
        self.last_results: dict[str, dict[str, float | list[float]]] = {}
        self.diverged: str | None = None  # why, once a training or validation loss is NaN or infinite
        self._transition_reported = False

    def forward(self, batch: dict[str, Tensor]) -> MMoEOutput:
        return self.net(batch)

    def _step(self, batch: dict[str, Tensor], stage: str) -> Tensor:
        output = self.net(batch)
        batch_size = next(iter(batch.values())).shape[0]
        loss, task_losses, counts = multitask_loss(self.info.tasks, self.weights, output.predictions, batch)
        for task, prediction, gate_output, value, count in zip(
            self.info.tasks, output.predictions, output.gates, task_losses, counts
        ):
            metrics = getattr(self, f"{stage}_metrics")[task.name]
            metrics["loss"].update(value.detach(), count)
            metrics["routing"].update(gate_output.weights)
            if stage != "train":
                prediction, target = task_rows(task, prediction, batch)  # the rows the task's metrics see
                if task.kind == "binary":
                    prediction = prediction.sigmoid()
                    target = target.long()
                for name, metric in metrics.items():
                    if name not in ("loss", "routing") and target.shape[0] > 0:
                        metric.update(prediction.detach(), target)
        getattr(self, f"{stage}_batch_loss").update(loss.detach(), batch_size)
        if stage == "train":
            aux = output.aux_loss
            self.log("train/aux_loss", aux, batch_size=batch_size, on_step=False, on_epoch=True)
            return loss + aux
        return loss

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def epoch_results(self, stage: str) -> dict[str, float | list[float]]:
        """Compute and reset the metrics ``stage``'s steps accumulated (vectors included): what reports show."""
        batch_loss = getattr(self, f"{stage}_batch_loss")
        results: dict[str, float | list[float]] = {"loss": float(batch_loss.compute())}
        batch_loss.reset()
        for task in self.info.tasks:
            collection = getattr(self, f"{stage}_metrics")[task.name]
            for name, metric in collection.items():
                if metric.update_count == 0:
                    continue
                value = metric.compute()
                for key, v in (value if isinstance(value, dict) else {name: value}).items():
                    results[f"{task.name}/{key}"] = v.tolist() if v.numel() > 1 else float(v)
            collection.reset()
        results["loss_dataset"] = sum(w * results[f"{t.name}/loss"] for w, t in zip(self.weights, self.info.tasks))
        return results

    @torch.no_grad()
    def evaluate(self, batches, stage: str) -> dict[str, float | list[float]]:
        """``stage``'s results on ``batches`` in eval mode, without a Trainer (trial packs test this way)."""
        self.eval()
        for batch in batches:
            self._step(batch, stage)
        return self.epoch_results(stage)

    def _log_epoch(self, stage: str) -> None:
        """Compute, log and reset the epoch's metrics; keep val/test results for reports."""
        results = self.epoch_results(stage)
        if not math.isfinite(results["loss"]) and self.diverged is None and not self.trainer.sanity_checking:
            self.diverged = f"{stage} loss {results['loss']} at epoch {self.current_epoch}"
        scalars = {}
        for key, value in results.items():
            for i, v in enumerate(value) if isinstance(value, list) else [(None, value)]:
                scalars[f"{stage}/{key}" + ("" if i is None else f"/{i}")] = v
        self.log(f"{stage}/loss", scalars.pop(f"{stage}/loss"), prog_bar=True)
        self.log_dict(scalars)
        if stage != "train":
            self.last_results[stage] = results

    def on_train_start(self) -> None:
        """Local search's window is E_perm epochs of the actual training loader (not a hard-coded step count);
        gates with a schedule in fractions of the run learn its planned training forward passes."""
        batches = int(self.trainer.num_training_batches)
        if self.net.local_search is not None:
            self.net.local_search.set_window(batches)
        epochs = self.trainer.max_epochs
        for gate in self.net.gates:
            gate.set_training_steps(batches * epochs if epochs is not None and epochs > 0 else None)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        search = self.net.local_search
        if search is not None and search.frozen and not self._transition_reported:
            self._transition_reported = True
            stats = search.statistics()
            rank_zero_info(
                f"local search: permutation frozen at step {int(search.step)}, "
                f"{stats['moved_experts']:.0f} experts moved from the identity; gate slot -> expert: "
                f"{search.assignment()}"
            )

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")
        if self.net.local_search is not None:
            self.log_dict({f"perm/{k}": v for k, v in self.net.local_search.statistics().items()})

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["dataset"] = self.info.name  # the model's shapes follow the dataset: checked on loading

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

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, eps=self.adam_eps, fused=True)
