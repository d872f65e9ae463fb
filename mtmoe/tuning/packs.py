"""``tune --pack P``: a worker trains up to P of the study's planned configurations at once, as one packed model
(:mod:`mtmoe.pack`), and tells each trial its own result.

* **Same plan, same trials.** The worker claims enqueued (WAITING) trials one by one, as Optuna's ``ask`` pops them
  (a trial moves to RUNNING only if it is still WAITING, so workers never share one), builds each with the run
  builder from the same ``fit`` arguments and seed as an unpacked trial (``seed + config_id``), and records the
  same user attributes (:func:`mtmoe.tuning.study.record_result`). Report, bootstrap and optuna-dashboard see
  packed trials like any other.
* **Structure.** Trials share a pack only if they agree on everything but per-trial settings (learning rate, Adam's
  epsilon, alpha, E_perm, zeta, epochs, patience and a gate's ``scalar_hyperparameters``): :func:`pack_key`. A
  worker packs the structure of the first waiting trial, then the next structure, and so on.
* **Refill.** A finished trial's slot takes the next waiting trial of the structure at the next epoch boundary.
* **Faults.** Every running trial of the pack has its heartbeat recorded (RDB storages) and the worker's pid as
  ``worker`` (all storages): a worker killed mid-pack leaves trials that the next ``tune`` fails and re-runs. Ctrl-C
  fails the pack's running trials (re-run on resume) and stops the worker.
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import TrialState

from mtmoe.errors import UsageError
from mtmoe.gates import gate_class
from mtmoe.pack.train import PackTrainer, PackTrial, TrialResult, memory_per_trial
from mtmoe.run import build_run
from mtmoe.tuning.space import SearchSpace
from mtmoe.tuning.objective import TrialInterrupted, cli_args, duplicate_of, record_result, study_counts, suggest
from mtmoe.tuning.storage import Heartbeats

#: Settings each trial of a pack may have its own value of (besides a gate's ``scalar_hyperparameters``).
PER_TRIAL_KEYS = frozenset({"model.lr", "model.adam_eps", "model.alpha", "model.perm_epochs", "model.zeta",
                            "trainer.max_epochs", "early_stopping.patience"})
#: Trainer settings a pack honours; any other one that differs from its default needs ``--pack 1``.
PACK_TRAINER_KEYS = frozenset({"accelerator", "devices", "precision", "max_epochs", "logger", "enable_progress_bar",
                               "enable_model_summary", "enable_checkpointing", "default_root_dir", "callbacks",
                               "log_every_n_steps", "deterministic", "benchmark"})
PRECISIONS = {"32": "32", "32-true": "32", "bf16-mixed": "bf16-mixed"}


def pack_key(space: SearchSpace, params: dict[str, Any]) -> str:
    """What trials must share to be packed together: every setting of the configuration but the per-trial ones."""
    scalars = {f"model.gate.{name}" for name in gate_class(space.gate.removesuffix("+")).scalar_hyperparameters}
    shared = {k: v for k, v in {**space.fixed, **params}.items() if k not in PER_TRIAL_KEYS | scalars}
    return json.dumps(shared, sort_keys=True, default=str)


class PackWorker:
    """Claims, packs, trains and reports the waiting trials of one study, one structure at a time."""

    def __init__(self, study: optuna.Study, space: SearchSpace, overrides: list[str], seed: int, log_dir: Path,
                 capacity: int | str, configurations: list[dict[str, Any]]) -> None:
        self.study, self.space, self.overrides, self.seed, self.log_dir = study, space, overrides, seed, log_dir
        self.capacity = capacity
        self.progress = PackProgress(study, space.trials)
        self.keys = {config_id: pack_key(space, params) for config_id, params in enumerate(configurations)}
        self.heartbeats = Heartbeats(study._storage)
        self.running: dict[int, optuna.Trial] = {}  # trial id -> trial, claimed and not yet told
        self.worker = f"{socket.gethostname()}:{os.getpid()}"

    def run(self) -> None:
        """Pack and train until no waiting trial is left; Ctrl-C fails the running ones (re-run on resume)."""
        try:
            while (claimed := self._claim(None)) is not None:
                first, run = claimed
                key = self.keys[first.key[0].user_attrs["config_id"]]
                trainer = self._trainer(run, key)
                queue = [first]

                def next_trial() -> PackTrial | None:
                    if queue:
                        return queue.pop()
                    claimed = self._claim(key)
                    return None if claimed is None else claimed[0]

                trainer.run(next_trial, self._finished, self._progress)
        except (KeyboardInterrupt, SystemExit) as interrupt:  # Lightning code may answer Ctrl-C with sys.exit(1)
            self._release()
            raise TrialInterrupted(f"{len(self.running)} packed trial(s) interrupted") from interrupt
        except torch.OutOfMemoryError:
            self._release()  # the pack size's fault, not the configurations': no lost attempt
            raise UsageError(f"the pack ran out of device memory: pass a smaller --pack (now {self.capacity}); its "
                             "trials run again when tune runs again") from None
        finally:
            self.heartbeats.stop()

    def _release(self) -> None:
        """Fail the running trials as interrupted (no reason, no lost attempt): ``tune`` runs them again."""
        for trial_id in list(self.running):
            self.study._storage.set_trial_user_attr(trial_id, "interrupted", True)
            self.study._storage.set_trial_state_values(trial_id, TrialState.FAIL)

    def _claim(self, key: str | None) -> tuple[PackTrial, Any] | None:
        """The next waiting planned trial of structure ``key`` (any, for ``None``), RUNNING and built, with its run."""
        storage = self.study._storage
        for waiting in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            config_id = waiting.user_attrs.get("config_id")
            if config_id is None or (key is not None and self.keys.get(config_id) != key):
                continue
            if not storage.set_trial_state_values(waiting._trial_id, TrialState.RUNNING):
                continue  # another worker took it first
            trial = optuna.Trial(self.study, waiting._trial_id)
            trial.set_user_attr("worker", self.worker)
            self.heartbeats.add(trial._trial_id)
            self.running[trial._trial_id] = trial
            params = {name: suggest(trial, name, dist) for name, dist in self.space.distributions.items()}
            duplicate = duplicate_of(self.study, trial.number, config_id)
            if duplicate is not None:  # enqueued twice: run once, as the unpacked objective does
                trial.set_user_attr("skipped", f"config_id {config_id} is evaluated by trial {duplicate}")
                self._tell(trial, state=TrialState.PRUNED)
                continue
            seed = self.seed + int(config_id)
            run = build_run(cli_args(self.space, params, self.overrides, seed, self.log_dir / f"config-{config_id:04d}"))
            check_packable(run)
            trial_in_pack = PackTrial((trial, seed), run.model, run.datamodule.seed, run.trainer.max_epochs,
                                      run.config.early_stopping.patience)
            return trial_in_pack, run
        return None

    def _trainer(self, run: Any, key: str) -> PackTrainer:
        """The pack for ``run``'s structure: its data, device, precision and number of slots."""
        datamodule = run.datamodule
        datamodule.prepare_data()
        datamodule.setup("fit")
        device = run.trainer.strategy.root_device
        waiting = sum(1 for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                      if self.keys.get(t.user_attrs.get("config_id")) == key)
        capacity = resolve_capacity(self.capacity, run, waiting + 1)
        return PackTrainer(datamodule.splits, datamodule.batch_size, datamodule.eval_batch_size, capacity, device,
                           PRECISIONS[str(run.trainer.precision)])

    def _finished(self, result: TrialResult) -> None:
        trial, seed = result.key
        objective = record_result(trial, seed, result.wall_time_s, result.results, result.diverged)
        if math.isnan(objective):
            self._tell(trial, state=TrialState.FAIL)
        else:
            self._tell(trial, values=objective)
        self.progress.finished += 1

    def _tell(self, trial: optuna.Trial, **kwargs: Any) -> None:
        self.study.tell(trial, **kwargs)
        self.heartbeats.remove(trial._trial_id)
        self.running.pop(trial._trial_id, None)

    def _progress(self, trainer: PackTrainer) -> None:
        self.progress(trainer)


