"""``python -m mtmoe tune``: the paper's random search (S1.3) as a reproducible, resumable Optuna study.

* **Planned once, from one seed.** The N configurations are drawn by ``RandomSampler(seed)`` on an in-memory
  study and enqueued with ``config_id`` and ``config_hash`` user attributes: two runs with the same seed evaluate
  the same configurations, in any number of workers, and workers pop distinct enqueued trials (ecosystem.md §3.2).
  Trial ``config_id`` is trained with ``--seed_everything = seed + config_id``.
* **An override wins** (:func:`pin_overrides`). A setting the search space tunes that the overrides give a value
  (``--model.lr 0.001``, parsed as ``fit`` parses it) is fixed at that value instead of sampled: every trial trains
  with it, and it is one of the study's settings.
* **One study, one setting.** A study's identity is its search space (fingerprint), its seed and its *settings*:
  every value in force that the ``--trainer.*``, ``--model.*``, ``--data.*`` and ``--early_stopping.*`` overrides
  (or a ``--config`` file) change from what the search space alone gives, or fix in it, except those that change
  where or how visibly a trial runs, not what it computes (:data:`NEUTRAL_SETTINGS`: data and log folders, progress
  display, accelerator, ...). ``--workers``, ``--storage``, ``--log-dir`` and ``--trials`` are not settings
  (``--trials`` extends or shortens the same plan). The identity is stored as study user attributes
  (``space_fingerprint``, ``seed``, ``settings``); a ``tune`` whose identity differs is refused, naming the
  differences.
* **Storage** (:mod:`mtmoe.tuning.storage`). Default: SQLite ``studies/optuna.db`` under the current directory
  (one worker). ``--storage postgresql://...``, ``grpc://HOST:PORT`` (a proxy in front of one, for hundreds of
  workers) or ``journal:PATH`` (no server; the file shared by the machines) for many workers and machines;
  ``--workers N`` starts N local worker processes, each on its own GPU where the machine has several. Processes
  started together on a fresh storage set it up one at a time. Every storage has heartbeats: a trial whose worker died or
  went silent, on any host, is failed and its configuration runs again.
* **Trials.** The objective is the validation task loss at the early-stopping best epoch; test loss, per-task
  metrics, n/s, routing statistics, epochs, wall time, seed and the configuration hash are user attributes. No
  pruning. A diverged trial (NaN or infinite loss) is failed with a ``fail_reason`` and not retried; a trial lost to
  a crash, a killed worker or Ctrl-C has no reason and is re-enqueued, within this ``tune`` or when it runs again
  (which resumes the study). A configuration lost :data:`MAX_LOST_ATTEMPTS` times (it kills its worker, e.g. out
  of memory) is failed with a reason instead: the study finishes with all N accounted for.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from mtmoe.arguments import MAX_SEED, attach_negative_numbers, is_number
from mtmoe.data import dataset_path
from mtmoe.errors import OneLineParser, SettingError, UsageError, did_you_mean
from mtmoe.gate_names import check_gate_name
from mtmoe.interrupts import Interrupted, handle_interrupts
from mtmoe.tuning.space import SearchSpace, load_space
from mtmoe.tuning.storage import (
    STUDIES_DIR,
    check_url,
    default_storage_url,
    display_url,
    fail_stale_trials,
    heartbeat_settings,
    past,
    readable,
    setup_lock,
    storage_for,
    trial_id,
)
from mtmoe.tuning.objective import (
    LOST_ATTEMPTS,
    cli_args,
    config_hash,
    is_lost,
    plan_configurations,
    study_counts,
)
from mtmoe.tuning.trials import describe_settings, writable_folder

# What trains (Lightning, torch: mtmoe.run, mtmoe.tuning.packs) is imported where it is used: `tune --help`, bad flags
# and unknown names answer without it.

#: Attempts of a configuration that may end without a result (worker killed or crashed) before it is failed.
MAX_LOST_ATTEMPTS = 3
#: The most configurations a study plans (all are drawn and enqueued at its start; the paper's are 100-500).
MAX_TRIALS = 100_000
#: The longest study name, in bytes: it names a folder (Linux's NAME_MAX).
MAX_NAME_BYTES = 255
#: Settings that change where a trial reads and writes, or what it displays, not what it computes: no part of a
#: study's identity (a key counts as neutral with everything under it).
NEUTRAL_SETTINGS = (
    "config", "data.root", "data.cache_dir", "data.download", "data.verify", "data.data_on_device",
    "trainer.accelerator", "trainer.logger", "trainer.default_root_dir", "trainer.enable_progress_bar",
    "trainer.enable_model_summary", "trainer.enable_checkpointing", "trainer.log_every_n_steps", "trainer.profiler",
    "trainer.enable_autolog_hparams", "trainer.model_registry", "early_stopping.verbose",
    "early_stopping.log_rank_zero_only",
)
#: The objective's name, an identifier: the validation task loss at the early-stopping best epoch, the column
#: ``value_val_loss`` of ``study.trials_dataframe()`` and the axis of optuna-dashboard. A study named otherwise by an
#: older mtmoe ("validation loss (best epoch)") takes this name when it is resumed.
OBJECTIVE_NAME = "val_loss"
#: The options ``tune`` passes to each trial's ``fit`` (a configuration file too).
FIT_OPTIONS = ("--trainer", "--model", "--data.", "--early_stopping", "--config", "-c")


class _QuietTrialLog(logging.Filter):
    """Optuna's trial log, trimmed: a diverged trial's failure is reported by the progress line with its reason (not
    as "the value nan is not acceptable"), an interrupted one without its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "failed with value nan" in (message := record.getMessage()) or "The value nan is not acceptable" in message:
            return False
        if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
            record.exc_info, record.exc_text = None, None
        return True


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs. A process that has exited but that its parent has not yet
    waited for (a zombie: a dead ``tune --workers`` child, until the parent reaps it) is not: ``os.kill(pid, 0)``
    still finds it, its state in ``/proc`` says it exited (where there is no ``/proc``, ``kill``'s answer). One reaped
    between the two looks is gone from ``/proc``: not alive either."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    if not Path("/proc/self/stat").is_file():
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False  # reaped since kill found it
    except OSError:
        return True  # there but not readable (procfs mounted with hidepid): kill found it
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")  # the state follows the command's name


def local_worker(trial: optuna.trial.FrozenTrial) -> int | None:
    """The process id of ``trial``'s worker if it runs on this host (its ``worker`` attribute, ``host:pid``)."""
    host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
    return int(pid) if host == socket.gethostname() and pid.isdigit() else None


def fail_orphaned_trials(study: optuna.Study, storage: Any) -> int:
    """Fail the RUNNING trials whose worker process on this host is gone, at once (no grace period to wait out);
    how many. A worker killed mid-trial (SIGKILL, a crash, a lost terminal) leaves its trial RUNNING; its
    configuration is then missing and re-enqueued by :func:`enqueue_missing`. ``storage``: the study's
    (:func:`~mtmoe.tuning.storage.storage_for`)."""
    failed = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = local_worker(trial)
        if pid is not None and not pid_alive(pid):
            try:
                lost = trial_id(storage, study, trial.number)
                storage.set_trial_user_attr(lost, "lost", f"worker {trial.user_attrs['worker']} exited mid-trial")
                storage.set_trial_state_values(lost, TrialState.FAIL)
                failed += 1
            except optuna.exceptions.UpdateFinishedTrialError:
                pass
    return failed


def reclaim_lost_trials(study: optuna.Study, storage: Any) -> None:
    """Fail the trials whose worker is gone: dead processes on this host at once, silent ones anywhere after the
    heartbeat grace period (a live local worker's trial is never failed)."""
    fail_orphaned_trials(study, storage)
    fail_stale_trials(study, storage, alive=lambda trial: (pid := local_worker(trial)) is not None and pid_alive(pid))


def quiet_libraries() -> None:
    """Per-trial chatter off (Optuna's info lines, Lightning's, experimental-feature and deprecation warnings of
    the libraries); the progress lines and warnings about the run stay."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optimize_logger = logging.getLogger("optuna.study._optimize")
    if not any(isinstance(f, _QuietTrialLog) for f in optimize_logger.filters):
        optimize_logger.addFilter(_QuietTrialLog())
    import lightning.pytorch  # noqa: F401  (first: importing it resets its loggers to INFO, e.g. in a spawned worker)

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")  # Lightning's


#: Where the trials' logs go without --log-dir.
DEFAULT_LOG_DIR = STUDIES_DIR / "runs"


def study_log_folder(log_dir: Path | None, study_name: str) -> Path:
    """The study's folder of trial logs under ``log_dir`` (default :data:`DEFAULT_LOG_DIR`): one per study, its name
    with ``/`` as ``_``."""
    return (Path(log_dir) if log_dir is not None else DEFAULT_LOG_DIR) / study_name.replace("/", "_")


@dataclass(frozen=True)
class WorkerSettings:
    """What each of ``tune``'s workers runs with (sent to worker processes as it is)."""

    url: str
    study_name: str
    space: SearchSpace
    overrides: list[str]
    seed: int
    workers: int  # local worker processes (1: this process)
    log_dir: Path | None = None
    pack: int | str = 1
    checkpoint_every: float | None = None
    checkpoints: Path | None = None  # the study's checkpoint folder (checkpoint_folder); None: --no-checkpoints
    deadline: float | None = None  # a time.time() (--timeout): no trial is claimed after it


def run_worker(settings: WorkerSettings) -> None:
    """One worker: pops enqueued configurations until none is left (or, past ``settings.deadline``, until its
    running trials end), ``settings.pack`` at a time (:mod:`mtmoe.tuning.packs`);
    every heartbeat interval it also takes back the trials of workers that died (:func:`reclaim_lost_trials`).
    Interrupted, it saves its trials' state for the next one in ``settings.checkpoints``
    (:mod:`mtmoe.tuning.checkpoints`); without that folder it neither keeps, writes nor resumes any."""
    from mtmoe.tuning.checkpoints import PackCheckpoints
    from mtmoe.tuning.packs import PackWorker

    quiet_libraries()
    space = settings.space
    storage = storage_for(settings.url)
    study = optuna.load_study(study_name=settings.study_name, storage=storage)
    if study_counts(study)["waiting"] == 0:
        return
    log_dir = study_log_folder(settings.log_dir, settings.study_name)
    configurations = plan_configurations(space, space.trials, settings.seed)

    def reclaim(study: optuna.Study) -> None:
        reclaim_lost_trials(study, storage)
        enqueue_missing(study, space, configurations)

    bar = settings.workers == 1 and sys.stderr.isatty()  # a progress bar at a terminal; N workers' would fight
    identity = {key: study.user_attrs.get(key) for key in ("space_fingerprint", "seed", "settings")}
    checkpoints = None if settings.checkpoints is None else PackCheckpoints(settings.checkpoints, identity,
                                                                             settings.checkpoint_every)
    PackWorker(study, storage, space, settings.overrides, settings.seed, log_dir, settings.pack, configurations,
               reclaim, bar, checkpoints, settings.deadline).run()


def gpu_names(count: int, visible: str | None) -> list[str]:
    """The ``count`` CUDA devices this process sees, as ``CUDA_VISIBLE_DEVICES`` names them: its first ``count``
    entries (indices or UUIDs) where ``visible`` (its value) is set, else ``0`` .. ``count - 1``."""
    if visible is None:
        return [str(index) for index in range(count)]
    return [entry.strip() for entry in visible.split(",") if entry.strip()][:count]


def worker_devices(workers: int, gpus: list[str]) -> list[str | None]:
    """Each local worker's ``CUDA_VISIBLE_DEVICES``: the ``gpus`` round-robin (worker i gets ``gpus[i % len]``), so
    that N workers on a machine of several GPUs train on all of them; ``None`` (left as it is) with fewer than two."""
    if len(gpus) < 2:
        return [None] * workers
    return [gpus[index % len(gpus)] for index in range(workers)]


def _worker_process(settings: WorkerSettings, device: str | None = None) -> None:
    if device is not None:  # before CUDA starts in this process (torch starts it at the first CUDA call)
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    handle_interrupts()  # a scheduler's SIGTERM to every process of the job stops this worker as Ctrl-C does
    if "OMP_NUM_THREADS" not in os.environ:  # N workers share the cores: no N-fold oversubscription of torch threads
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings.workers))
    try:
        run_worker(settings)
    except KeyboardInterrupt:  # the trial in flight is already failed (re-run on resume); the parent reports
        pass
    except UsageError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        sys.exit(2)


