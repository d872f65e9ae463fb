"""``python -m mtmoe tune``: the paper's random search (S1.3) as a reproducible, resumable Optuna study.

* **Planned once, from one seed.** The N configurations are drawn by ``RandomSampler(seed)`` on an in-memory
  study and enqueued with ``config_id`` and ``config_hash`` user attributes: two runs with the same seed evaluate
  the same configurations, in any number of workers, and workers pop distinct enqueued trials (ecosystem.md §3.2).
  Trial ``config_id`` is trained with ``--seed_everything = seed + config_id``.
* **Storage** (:mod:`mtmoe.tuning.storage`). Default: SQLite ``studies/optuna.db`` under the current directory
  (one worker). ``--storage postgresql://...`` (heartbeats: a worker killed mid-trial has its trial failed after
  the grace period and its configuration re-enqueued) or ``--storage journal:PATH`` (Optuna's JournalStorage, no
  server, no heartbeats) for many workers and machines; ``--workers N`` starts N local worker processes.
* **Trials.** The objective is the validation task loss at the early-stopping best epoch; test loss, per-task
  metrics, n/s, routing statistics, epochs, wall time, seed and the configuration hash are user attributes. No
  pruning. A diverged trial (NaN or infinite loss) is failed with a ``fail_reason`` and not retried; a trial lost to
  a crash or Ctrl-C has no reason and is re-enqueued when ``tune`` runs again, which resumes the study.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from mtmoe.errors import UsageError
from mtmoe.run import build_run, translate_shortcuts
from mtmoe.tuning.space import SearchSpace, load_space
from mtmoe.tuning.storage import STUDIES_DIR, default_storage_url, has_heartbeat, heartbeat_settings, storage_for


class TrialInterrupted(KeyboardInterrupt):
    """Ctrl-C inside a trial (Lightning turns it into ``SystemExit(1)``): the trial is failed, re-run on resume."""


class _OneLineInterrupts(logging.Filter):
    """Optuna logs a failed trial with its traceback; for an interrupt one line is enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
            record.exc_info, record.exc_text = None, None
        return True


def plan_configurations(space: SearchSpace, n: int, seed: int) -> list[dict[str, Any]]:
    """The study's N configurations, drawn once from one seed by Optuna's RandomSampler."""
    planner = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    configurations = []
    for _ in range(n):
        trial = planner.ask(space.distributions)
        configurations.append(dict(trial.params))
        planner.tell(trial, 0.0)
    return configurations


def config_hash(space: SearchSpace, params: dict[str, Any]) -> str:
    payload = {**space.fixed, **params, "gate": space.gate, "data": space.data}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cli_args(space: SearchSpace, params: dict[str, Any], overrides: list[str], seed: int, log_dir: Path) -> list[str]:
    """The ``fit`` arguments of one configuration (``overrides`` from the ``tune`` command line come last)."""
    args = ["--data", space.data, "--gate", space.gate, f"--seed_everything={seed}"]
    args += [f"--{key}={json.dumps(value) if isinstance(value, (list, dict)) else value}"
             for key, value in {**space.fixed, **params}.items()]
    args += [
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.enable_checkpointing=false", f"--trainer.logger.init_args.save_dir={log_dir}",
    ]
    return args + overrides


def suggest(trial: optuna.Trial, key: str, distribution: optuna.distributions.BaseDistribution) -> Any:
    """Ask ``trial`` for ``key``: an enqueued trial returns its planned value."""
    if isinstance(distribution, optuna.distributions.CategoricalDistribution):
        return trial.suggest_categorical(key, distribution.choices)
    if isinstance(distribution, optuna.distributions.IntDistribution):
        return trial.suggest_int(key, distribution.low, distribution.high)
    return trial.suggest_float(key, distribution.low, distribution.high, log=distribution.log)


