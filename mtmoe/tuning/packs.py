"""The tune worker: it trains the study's planned configurations ``--pack P`` at a time through the training engine
(:class:`mtmoe.lit.module.PackModule` over :class:`mtmoe.pack.engine.PackEngine`, the engine ``fit`` runs), and
tells each trial its own result. ``--pack 1`` trains one at a time, with the same engine.

* **Same plan, same trials.** The worker claims enqueued (WAITING) trials one by one (a trial moves to RUNNING only
  if it is still WAITING, so workers never share one) and builds each from its planned values and its seed
  (``seed + config_id``) exactly as ``fit --seed_everything=seed`` with the same settings builds it; it records the
  same user attributes (:func:`mtmoe.tuning.objective.record_result`), each epoch's validation loss as the trial's
  intermediate value (optuna-dashboard's learning curves), and each trial's configuration, per-epoch log and results
  as ``<log-dir>/config-NNNN/config.yaml``, ``metrics.csv`` and ``results.json``; where each pack epoch's wall time
  went, as ``<log-dir>/pack-epochs.csv``.
* **Values, not strings.** The settings trials share (dataset, fixed settings, trainer options) are parsed once
  per structure by the run builder, from ``fit`` arguments without planned values, and the first trial's planned
  values applied to them as values (:class:`TrialFactory`); every trial after it is its planned values applied to
  them, a net built from its :class:`~mtmoe.pack.settings.ModelSettings` and loaded into a slot: no command line,
  CLI or Trainer per trial. That configuration is the trial's ``config-NNNN/config.yaml``: ``fit --config`` on it
  retrains the trial.
* **Structure.** Trials share a pack only if they agree on everything but per-trial settings (learning rate, Adam's
  epsilon, alpha, E_perm, zeta, epochs, early stopping and a gate's ``scalar_names``): :func:`pack_key`. A worker
  packs the structure of the first waiting trial, then the next structure, and so on.
* **Refill.** A finished trial's slot takes the next waiting trial of the structure at the end of that epoch; past
  ``tune --timeout`` none does, and the pack shrinks as its trials end (its epochs quicken) until none is left.
* **Alone after lost attempts.** A configuration lost :data:`~mtmoe.tuning.objective.ALONE_AFTER_LOST_ATTEMPTS`
  times trains in a pack of its own, and no pack takes it in a refill: one that kills its worker then uses up its
  own attempts (:data:`~mtmoe.tuning.study.MAX_LOST_ATTEMPTS`), not those of the configurations packed with it.
* **Dead workers.** Every heartbeat interval, however long a pack epoch is, a thread of the worker
  (:class:`~mtmoe.tuning.storage.Periodic`) fails the trials of workers that died (on this host: at once) or went
  silent for the grace period (anywhere) and enqueues their configurations again: a dead worker's trial is failed
  within grace + one interval, and its configuration takes the next free slot of any live worker of its structure
  before the rest of the plan.
* **Faults.** Every running trial of the pack has its heartbeat recorded (every storage) and the worker's pid as
  ``worker``: a worker killed mid-pack leaves trials that the next ``tune`` (or a live worker) fails and re-runs.
  A worker frozen past the grace period (SIGSTOP, a paused VM) finds at its next epoch that its trials were failed
  and taken over: it drops them, logs untouched, with one warning, and carries on. Ctrl-C or SIGTERM fails the
  pack's running trials as interrupted and stops the worker, after saving their state at the last epoch end
  (:mod:`mtmoe.tuning.checkpoints`): the next ``tune`` continues them from that epoch, as they would have gone on.
  A full disk under the logs fails them as interrupted too (re-run from their start), with one error line.
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import optuna
import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import Callback
from optuna.trial import TrialState
from tqdm import tqdm

from mtmoe.errors import UsageError
from mtmoe.files import write_atomic, write_csv_atomic
from mtmoe.gate_names import split_gate_name
from mtmoe.gates import gate_class
from mtmoe.interrupts import deferred
from mtmoe.mmoe import per_trial_settings
from mtmoe.lit.module import PackModule
from mtmoe.pack.engine import EarlyStopping, Trial, TrialResult
from mtmoe.pack.memory import memory_per_trial
from mtmoe.pack.precision import matmul_precision
from mtmoe.pack.settings import ModelSettings, build_trial
from mtmoe.routing_names import routing_history
from mtmoe.run import Run, build_run
from mtmoe.run_settings import model_settings, set_values
from mtmoe.tuning.checkpoints import PackCheckpoints
from mtmoe.tuning.objective import (
    ALONE_AFTER_LOST_ATTEMPTS,
    LOST_ATTEMPTS,
    TrialInterrupted,
    cli_args,
    duplicate_of,
    objective_of,
    record_result,
    study_counts,
    suggest,
)
from mtmoe.tuning.space import SearchSpace
from mtmoe.tuning.storage import Heartbeats, OrderedWrites, Periodic, heartbeat_settings, past, trial_id

#: Settings each trial of a pack may have its own value of (besides a gate's ``scalar_names``): the model settings
#: declared ``per_trial`` (:func:`mtmoe.mmoe.setting`), early stopping and the epochs (the engine's per-trial
#: :class:`~mtmoe.pack.engine.Trial` fields).
PER_TRIAL_KEYS = frozenset({*(f"model.{name}" for name in per_trial_settings(ModelSettings)),
                            *(f"early_stopping.{f.name}" for f in fields(EarlyStopping)), "trainer.max_epochs"})
#: Trainer settings of a pack: the pack runs until its trials end (each by its own max_epochs and early stopping),
#: and each trial's log is written by the worker.
PACK_TRAINER = {"max_epochs": -1, "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
#: The display and log settings ``tune`` gives its trials (:func:`mtmoe.tuning.objective.cli_args`); a trial's
#: ``config.yaml`` has ``fit``'s defaults for them.
TUNE_DISPLAY = ("trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.enable_checkpointing",
                "trainer.logger")


def pack_key(space: SearchSpace, params: dict[str, Any]) -> str:
    """What trials must share to be packed together: every setting of the configuration but the per-trial ones."""
    scalars = {f"model.gate.{name}" for name in gate_class(split_gate_name(space.gate)[0]).scalar_names}
    shared = {k: v for k, v in {**space.fixed, **params}.items() if k not in PER_TRIAL_KEYS | scalars}
    return json.dumps(shared, sort_keys=True, default=str)


class TrialFactory:
    """Trials of one structure from planned values: the structure's settings as one run built from the command line
    parsed them (``run``); each trial's configuration is those settings with its planned values and its seed
    (:meth:`config`, what its ``config.yaml`` holds), and its net is built from it under that seed, as ``fit
    --config config.yaml`` builds it (the run builder seeds the global generators, then builds the net)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.defaults = run.cli.parser.get_defaults()

    def config(self, params: dict[str, Any], seed: int) -> Namespace:
        """The configuration a trial trains with: the structure's, with its planned values and ``seed_everything``;
        the display and log settings ``tune`` gives its trials are ``fit``'s defaults again."""
        config = self.run.config.clone()
        config.seed_everything = seed
        set_values(config, params)
        for name in TUNE_DISPLAY:
            config[name] = self.defaults[name]
        return config

    def yaml(self, config: Namespace) -> str:
        """``config`` as the YAML ``fit --config`` reads."""
        return self.run.cli.parser.dump(config, skip_none=False)

    def trial(self, key: Any, config: Namespace) -> Trial:
        """The trial of a configuration of :meth:`config` (its engine settings are the pack's)."""
        max_epochs, data_seed = config.trainer.max_epochs, config.data.get("init_args", Namespace()).get("seed")
        torch.manual_seed(config.seed_everything)
        return build_trial(self.run.datamodule.info, key, model_settings(config.model),
                           data_seed=config.seed_everything if data_seed is None else data_seed,
                           max_epochs=max_epochs if max_epochs is not None and max_epochs > 0 else None,
                           stopping=EarlyStopping(config.early_stopping.patience, config.early_stopping.min_delta))

    def build(self, key: Any, params: dict[str, Any], seed: int) -> Trial:
        return self.trial(key, self.config(params, seed))