def run_workers(settings: WorkerSettings) -> None:
    """``settings.workers`` local worker processes (or this one) pop WAITING trials until none is left, each on its
    own GPU where the machine has several (:func:`worker_devices`, one line per worker says which). A worker that
    died leaves its trial to :func:`reclaim_lost_trials`; one that met bad input ends ``tune`` (exit 2)."""
    workers = settings.workers
    if workers == 1:
        run_worker(settings)
        return
    import torch

    devices = worker_devices(workers, gpu_names(torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")))
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_worker_process, args=(settings,), kwargs={"device": device})
                 for device in devices]
    for index, (process, device) in enumerate(zip(processes, devices)):
        process.start()
        if device is not None:
            print(f"worker {index + 1} of {workers} (pid {process.pid}): GPU {device} (CUDA_VISIBLE_DEVICES={device})",
                  flush=True)
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
    if any(process.exitcode == 2 for process in processes):
        sys.exit(2)


def enqueue_missing(study: optuna.Study, space: SearchSpace, configurations: list[dict]) -> int:
    """Enqueue every configuration with no completed, failed, waiting or running trial; how many were. One with
    lost attempts is marked (:data:`~mtmoe.tuning.objective.LOST_ATTEMPTS`: workers run it before the plan); one
    lost :data:`MAX_LOST_ATTEMPTS` times is failed with its reason instead (a trial of its own).

    Optuna's ``RetryFailedTrialCallback`` is not used: it serves RDB storages' stale trials only, not a journal's
    nor the trials of a dead local worker failed at once, and it knows no configuration ids."""
    counts = study_counts(study)
    accounted = {t.user_attrs["config_id"] for t in counts["complete"] + counts["failed"]}
    accounted |= {t.user_attrs["config_id"] for t in counts["trials"]
                  if t.state in (TrialState.WAITING, TrialState.RUNNING) and "config_id" in t.user_attrs}
    lost: dict[int, int] = {}
    for trial in counts["trials"]:
        if is_lost(trial):
            lost[trial.user_attrs["config_id"]] = lost.get(trial.user_attrs["config_id"], 0) + 1
    enqueued = 0
    for config_id in range(len(configurations)):
        if config_id in accounted:
            continue
        params = configurations[config_id]
        attrs = {"config_id": config_id, "config_hash": config_hash(space, params)}
        if lost.get(config_id, 0) >= MAX_LOST_ATTEMPTS:
            reason = (f"lost: {lost[config_id]} attempts ended without a result (its worker was killed, e.g. out of "
                      "memory, or crashed; see the trial logs)")
            study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, params=params,
                                                      distributions=space.distributions,
                                                      user_attrs={**attrs, "fail_reason": reason}))
        else:
            study.enqueue_trial(params, user_attrs={**attrs, LOST_ATTEMPTS: lost[config_id]} if config_id in lost
                                else attrs)
            enqueued += 1
    return enqueued


