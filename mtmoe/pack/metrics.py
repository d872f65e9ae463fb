"""Metrics of a trial pack: what :meth:`mtmoe.lit.module.MultiTaskMoE.epoch_results` reports for each trial alone,
computed for P trials at once on the device (:class:`PackMetrics`).

``update`` is a fixed number of tensor operations whatever P (no loop over trials, static shapes, masks used as
weights, no host read); ``results`` reads every trial's values back in one transfer. Keys, their order and the cases
that leave a key out are those of ``epoch_results``.

Sums accumulate in the dtypes torchmetrics and ``RoutingStats`` use (float32 losses and squared errors, int64
counts, float64 routing sums), so that values equal theirs; AUROC is computed once per epoch, in float64.
How the values relate to torchmetrics' on the same per-batch inputs (finite predictions):

* ``loss`` and ``<task>/loss``: equal, bit for bit (``MeanMetric``'s float32 products and sums; a NaN batch value is
  left out as ``MeanMetric``'s default ``nan_strategy="warn"`` leaves it out);
* ``accuracy`` (binary: sigmoid probability > 0.5; multiclass: micro), ``experts_per_sample``, ``selection_rate``,
  ``unused_experts``, ``zero_expert_fraction``, ``simplex_violations``: equal (exact counts, the same division);
* ``mse`` and ``utilisation``: equal up to float32 rounding (a batch's sum runs over all its rows, masked ones as
  zeros: another summation order);
* ``auroc``: the exact Mann-Whitney statistic with ties counted one half, in float64 (0 when the rows hold one class
  only, as torchmetrics); torchmetrics' trapezoid over the same ROC curve carries float32 rounding (about 1e-7);
* ``loss_dataset``: today's formula with the weights as ``task_weights`` holds them (0.9 in float32 is 0.89999998).

``tests/test_pack_metrics.py`` checks these against torchmetrics and ``RoutingStats`` with the tolerances it names.

Evaluation passes (``prediction_metrics``) also measure how each task gate routes (issue 35, item 3), on the experts
it *selects*: a sparse gate's nonzero weights; for a dense gate (``Gate.sparse`` False, Softmax) the ``k`` largest
weights, ``k`` the gate's cardinality ``GateDims.k`` (``selection="topk"``), or with ``selection="above_uniform"``
(``--model.dense_selection above_uniform``) the weights above ``1/n``:

* ``routing_entropy``: the mean over samples of the entropy (nats) of the gate's row scaled to sum 1 (0 for an
  all-zero row), at most ``log n``;
* ``expert_overlap``: the mean over samples and over the other task gates of the Jaccard index of the two gates'
  selected sets (1 when both are empty); left out for a one-task dataset;
* ``expert_load``: per expert, its share of the gate's selections (sums to 1);
* ``selection_changed``: with :attr:`PackMetrics.tracking` on (validation), the share of samples whose selected
  set differs from the one the same trial selected for the same sample in the previous tracked pass; left out when
  no sample has one. The previous selections stay on the device, one bit per expert (``[P, N, T, ceil(n/8)]``
  bytes), filled in as the passes go (the validation batches come in the same order every epoch).

A pass's per-sample values (the recorded selections, a binary task's probabilities for AUROC) go into buffers at the
rows ``[offset, offset + B)`` of its batch. A buffer grows (by doubling) only in :meth:`PackMetrics.reserve`, on a
pass's first batches: afterwards ``update`` changes no Python state but ``offset``, so a CUDA graph of an evaluation
batch, replayed, updates what the eager batch updates (:meth:`mtmoe.pack.engine.PackEngine.eval_step`).

The tests check them against a per-sample computation and a packed trial's against the trial's alone.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mtmoe.dataset_info import TaskSpec
from mtmoe.routing_names import BEHAVIOUR_KEYS

SIMPLEX_TOLERANCE = 1e-5  # a simplex gate's row summing further from 1 counts as a violation
BINARY_THRESHOLD = 0.5  # BinaryAccuracy's default threshold on the probability
ROUTING_KEYS = ("experts_per_sample", "utilisation", "selection_rate", "unused_experts", "zero_expert_fraction",
                "simplex_violations")  # RoutingStats' order
SELECTIONS = ("nonzero", "topk", "above_uniform")  # what a gate selects (module docstring)


def selected_experts(weights: Tensor, selection: str, k: int) -> Tensor:
    """The experts each row of ``weights [..., n]`` selects, as a bool mask (module docstring)."""
    if selection == "nonzero":
        return weights > 0
    if selection == "above_uniform":
        return weights > 1.0 / weights.shape[-1]
    top = weights.topk(k, dim=-1).indices
    return torch.zeros_like(weights, dtype=torch.bool).scatter_(-1, top, True)


def pack_bits(mask: Tensor) -> Tensor:
    """A bool mask ``[..., n]`` as ``ceil(n/8)`` bytes per row, expert ``i`` in bit ``i % 8`` of byte ``i // 8``."""
    n = mask.shape[-1]
    padded = torch.nn.functional.pad(mask.to(torch.uint8), (0, -n % 8))
    grouped = padded.view(*mask.shape[:-1], -1, 8)
    return (grouped << torch.arange(8, dtype=torch.uint8, device=mask.device)).sum(-1, dtype=torch.uint8)