def claimed_trial(study: optuna.Study, claimed_id: int) -> optuna.Trial:
    """The live trial of the trial ``claimed_id`` this worker set RUNNING: ``optuna.Trial(study, trial_id)``, as
    ``Study.ask`` makes it. A private use: no public call gives the trial of a chosen waiting trial (``ask`` claims
    the first of any structure; ``tests/test_tuning_clusters.py::test_optuna_trial_of_a_claimed_trial`` fails when
    Optuna changes the constructor)."""
    return optuna.Trial(study, claimed_id)


class PackWorker:
    """Claims, packs, trains and reports the waiting trials of one study, one structure at a time."""

    def __init__(self, study: optuna.Study, storage: Any, space: SearchSpace, overrides: list[str], seed: int,
                 log_dir: Path, capacity: int | str, configurations: list[dict[str, Any]], reclaim=None,
                 bar: bool = False, checkpoints: PackCheckpoints | None = None, deadline: float | None = None) -> None:
        self.study, self.space, self.overrides, self.seed, self.log_dir = study, space, overrides, seed, log_dir
        self.storage = storage  # the study's (mtmoe.tuning.storage.storage_for): trials are claimed and failed there
        self.checkpoints = checkpoints
        self.capacity = capacity
        self.deadline = deadline  # a time.time(): no trial is claimed after it (tune --timeout)
        self.progress = PackProgress(study, space.trials, bar)
        self.keys = {config_id: pack_key(space, params) for config_id, params in enumerate(configurations)}
        self.heartbeats = Heartbeats(storage)
        self.reclaimer = Periodic(partial(reclaim, study)) if reclaim is not None else None
        self.running: dict[int, optuna.Trial] = {}  # trial number -> trial, claimed and not yet told
        self.trial_ids: dict[int, int] = {}  # trial number -> the storage's trial id, of the trials claimed
        self.dropped: list[optuna.Trial] = []  # taken over by another worker since the last epoch's end
        self.dropped_lock = threading.Lock()  # the writes' thread drops a trial failed as stale before its tell
        self.still_running: set[int] | None = None  # the numbers of the storage's RUNNING trials at this epoch's end
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.device = ""  # what trains the pack now (a GPU's name, or cpu), recorded with each trial's results
        self.module: PackModule | None = None  # the pack training now
        # what the storage and the logs take that training need not wait for, written by a thread while the pack
        # trains on, in order: each epoch's intermediate values, each trial's config.yaml, logs, results and tell
        self.writes = OrderedWrites()
        # the configurations and results of an epoch end, queued when its own work is done (:meth:`_flush`): the
        # thread's Python would otherwise share the interpreter with the claims and set-ups of the refill
        self.held: list[Callable[[], None]] = []

    def run(self) -> None:
        """Pack and train until no waiting trial is left; Ctrl-C or SIGTERM fails the running ones (re-run on
        resume)."""
        try:
            while (claimed := self._claim(None)) is not None:
                trial, params, config_id = claimed
                key = self.keys[config_id]
                alone = trial.user_attrs.get(LOST_ATTEMPTS, 0) >= ALONE_AFTER_LOST_ATTEMPTS
                seed = self.seed + config_id
                run = build_run(cli_args(self.space, {}, self.overrides, seed, self.log_dir / "pack"), params)
                factory = TrialFactory(run)
                first = self._start(factory, trial, params, config_id)

                def next_trial(key: str = key, factory: TrialFactory = factory, alone: bool = alone) -> Trial | None:
                    nonlocal first
                    if first is not None:
                        trial, first = first, None
                        return trial
                    claimed = None if alone else self._claim(key)
                    if claimed is None:
                        return None
                    return self._start(factory, *claimed)

                self._train(run, key, next_trial, alone)
            self._flush()
            self.writes.join()  # every result told before the study's counts are read
            self._warn_dropped()
            self.progress.finish()
            if self.checkpoints is not None:
                self.checkpoints.clear()
        except (KeyboardInterrupt, SystemExit) as interrupt:  # Lightning answers Ctrl-C with sys.exit(1), SIGTERM
            # with its SIGTERMException (mtmoe.interrupts)
            self._test_untested()
            self._release(saved=self.checkpoints.write() if self.checkpoints is not None else [])
            raise TrialInterrupted(f"{len(self.running)} packed trial(s) interrupted") from interrupt
        except torch.OutOfMemoryError:
            self._release()  # the pack size's fault, not the configurations': no lost attempt
            raise UsageError(f"the pack ran out of device memory: pass a smaller --pack (now {self.capacity}); its "
                             "trials run again when tune runs again") from None
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self._release()  # the disk's fault, not the configurations': no lost attempt
            raise UsageError(f"cannot write the trials' logs under {self.log_dir} ({error.strerror}): free some space "
                             "there (or pass another --log-dir), then run the same tune command again: it resumes "
                             "the study, the trials in flight run again") from None
        finally:
            self.heartbeats.stop()
            if self.reclaimer is not None:
                self.reclaimer.stop()
            self.progress.close()

    def _start(self, factory: TrialFactory, trial: optuna.Trial, params: dict[str, Any], config_id: int) -> Trial:
        """The trial of a claimed configuration; its configuration is written as ``config-NNNN/config.yaml`` by
        the writes' thread (``fit --config`` on it retrains the trial)."""
        seed = self.seed + config_id
        config = factory.config(params, seed)
        self.held.append(partial(self._write_config, factory, config, trial, config_id))
        built = factory.trial((trial, seed, config_id), config)
        if self.checkpoints is not None:
            built.saved = self.checkpoints.resume(config_id, self.keys[config_id], trial.user_attrs["config_hash"])
            for record in built.saved["progress"]["history"] if built.saved is not None else []:
                self._report(trial, record)  # the learning curve so far, on the trial that continues it
        return built

    def _write_config(self, factory: TrialFactory, config: Namespace, trial: optuna.Trial, config_id: int) -> None:
        """In the writes' thread: ``config-NNNN/config.yaml``, unless the trial was dropped since (taken over by
        another worker: the logs are that worker's)."""
        if trial.number not in self.running:
            return
        folder = self.log_dir / f"config-{config_id:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(factory.yaml(config), folder / "config.yaml")

    def _train(self, run: Run, key: str, next_trial, alone: bool = False) -> None:
        """Train the pack of structure ``key`` that ``next_trial`` fills, of one slot if ``alone``."""
        datamodule = run.datamodule
        datamodule.prepare_data()
        datamodule.setup("fit")
        waiting = sum(1 for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                      if self.keys.get(t.user_attrs.get("config_id")) == key)
        device = run.trainer.strategy.root_device
        self.device = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type  # on record
        with matmul_precision(run.config.model.matmul_precision):  # the pack size is measured as it will train
            capacity = 1 if alone else resolve_capacity(self.capacity, run, waiting + 1,
                                                        checkpoints=self.checkpoints is not None)
            module = PackModule(datamodule.info, datamodule.splits, datamodule.batch_size,
                                datamodule.eval_batch_size, capacity, next_trial, self._finished, self._epoch,
                                run.config.model.cuda_graphs, run.config.model.fused_adam,
                                run.config.model.dense_selection)
            # the structure's configuration (config.yaml) goes with the trials' logs, not into the working directory
            trainer = run.cli.instantiate_trainer(**PACK_TRAINER, default_root_dir=str(self.log_dir))
            trainer.callbacks.append(self.progress)
            self.module = module
            trainer.fit(module)
            self.module = None

    def _test_untested(self) -> None:
        """On a stop: the trials that ended and wait for their test pass (:meth:`PackModule.test_untested`) tested
        and told now, rather than failed and rerun. If the test pass fails, they are failed as the running ones."""
        module, self.module = self.module, None
        if module is None or not module.untested:
            return
        try:
            results = module.test_untested()
        except Exception as error:  # noqa: BLE001 - they rerun, as the running trials do
            self.progress.write(f"warning: [{self.study.study_name}] the test pass of the trials that ended failed "
                                f"on the stop ({type(error).__name__}): they run again", warning=True)
            return
        for result in results:
            self._finished(result)

    def _release(self, saved: list[int] = ()) -> None:
        """Fail the running trials as interrupted (no reason, no lost attempt): ``tune`` runs them again, those of
        the config_ids ``saved`` in a checkpoint from it (their ``checkpoint`` attribute: its file). The queued
        writes go first (a trial that ended is told its result, not failed), unless one failed: those after it are
        not written, and their trials fail as running ones. The heartbeat thread stops next, so the two do not
        contend for the storage (hundreds of trials in a pack)."""
        self._flush()
        self.writes.join(check=False)
        self.heartbeats.stop()
        for number, trial in list(self.running.items()):
            running_id = self.trial_ids[number]
            if trial.user_attrs.get("config_id") in saved:
                self.storage.set_trial_user_attr(running_id, "checkpoint", str(self.checkpoints.path))
            self.storage.set_trial_user_attr(running_id, "interrupted", True)
            self.storage.set_trial_state_values(running_id, TrialState.FAIL)

    def _claim(self, key: str | None) -> tuple[optuna.Trial, dict[str, Any], int] | None:
        """The next waiting planned trial of structure ``key`` (any, for ``None``), RUNNING, with its planned values
        and config_id: the configurations of dead workers' trials first, then the plan in order. A refill (``key``
        given) takes none lost :data:`~mtmoe.tuning.objective.ALONE_AFTER_LOST_ATTEMPTS` times: it trains alone."""
        if past(self.deadline):
            return None
        waiting_trials = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        saved = self.checkpoints.saved if self.checkpoints is not None else {}

        def order(trial: optuna.trial.FrozenTrial) -> tuple:  # lost attempts, checkpointed (in slot order), plan
            entry = saved.get(trial.user_attrs.get("config_id"))
            return LOST_ATTEMPTS not in trial.user_attrs, entry is None, entry["state"]["slot"] if entry else 0

        for waiting in sorted(waiting_trials, key=order):
            config_id = waiting.user_attrs.get("config_id")
            if config_id is None or (key is not None and (self.keys.get(config_id) != key or waiting.user_attrs.get(
                    LOST_ATTEMPTS, 0) >= ALONE_AFTER_LOST_ATTEMPTS)):
                continue
            waiting_id = trial_id(self.storage, self.study, waiting.number)
            with deferred():  # a stop lands after the trial is this worker's running one (:meth:`_release` fails it)
                try:  # as Study.ask claims a waiting trial, but this one: ask takes the first of any structure
                    if not self.storage.set_trial_state_values(waiting_id, TrialState.RUNNING):
                        continue  # another worker took it first
                except optuna.exceptions.UpdateFinishedTrialError:  # or took and finished it
                    continue
                trial = claimed_trial(self.study, waiting_id)
                trial.set_user_attr("worker", self.worker)
                self.trial_ids[trial.number] = waiting_id
                self.heartbeats.add(waiting_id)
                self.running[trial.number] = trial
            if self.still_running is not None:  # claimed after this epoch end read the storage (a refill)
                self.still_running.add(trial.number)
            params = {name: suggest(trial, name, dist) for name, dist in self.space.distributions.items()}
            duplicate = duplicate_of(self.study, trial.number, config_id)
            if duplicate is not None:  # enqueued twice: run once
                trial.set_user_attr("skipped", f"config_id {config_id} is evaluated by trial {duplicate}")
                self._told(trial, state=TrialState.PRUNED)
                continue
            return trial, params, int(config_id)
        return None

    def _finished(self, result: TrialResult) -> None:
        """A trial's results: its last intermediate value, logs, user attributes and tell, queued for the writes'
        thread (:meth:`_record`): the next epoch does not wait for some forty storage writes a trial."""
        trial, _, config_id = result.key
        if self._taken_over([trial]):
            return
        history = result.results.get("history")
        if history:
            self._report(trial, history[-1])  # its last epoch (the earlier ones were reported as they ended)
        self.held.append(partial(self._record, result, self.device))
        self.progress.ended(trial.number, objective_of(result.results, result.diverged))

    def _record(self, result: TrialResult, device: str) -> None:
        """In the writes' thread: the trial's logs, its results as user attributes, its tell."""
        trial, seed, config_id = result.key
        self._write_log(config_id, result)
        try:
            trial.set_user_attr("device", device)
            objective = record_result(trial, seed, result.wall_time_s, result.results, result.diverged)
            if math.isnan(objective):
                self.progress.write(f"[{self.study.study_name}] trial {trial.number} (config_id {config_id}) failed: "
                                    f"{trial.user_attrs['fail_reason']}")
                self._told(trial, state=TrialState.FAIL)
            else:
                self._told(trial, values=objective)
        except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale since _taken_over looked
            self._drop([trial])

    def _taken_over(self, trials: list[optuna.Trial]) -> list[optuna.Trial]:
        """Those of ``trials`` no longer RUNNING in the storage (this worker went silent past the grace period, e.g.
        frozen, and another failed them and runs their configurations): dropped (:meth:`_drop`). The storage is
        read once an epoch end (:meth:`_epoch` forgets it), not once a finished trial."""
        if self.still_running is None:
            self.still_running = {t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        lost = [trial for trial in trials if trial.number not in self.still_running]
        if lost:
            self._drop(lost)
        return lost

    def _drop(self, trials: list[optuna.Trial]) -> None:
        """Forget ``trials`` (failed by another worker): no result, no log written; :meth:`_warn_dropped` warns."""
        for trial in trials:
            self._forget(trial)
        with self.dropped_lock:
            self.dropped += trials

    def _write_log(self, config_id: int, result: TrialResult) -> None:
        """``config-NNNN/metrics.csv`` (one row per epoch, the columns Lightning's CSV logger writes for ``fit``) and
        ``results.json`` (with each validated epoch's routing statistics), as ``fit`` writes them."""
        folder = self.log_dir / f"config-{config_id:04d}"
        history = result.results.get("history", [])
        rows = []
        for record in history:
            row = {"epoch": record["epoch"]}
            for stage in ("train", "val"):
                for name, value in record.get(stage, {}).items():
                    if isinstance(value, list):
                        row.update({f"{stage}/{name}/{i}": v for i, v in enumerate(value)})
                    else:
                        row[f"{stage}/{name}"] = value
            rows.append(row)
        if rows:
            write_csv_atomic(rows, folder / "metrics.csv")
        results = {key: value for key, value in result.results.items() if key != "history"}
        results["routing"] = routing_history(history)
        write_atomic(json.dumps({**results, "diverged": result.diverged}, indent=2, default=str) + "\n",
                     folder / "results.json")

    def _epoch(self, module: PackModule) -> None:
        """Each running trial's validation loss of this epoch as its intermediate value; the progress line; a row of
        ``pack-epochs.csv`` (:meth:`_log_epoch`). Trials taken over by another worker meanwhile leave the pack (their
        slots are refilled)."""
        self._log_epoch(module.epoch_seconds)
        taken = {trial.number for trial in self._taken_over([trial.key[0] for _, trial in module.engine.running])}
        for slot, trial in module.engine.running:
            if trial.key[0].number in taken:
                module.engine.drop(slot)
            elif trial.history:
                self._report(trial.key[0], trial.history[-1])
        self._warn_dropped()
        self.still_running = None
        if self.checkpoints is not None:
            states = module.engine.snapshot(on_device=True)  # the trials' states made only if written
            self.checkpoints.keep(lambda: [(key[2], self.keys[key[2]], key[0].user_attrs["config_hash"], state)
                                           for key, state in states()])
        self.progress(module)
        self._flush()

    def _warn_dropped(self) -> None:
        """One line for the trials dropped since the last (a frozen worker wakes up to all its trials taken over at
        once): at each epoch's end, and once the writes' thread is done (it drops a trial whose tell comes late)."""
        with self.dropped_lock:
            dropped, self.dropped = self.dropped, []
        if dropped:
            names = ", ".join(f"{t.number} (config_id {t.user_attrs.get('config_id')})" for t in dropped)
            self.progress.write(f"warning: [{self.study.study_name}] trial(s) {names} were failed by another worker "
                                f"while this one ({self.worker}) was silent past the {heartbeat_settings()[1]} s "
                                "grace period (frozen or paused?) and run again there: dropped here, their logs left "
                                "alone", warning=True)

    def _flush(self) -> None:
        """The held writes to the writes' thread, in order."""
        held, self.held = self.held, []
        for call in held:
            self.writes.put(call)

    def _log_epoch(self, seconds: dict[str, float]) -> None:
        """A row of ``pack-epochs.csv`` in the study's log folder, one per pack epoch of every worker: when it ended,
        the worker, the pack's slots, the trials it trained, that ended in it and that it tested, and where its wall
        time went (training and validation; early stopping and the ended trials' release; the free slots refilled:
        claims and set-ups; the test pass; the tested trials' results handed to the writes' thread)."""
        path = self.log_dir / "pack-epochs.csv"
        row = {"time": round(time.time(), 3), "worker": self.worker,
               **{k: round(v, 4) if isinstance(v, float) else v for k, v in seconds.items()}}
        if not path.exists():  # the columns' names, in place before any row: linked in whole, or not at all
            header = path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}")
            header.write_text(",".join(row) + "\n")
            try:
                os.link(header, path)
            except FileExistsError:  # another worker's came first
                pass
            finally:
                header.unlink()
        with open(path, "a") as file:  # one write of one short line: workers' rows do not interleave
            file.write(",".join(str(v) for v in row.values()) + "\n")

    def _report(self, trial: optuna.Trial, record: dict[str, Any]) -> None:
        """An epoch's validation loss as the trial's intermediate value (optuna-dashboard's learning curves),
        written by a thread: a pack of hundreds of trials does not wait for hundreds of storage writes an epoch."""
        if "val" in record and math.isfinite(record["val"]["loss"]):
            self.writes.put(partial(self._write_report, trial, record["val"]["loss"], record["epoch"]))

    @staticmethod
    def _write_report(trial: optuna.Trial, value: float, epoch: int) -> None:
        try:
            trial.report(value, epoch)
        except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale meanwhile
            pass

    def _told(self, trial: optuna.Trial, **kwargs: Any) -> None:
        """Tell ``trial``, after its intermediate values (a finished trial takes none): from the writes' thread, or
        for a trial with none queued."""
        self.progress.told(trial.number)  # first: a count read meanwhile misses it rather than counts it twice
        self.study.tell(trial, **kwargs)
        self._forget(trial)

    def _forget(self, trial: optuna.Trial) -> None:
        """No more heartbeats for ``trial``, no longer running here."""
        self.heartbeats.remove(self.trial_ids[trial.number])
        self.running.pop(trial.number, None)