def prepare_study(url: str, study_name: str, space: SearchSpace, seed: int, configurations: list[dict],
                  settings: dict[str, Any] | None = None, alpha: str | None = None) -> optuna.Study:
    """Create the study (or check that an existing one has the same identity: space, seed and settings) and enqueue
    what is missing; the study. Run it under :func:`~mtmoe.tuning.storage.setup_lock`.

    A configuration is missing when it has no completed, failed, waiting or running trial: never enqueued, or
    lost to a crash or an interrupt (resume).
    """
    storage = storage_for(url)
    identity = {"space_fingerprint": space.fingerprint, "seed": seed, "settings": _as_json(settings or {})}
    if study_name in optuna.get_all_study_names(storage):
        study = optuna.load_study(study_name=study_name, storage=storage)
        check_identity(study_name, study, identity)
    study = optuna.create_study(study_name=study_name, storage=storage, direction="minimize",
                                sampler=optuna.samplers.RandomSampler(seed=seed), load_if_exists=True)
    with warnings.catch_warnings():  # "experimental" since Optuna 3.2
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([OBJECTIVE_NAME])
    attrs = {**identity, "data": space.data, "gate": space.gate, "trials": space.trials}
    if alpha is not None:
        attrs["alpha"] = alpha
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    reclaim_lost_trials(study, storage)
    enqueue_missing(study, space, configurations)
    return study