def binary_auroc(scores: Tensor, positive: Tensor, seen: Tensor) -> Tensor:
    """Exact AUROC of each row of ``scores [P, N]`` against ``positive [P, N]`` (bool) over the entries ``seen``
    (bool) selects: the Mann-Whitney statistic, a positive-negative pair of equal scores counting one half; 0 where
    the seen entries hold one class only (torchmetrics' ``BinaryAUROC(thresholds=None)`` then). Float64 ``[P]``."""
    sorted_scores, order = scores.sort(dim=1)
    positives = (positive & seen).gather(1, order).double()
    negatives = (~positive & seen).gather(1, order).double()
    starts = torch.ones_like(sorted_scores, dtype=torch.bool)
    starts[:, 1:] = sorted_scores[:, 1:] != sorted_scores[:, :-1]
    group = starts.cumsum(1) - 1  # tie group of each sorted entry
    group_positives = torch.zeros_like(positives).scatter_add_(1, group, positives)
    group_negatives = torch.zeros_like(negatives).scatter_add_(1, group, negatives)
    negatives_below = group_negatives.cumsum(1) - group_negatives
    wins = (group_positives * (negatives_below + 0.5 * group_negatives)).sum(1)
    pairs = group_positives.sum(1) * group_negatives.sum(1)
    return torch.where(pairs > 0, wins / pairs.clamp_min(1), 0.0)


SELECTION_BUFFERS = ("previous", "recorded")  # PackMetrics' sample buffers of tracked selections
AUROC_BUFFERS = ("auroc_scores", "auroc_positive", "auroc_seen")  # and of the binary tasks' AUROC inputs