class Objective:
    """Trains one enqueued configuration and returns its validation objective."""

    def __init__(self, space: SearchSpace, overrides: list[str], seed: int, log_dir: Path) -> None:
        self.space, self.overrides, self.seed, self.log_dir = space, overrides, seed, log_dir

    def __call__(self, trial: optuna.Trial) -> float:
        config_id = trial.user_attrs.get("config_id")
        if config_id is None:  # the queue ran dry between this worker's check and its pop: not a planned trial
            trial.set_user_attr("fail_reason", "no planned configuration left (stray trial, ignored)")
            raise optuna.TrialPruned()
        params = {key: suggest(trial, key, distribution) for key, distribution in self.space.distributions.items()}
        duplicate = duplicate_of(trial.study, trial.number, config_id)
        if duplicate is not None:  # enqueued twice (concurrent tune starts, a retry racing a resume): run it once
            trial.set_user_attr("skipped", f"config_id {config_id} is evaluated by trial {duplicate}")
            raise optuna.TrialPruned()
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        seed = self.seed + int(config_id)
        start = time.perf_counter()
        try:
            args = cli_args(self.space, params, self.overrides, seed, self.log_dir / f"config-{config_id:04d}")
            run = build_run(args)
            results = run.fit()
        except (KeyboardInterrupt, SystemExit) as interrupt:  # Lightning answers Ctrl-C with sys.exit(1)
            raise TrialInterrupted(f"trial {trial.number} (config_id {config_id}) interrupted") from interrupt
        return record_result(trial, seed, time.perf_counter() - start, results, run.model.diverged)


def record_result(trial: optuna.Trial, seed: int, wall_time_s: float, results: dict, diverged: str | None) -> float:
    """Record a finished trial's results as its user attributes (seed, wall time, epochs, ``test/<key>`` for every
    test metric, ``test_loss``; a ``fail_reason`` when it diverged) and return its objective: the best epoch's
    validation loss, or NaN for a diverged trial (Optuna records it FAILED; it counts among the N with +inf)."""
    trial.set_user_attr("seed", seed)
    trial.set_user_attr("wall_time_s", round(wall_time_s, 2))
    trial.set_user_attr("epochs_run", results.get("epochs_run"))
    trial.set_user_attr("best_epoch", results.get("best_epoch"))
    for key, value in results.get("test", {}).items():
        trial.set_user_attr(f"test/{key}", value)
    trial.set_user_attr("test_loss", results.get("test", {}).get("loss"))
    objective = results.get("best_val_loss", math.inf)
    if diverged is not None or not math.isfinite(objective):
        trial.set_user_attr("fail_reason", f"diverged: {diverged or 'no finite validation loss'}")
        return math.nan
    return objective


def duplicate_of(study: optuna.Study, number: int, config_id: int) -> int | None:
    """The trial that evaluates ``config_id`` instead of trial ``number``, if any.

    That is one already complete or diverged, or an earlier-numbered one waiting or running: of several
    enqueued copies exactly the lowest-numbered live one runs, whatever the order in which workers pop them.
    """
    for other in study.get_trials(deepcopy=False):
        if other.number == number or other.user_attrs.get("config_id") != config_id:
            continue
        done = other.state == TrialState.COMPLETE or (other.state == TrialState.FAIL and "fail_reason" in other.user_attrs)
        if done or (other.state in (TrialState.WAITING, TrialState.RUNNING) and other.number < number):
            return other.number
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fail_orphaned_trials(study: optuna.Study) -> int:
    """Storages without heartbeats (SQLite, journal): fail RUNNING trials whose worker process on this host is gone.

    A worker killed mid-trial (SIGKILL, a crash, a lost terminal) leaves its trial RUNNING; its configuration is then
    missing and re-enqueued by :func:`enqueue_missing`. Trials of workers on other hosts cannot be checked here.
    """
    host, failed = socket.gethostname(), 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
        if worker_host == host and pid.isdigit() and not _pid_alive(int(pid)):
            try:
                study._storage.set_trial_user_attr(trial._trial_id, "lost", f"worker {host}:{pid} exited mid-trial")
                study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
                failed += 1
            except optuna.exceptions.UpdateFinishedTrialError:
                pass
    return failed