class PackProgress:
    """One line per study at most every ``every`` seconds and when trials end: trials done / total, running in
    this pack, failed, best so far and an ETA from this worker's rate of finishing trials."""

    def __init__(self, study: optuna.Study, total: int, every: float = 10.0) -> None:
        self.study, self.total, self.every = study, total, every
        self.start, self.last, self.finished, self.reported = time.perf_counter(), -math.inf, 0, 0

    def __call__(self, trainer: PackTrainer) -> None:
        now = time.perf_counter()
        if now - self.last < self.every and self.finished == self.reported:
            return
        self.last, self.reported = now, self.finished
        counts = study_counts(self.study)
        done = len(counts["complete"]) + len(counts["failed"])
        best = min((t.value for t in counts["complete"]), default=None)
        rate = self.finished / (now - self.start)
        eta = time.strftime("%Hh%Mm%Ss", time.gmtime((self.total - done) / rate)) if rate > 0 else "?"
        print(f"[{self.study.study_name}] {done}/{self.total} done, {len(trainer.running)} running in a pack of "
              f"{trainer.capacity}, {len(counts['failed'])} failed, best {'-' if best is None else f'{best:.5g}'}, "
              f"ETA {eta}", flush=True)


def check_packable(run: Any) -> None:
    """A pack trains as ``fit`` does with the trainer settings it honours; others need ``--pack 1``."""
    defaults = run.cli.parser.get_defaults()
    for group, honoured in (("trainer", PACK_TRAINER_KEYS), ("early_stopping", {"patience"})):
        config = run.config[group]
        for key in sorted(set(vars(config)) - honoured):
            if config[key] != defaults.get(f"{group}.{key}"):
                raise UsageError(f"--{group}.{key} is not supported by trial packs; run with --pack 1")
    if str(run.trainer.precision) not in PRECISIONS:
        raise UsageError(f"trial packs train in precision 32 or bf16-mixed, not {run.trainer.precision}; "
                         "run with --pack 1")
    if run.trainer.num_devices != 1:
        raise UsageError("a trial pack trains on one device: run one worker per device (--workers)")


