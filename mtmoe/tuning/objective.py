"""One planned trial of a study: its configuration's ``fit`` arguments and planned values, whether another trial
already evaluates it, and the user attributes its results are recorded as; shared by the tune driver
(:mod:`mtmoe.tuning.study`) and its worker (:mod:`mtmoe.tuning.packs`)."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import optuna
from optuna.trial import TrialState

from mtmoe.routing_names import routing_of
from mtmoe.tuning.space import SearchSpace


#: User attribute of a configuration enqueued again after lost attempts (their number): workers claim it first.
LOST_ATTEMPTS = "lost_attempts"
#: A configuration lost this many times trains in a pack of its own: the trials of a pack are lost together when one
#: of them kills its worker (out of memory, a crash), and only alone is the one that does charged alone. Once lost,
#: a configuration still trains packed (a worker killed from outside, a preempted machine, loses every trial of its
#: pack once; those reruns stay packed).
ALONE_AFTER_LOST_ATTEMPTS = 2


class TrialInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM inside a trial (Lightning turns them into ``SystemExit``): the trial is failed, re-run on
    resume."""


class _QuietThreads(logging.Filter):
    """Drops the info lines of the threads inside :func:`quiet_optuna` (a count per thread: the context nests);
    warnings, errors and every other thread's lines pass."""

    def __init__(self) -> None:
        super().__init__()
        self.depth: Counter[int] = Counter()
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.thread not in self.depth

    def enter(self) -> None:
        with self.lock:
            self.depth[threading.get_ident()] += 1

    def leave(self) -> None:
        with self.lock:
            self.depth[threading.get_ident()] -= 1
            if not self.depth[threading.get_ident()]:
                del self.depth[threading.get_ident()]


_QUIET_THREADS = _QuietThreads()
#: The loggers of Optuna's info lines about an in-memory study ("A new study created in memory", "Trial 0
#: finished"): its modules' loggers, named after the modules of public classes (Optuna names a logger by its module).
OPTUNA_STUDY_LOGGERS = (optuna.storages.InMemoryStorage.__module__, optuna.Study.__module__)


@contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna's info lines ("A new study created in memory", "Trial 0 finished") off while mtmoe works with an
    in-memory study of its own (the plan, the importances): the terminal shows mtmoe's output only. Only the lines
    this thread logs are dropped, by a filter on :data:`OPTUNA_STUDY_LOGGERS`: Optuna's verbosity (a user's, for
    their own studies) is left as it is, and another thread's lines, or a callback's of another thread, pass;
    warnings and errors stay."""
    for name in OPTUNA_STUDY_LOGGERS:
        if _QUIET_THREADS not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_QUIET_THREADS)
    _QUIET_THREADS.enter()
    try:
        yield
    finally:
        _QUIET_THREADS.leave()


def plan_configurations(space: SearchSpace, n: int, seed: int) -> list[dict[str, Any]]:
    """The study's N configurations, drawn once from one seed by Optuna's RandomSampler (an in-memory study)."""
    configurations = []
    with quiet_optuna():
        planner = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
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


def record_result(trial: optuna.Trial, seed: int, wall_time_s: float, results: dict, diverged: str | None) -> float:
    """Record a finished trial's results as its user attributes (seed, the code that trained it
    (:func:`~mtmoe.code_version.code_version`), wall time, epochs, ``test/<key>`` for every
    test metric, ``val/<key>`` for the best epoch's routing statistics, ``test_loss``; a ``fail_reason`` when it
    diverged; ``plain_kernels`` when ``MTMOE_PLAIN_KERNELS`` ran fused kernels as torch operations) and return its
    objective: the best epoch's
    validation loss, or NaN for a diverged trial (Optuna records it FAILED; it counts among the N with +inf)."""
    from mtmoe.code_version import code_version
    from mtmoe.plain_kernels import plain_kernels  # torch: not at import (report and bootstrap read this module)

    trial.set_user_attr("seed", seed)
    trial.set_user_attr("code", code_version())
    plain = plain_kernels()
    if plain:  # the same values to rounding, but which code trained it is on record
        trial.set_user_attr("plain_kernels", sorted(plain))
    trial.set_user_attr("wall_time_s", round(wall_time_s, 2))
    trial.set_user_attr("epochs_run", results.get("epochs_run"))
    trial.set_user_attr("best_epoch", results.get("best_epoch"))
    for key, value in results.get("test", {}).items():
        trial.set_user_attr(f"test/{key}", value)
    for key, value in routing_of(results.get("val", {})).items():
        trial.set_user_attr(f"val/{key}", value)
    trial.set_user_attr("test_loss", results.get("test", {}).get("loss"))
    objective = objective_of(results, diverged)
    if math.isnan(objective):
        trial.set_user_attr("fail_reason", f"diverged: {diverged or 'no finite validation loss'}")
    return objective


def objective_of(results: dict, diverged: str | None) -> float:
    """A finished trial's objective: its best epoch's validation loss, or NaN if it diverged or has none finite."""
    objective = results.get("best_val_loss", math.inf)
    return math.nan if diverged is not None or not math.isfinite(objective) else objective


def duplicate_of(study: optuna.Study, number: int, config_id: int) -> int | None:
    """The trial that evaluates ``config_id`` instead of trial ``number``, if any.

    That is one already complete or failed with a reason, or an earlier-numbered one waiting or running: of several
    enqueued copies exactly the lowest-numbered live one runs, whatever the order in which workers pop them.
    """
    for other in study.get_trials(deepcopy=False):
        if other.number == number or other.user_attrs.get("config_id") != config_id:
            continue
        done = other.state == TrialState.COMPLETE or (other.state == TrialState.FAIL and "fail_reason" in other.user_attrs)
        if done or (other.state in (TrialState.WAITING, TrialState.RUNNING) and other.number < number):
            return other.number
    return None


def is_lost(trial: optuna.trial.FrozenTrial) -> bool:
    """A planned trial that ended without a result and through no choice of the user: its worker was killed or
    crashed (not a diverged trial, a skipped duplicate or a Ctrl-C)."""
    attrs = trial.user_attrs
    return (trial.state == TrialState.FAIL and "config_id" in attrs
            and not {"fail_reason", "interrupted", "skipped"} & set(attrs))


def study_counts(study: optuna.Study) -> dict[str, Any]:
    """The planned trials by outcome: ``complete`` and ``failed`` (with a ``fail_reason``: diverged, or lost too
    often) trials, counts of ``lost`` attempts and of ``waiting`` and ``running`` trials, and all ``trials``."""
    trials = study.get_trials(deepcopy=False)
    planned = [t for t in trials if "config_id" in t.user_attrs]
    return {
        "complete": [t for t in planned if t.state == TrialState.COMPLETE],
        "failed": [t for t in planned if t.state == TrialState.FAIL and "fail_reason" in t.user_attrs],
        "lost": sum(map(is_lost, planned)),
        "waiting": sum(t.state == TrialState.WAITING for t in planned),
        "running": sum(t.state == TrialState.RUNNING for t in planned),
        "trials": trials,
    }