def study_counts(study: optuna.Study) -> dict[str, Any]:
    trials = study.get_trials(deepcopy=False)
    planned = [t for t in trials if "config_id" in t.user_attrs]
    complete = [t for t in planned if t.state == TrialState.COMPLETE]
    diverged = [t for t in planned if t.state == TrialState.FAIL and "fail_reason" in t.user_attrs]
    return {
        "complete": complete,
        "diverged": diverged,
        "waiting": sum(t.state == TrialState.WAITING for t in planned),
        "running": sum(t.state == TrialState.RUNNING for t in planned),
        "trials": trials,
    }


class Progress:
    """After each trial: one line per study with trials done / total, failed, best so far and an ETA."""

    def __init__(self, total: int, workers: int) -> None:
        self.total, self.workers, self.start = total, workers, time.perf_counter()

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        counts = study_counts(study)
        done = len(counts["complete"]) + len(counts["diverged"])
        best = min((t.value for t in counts["complete"]), default=math.nan)
        times = [t.user_attrs["wall_time_s"] for t in counts["complete"] if "wall_time_s" in t.user_attrs]
        remaining = self.total - done
        eta = remaining * (sum(times) / len(times)) / self.workers if times else math.nan
        eta_text = "?" if math.isnan(eta) else time.strftime("%Hh%Mm%Ss", time.gmtime(eta))
        print(f"[{study.study_name}] {done}/{self.total} done, {len(counts['diverged'])} failed, "
              f"best {best:.5g}, ETA {eta_text}", flush=True)
        if counts["waiting"] == 0:
            study.stop()


def quiet_libraries() -> None:
    """Per-trial chatter off (Lightning's info lines, experimental-feature warnings); the progress line stays."""
    optimize_logger = logging.getLogger("optuna.study._optimize")
    if not any(isinstance(f, _OneLineInterrupts) for f in optimize_logger.filters):
        optimize_logger.addFilter(_OneLineInterrupts())
    import lightning.pytorch  # noqa: F401  (first: importing it resets its loggers to INFO, e.g. in a spawned worker)

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")


def run_worker(url: str, study_name: str, space: SearchSpace, overrides: list[str], seed: int, workers: int,
               log_dir: Path | None = None) -> None:
    """One worker: pops enqueued configurations until none is left."""
    quiet_libraries()
    study = optuna.load_study(study_name=study_name, storage=storage_for(url))
    if study_counts(study)["waiting"] == 0:
        return
    log_dir = Path(log_dir) if log_dir is not None else STUDIES_DIR / "runs"
    objective = Objective(space, overrides, seed, log_dir / study_name.replace("/", "_"))
    study.optimize(objective, callbacks=[Progress(space.trials, workers)], catch=())


def _worker_process(*args: Any) -> None:
    if "OMP_NUM_THREADS" not in os.environ:  # N workers share the cores: no N-fold oversubscription of torch threads
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args[5]))
    try:
        run_worker(*args)
    except KeyboardInterrupt:  # the trial in flight is already failed (re-run on resume); the parent reports
        pass
    except UsageError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        sys.exit(2)


def run_workers(worker_args: tuple, workers: int) -> bool:
    """``workers`` local worker processes (or this one) pop WAITING trials until none is left; all ended well?"""
    if workers == 1:
        run_worker(*worker_args)
        return True
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_worker_process, args=worker_args) for _ in range(workers)]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join()
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; a signal to this process alone is passed on
        for process in processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGINT)
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
        raise
    codes = [process.exitcode for process in processes]
    if 2 in codes:
        sys.exit(2)
    return all(code == 0 for code in codes)