class PackMetrics:
    """Every trial's epoch metrics for a pack of ``capacity`` trials: losses, routing statistics and (validation,
    test) the tasks' metrics.

    Args:
        tasks: the dataset's tasks.
        n_experts: the experts each gate weighs.
        simplex: the gates' rows should sum to 1 (reports ``simplex_violations``).
        capacity: P, the number of trials (slots) of the pack.
        device: where the sums accumulate.
        task_weights: ``[P, T]``, each trial's task weights (for ``loss_dataset``); read at ``results()``, so a slot
            refilled in place reports with its new weights.
        selection: what a gate selects, one of :data:`SELECTIONS` (module docstring).
        k: the experts a ``topk`` selection takes.

    :attr:`tracking` (off unless set) makes a pass count ``selection_changed`` and keep its selections for the next.
    """

    def __init__(self, tasks: tuple[TaskSpec, ...], n_experts: int, simplex: bool, capacity: int,
                 device: torch.device | str, task_weights: Tensor, selection: str = "nonzero", k: int = 1) -> None:
        if tuple(task_weights.shape) != (capacity, len(tasks)):
            raise ValueError(f"task_weights must be [{capacity}, {len(tasks)}], got {list(task_weights.shape)}")
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        self.tasks, self.n_experts, self.simplex, self.capacity = tasks, n_experts, simplex, capacity
        self.selection, self.k, self.tracking = selection, k, False
        self.device = torch.device(device)
        self.task_weights = task_weights
        self._every_trial = torch.ones(capacity, dtype=torch.bool, device=self.device)
        P, T, n = capacity, len(tasks), n_experts

        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        # MeanMetric's float32 sums: of batch loss x batch size and batch size; of task loss x count and count
        self.batch_loss_sum, self.batch_loss_weight = zeros(P), zeros(P)
        self.task_loss_sum, self.task_loss_weight = zeros(P, T), zeros(P, T)
        self.updates = zeros(P, dtype=torch.int64)  # batches counted per trial
        # prediction metrics: rows seen, right answers (binary, multiclass), float32 squared errors (regression)
        self.rows, self.correct = zeros(P, T, dtype=torch.int64), zeros(P, T, dtype=torch.int64)
        self.squared_error = zeros(P, T)
        # RoutingStats' float64 sums
        self.weight_sum, self.selected = zeros(P, T, n, dtype=torch.float64), zeros(P, T, n, dtype=torch.float64)
        self.violations, self.empty = zeros(P, T, dtype=torch.float64), zeros(P, T, dtype=torch.float64)
        self.routed_rows = zeros(P, dtype=torch.float64)
        # routing behaviour (evaluation): float64 sums of entropies and Jaccard indices, selections, changed rows
        self.entropy, self.overlap = zeros(P, T, dtype=torch.float64), zeros(P, T, dtype=torch.float64)
        self.chosen, self.evaluated_rows = zeros(P, T, n, dtype=torch.float64), zeros(P, dtype=torch.float64)
        self.changed, self.compared_rows = zeros(P, T, dtype=torch.float64), zeros(P, dtype=torch.float64)
        self.offset = 0  # the pass's next sample
        # the latest tracked selection of each trial and sample (packed bits), and whether it was recorded
        self.previous = zeros(P, 0, T, -(-n // 8), dtype=torch.uint8)
        self.recorded = zeros(P, 0, dtype=torch.bool)
        # the pass's samples, per binary task (its column in ``binary``): sigmoid probability, positive target, seen
        self.binary = {t: column for column, t in enumerate(t for t, task in enumerate(tasks) if task.kind == "binary")}
        self.auroc_scores = zeros(P, 0, len(self.binary))
        self.auroc_positive = zeros(P, 0, len(self.binary), dtype=torch.bool)
        self.auroc_seen = zeros(P, 0, len(self.binary), dtype=torch.bool)

    @property
    def _sums(self) -> tuple[Tensor, ...]:
        return (self.batch_loss_sum, self.batch_loss_weight, self.task_loss_sum, self.task_loss_weight, self.updates,
                self.rows, self.correct, self.squared_error, self.weight_sum, self.selected, self.violations,
                self.empty, self.routed_rows, self.entropy, self.overlap, self.chosen, self.evaluated_rows,
                self.changed, self.compared_rows)

    def reset(self) -> None:
        """Forget everything accumulated (a new epoch); the recorded selections stay, for the next tracked pass."""
        for tensor in self._sums:
            tensor.zero_()
        self.offset = 0

    def forget(self, slots: list[int] | None = None) -> None:
        """Drop the recorded selections of ``slots`` (``None``: every slot), e.g. when a slot gets a new trial."""
        if slots is None:
            self.recorded.zero_()
        elif slots:
            self.recorded[torch.tensor(slots, device=self.device)] = False

    @torch.no_grad()
    def load_selections(self, slot: int, previous: Tensor, recorded: Tensor) -> None:
        """A checkpointed trial's recorded selections (its rows of :attr:`previous` and :attr:`recorded`) into
        ``slot``, the buffers grown to hold them."""
        width = previous.shape[0]
        self._grow(SELECTION_BUFFERS, width)
        self.previous[slot, :width] = previous.to(self.device)
        self.recorded[slot, :width] = recorded.to(self.device)

    def take(self, other: PackMetrics, slots: list[int]) -> None:
        """The recorded selections of ``other``'s ``slots``, in that order (a compacted pack keeps them)."""
        index = torch.tensor(slots, device=self.device)
        self.previous, self.recorded = other.previous[index], other.recorded[index]

    def sample_buffers(self) -> tuple[Tensor, ...]:
        """The buffers a pass fills at its samples' rows (module docstring)."""
        return tuple(getattr(self, name) for name in SELECTION_BUFFERS + AUROC_BUFFERS)

    @torch.no_grad()
    def reserve(self, end: int) -> None:
        """Room in the sample buffers a pass with prediction metrics fills for its samples up to ``end``: the
        selections' (while :attr:`tracking`) and the binary tasks' (each grows by doubling, its rows kept)."""
        self._grow(SELECTION_BUFFERS if self.tracking else (), end)
        if self.binary:
            self._grow(AUROC_BUFFERS, end)

    def _grow(self, names: tuple[str, ...], end: int) -> None:
        for name in names:
            buffer = getattr(self, name)
            width = buffer.shape[1]
            if end > width:
                grow = max(end, 2 * width) - width
                setattr(self, name, torch.cat([buffer, buffer.new_zeros(buffer.shape[0], grow, *buffer.shape[2:])], 1))

    @property
    def loss(self) -> Tensor:
        """Every trial's ``loss`` so far, ``[P]`` float32 on the device (no host read; NaN for a trial with no
        batch counted)."""
        return self.batch_loss_sum / self.batch_loss_weight

    @torch.no_grad()
    def update(self, predictions: list[Tensor], task_losses: Tensor, counts: Tensor, batch_loss: Tensor,
               batch: dict[str, Tensor], weights: Tensor, active: Tensor | None = None, *,
               prediction_metrics: bool = True) -> None:
        """Count one batch of every trial.

        Args:
            predictions: per task, ``[P, B]`` logits or values (one-output tasks) or ``[P, B, C]`` class logits.
            task_losses: ``[P, T]``, each task's mean loss on the rows it sees (``multitask_loss``'s).
            counts: ``[P, T]``, those rows' numbers.
            batch_loss: ``[P]``, ``sum_t w_t L_t``.
            batch: targets and masks, ``[B]`` shared by every trial (evaluation) or ``[P, B]`` (each trial its rows).
            weights: ``[P, B, T, n]``, the gate weights each task's tower received.
            active: ``[P]`` bool, the trials this batch counts for (``None``: all); the others' sums stay as they are.
            prediction_metrics: False counts losses and routing statistics only (a training epoch).
        """
        live = self._every_trial if active is None else active
        batch_size = weights.shape[1]
        self._add_mean(self.batch_loss_sum, self.batch_loss_weight, batch_loss,
                       torch.full_like(self.batch_loss_weight, batch_size), live)
        self._add_mean(self.task_loss_sum, self.task_loss_weight, task_losses, counts, live.unsqueeze(1))
        self.updates += live
        self._add_routing(weights, live)
        if prediction_metrics:
            rows = slice(self.offset, self.offset + batch_size)
            self.reserve(rows.stop)
            self.offset = rows.stop
            selected = selected_experts(weights, self.selection, self.k)
            self._add_behaviour(weights, selected, live)
            if self.tracking:
                self._add_changes(selected, live, rows)
            for t, (task, prediction) in enumerate(zip(self.tasks, predictions)):
                seen = live.unsqueeze(1).repeat(1, batch_size)
                if task.masked:
                    seen &= batch[f"{task.name}_mask"]
                self.rows[:, t] += seen.sum(1)
                self._add_predictions(t, task, prediction, batch[task.name], seen, rows)

    @staticmethod
    def _add_mean(total: Tensor, weight: Tensor, value: Tensor, value_weight: Tensor, live: Tensor) -> None:
        """``MeanMetric.update(value, value_weight)`` elementwise, for live entries with a value that is not NaN."""
        value, value_weight = value.float(), value_weight.float()
        kept = live & ~value.isnan()
        total += torch.where(kept, value * value_weight, 0.0)
        weight += torch.where(kept, value_weight, 0.0)

    def _add_routing(self, weights: Tensor, live: Tensor) -> None:
        """``RoutingStats.update`` of every task gate of every live trial."""
        live_rows = live.view(-1, 1)
        live_experts = live.view(-1, 1, 1)
        routed = weights > 0
        self.weight_sum += torch.where(live_experts, weights.sum(1), 0.0).double()
        self.selected += (routed.sum(1) * live_experts).double()
        self.violations += (((weights.sum(-1) - 1).abs() > SIMPLEX_TOLERANCE).sum(1) * live_rows).double()
        self.empty += ((~routed.any(-1)).sum(1) * live_rows).double()
        self.routed_rows += live * weights.shape[1]

    def _add_behaviour(self, weights: Tensor, selected: Tensor, live: Tensor) -> None:
        """Entropy, Jaccard overlap and selections of every task gate of every live trial (module docstring)."""
        live_rows = live.view(-1, 1)
        rows = weights.double()
        total = rows.sum(-1, keepdim=True)
        shares = torch.where(total > 0, rows / torch.where(total > 0, total, 1.0), 0.0)
        entropy = -torch.special.xlogy(shares, shares).sum(-1)  # [P, B, T]
        self.entropy += torch.where(live_rows, entropy.sum(1), 0.0)  # a diverged trial's NaN rows stay out
        chosen = selected.double()
        common = torch.einsum("pbtn,pbun->pbtu", chosen, chosen)
        sizes = chosen.sum(-1)
        union = sizes.unsqueeze(-1) + sizes.unsqueeze(-2) - common
        jaccard = torch.where(union > 0, common / union.clamp_min(1), 1.0)
        others = max(len(self.tasks) - 1, 1)
        self.overlap += (jaccard.sum(-1) - 1).sum(1) / others * live_rows  # the diagonal's Jaccard is 1
        self.chosen += chosen.sum(1) * live.view(-1, 1, 1)
        self.evaluated_rows += live * weights.shape[1]

    def _add_changes(self, selected: Tensor, live: Tensor, rows: slice) -> None:
        """Count the live trials' samples whose selection differs from the one recorded, and record the new one."""
        bits, old = pack_bits(selected), self.previous[:, rows]
        known = self.recorded[:, rows] & live.view(-1, 1)
        self.changed += ((bits != old).any(-1) & known.unsqueeze(-1)).sum(1).double()
        self.compared_rows += known.sum(1).double()
        self.previous[:, rows] = torch.where(live.view(-1, 1, 1, 1), bits, old)
        self.recorded[:, rows] |= live.view(-1, 1)

    def _add_predictions(self, t: int, task: TaskSpec, prediction: Tensor, target: Tensor, seen: Tensor,
                         rows: slice) -> None:
        """Task ``t``'s metric sums over the rows ``seen [P, B]``; a binary task's probabilities kept for AUROC."""
        if task.kind == "regression":
            error = prediction - target
            self.squared_error[:, t] += torch.where(seen, error * error, 0.0).sum(1)
            return
        if task.kind == "binary":
            probability = prediction.sigmoid()
            positive = target == 1
            hit = (probability > BINARY_THRESHOLD) == positive
            column = self.binary[t]
            self.auroc_scores[:, rows, column] = probability  # exact: a bfloat16 probability is a float32 one
            self.auroc_positive[:, rows, column] = positive
            self.auroc_seen[:, rows, column] = seen
        else:
            hit = prediction.argmax(-1) == target
        self.correct[:, t] += (hit & seen).sum(1)

    def _auroc(self, t: int) -> Tensor:
        if not self.offset:
            return torch.zeros(self.capacity, dtype=torch.float64, device=self.device)
        column, rows = self.binary[t], slice(0, self.offset)
        return binary_auroc(self.auroc_scores[:, rows, column], self.auroc_positive[:, rows, column],
                            self.auroc_seen[:, rows, column])

    def _columns(self) -> tuple[list[tuple[str, Tensor, int | None]], Tensor]:
        """Every result as ``(key, [P, width] values, presence column or None)`` in ``epoch_results``' order, and
        the presence columns ``[P, 3 + T]``: a trial counted a batch; task t's metrics saw a row; an evaluation batch
        measured its routing; a sample had a recorded selection to compare with."""
        count = self.routed_rows.clamp_min(1).view(-1, 1)
        rows = self.rows.float().clamp_min(1)
        T, evaluated = len(self.tasks), self.evaluated_rows.clamp_min(1)
        columns: list[tuple[str, Tensor, int | None]] = [("loss", self.loss, None)]
        for t, task in enumerate(self.tasks):
            metrics = {"loss": (self.task_loss_sum[:, t] / self.task_loss_weight[:, t], 0)}
            if task.kind == "regression":
                metrics["mse"] = (self.squared_error[:, t] / rows[:, t], 1 + t)
            else:
                metrics["accuracy"] = (self.correct[:, t].float() / rows[:, t], 1 + t)
            if task.kind == "binary":
                metrics["auroc"] = (self._auroc(t), 1 + t)
            selected = self.selected[:, t]
            routing = {
                "experts_per_sample": selected.sum(1) / count[:, 0],
                "utilisation": self.weight_sum[:, t] / count,
                "selection_rate": selected / count,
                "unused_experts": (selected == 0).sum(1).double(),
                "zero_expert_fraction": self.empty[:, t] / count[:, 0],
                "simplex_violations": self.violations[:, t] / count[:, 0],
            }
            columns += [(f"{task.name}/{name}", *metrics[name]) for name in sorted(metrics)]  # MetricCollection's
            columns += [(f"{task.name}/{name}", routing[name], 0) for name in ROUTING_KEYS  # order; routing last
                        if self.simplex or name != "simplex_violations"]
            chosen = self.chosen[:, t]
            behaviour = {
                "routing_entropy": (self.entropy[:, t] / evaluated, T + 1),
                "expert_overlap": (self.overlap[:, t] / evaluated, T + 1),
                "expert_load": (chosen / chosen.sum(1, keepdim=True).clamp_min(1), T + 1),
                "selection_changed": (self.changed[:, t] / self.compared_rows.clamp_min(1), T + 2),
            }
            columns += [(f"{task.name}/{name}", *behaviour[name]) for name in BEHAVIOUR_KEYS
                        if T > 1 or name != "expert_overlap"]
        presence = torch.cat([(self.updates > 0).unsqueeze(1), self.rows > 0, (self.evaluated_rows > 0).unsqueeze(1),
                              (self.compared_rows > 0).unsqueeze(1)], dim=1)
        return columns, presence

    @torch.no_grad()
    def results(self) -> list[dict[str, float | list[float]]]:
        """One dict per trial with ``epoch_results``' keys and values; one host transfer for all trials.

        A trial with no batch counted has ``loss`` and ``loss_dataset`` NaN and no other key."""
        columns, presence = self._columns()
        widths = [1 if values.ndim == 1 else values.shape[1] for _, values, _ in columns]
        table = torch.cat([values.double().view(self.capacity, -1) for _, values, _ in columns]
                          + [presence.double(), self.task_weights.to(self.device, torch.float64)], dim=1).tolist()
        n_values = sum(widths)
        results = []
        for row in table:
            present, task_weights = row[n_values:n_values + presence.shape[1]], row[n_values + presence.shape[1]:]
            trial: dict[str, float | list[float]] = {}
            start = 0
            for (key, _, condition), width in zip(columns, widths):
                if condition is None or present[condition]:
                    trial[key] = row[start] if width == 1 else row[start:start + width]
                start += width
            task_losses = [trial.get(f"{task.name}/loss", float("nan")) for task in self.tasks]
            trial["loss_dataset"] = sum(w * loss for w, loss in zip(task_weights, task_losses))
            results.append(trial)
        return results