#: On a CPU the pack size the benchmark measured fastest (benchmarks/bench_packs.py); on a GPU the memory decides.
CPU_AUTO_PACK = 8


def resolve_capacity(requested: int | str, run: Any, trials: int) -> int:
    """``--pack``'s number of slots: ``auto`` fits the device (on a GPU as many trials as 80% of its free memory
    holds, :func:`mtmoe.pack.train.memory_per_trial`; on a CPU ``CPU_AUTO_PACK``), never more than the trials there
    are to run; a number is checked against the device's memory."""
    device, datamodule = run.trainer.strategy.root_device, run.datamodule
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        per_trial = memory_per_trial(run.model, datamodule.splits, datamodule.batch_size, datamodule.eval_batch_size,
                                     device, PRECISIONS[str(run.trainer.precision)])
        fits = int(0.8 * free / per_trial)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        per_trial = 5 * sum(p.numel() * p.element_size() for p in run.model.net.parameters())  # + grads, moments, best
        fits = int(free / per_trial)
    if requested == "auto":
        return max(1, min(fits, trials, CPU_AUTO_PACK if device.type != "cuda" else trials))
    if int(requested) > fits:
        raise UsageError(f"a pack of {requested} trials does not fit in the memory of {device} ({free / 2**30:.1f} "
                         f"GiB free, about {per_trial / 2**20:.0f} MiB per trial): pass --pack {max(1, fits)} or "
                         "--pack auto")
    return max(1, min(int(requested), trials))