def enqueue_missing(study: optuna.Study, space: SearchSpace, configurations: list[dict]) -> int:
    """Enqueue every configuration with no completed, diverged, waiting or running trial; how many were."""
    counts = study_counts(study)
    accounted = {t.user_attrs["config_id"] for t in counts["complete"] + counts["diverged"]}
    accounted |= {t.user_attrs["config_id"] for t in counts["trials"]
                  if t.state in (TrialState.WAITING, TrialState.RUNNING) and "config_id" in t.user_attrs}
    missing = [config_id for config_id in range(len(configurations)) if config_id not in accounted]
    for config_id in missing:
        params = configurations[config_id]
        study.enqueue_trial(params, user_attrs={"config_id": config_id, "config_hash": config_hash(space, params)})
    return len(missing)


def prepare_study(url: str, study_name: str, space: SearchSpace, seed: int, configurations: list[dict],
                  alpha: str | None = None) -> None:
    """Create the study (or check that an existing one has the same space and seed) and enqueue what is missing.

    A configuration is missing when it has no completed, diverged, waiting or running trial: never enqueued, or
    lost to a crash or an interrupt (resume).
    """
    storage = storage_for(url)
    if study_name in optuna.get_all_study_names(storage):
        attrs = optuna.load_study(study_name=study_name, storage=storage).user_attrs
        if attrs.get("space_fingerprint") != space.fingerprint or attrs.get("seed") != seed:
            raise UsageError(
                f"study {study_name!r} exists with a different search space or seed "
                f"(space {attrs.get('space_fingerprint')}, seed {attrs.get('seed')}; now {space.fingerprint}, "
                f"seed {seed}): refusing to mix them; pass --study-name to start another study"
            )
    study = optuna.create_study(study_name=study_name, storage=storage, direction="minimize",
                                sampler=optuna.samplers.RandomSampler(seed=seed), load_if_exists=True)
    attrs = {"space_fingerprint": space.fingerprint, "seed": seed, "data": space.data, "gate": space.gate,
             "trials": space.trials}
    if alpha is not None:
        attrs["alpha"] = alpha
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    if has_heartbeat(storage):
        optuna.storages.fail_stale_trials(study)
    else:
        fail_orphaned_trials(study)
    enqueue_missing(study, space, configurations)