def _as_json(value: Any) -> Any:
    """``value`` as the storage gives it back (JSON): tuples become lists, paths and other objects text."""
    return json.loads(json.dumps(value, default=lambda item: item.as_dict() if hasattr(item, "as_dict") else str(item)))


def check_identity(study_name: str, study: optuna.Study, identity: dict[str, Any]) -> None:
    """Refuse to add trials of another search space, seed or settings to an existing study (one line naming the
    differences). A study from before settings were recorded takes this run's, with a warning."""
    attrs = study.user_attrs
    if "settings" not in attrs and "space_fingerprint" in attrs:
        print(f"warning: study {study_name!r} has no recorded settings (created by an older mtmoe); recording this "
              f"run's: {describe_settings(identity['settings'])}", file=sys.stderr, flush=True)
        attrs = {**attrs, "settings": identity["settings"]}
    if "space_fingerprint" not in attrs:  # created by hand or elsewhere, nothing recorded: adopt this identity
        return
    differences = [f"{name} {attrs.get(key)} there, {identity[key]} now"
                   for key, name in (("space_fingerprint", "search space"), ("seed", "seed"))
                   if attrs.get(key) != identity[key]]
    stored, current = attrs["settings"], identity["settings"]
    for key in sorted(set(stored) | set(current)):
        if key not in stored or key not in current or _compared(key, stored[key]) != _compared(key, current[key]):
            there = json.dumps(stored[key]) if key in stored else "(not set)"
            now = json.dumps(current[key]) if key in current else "(not set)"
            differences.append(f"{key} {there} there, {now} now")
    if differences:
        raise UsageError(
            f"study {study_name!r} exists with other settings ({'; '.join(differences)}): refusing to mix trials of "
            "different settings; pass --study-name NAME to start another study, or another --storage"
        )


def _compared(key: str, value: Any) -> str:
    """A setting as two runs compare it: as JSON, so that a batch limit's count 1 is not the fraction 1.0 (all
    batches), but a whole float above 1 is the count Lightning reads it as (what a study recorded before counts were
    parsed as integers)."""
    if key.startswith("trainer.limit_") and isinstance(value, float) and value > 1 and value.is_integer():
        value = int(value)
    return json.dumps(value)


