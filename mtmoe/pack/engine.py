"""The training engine: P trials of one model structure trained as one model, each with its own hyperparameters,
data order, random stream, early stopping, best weights and divergence; ``fit`` is a pack of one.

A step of the pack runs the plain modules' own code (:class:`mtmoe.mmoe.MMoE`, its gates and local search, and
:func:`mtmoe.losses.multitask_loss`) under ``torch.func.vmap`` over the stacked tensors of
:class:`~mtmoe.pack.stack.TrialStack`, then one backward pass and one :class:`~mtmoe.pack.adam.PackedAdam` update
of every trial: each kernel is launched once per pack, whatever P. Nothing in a step reads a device value on the
host: a trial's schedules are its own buffers (local search's window, CompeteSMoE's coin, the random stream's
step), driven through one interface (:class:`mtmoe.schedules.Schedule`, found by walking the template's modules),
its losses and routing statistics accumulate on the device (:class:`~mtmoe.pack.metrics.PackMetrics`), and
on a GPU the whole step (forward, backward, Adam) is captured once per batch shape in a CUDA graph and replayed
(:class:`~mtmoe.pack.graphs.CapturedStep`; ``cuda_graphs=False`` runs it eagerly), and so is each evaluation batch
of a pass (``MTMOE_PLAIN_KERNELS=eval_graphs`` runs those eagerly). ``vmap`` runs with
``randomness="error"``: a trial's every random draw comes from its own counter-based stream (:mod:`mtmoe.random`),
so it depends on its seed and its own step alone, not on its slot, its neighbours or the pack size.

Per epoch, the driver (:class:`mtmoe.lit.module.EngineModule`, inside Lightning) calls :meth:`PackEngine.train_step`
for each batch, :meth:`PackEngine.eval_step` for each validation batch and :meth:`PackEngine.end_epoch`, which reads
the epoch's losses once and applies each trial's rules as ``fit`` does for one trial alone (Keras'
``EarlyStopping(patience, min_delta, restore_best_weights=True)``): a non-finite validation or training loss ends the
trial as diverged; a validation loss below the best by more than ``min_delta`` is the new best (its weights and
validation results kept on the device, in one snapshot for all trials); ``patience`` validations without one, or
``max_epochs`` epochs, end it. A schedule's host-side work (local search's linear assignment, eq. 5 of the COMET
paper) runs between steps, in its :meth:`~mtmoe.schedules.Schedule.before_step` and
:meth:`~mtmoe.schedules.Schedule.before_evaluation`.
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
from torch.func import functional_call, vmap

from mtmoe.dataset_info import TaskSpec
from mtmoe.host_memory import keep_freed_memory
from mtmoe.losses import multitask_loss
from mtmoe.mmoe import MMoE
from mtmoe.pack.adam import PackedAdam
from mtmoe.pack.graphs import CapturedStep
from mtmoe.pack.metrics import PackMetrics
from mtmoe.pack.stack import TrialStack
from mtmoe.plain_kernels import plain_kernels
from mtmoe.schedules import Trials, local_state, schedules
# a one-row parameter's gradient view has the stride of its row in the flat gradient, which the contract's check
# does not expect; autograd still accumulates in place
warnings.filterwarnings("ignore", message=".*grad and param do not obey the gradient layout contract.*")


def shared(batch: dict[str, Tensor], capacity: int) -> dict[str, Tensor]:
    """One batch every slot sees (evaluation), as a ``[P, B, ...]`` view: the vmapped step takes the same layout in
    training and evaluation (and no operation's batching rule then depends on which)."""
    return {key: tensor.expand(capacity, *tensor.shape) for key, tensor in batch.items()}


@dataclass
class EarlyStopping:
    """Keras' ``EarlyStopping(monitor="val_loss", patience, min_delta, restore_best_weights=True)``: a trial stops
    after ``patience`` validations without a validation loss below its best by more than ``min_delta``, and its
    best epoch's weights are the ones tested (the paper: patience 25)."""

    patience: int = 25
    min_delta: float = 0.0


@dataclass
class Trial:
    """One configuration to train: its built net (initialised under its own seed) and its own settings.

    ``key`` is the caller's; the fields after ``min_delta`` are the trial's progress, kept by the engine.
    """

    key: Any
    net: MMoE
    task_weights: tuple[float, ...]
    lr: float
    adam_eps: float
    data_seed: int
    max_epochs: int | None  # None: until early stopping
    patience: int
    min_delta: float = 0.0
    epochs_run: int = 0
    steps: int = 0  # training forward passes so far (a host-side mirror of the trial's own counters)
    best_score: float = math.inf
    best_epoch: int = -1
    best_results: dict[str, Any] | None = None  # the best epoch's validation results
    wait: int = 0
    diverged: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)  # per epoch: its train (and val) results
    started: float = field(default_factory=time.perf_counter)
    saved: dict[str, Any] | None = None  # a checkpoint's state to continue from (PackEngine.checkpoint), once loaded

    def stopped(self) -> bool:
        return (self.diverged is not None or self.wait >= self.patience
                or (self.max_epochs is not None and self.epochs_run >= self.max_epochs))