class PackProgress(Callback):
    """``tune``'s progress, read at batch and epoch boundaries from host-side counters (nothing in a training step
    waits for it): trials done / failed / running of N, the pack's epoch and how far into it, the best objective so
    far, elapsed time and ETA. On a terminal (``bar``) a tqdm bar on stderr, refreshed as batches end; elsewhere a
    plain line on stdout at most every ``every`` seconds and whenever trials end.

    The bar counts trials, a running one by the share of its ``max_epochs`` it has trained (none if it runs until
    early stopping), so it moves within the first pack epoch; the ETA is the rest at the average rate so far (an
    upper bound where trials stop early). Done, failed and best are the study's, read at each epoch's end, with the
    trials that ended here and whose tells the writes' thread has not written yet (:meth:`ended`).
    """

    def __init__(self, study: optuna.Study, total: int, bar: bool, every: float = 10.0) -> None:
        self.study, self.total, self.every, self.use_bar = study, total, every, bar
        self.start = self.last = time.perf_counter()
        self.finished, self.reported, self.epochs = 0, 0, 0
        self.pending: dict[int, float] = {}  # trial number -> objective (NaN: failed), ended here and not yet told
        self.module: PackModule | None = None
        self.batch, self.batches = 0, 1
        self.done, self.failed, self.best = self._counts()
        self.initial = self.done
        self.bar: tqdm | None = None  # made when the first epoch starts (after --pack auto's line)

    def ended(self, number: int, objective: float) -> None:
        """Trial ``number`` ended here with ``objective``; its tell is queued."""
        self.pending[number] = objective
        self.finished += 1

    def told(self, number: int) -> None:
        """Trial ``number``'s tell is being written (from the writes' thread)."""
        self.pending.pop(number, None)

    def _counts(self) -> tuple[int, int, float | None]:
        self.counted = time.perf_counter()
        counts = study_counts(self.study)
        pending = list(self.pending.values())  # after the storage: a trial told in between is in neither
        failed = len(counts["failed"]) + sum(map(math.isnan, pending))
        best = min([t.value for t in counts["complete"]] + [v for v in pending if not math.isnan(v)], default=None)
        return len(counts["complete"]) + len(counts["failed"]) + len(pending), failed, best

    def progress(self) -> float:
        """Trials done, plus each running trial's trained share of its ``max_epochs``."""
        running = self.module.engine.running if self.module is not None and self.module.engine is not None else []
        share = sum(min(1.0, (trial.epochs_run + self.batch / self.batches) / trial.max_epochs)
                    for _, trial in running if trial.max_epochs)
        return min(self.total, self.done + share)

    def status(self) -> str:
        engine = self.module.engine if self.module is not None else None
        running = f"{len(engine.running)} running in a pack of {engine.capacity}" if engine is not None else "0 running"
        best = "n/a" if self.best is None else f"{self.best:.5g}"
        epoch = (f"pack epoch {self.epochs} done" if self.epochs and not self.batch else
                 f"pack epoch {self.epochs + 1} {100 * self.batch // self.batches}%")
        return f"{self.done}/{self.total} done, {self.failed} failed, best {best}, {running}, {epoch}"

    def show(self, force: bool = False) -> None:
        """Refresh the bar (at most every tenth of a second), or print a line if ``every`` seconds have passed;
        ``force``: now."""
        now = time.perf_counter()
        if not force and now - self.last < (0.1 if self.bar is not None else self.every):
            return
        self.last = now
        progress = self.progress()
        if self.bar is not None:
            self.bar.n = progress
            self.bar.set_postfix_str(self.status(), refresh=False)
            self.bar.refresh()
            return
        rate = (progress - self.initial) / (now - self.start)
        eta = time.strftime("%Hh%Mm%Ss", time.gmtime((self.total - progress) / rate)) if rate > 0 else "?"
        elapsed = time.strftime("%Hh%Mm%Ss", time.gmtime(now - self.start))
        print(f"[{self.study.study_name}] {self.status()}, elapsed {elapsed}, ETA {eta}", flush=True)

    def write(self, line: str, warning: bool = False) -> None:
        """A line of its own (a failed trial; a ``warning`` goes to stderr), above the bar if there is one."""
        file = sys.stderr if warning else sys.stdout
        if self.bar is not None:
            tqdm.write(line, file=file)
        else:
            print(line, file=file, flush=True)

    def on_train_epoch_start(self, trainer: pl.Trainer, module: PackModule) -> None:
        self.module, self.batch, self.batches = module, 0, max(1, int(trainer.num_training_batches))
        if self.use_bar and self.bar is None:
            size = shutil.get_terminal_size()  # 80x24 where the terminal does not say (tqdm would draw nothing)
            self.bar = tqdm(total=self.total, initial=self.done, file=sys.stderr, ncols=size.columns,
                            nrows=size.lines, smoothing=0, desc=f"[{self.study.study_name}]",
                            bar_format="{desc} {percentage:3.0f}%|{bar:10}| {elapsed}<{remaining}{postfix}")
        self.show(force=self.epochs == 0)

    def on_train_batch_end(self, trainer: pl.Trainer, module: PackModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batch = batch_idx + 1
        self.show()

    def __call__(self, module: PackModule) -> None:
        """The end of a pack epoch (its trials that ended already told): the study's counts read again when trials
        ended here, else at most every ``every`` seconds (other workers' trials; a storage query)."""
        self.epochs += 1
        self.batch = 0
        if self.finished != self.reported or time.perf_counter() - self.counted >= self.every:
            self.done, self.failed, self.best = self._counts()
        self.show(force=self.finished != self.reported)
        self.reported = self.finished

    def finish(self) -> None:
        """The study's counts once more, this worker's writes done: the bar's last state, or a last line where they
        changed since the last one (other workers' trials, told after this one's last epoch)."""
        counts = self._counts()
        if counts != (self.done, self.failed, self.best) or self.bar is not None:
            self.done, self.failed, self.best = counts
            self.show(force=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


#: On a CPU, ``--pack auto`` measures packs of at most this many trials (a CPU's matmuls are saturated long before).
CPU_MAX_PACK = 32


def fastest_capacity(run: Run, limit: int) -> int:
    """The pack size with the most trial-steps per second on this device, measured: packs of 1, 2, 4, ... (at most
    ``limit``) of throwaway copies of the run's net each train a few steps on random rows, as the run would (its
    precision, CUDA graphs), until the rate falls below the best so far."""
    import copy

    from mtmoe.pack.engine import PackEngine, Trial

    device, datamodule = run.trainer.strategy.root_device, run.datamodule
    split, net = datamodule.splits["train"], run.model.net
    rows = len(next(iter(split.values())))
    tasks = datamodule.info.tasks
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=str(run.trainer.precision) == "bf16-mixed")
    candidates = sorted({min(2**i, limit) for i in range(limit.bit_length() + 1)})
    best, best_rate = 1, 0.0
    for capacity in candidates:
        engine = PackEngine(net, tasks, capacity, device, run.config.model.cuda_graphs, run.config.model.fused_adam)
        engine.set_steps_per_epoch(10**6)
        for slot in range(capacity):
            engine.load(slot, Trial(None, copy.deepcopy(net), (1.0,) * len(tasks), 1e-4, 1e-7, 0, None, 1))
        index = torch.randint(rows, (capacity, datamodule.batch_size), generator=torch.Generator().manual_seed(0))
        batch = {key: tensor[index.to(tensor.device)].to(device) for key, tensor in split.items()}  # split: maybe host
        with autocast:
            for _ in range(5):  # warm-up (and, on a GPU, the graph's capture)
                engine.train_step(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(3):
                engine.train_step(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        rate = capacity * 3 / (time.perf_counter() - start)
        del engine
        if rate > best_rate:
            best, best_rate = capacity, rate
        elif rate < 0.95 * best_rate:
            break
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"--pack auto: packs of {best} ({best_rate:.1f} trial-steps/s measured on {device})", flush=True)
    return best


def resolve_capacity(requested: int | str, run: Run, trials: int, measure: bool = True,
                     checkpoints: bool = True) -> int:
    """``--pack``'s number of slots: ``auto`` is the fastest pack size that fits the device and the trials there are
    to run, measured (:func:`fastest_capacity`; on a GPU what fits is what 80% of its free memory holds,
    :func:`mtmoe.pack.memory.memory_per_trial`; ``measure=False``: the largest of them); a number is checked against
    the device's memory."""
    device, datamodule = run.trainer.strategy.root_device, run.datamodule
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        per_trial = memory_per_trial(run.model.net, datamodule, device, str(run.trainer.precision),
                                     run.config.model.fused_adam, checkpoints)
        fits = int(0.8 * free / per_trial)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        per_trial = 5 * sum(p.numel() * p.element_size() for p in run.model.net.parameters())  # + grads, moments, best
        fits = int(free / per_trial)
    if requested == "auto":
        limit = max(1, min(fits, trials, CPU_MAX_PACK if device.type != "cuda" else trials))
        return fastest_capacity(run, limit) if measure and limit > 1 else limit
    if int(requested) > fits:
        raise UsageError(f"a pack of {requested} trials does not fit in the memory of {device} ({free / 2**30:.1f} "
                         f"GiB free, about {per_trial / 2**20:.0f} MiB per trial): pass --pack {max(1, fits)} or "
                         "--pack auto")
    return max(1, min(int(requested), trials))