def parse_tune_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = OneLineParser(
        prog="python -m mtmoe tune", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s --gate GATE --data DATA [options]\n"
              "           [--trainer.* ...] [--model.* ...] [--data.* ...] [--early_stopping.* ...]",
        description="The paper's random search: --trials configurations of a gate's search space, drawn once from "
                    "--seed, each\ntrained as `fit` would (early stopping on the validation loss) in an Optuna study "
                    "that any number\nof workers and machines share and that a rerun of the same command resumes.",
        epilog="Every other option is passed to each trial's `fit`: --trainer.*, --model.*, --data.*, "
               "--early_stopping.*\n(e.g. --trainer.max_epochs 1 --model.alpha 0.1 --data.root DIR); one the search "
               "space tunes\n(e.g. --model.lr 0.001) is not sampled: every trial trains with it. Each trial's "
               "configuration is\nwritten as <log-dir>/<study>/config-NNNN/config.yaml (fit --config retrains it). "
               "What they change\nis part of the study's identity, with the search space and the seed:\nrerunning "
               "with other values is refused (pass --study-name for a new study). "
               "Folders, progress\ndisplay and the accelerator do not count, nor do --workers, --storage and "
               "--log-dir.\nThe database password may come from PGPASSWORD or ~/.pgpass instead of the URL.",
    )
    parser.add_argument("--gate", required=True, help="registered gate (`python -m mtmoe gates`) or module:Class, "
                                                      "NAME+ with local search")
    parser.add_argument("--data", required=True, help="dataset (`python -m mtmoe datasets`)")
    parser.add_argument("--trials", type=int, default=None, help="configurations (default: the space file's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the configurations and of the trials")
    parser.add_argument("--storage", default=None,
                        help="RDB URL (postgresql://user@host/db), journal:PATH or grpc://HOST:PORT (an Optuna gRPC "
                             "storage proxy), shared by the workers "
                             "(default: SQLite studies/optuna.db under the current directory, one worker)")
    parser.add_argument("--workers", type=int, default=1, help="local worker processes")
    parser.add_argument("--pack", default=None,
                        help="trials each worker trains at once as one packed model: a number, or auto (default: the "
                             "fastest pack size that fits the device, measured at the start)")
    parser.add_argument("--study-name", default=None, help="default: <data>/<gate>[/alpha=<alpha>]")
    parser.add_argument("--space", default=None, help="search-space file (default: the packaged spaces/<data>.yaml)")
    parser.add_argument("--log-dir", default=None,
                        help="per-trial logs (default: studies/runs/ under the current directory)")
    parser.add_argument("--checkpoint-every", type=float, default=None, metavar="SECONDS",
                        help="also save the running trials' state at the first epoch end this long after the last "
                             "save (always saved on Ctrl-C or SIGTERM; a rerun continues them)")
    parser.add_argument("--checkpoint-dir", default=None, metavar="FOLDER",
                        help="where the checkpoints go, in a folder per study (default: checkpoints/ beside a file "
                             "storage, else in the trials' log folder), e.g. a node's local disk")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="claim no trial this long after the start: the running ones finish, the same tune "
                             "resumes the study (Optuna's study.optimize(timeout=...); a job's time limit)")
    parser.add_argument("--no-checkpoints", action="store_true",
                        help="keep no state of the running trials (an interrupted trial reruns from its first "
                             "epoch): spares the copy of the pack's state at every epoch end and its write on "
                             "Ctrl-C or SIGTERM, e.g. where the checkpoints could not be kept anyway; "
                             "refused while an earlier tune's checkpoints of the study are kept (resume them, or "
                             "delete their folder)")
    args, overrides = parser.parse_known_args(argv)
    for arg in overrides:
        flag = arg.partition("=")[0]
        if arg.startswith("-") and not is_number(arg) and not flag.startswith(FIT_OPTIONS):
            raise UsageError(f"tune: unrecognized argument {flag}{did_you_mean(flag, parser._option_string_actions)}; "
                             "the trials' fit options are --trainer.*, --model.*, --data.*, --early_stopping.*")
    return args, attach_negative_numbers(overrides)


def pack_size(value: str | None) -> int | str:
    """``--pack``: a positive number or ``auto`` (the default: the fastest pack size that fits, measured)."""
    if value is None or value == "auto":
        return "auto"
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"--pack must be a positive number of trials or auto, got {value!r}")
    return int(value)


