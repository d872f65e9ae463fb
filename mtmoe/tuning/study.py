"""``python -m mtmoe tune``: the paper's random search (S1.3) as a reproducible, resumable Optuna study.

* **Planned once, from one seed.** The N configurations are drawn by ``RandomSampler(seed)`` on an in-memory
  study and enqueued with ``config_id`` and ``config_hash`` user attributes: two runs with the same seed evaluate
  the same configurations, in any number of workers, and workers pop distinct enqueued trials (ecosystem.md §3.2).
  Trial ``config_id`` is trained with ``--seed_everything = seed + config_id``.
* **Storage.** Default: SQLite under ``studies/`` (one worker). ``--storage postgresql://...`` (heartbeats: a
  worker killed mid-trial has its trial failed after the grace period and its configuration re-enqueued) or
  ``--storage journal:PATH`` (Optuna's JournalStorage, no server, no heartbeats) for many workers and machines;
  ``--workers N`` starts N local worker processes.
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
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from mtmoe.errors import UsageError
from mtmoe.tuning.space import STUDIES_DIR, SearchSpace, load_space

HEARTBEAT_INTERVAL, GRACE_PERIOD = 10, 30  # seconds


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


def make_cli(args: list[str]):
    """Instantiate (but do not run) the LightningCLI for ``fit`` arguments; ``cli.fit(...)`` then runs them."""
    from mtmoe.cli import MTMoECLI, lightning_cli_kwargs, translate_shortcuts

    saved_argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        cli = MTMoECLI(**lightning_cli_kwargs(translate_shortcuts(args)), run=False)
    finally:
        sys.argv = saved_argv
    cli.quiet = True
    return cli


def suggest(trial: optuna.Trial, key: str, distribution: optuna.distributions.BaseDistribution) -> Any:
    """Ask ``trial`` for ``key``: an enqueued trial returns its planned value."""
    if isinstance(distribution, optuna.distributions.CategoricalDistribution):
        return trial.suggest_categorical(key, distribution.choices)
    if isinstance(distribution, optuna.distributions.IntDistribution):
        return trial.suggest_int(key, distribution.low, distribution.high)
    return trial.suggest_float(key, distribution.low, distribution.high, log=distribution.log)


def storage_for(url: str):
    """An Optuna storage: RDB URL (with heartbeats), ``journal:PATH``; unreachable -> one-line UsageError."""
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
        return optuna.storages.RDBStorage(
            url,
            engine_kwargs={"pool_pre_ping": True} if not url.startswith("sqlite") else None,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            grace_period=GRACE_PERIOD,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3),
        )
    except Exception as error:  # sqlalchemy/driver errors: say what could not be reached
        reason = " ".join(str(error).split())[:300]
        raise UsageError(f"cannot open the study storage {url!r}: {reason}") from None


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
        seed = self.seed + int(config_id)
        start = time.perf_counter()
        cli = make_cli(cli_args(self.space, params, self.overrides, seed, self.log_dir / f"config-{config_id:04d}"))
        cli.fit(cli.model, cli.datamodule)
        results = cli.results or {}
        trial.set_user_attr("seed", seed)
        trial.set_user_attr("wall_time_s", round(time.perf_counter() - start, 2))
        trial.set_user_attr("epochs_run", results.get("epochs_run"))
        trial.set_user_attr("best_epoch", results.get("best_epoch"))
        for key, value in results.get("test", {}).items():
            trial.set_user_attr(f"test/{key}", value)
        trial.set_user_attr("test_loss", results.get("test", {}).get("loss"))
        objective = results.get("best_val_loss", math.inf)
        if cli.model.diverged is not None or not math.isfinite(objective):
            trial.set_user_attr("fail_reason", f"diverged: {cli.model.diverged or 'no finite validation loss'}")
            return math.nan  # Optuna records the trial as FAILED; it counts among the N, with objective +inf
        return objective


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
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")


def run_worker(url: str, study_name: str, space: SearchSpace, overrides: list[str], seed: int, workers: int) -> None:
    """One worker: pops enqueued configurations until none is left."""
    quiet_libraries()
    study = optuna.load_study(study_name=study_name, storage=storage_for(url))
    if study_counts(study)["waiting"] == 0:
        return
    objective = Objective(space, overrides, seed, STUDIES_DIR / "runs" / study_name.replace("/", "_"))
    study.optimize(objective, callbacks=[Progress(space.trials, workers)], catch=())


def _worker_process(*args: Any) -> None:
    try:
        run_worker(*args)
    except KeyboardInterrupt:
        pass


def prepare_study(url: str, study_name: str, space: SearchSpace, seed: int, configurations: list[dict]) -> None:
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
    for key, value in {"space_fingerprint": space.fingerprint, "seed": seed, "data": space.data,
                       "gate": space.gate, "trials": space.trials}.items():
        study.set_user_attr(key, value)
    if "RDBStorage" in type(storage).__name__:
        optuna.storages.fail_stale_trials(study)
    counts = study_counts(study)
    accounted = {t.user_attrs["config_id"] for t in counts["complete"] + counts["diverged"]}
    accounted |= {t.user_attrs["config_id"] for t in counts["trials"]
                  if t.state in (TrialState.WAITING, TrialState.RUNNING) and "config_id" in t.user_attrs}
    for config_id, params in enumerate(configurations):
        if config_id not in accounted:
            study.enqueue_trial(params, user_attrs={"config_id": config_id, "config_hash": config_hash(space, params)})


def default_storage() -> str:
    STUDIES_DIR.mkdir(exist_ok=True)
    return f"sqlite:///{STUDIES_DIR / 'optuna.db'}"


def parse_tune_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m mtmoe tune", exit_on_error=False, add_help=True)
    parser.add_argument("--gate", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--trials", type=int, default=None, help="configurations (default: the space file's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the configurations and of the trials")
    parser.add_argument("--storage", default=None, help="RDB URL or journal:PATH (default: SQLite under studies/)")
    parser.add_argument("--workers", type=int, default=1, help="local worker processes")
    parser.add_argument("--study-name", default=None, help="default: <data>/<gate>[/alpha=<alpha>]")
    parser.add_argument("--space", default=None, help="search-space file (default: studies/<data>.yaml)")
    try:
        return parser.parse_known_args(argv)
    except argparse.ArgumentError as error:
        raise UsageError(str(error)) from None


def tune(argv: list[str]) -> None:
    quiet_libraries()
    args, overrides = parse_tune_args(argv)
    from mtmoe.cli import translate_shortcuts

    translate_shortcuts(["--gate", args.gate, "--data", args.data])  # unknown names fail here, storage untouched
    space = load_space(args.data, args.gate, args.space)
    trials = space.trials if args.trials is None else args.trials
    if trials < 1:
        raise UsageError(f"--trials must be >= 1, got {trials}")
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    space = SearchSpace(space.data, space.gate, trials, space.fixed, space.distributions)
    url = args.storage or default_storage()
    if url.startswith("sqlite") and args.workers > 1:
        raise UsageError("SQLite serialises writers: use --storage postgresql://... or journal:PATH for --workers > 1")
    alpha = next((a.split("=", 1)[1] for a in overrides if a.startswith("--model.alpha=")), None)
    study_name = args.study_name or f"{args.data}/{args.gate}" + (f"/alpha={alpha}" if alpha else "")
    configurations = plan_configurations(space, trials, args.seed)
    with tempfile.TemporaryDirectory() as scratch:  # check the overrides on the first configuration
        make_cli(cli_args(space, configurations[0], overrides, args.seed, Path(scratch)))
    prepare_study(url, study_name, space, args.seed, configurations)
    print(f"study {study_name!r}: {trials} configurations, storage {url}, {args.workers} worker(s)", flush=True)
    worker_args = (url, study_name, space, overrides, args.seed, args.workers)
    if args.workers == 1:
        run_worker(*worker_args)
    else:
        context = multiprocessing.get_context("spawn")
        processes = [context.Process(target=_worker_process, args=worker_args) for _ in range(args.workers)]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
    counts = study_counts(optuna.load_study(study_name=study_name, storage=storage_for(url)))
    print(f"study {study_name!r}: {len(counts['complete'])} complete, {len(counts['diverged'])} diverged, "
          f"{counts['waiting']} waiting", flush=True)
    if counts["waiting"] or counts["running"]:
        sys.exit(1)