def parse_tune_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m mtmoe tune", exit_on_error=False, add_help=True)
    parser.add_argument("--gate", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--trials", type=int, default=None, help="configurations (default: the space file's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the configurations and of the trials")
    parser.add_argument("--storage", default=None,
                        help="RDB URL or journal:PATH (default: SQLite studies/optuna.db under the current directory)")
    parser.add_argument("--workers", type=int, default=1, help="local worker processes")
    parser.add_argument("--study-name", default=None, help="default: <data>/<gate>[/alpha=<alpha>]")
    parser.add_argument("--space", default=None, help="search-space file (default: the packaged spaces/<data>.yaml)")
    parser.add_argument("--log-dir", default=None,
                        help="per-trial logs (default: studies/runs/ under the current directory)")
    try:
        return parser.parse_known_args(argv)
    except argparse.ArgumentError as error:
        raise UsageError(str(error)) from None


def _option_value(overrides: list[str], key: str) -> str | None:
    """The last ``--key=value`` or ``--key value`` among the overrides."""
    value = None
    for i, arg in enumerate(overrides):
        if arg.startswith(f"--{key}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{key}" and i + 1 < len(overrides):
            value = overrides[i + 1]
    return value


def check_overrides(space: SearchSpace, configurations: list[dict], overrides: list[str], seed: int) -> None:
    """Instantiate the CLI for one configuration (the one with the longest permutation window): bad overrides and a
    window longer than the run fail here, before the storage is touched, not in the middle of the study."""
    longest = max(range(len(configurations)), key=lambda i: configurations[i].get("model.perm_epochs") or 0)
    with tempfile.TemporaryDirectory() as scratch:
        run = build_run(cli_args(space, configurations[longest], overrides, seed, Path(scratch)))
        search, max_epochs = run.model.net.local_search, run.trainer.max_epochs
        if search is not None and max_epochs not in (None, -1) and search.epochs > max_epochs:
            raise UsageError(
                f"configuration {longest} has perm_epochs={search.epochs}, longer than the run "
                f"(--trainer.max_epochs={max_epochs}): the permutation would never be frozen; raise max_epochs "
                "or pass --model.perm_epochs"
            )


def tune(argv: list[str]) -> None:
    """``python -m mtmoe tune``: plan, prepare the study, run the workers; Ctrl-C stops cleanly (exit 130)."""
    try:
        _tune(argv)
    except KeyboardInterrupt:
        print("error: interrupted; trials in flight are marked failed and re-run when the same tune command runs "
              "again (it resumes the study)", file=sys.stderr, flush=True)
        sys.exit(130)


def _tune(argv: list[str]) -> None:
    quiet_libraries()
    args, overrides = parse_tune_args(argv)
    translate_shortcuts(["--gate", args.gate, "--data", args.data])  # unknown names fail here, storage untouched
    space = load_space(args.data, args.gate, args.space)
    trials = space.trials if args.trials is None else args.trials
    if trials < 1:
        raise UsageError(f"--trials must be >= 1, got {trials}")
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    space = SearchSpace(space.data, space.gate, trials, space.fixed, space.distributions)
    if args.storage is None:
        STUDIES_DIR.mkdir(exist_ok=True)
    url = args.storage or default_storage_url()
    if url.startswith("sqlite") and args.workers > 1:
        raise UsageError("SQLite serialises writers: use --storage postgresql://... or journal:PATH for --workers > 1")
    alpha = _option_value(overrides, "model.alpha")
    study_name = args.study_name or f"{args.data}/{args.gate}" + (f"/alpha={alpha}" if alpha else "")
    configurations = plan_configurations(space, trials, args.seed)
    check_overrides(space, configurations, overrides, args.seed)
    prepare_study(url, study_name, space, args.seed, configurations, alpha=alpha)
    print(f"study {study_name!r}: {trials} configurations, storage {url}, {args.workers} worker(s)", flush=True)
    log_dir = Path(args.log_dir) if args.log_dir else STUDIES_DIR / "runs"
    worker_args = (url, study_name, space, overrides, args.seed, args.workers, log_dir)
    storage = storage_for(url)
    heartbeat = has_heartbeat(storage)
    announced, done = False, -1
    while True:
        clean = run_workers(worker_args, args.workers)
        study = optuna.load_study(study_name=study_name, storage=storage)
        counts = study_counts(study)
        progress, done = done, len(counts["complete"]) + len(counts["diverged"])
        if counts["waiting"] and clean and done > progress:  # a retry enqueued after a worker stopped
            continue
        if not counts["running"] or not heartbeat:
            break
        if not announced:  # other workers' trials, or lost ones: a heartbeat storage fails those after the grace
            print(f"study {study_name!r}: waiting for {counts['running']} running trial(s) of other workers "
                  f"(a lost one is failed after {heartbeat_settings()[1]} s without a heartbeat and re-run here)",
                  flush=True)
            announced = True
        while counts["running"] and not counts["waiting"]:
            time.sleep(heartbeat_settings()[0])
            optuna.storages.fail_stale_trials(study)
            enqueue_missing(study, space, configurations)
            counts = study_counts(study)
    counts = study_counts(optuna.load_study(study_name=study_name, storage=storage))
    print(f"study {study_name!r}: {len(counts['complete'])} complete, {len(counts['diverged'])} diverged, "
          f"{counts['waiting']} waiting", flush=True)
    if counts["waiting"] or counts["running"]:
        print(f"study {study_name!r} is not finished: {counts['running']} trial(s) RUNNING in other workers, "
              f"{counts['waiting']} waiting; run the same tune command again to resume", file=sys.stderr, flush=True)
        sys.exit(1)