def _option_value(overrides: list[str], key: str) -> str | None:
    """The last ``--key=value`` or ``--key value`` among the overrides."""
    value = None
    for i, arg in enumerate(overrides):
        if arg.startswith(f"--{key}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{key}" and i + 1 < len(overrides):
            value = overrides[i + 1]
    return value


def _flat_config(namespace: Any) -> dict[str, Any]:
    """A parsed configuration as ``{dotted key: value}``, keyed as on the command line (no ``init_args``)."""
    return {key.replace(".init_args.", ".").removesuffix(".class_path"): value
            for key, value in namespace.items()}


def _neutral(key: str) -> bool:
    return any(key == name or key.startswith(name + ".") for name in NEUTRAL_SETTINGS)


def pin_overrides(space: SearchSpace, overrides: list[str]) -> tuple[SearchSpace, dict[str, Any]]:
    """The search space without the settings the overrides give a value (parsed as ``fit`` parses them, a
    ``--config`` file's included), which become fixed values: the override wins, every trial trains with it and it
    is not sampled. Returns that space and the pinned ``{key: value}``."""
    from mtmoe.run import build_run

    if not overrides:
        return space, {}
    with tempfile.TemporaryDirectory() as scratch:  # the parser of the run, which checks the overrides too
        run = build_run(cli_args(space, {}, overrides, 0, Path(scratch)))
    classes = [f"--data={run.config.data.class_path}", f"--model.gate={run.config.model.gate.class_path}"]
    given = run.cli.parser.parse_args([*classes, *overrides], defaults=False)  # what the overrides set, no more
    pinned = {key: value for key, value in _flat_config(given).items() if key in space.distributions}
    distributions = {key: value for key, value in space.distributions.items() if key not in pinned}
    return replace(space, fixed={**space.fixed, **_as_json(pinned)}, distributions=distributions), _as_json(pinned)


def check_overrides(space: SearchSpace, configurations: list[dict], overrides: list[str],
                    seed: int, pack: int | str = 1, checkpoints: bool = True) -> tuple[dict[str, Any], str | None]:
    """Instantiate the CLI for one configuration (the one with the longest permutation window): bad overrides, a
    window longer than the run and settings a pack cannot honour fail here, before the storage is touched, not in
    the middle of the study. ``checkpoints``: whether the packs keep their epoch-end snapshots on the device (counted
    in what a pack needs, as the workers count it).

    Returns the study's settings (every non-neutral value the overrides change from the search space's run) and
    the task weight alpha in force (``None`` where the dataset weights its tasks equally).
    """
    from mtmoe.run import build_run, translate_shortcuts
    from mtmoe.run_settings import dataset_info, resolve_dataset_settings, set_values
    from mtmoe.tuning.packs import resolve_capacity

    longest = max(range(len(configurations)), key=lambda i: configurations[i].get("model.perm_epochs") or 0)
    params = configurations[longest]
    with tempfile.TemporaryDirectory() as scratch:  # its planned values as values, as the tune worker sets them
        try:
            run = build_run(cli_args(space, {}, overrides, seed, Path(scratch)), params)
            check_space_values(run, space, params, seed)
        except SettingError as error:  # a planned value (the run names the flag of any other)
            key = next(key for key in (f"model.{error.setting}", f"data.{error.setting}") if key in params)
            raise refused_space_value(key, error.value, key, error) from None
        if pack != 1:
            run.datamodule.prepare_data()
            run.datamodule.setup("fit")
            resolve_capacity(pack, run, len(configurations), measure=False, checkpoints=checkpoints)
        search, max_epochs = run.model.net.local_search, run.trainer.max_epochs
        if search is not None and max_epochs not in (None, -1) and search.epochs > max_epochs:
            raise UsageError(
                f"configuration {longest} has perm_epochs={search.epochs}, longer than the run "
                f"(--trainer.max_epochs={max_epochs}): the permutation would never be frozen; raise max_epochs "
                "or pass --model.perm_epochs"
            )
        plain = run.cli.parser.parse_args(translate_shortcuts(cli_args(space, {}, [], seed, Path(scratch))))
        set_values(plain, params)
        resolve_dataset_settings(plain.model, dataset_info(plain.data))  # the values in force, as run.config's
    given, default = _flat_config(run.config), _flat_config(plain)
    settings = {key: given.get(key) for key in sorted(set(given) | set(default))
                if not _neutral(key) and given.get(key) != default.get(key)}
    alpha = f"{run.model.trial.task_weights[0]:g}" if run.datamodule.info.task_weighting == "alpha" else None
    return _as_json(settings), alpha


def check_space_values(run: Any, space: SearchSpace, params: dict[str, Any], seed: int) -> None:
    """Build the nets (and DataModules) of the values of the search space a model (or its data) may refuse (a
    gate's ``k`` above ``n_experts``), before the storage is touched, not when a trial meets them: each choice and
    each end of each range, one setting at a time, the others at ``params`` (a setting's check is a range).
    ``run``: a run of the overrides; a refused value raises its SettingError."""
    from mtmoe.run_settings import dataset_info
    from mtmoe.tuning.packs import TrialFactory

    factory = TrialFactory(run)
    for key, distribution in space.distributions.items():
        ends = distribution.choices if isinstance(distribution, CategoricalDistribution) else (distribution.low,
                                                                                             distribution.high)
        for value in ends:
            config = factory.config({**params, key: value}, seed)
            try:
                if key.startswith("data."):
                    dataset_info(config.data)
                elif key.startswith("model."):
                    factory.trial(None, config)
            except SettingError as error:
                group = "data" if key.startswith("data.") else "model"
                raise refused_space_value(key, value, f"{group}.{error.setting}", error) from None


def refused_space_value(key: str, value: Any, refused: str, error: SettingError) -> UsageError:
    """The search space's ``key`` at ``value`` makes the setting ``refused`` (``key`` itself, or one it bounds: a
    fixed ``model.gate.k`` above a tuned ``model.n_experts``) what ``error`` refuses, as one line."""
    which = "which is" if refused == key else f"with which {refused} {error.value} is"
    return UsageError(f"the search space's {key} may be {value}, {which} not allowed: {error.requirement}; narrow "
                      f"its range in the search space (--space), or pass --{key} VALUE to fix it")


def tune(argv: list[str]) -> None:
    """``python -m mtmoe tune``: plan, prepare the study, run the workers; Ctrl-C or SIGTERM stops cleanly
    (:mod:`mtmoe.interrupts`), saying whether the storage was touched."""
    touched: list[str] = []
    try:
        _tune(argv, touched)
    except KeyboardInterrupt:
        if not touched:
            raise Interrupted("before the study storage was opened: nothing was written; run the same command "
                              "again") from None
        raise Interrupted("trials in flight are marked failed and run again when the same tune command runs again "
                          "(it resumes the study), from their last epoch's checkpoint where one was saved") from None


def check_study_name(name: str) -> None:
    """``--study-name``: not empty (that is no name), and short enough to name its trials' log folder under
    ``--log-dir`` (a file name: at most :data:`MAX_NAME_BYTES` bytes, which also fits Optuna's 512 characters)."""
    if not name.strip():
        raise UsageError("--study-name is empty: pass a name, or leave the flag out for the default <data>/<gate>")
    size = len(name.replace("/", "_").encode())
    if size > MAX_NAME_BYTES:
        raise UsageError(f"--study-name is {size} bytes long, more than the {MAX_NAME_BYTES} that can name the "
                         "folder of its trials' logs: pass a shorter name")


def _tune(argv: list[str], touched: list[str]) -> None:
    """:func:`tune`; the storage's URL is appended to ``touched`` before it is first opened."""
    args, overrides = parse_tune_args(argv)
    deadline = None if args.timeout is None else time.time() + args.timeout
    if args.study_name is not None:
        check_study_name(args.study_name)
    if args.storage is not None:
        check_url(args.storage, writing=True)
    heartbeat_settings()  # a bad MTMOE_HEARTBEAT_* is refused before the storage is created
    dataset_path(args.data)  # unknown names fail here, before torch is imported and the storage touched
    check_gate_name(args.gate)
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if args.checkpoint_every is not None and not args.checkpoint_every > 0:
        raise UsageError(f"--checkpoint-every must be a positive number of seconds, got {args.checkpoint_every}")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.no_checkpoints and (args.checkpoint_every is not None or args.checkpoint_dir is not None):
        given = "--checkpoint-every" if args.checkpoint_every is not None else "--checkpoint-dir"
        raise UsageError(f"{given} and --no-checkpoints contradict each other: give one of them")
    checkpoint_dir = None if args.checkpoint_dir is None else writable_folder(
        Path(args.checkpoint_dir), "--checkpoint-dir", "the checkpoints")
    pack = pack_size(args.pack)
    log_dir = writable_folder(Path(args.log_dir) if args.log_dir else DEFAULT_LOG_DIR, "--log-dir",
                              "the trials' logs")
    url = default_storage_url() if args.storage is None else args.storage
    if url.startswith("sqlite") and args.workers > 1:
        raise UsageError("SQLite serialises writers: use --storage postgresql://... or journal:PATH for --workers > 1")
    from mtmoe.plain_kernels import announce

    announce()  # a bad MTMOE_PLAIN_KERNELS is refused before the storage is touched (the workers inherit it)
    space = load_space(args.data, args.gate, args.space)  # checks its keys against the signatures: imports Lightning
    trials = space.trials if args.trials is None else args.trials
    if not 1 <= trials <= MAX_TRIALS:
        raise UsageError(f"--trials must be between 1 and {MAX_TRIALS} (the plan of every configuration is drawn and "
                         f"enqueued when the study starts), got {trials}; split a larger search into studies of "
                         "other --seed values")
    if not 0 <= args.seed <= MAX_SEED - trials:
        raise UsageError(f"--seed must be between 0 and {MAX_SEED - trials} (configuration i trains with seed + i, "
                         f"at most {MAX_SEED}), got {args.seed}")
    quiet_libraries()
    space = SearchSpace(space.data, space.gate, trials, space.fixed, space.distributions)
    given_alpha = _option_value(overrides, "model.alpha")
    study_name = args.study_name or f"{args.data}/{args.gate}" + (f"/alpha={given_alpha}" if given_alpha else "")
    from mtmoe.tuning.checkpoints import checkpoint_folder, refuse_saved_states, saved_elsewhere, warn

    checkpoints = checkpoint_folder(url, study_name, study_log_folder(log_dir, study_name), checkpoint_dir)
    if args.no_checkpoints:
        refuse_saved_states(checkpoints)
    space, pinned = pin_overrides(space, overrides)
    configurations = plan_configurations(space, trials, args.seed)
    settings, alpha = check_overrides(space, configurations, overrides, args.seed, pack, not args.no_checkpoints)
    settings = {**settings, **pinned}  # a tuned setting given a value: part of the study's identity
    touched.append(url)
    if args.storage is None:  # made once the overrides are checked: bad input leaves no empty studies/ behind
        STUDIES_DIR.mkdir(exist_ok=True)
    with setup_lock(url), readable(url):
        study = prepare_study(url, study_name, space, args.seed, configurations, settings, alpha)
    print(f"study {study_name!r}: {trials} configurations, settings: {describe_settings(settings)}; storage "
          f"{display_url(url)}, {args.workers} worker(s)", flush=True)
    if not args.no_checkpoints:
        elsewhere = saved_elsewhere(study, checkpoints)
        if elsewhere:
            warn(f"{len(elsewhere)} checkpoint file(s) of this study's interrupted trials are outside {checkpoints}, "
                 f"which this tune reads: {', '.join(map(str, elsewhere))}; to continue those trials from their "
                 f"saved epoch, stop and pass --checkpoint-dir {elsewhere[0].parent.parent}; else they rerun")
    run_until_accounted(WorkerSettings(url, study_name, space, overrides, args.seed, args.workers, log_dir, pack,
                                       args.checkpoint_every, None if args.no_checkpoints else checkpoints, deadline),
                        configurations)


def run_until_accounted(settings: WorkerSettings, configurations: list[dict]) -> None:
    """Run the workers until every configuration is complete or failed: a lost trial's configuration runs again
    (or is failed after :data:`MAX_LOST_ATTEMPTS`), other workers' running trials are waited for. Past
    ``settings.deadline`` (``--timeout``), once this tune's running trials have ended: stop, also while waiting for
    other workers' trials, and say what waits. Exit 1 if the study is left unfinished otherwise (nothing moved while
    trials still wait)."""
    url, study_name, space, deadline = settings.url, settings.study_name, settings.space, settings.deadline
    storage = storage_for(url)
    announced, progress = False, None
    while True:
        run_workers(settings)
        study = optuna.load_study(study_name=study_name, storage=storage)
        reclaim_lost_trials(study, storage)
        enqueue_missing(study, space, configurations)
        counts = study_counts(study)
        state = (len(counts["complete"]) + len(counts["failed"]), counts["lost"])
        timed_out = past(deadline)
        if timed_out:
            break
        if counts["waiting"] and state != progress:  # lost trials re-enqueued, or more work: run the workers again
            progress = state
            continue
        if not counts["running"] or counts["waiting"]:
            break
        if not announced:  # trials of workers elsewhere: done, or failed after the grace period and re-run here
            print(f"study {study_name!r}: waiting for {counts['running']} running trial(s) of other workers "
                  f"(a lost one is failed after {heartbeat_settings()[1]} s without a heartbeat and re-run here)",
                  flush=True)
            announced = True
        while counts["running"] and not counts["waiting"] and not past(deadline):
            time.sleep(heartbeat_settings()[0] if deadline is None else
                       max(0.0, min(heartbeat_settings()[0], deadline - time.time())))
            reclaim_lost_trials(study, storage)
            enqueue_missing(study, space, configurations)
            counts = study_counts(study)
        progress = None
    print(f"study {study_name!r}: {len(counts['complete'])} complete, {len(counts['failed'])} failed, "
          f"{counts['waiting']} waiting", flush=True)
    if timed_out and (counts["waiting"] or counts["running"]):
        print(f"study {study_name!r}: --timeout reached, no trial claimed since; {counts['waiting']} waiting, "
              f"{counts['running']} running in other workers: the same tune command resumes the study", flush=True)
        return
    if counts["waiting"] or counts["running"]:
        others = sorted({str(t.user_attrs.get("worker", "?")) for t in counts["trials"]
                         if t.state == TrialState.RUNNING and "config_id" in t.user_attrs})
        print(f"study {study_name!r} is not finished: {counts['running']} trial(s) RUNNING in other workers "
              f"({', '.join(others) or 'none'}), {counts['waiting']} waiting that this tune's workers could not "
              "run; run the same tune command again to resume", file=sys.stderr, flush=True)
        sys.exit(1)