@dataclass
class TrialResult:
    """What ``fit`` reports for a trial: ``results`` has ``epochs_run``, ``best_epoch``, ``best_val_loss``, the
    ``val`` results of the best epoch and the ``test`` results of its weights; ``diverged`` says why it failed."""

    key: Any
    results: dict[str, Any]
    diverged: str | None
    wall_time_s: float


@dataclass
class Untested:
    """A trial ended and released (:meth:`PackEngine.release`), its test pass to come: its result so far and, if it
    has best weights to test, a copy of them and of its task weights, and local search's final permutation."""

    result: TrialResult
    best: dict[str, Tensor] | None = None
    task_weights: Tensor | None = None
    permutation: dict[str, Any] | None = None


class PackEngine:
    """``capacity`` slots of one model structure, on ``device``.

    Args:
        example: a net of the pack's structure (its values are not used).
        tasks: the dataset's tasks.
        capacity: P, the number of slots.
        device: where the stacked tensors live.
        cuda_graphs: on a GPU, capture the training step in CUDA graphs (default) or run it eagerly.
        fused_adam: Adam in one kernel for all trials (default), or in element-wise torch operations
            (:class:`~mtmoe.pack.adam.PackedAdam`).
        dense_selection: the experts a dense gate's routing statistics count as selected, ``topk`` (its ``k``
            largest weights) or ``above_uniform`` (weights above ``1/n``): :mod:`mtmoe.pack.metrics`.

    :attr:`eval_metrics` tracks the selections from one evaluation pass to the next (``selection_changed``) unless
    its ``tracking`` is turned off (a test pass).

    The training batches per epoch (local search's windows and the gates' warm-ups count in them) are set with
    :meth:`set_steps_per_epoch` before the first training step. Every :class:`~mtmoe.schedules.Schedule` in the
    net is driven through its hooks, each on its own stacked buffers (:meth:`schedule_state_dict`).
    """

    TRIAL_PROGRESS = ("epochs_run", "steps", "best_score", "best_epoch", "best_results", "wait", "diverged",
                      "history")

    def __init__(self, example: MMoE, tasks: tuple[TaskSpec, ...], capacity: int, device: torch.device | str,
                 cuda_graphs: bool = True, fused_adam: bool = True, dense_selection: str = "topk") -> None:
        self.tasks, self.capacity, self.steps_per_epoch = tasks, capacity, None
        self.device = torch.device(device)
        if self.device.type == "cpu":  # a step's large activations reuse freed memory instead of faulting in pages
            keep_freed_memory()
        self.stack = TrialStack(example, capacity, self.device)
        self.adam = PackedAdam(self.stack, fused_adam)
        self.template = copy.deepcopy(example).to("meta")
        self.schedules = schedules(self.template)
        self.schedule_states = [local_state(prefix, self.stack.buffers) for prefix, _ in self.schedules]
        self.task_weights = torch.zeros(capacity, len(tasks), device=self.device)
        self.dense_selection = dense_selection
        self.train_metrics = self._metrics(capacity, self.task_weights)
        self.eval_metrics = self._metrics(capacity, self.task_weights)
        self.eval_metrics.tracking = True
        self.aux_sum = torch.zeros(capacity, device=self.device)
        self.slots: list[Trial | None] = [None] * capacity
        self.best: dict[str, Tensor] | None = None
        self.captured = self.captured_eval = None
        if cuda_graphs and self.device.type == "cuda":
            self.captured = CapturedStep(self._train_step)
            if "eval_graphs" not in plain_kernels():
                self.captured_eval = CapturedStep(self._eval_step, self.captured.pool)
        self._eval_buffers: tuple = ()  # the sample buffers the evaluation graphs write (data pointers, shapes)
        self.cast_names = frozenset(f"{prefix}.{name}" if prefix else name
                                    for prefix, module in self.template.named_modules()
                                    for name in getattr(module, "autocast_parameters", ()))
        self._copies: dict[str, Tensor] = {}
        self._snapshot: dict[str, dict[str, Tensor]] = {}  # snapshot(on_device=True)'s buffers
        self._forward = vmap(self._trial_losses, in_dims=(0, 0, 0, None), randomness="error")

    def _metrics(self, capacity: int, task_weights: Tensor) -> PackMetrics:
        gate = self.template.gates[0]
        selection = "nonzero" if gate.sparse else self.dense_selection
        return PackMetrics(self.tasks, self.template.experts.n_experts, gate.simplex, capacity, self.device,
                           task_weights, selection, min(gate.dims.k, gate.n_experts))

    # ----------------------------------------------------------------------------------------------- slots
    @property
    def running(self) -> list[tuple[int, Trial]]:
        return [(slot, trial) for slot, trial in enumerate(self.slots) if trial is not None]

    def free_slots(self) -> list[int]:
        return [slot for slot, trial in enumerate(self.slots) if trial is None]

    def load(self, slot: int, trial: Trial) -> None:
        """Put a trial into ``slot``: the stack takes its net's values (the net keeps views of them), Adam starts
        fresh with its learning rate and epsilon, its schedules learn the epoch's length."""
        net = trial.net.to(self.device)
        self._plan(trial)
        self.stack.load(slot, net)
        self.adam.reset(slot, trial.lr, trial.adam_eps)
        self.task_weights[slot] = torch.tensor(trial.task_weights, dtype=self.task_weights.dtype)
        self.eval_metrics.forget([slot])
        trial.started = time.perf_counter()
        self.slots[slot] = trial
        if trial.saved is not None:
            self._resume(slot, trial)

    @torch.no_grad()
    def _resume(self, slot: int, trial: Trial) -> None:
        """A checkpointed trial (:meth:`checkpoint`) continues in ``slot`` from where it was saved: its tensors,
        Adam's state, best weights and progress."""
        saved, trial.saved = trial.saved, None
        for name, tensor in self.stack.tensors().items():
            tensor[slot] = saved["tensors"][name]
        self.adam.load_slot(slot, saved["adam"])
        if saved["best"] is not None:
            if self.best is None:  # the other slots' rows are theirs to overwrite when they improve
                self.best = {name: tensor.clone() for name, tensor in self.stack.tensors().items()}
            for name, tensor in self.best.items():
                tensor[slot] = saved["best"][name]
        self.eval_metrics.load_selections(slot, *saved["selections"])
        for name, value in saved["progress"].items():
            setattr(trial, name, value)

    def drop(self, slot: int) -> None:
        """Free ``slot`` without a result (its trial was taken over elsewhere); the slot is refilled by :meth:`load`."""
        self.slots[slot] = None

    def set_steps_per_epoch(self, steps: int) -> None:
        self.steps_per_epoch = steps
        for _, schedule in self.schedules:  # the template's host flags (the slots' buffers are planned per trial)
            schedule.plan(steps, None)
        for _, trial in self.running:
            self._plan(trial)

    def _plan(self, trial: Trial) -> None:
        """A trial's schedules learn the run's length in steps (local search's window, CompeteSMoE v2's warm-up)."""
        if self.steps_per_epoch is None:
            return
        total = None if trial.max_epochs is None else self.steps_per_epoch * trial.max_epochs
        for prefix, _ in self.schedules:
            trial.net.get_submodule(prefix).plan(self.steps_per_epoch, total)

    def _trials(self, prefix: str) -> Trials:
        """The running trials' own schedule modules at ``prefix`` and their steps so far (the host hooks' view)."""
        return {slot: (trial.net.get_submodule(prefix), trial.steps) for slot, trial in self.running}

    def schedule_state_dict(self) -> dict[str, Tensor]:
        """Every schedule's state, ``[P, ...]`` tensors by qualified buffer name (the stack's own, not copies): what a
        pack checkpoint saves beside the parameters, Adam's state and :meth:`state_dict`'s trial progress (whose
        ``steps`` is the host-side mirror the host hooks read)."""
        return {f"{prefix}.{name}" if prefix else name: tensor
                for (prefix, _), state in zip(self.schedules, self.schedule_states) for name, tensor in state.items()}

    @torch.no_grad()
    def load_schedule_state_dict(self, state: dict[str, Tensor]) -> None:
        for name, tensor in self.schedule_state_dict().items():
            tensor.copy_(state[name])

    def compacted(self) -> PackEngine:
        """A pack of the running trials only (their state, Adam moments and best-weights snapshots move along), to
        continue with once no trial is left to refill the free slots: no work goes to empty slots."""
        keep = [slot for slot, _ in self.running]
        trials = [self.slots[slot] for slot in keep]
        smaller = PackEngine(trials[0].net, self.tasks, len(keep), self.device, self.captured is not None,
                             self.adam.fused, self.dense_selection)
        smaller.steps_per_epoch = self.steps_per_epoch
        smaller.stack.take(self.stack, keep)
        smaller.adam.take(self.adam, keep)
        smaller.eval_metrics.take(self.eval_metrics, keep)
        smaller.task_weights.copy_(self.task_weights[keep])
        index = torch.tensor(keep, device=self.device)
        smaller.best = None if self.best is None else {name: t[index] for name, t in self.best.items()}
        for new, trial in enumerate(trials):  # the nets follow their state into the new stack
            self.stack.unload(keep[new], trial.net)
            smaller.stack.load(new, trial.net)
        smaller.slots = trials
        return smaller

    # ----------------------------------------------------------------------------------------------- steps
    def _trial_losses(self, tensors: dict[str, Tensor], batch: dict[str, Tensor], task_weights: Tensor,
                      training: bool) -> tuple[Tensor, ...]:
        """One trial's forward pass and losses (vmapped over the trials)."""
        output = functional_call(self.template, tensors, (batch,))
        loss, task_losses, counts = multitask_loss(self.tasks, task_weights, output.predictions, batch)
        weights = torch.stack([gate.weights for gate in output.gates], dim=1)  # [B, T, n]
        aux = output.aux_loss if training else loss.new_zeros(())
        return loss, aux, torch.stack(task_losses), torch.stack(counts).to(loss.dtype), output.predictions, weights

    def _schedule_updates(self) -> tuple[dict[str, Tensor], Tensor | None]:
        """This step's Adam arguments from the schedules: the parameters each trial leaves as they are
        (``frozen_parameters``, by full name) and the product of their learning-rate factors (``None``: none)."""
        skip, lr_scale = {}, None
        for (prefix, schedule), state in zip(self.schedules, self.schedule_states):
            frozen = schedule.frozen_parameters(state)
            skip.update({f"{prefix}.{name}" if prefix else name: mask for name, mask in frozen.items()})
            scale = schedule.lr_scale(state)
            if scale is not None:
                lr_scale = scale if lr_scale is None else lr_scale * scale
        return skip, lr_scale

    def _tensors(self) -> dict[str, Tensor]:
        return {**self.stack.params, **self.stack.buffers}

    def train_step(self, batch: dict[str, Tensor]) -> None:
        """One optimisation step of every slot on its own rows ``batch`` (``[P, B, ...]`` tensors)."""
        for (prefix, schedule), state in zip(self.schedules, self.schedule_states):
            schedule.before_step(state, self._trials(prefix))
        for _, trial in self.running:
            trial.steps += 1
        self._copies = self._bfloat16_copies()
        if self.captured is None:
            self._train_step(batch)
        else:
            size = next(iter(batch.values())).shape[1]
            self.captured((size, *self._flags()), batch)

    def _flags(self) -> tuple:
        """The schedules' host flags, which change what a step computes (a CUDA graph per value)."""
        return tuple(flag for _, schedule in self.schedules for flag in schedule.flags())

    def _bfloat16_copies(self) -> dict[str, Tensor]:
        """Under bfloat16 autocast, the parameters that the model only ever uses cast to bfloat16 (a module's
        ``autocast_parameters``: the expert layer's and the towers' hidden layers'), as the bfloat16 copies Adam
        writes (:meth:`PackedAdam.bfloat16_copies`), in place of autocast's cast of each of them each step: the
        same values. Outside autocast, none. On the host, before a captured step: the copies' tensors stay the same."""
        device = self.device.type
        if not (self.cast_names and torch.is_autocast_enabled(device)
                and torch.get_autocast_dtype(device) == torch.bfloat16):
            return {}
        return self.adam.bfloat16_copies(self.cast_names)

    def _train_step(self, batch: dict[str, Tensor]) -> None:
        self.template.train()
        gradients = self.adam.bfloat16_gradients() if self._copies else {}
        parameters = self.stack.tracked(self._copies, gradients, keep=self.adam.reads_kept())
        loss, aux, task_losses, counts, predictions, weights = self._forward(
            {**parameters, **self.stack.buffers}, batch, self.task_weights, True)
        (loss + aux).float().sum().backward()
        self.stack.zero_unreached()
        self.adam.step(*self._schedule_updates(), copies=bool(self._copies), gradients=bool(gradients),
                       kept=self.stack.kept)
        with torch.no_grad():
            for (_, schedule), state in zip(self.schedules, self.schedule_states):
                schedule.on_step(state)
            self.train_metrics.update(predictions, task_losses, counts, loss.detach(), batch, weights,
                                      prediction_metrics=False)
            self.aux_sum.add_(aux.detach().float() * weights.shape[1])

    @torch.no_grad()
    def eval_step(self, batch: dict[str, Tensor]) -> None:
        """Evaluate every slot on one shared batch (``[B, ...]`` tensors) into :attr:`eval_metrics` (after
        :meth:`prepare_evaluation`). On a GPU each batch of a pass is captured in a CUDA graph (keyed by its rows in
        the pass and the schedules' flags) and replayed in later passes, as the training step is; the graphs are
        captured again when the metrics' sample buffers have grown (a pass's first batches grow them); the one Python
        state a batch changes, the metrics' ``offset``, is set here."""
        if self.captured_eval is None:
            self._eval_step(batch)
            return
        metrics = self.eval_metrics
        start, size = metrics.offset, next(iter(batch.values())).shape[0]
        metrics.reserve(start + size)  # no buffer grows inside a capture
        buffers = tuple((t.data_ptr(), tuple(t.shape)) for t in metrics.sample_buffers())
        if buffers != self._eval_buffers:
            self._eval_buffers = buffers
            self.captured_eval.drop_graphs()
        self.captured_eval((start, size, metrics.tracking, *self._flags()), batch)
        metrics.offset = start + size

    def _eval_step(self, batch: dict[str, Tensor]) -> None:
        self.template.eval()
        loss, _, task_losses, counts, predictions, weights = self._forward(
            self._tensors(), shared(batch, self.capacity), self.task_weights, False)
        self.eval_metrics.update(predictions, task_losses, counts, loss, batch, weights)

    @torch.no_grad()
    def evaluate(self, tensors: dict[str, Tensor], task_weights: Tensor, batches) -> list[dict[str, Any]]:
        """The results on ``batches`` of the trials whose stacked tensors (``[K, ...]``, best weights say) and task
        weights are given: the same vmapped forward pass and metrics as :meth:`eval_step`, for those trials alone."""
        metrics = self._metrics(len(task_weights), task_weights)
        for prefix, schedule in self.schedules:
            schedule.before_evaluation(local_state(prefix, tensors), None)
        self.template.eval()
        for batch in batches:
            loss, _, task_losses, counts, predictions, weights = self._forward(
                tensors, shared(batch, len(task_weights)), task_weights, False)
            metrics.update(predictions, task_losses, counts, loss, batch, weights)
        return metrics.results()

    def prepare_evaluation(self) -> None:
        """Before evaluating the live slots: each schedule's :meth:`~mtmoe.schedules.Schedule.before_evaluation`
        (local search rounds the soft permutations of the trials inside their window)."""
        for (prefix, schedule), state in zip(self.schedules, self.schedule_states):
            schedule.before_evaluation(state, self._trials(prefix))

    # ----------------------------------------------------------------------------------------------- epochs
    def start_epoch(self) -> None:
        self.train_metrics.reset()
        self.eval_metrics.reset()
        self.aux_sum.zero_()

    def end_epoch(self, val: list[dict[str, Any]] | None) -> list[int]:
        """Apply each trial's rules to the epoch just run, given its validation results per slot (``None``: no
        validation this epoch), and return the slots whose trial ended. Reads the epoch's training values once."""
        train = self.train_metrics.results()
        aux = (self.aux_sum / self.train_metrics.batch_loss_weight).tolist()
        improved = torch.zeros(self.capacity, dtype=torch.bool)
        ended = []
        for slot, trial in self.running:
            epoch = trial.epochs_run
            trial.epochs_run += 1
            record = {"epoch": epoch, "train": {**train[slot], "aux_loss": aux[slot]}}
            if val is not None:
                record["val"] = val[slot]
            trial.history.append(record)
            losses = ([("val", val[slot]["loss"])] if val is not None else []) + [("train", train[slot]["loss"])]
            for stage, value in losses:  # Lightning's hook order: validation ends before the training epoch
                if not math.isfinite(value) and trial.diverged is None:
                    trial.diverged = f"{stage} loss {value} at epoch {epoch}"
            if val is not None:
                score = val[slot]["loss"]
                if trial.diverged is None and score < trial.best_score - trial.min_delta:
                    trial.best_score, trial.best_epoch, trial.wait = score, epoch, 0
                    trial.best_results = val[slot]
                    improved[slot] = True
                else:
                    trial.wait += 1
            if trial.stopped():
                ended.append(slot)
        if improved.any():
            self.best = self.stack.snapshot(improved.to(self.device), self.best)
        for (_, schedule), state in zip(self.schedules, self.schedule_states):
            schedule.on_epoch_end(state)
        return ended

    # ----------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs beside the nets' own state and Adam's (:attr:`adam`): each trial's progress, the
        best weights and the recorded selections (``fit`` saves it in its checkpoints)."""
        return {"best": self.best, "selections": (self.eval_metrics.previous, self.eval_metrics.recorded),
                "trials": [None if trial is None else {name: getattr(trial, name) for name in self.TRIAL_PROGRESS}
                           for trial in self.slots]}

    def checkpoint(self, on_device: bool = False) -> list[tuple[Any, dict[str, Any]]]:
        """Each running trial that has trained an epoch, with its state copied as it stands (an epoch's end) to the
        host, or ``on_device``: into buffers on the engine's device that the next such call overwrites (a snapshot
        without a transfer, and no new memory each epoch):
        parameters and buffers (its random stream's counters, local search's matrices and step), Adam's moments,
        step count, learning rate and epsilon, its best weights, its recorded routing selections, and its progress (:attr:`TRIAL_PROGRESS`: epochs,
        early stopping's best, best epoch and wait, metric history; its step count). The pack's tensors are copied
        once each, then viewed per trial; :meth:`load` continues a trial from its state (``Trial.saved``) in any
        slot, and its data order follows from its epoch (:func:`mtmoe.data.base.shuffled_order`)."""
        return self.snapshot(on_device)()

    def snapshot(self, on_device: bool = False) -> Callable[[], list[tuple[Any, dict[str, Any]]]]:
        """:meth:`checkpoint` in two halves: the copies and each trial's progress now, the trials' states (views of
        the copies, some hundred a trial) when the returned function is called, which ``tune`` does only for the
        checkpoints it writes, before the next ``on_device`` call overwrites the copies."""
        def copied(group: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
            if not on_device:
                return {name: tensor.to("cpu", copy=True) for name, tensor in tensors.items()}
            kept = self._snapshot.setdefault(group, {})
            for name, tensor in tensors.items():
                if name not in kept or kept[name].shape != tensor.shape or kept[name].dtype != tensor.dtype:
                    kept[name] = torch.empty_like(tensor)
                kept[name].copy_(tensor)
            return {name: kept[name] for name in tensors}

        tensors, adam = copied("tensors", self.stack.tensors()), copied("adam", self.adam.state_dict())
        selections = copied("selections", {"previous": self.eval_metrics.previous,
                                           "recorded": self.eval_metrics.recorded})
        previous, recorded = selections["previous"], selections["recorded"]
        best = None if self.best is None else copied("best", self.best)
        progresses = []
        for slot, trial in self.running:
            if trial.epochs_run == 0:
                continue
            progress = {name: getattr(trial, name) for name in (*self.TRIAL_PROGRESS, "steps")}
            progress["history"] = list(trial.history)  # records are appended, never changed
            progresses.append((slot, trial.key, progress, None if best is None or trial.best_epoch < 0 else best))

        def states() -> list[tuple[Any, dict[str, Any]]]:
            return [(key, {"slot": slot, "tensors": {name: t[slot] for name, t in tensors.items()},
                           "adam": self.adam.slot_state(slot, adam), "progress": progress,
                           "selections": (previous[slot], recorded[slot]),
                           "best": None if kept_best is None else {name: t[slot] for name, t in kept_best.items()}})
                    for slot, key, progress, kept_best in progresses]

        return states

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else {name: t.to(self.device) for name, t in state["best"].items()}
        if "selections" in state:  # a checkpoint written before the routing statistics has none
            self.eval_metrics.previous, self.eval_metrics.recorded = (t.to(self.device) for t in state["selections"])
        for trial, progress in zip(self.slots, state["trials"]):
            if trial is not None and progress is not None:
                for name, value in progress.items():
                    setattr(trial, name, value)

    # ----------------------------------------------------------------------------------------------- results
    def summary(self, slot: int) -> dict[str, Any]:
        """The trial's epochs, its best epoch and the best epoch's validation results (what ``fit`` reports beside
        the test results)."""
        trial = self.slots[slot]
        results: dict[str, Any] = {"epochs_run": trial.epochs_run}
        if trial.diverged is None and trial.best_epoch >= 0:
            results.update(best_epoch=trial.best_epoch, best_val_loss=trial.best_score, val=trial.best_results)
        return results

    def restore_best(self, slot: int) -> None:
        """The best epoch's weights and buffers back into ``slot`` (its net sees them)."""
        if self.best is not None and self.slots[slot].best_epoch >= 0:
            self.stack.restore(slot, self.best)

    def release(self, slots: list[int]) -> list[Untested]:
        """End ``slots``' trials untested: give each net its own copy of its best weights (refilling the slot can no
        longer change it), keep another for its test pass (:meth:`test`, which may test the trials of several
        epochs' ends together) and free the slots. A trial's wall time ends here."""
        out = []
        for slot in slots:
            trial = self.slots[slot]
            results = {**self.summary(slot), "history": trial.history}
            tested = trial.diverged is None and trial.best_epoch >= 0
            untested = Untested(TrialResult(trial.key, results, trial.diverged,
                                            round(time.perf_counter() - trial.started, 2)))
            if tested:
                untested.best = {name: tensor[slot:slot + 1].clone() for name, tensor in self.best.items()}
                untested.task_weights = self.task_weights[slot:slot + 1].clone()
            self.stack.unload(slot, trial.net, self.best if tested else None)
            if tested and trial.net.local_search is not None:
                untested.permutation = {"assignment": trial.net.local_search.assignment(),
                                        **trial.net.local_search.statistics()}
            out.append(untested)
            self.slots[slot] = None
        return out

    def test(self, untested: list[Untested], test_batches) -> list[TrialResult]:
        """The results of released trials (:meth:`release`), the best weights of those that have them tested on
        ``test_batches`` in one pass of the pack's vmapped evaluation (a trial's results are its own whatever the
        trials beside it)."""
        tested = [item for item in untested if item.best is not None]
        if tested:
            best = {name: torch.cat([item.best[name] for item in tested]) for name in tested[0].best}
            weights = torch.cat([item.task_weights for item in tested])
            for item, test in zip(tested, self.evaluate(best, weights, test_batches)):
                item.result.results["test"] = test
                if item.permutation is not None:
                    item.result.results["permutation"] = item.permutation
        return [item.result for item in untested]
