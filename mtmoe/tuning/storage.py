"""Where the tuning studies live and how a storage is opened (``tune`` writes it, ``report`` and ``bootstrap`` read it).

Like Lightning's ``lightning_logs/``, everything the tuning commands write goes under the current directory unless
a flag says otherwise: the folder ``studies/`` (:data:`STUDIES_DIR`) holds the default SQLite storage
``studies/optuna.db``, the trials' logs ``studies/runs/`` and the reports ``studies/reports/<data>/``.
``--storage`` takes an RDB URL (PostgreSQL for many workers and machines, with heartbeats) or ``journal:PATH``
(Optuna's JournalStorage, no server, no heartbeats).
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

import optuna

from mtmoe.errors import UsageError

STUDIES_DIR = Path("studies")  # relative: under the current directory
HEARTBEAT_INTERVAL, GRACE_PERIOD = 10, 30  # seconds; MTMOE_HEARTBEAT_INTERVAL / MTMOE_HEARTBEAT_GRACE override


def default_storage_url() -> str:
    """The default storage: SQLite ``studies/optuna.db`` under the current directory (one worker)."""
    return f"sqlite:///{Path.cwd() / STUDIES_DIR / 'optuna.db'}"


def heartbeat_settings() -> tuple[int, int]:
    """(interval, grace period) in seconds of RDB heartbeats; the environment may shorten them (tests)."""
    try:
        interval = int(os.environ.get("MTMOE_HEARTBEAT_INTERVAL", HEARTBEAT_INTERVAL))
        grace = int(os.environ.get("MTMOE_HEARTBEAT_GRACE", GRACE_PERIOD))
    except ValueError as error:
        raise UsageError(f"MTMOE_HEARTBEAT_INTERVAL/MTMOE_HEARTBEAT_GRACE must be integers: {error}") from None
    if not 1 <= interval < grace:
        raise UsageError(f"heartbeat: need 1 <= MTMOE_HEARTBEAT_INTERVAL ({interval}) < MTMOE_HEARTBEAT_GRACE ({grace})")
    return interval, grace


def rdb_url(url: str) -> str:
    """``postgresql://`` with the installed driver: SQLAlchemy >= 2.1 defaults to psycopg 3, the project installs
    psycopg2 (``psycopg2-binary``), so a plain URL would fail with "Failed to import DB access module"."""
    if url.startswith("postgresql://"):
        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + url.removeprefix("postgresql://")
    return url


def storage_for(url: str):
    """An Optuna storage: RDB URL (with heartbeats), ``journal:PATH``; unreachable -> one-line UsageError."""
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
        interval, grace = heartbeat_settings()
        with warnings.catch_warnings():  # heartbeats are "experimental": not worth a warning on every command
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                rdb_url(url),
                engine_kwargs={"pool_pre_ping": True} if not url.startswith("sqlite") else None,
                heartbeat_interval=interval,
                grace_period=grace,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3),
            )
    except UsageError:
        raise
    except Exception as error:  # sqlalchemy/driver errors: say what could not be reached
        reason = " ".join(str(error).split())[:300]
        raise UsageError(f"cannot open the study storage {url!r}: {reason}") from None


def open_storage(url: str | None):
    """(URL, storage) of an existing storage, read-only in spirit: a missing SQLite or journal file is an error,
    never created. ``None``: the default storage."""
    url = url or default_storage_url()
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        if not path.is_file():
            raise UsageError(f"no study storage at {path} (run `python -m mtmoe tune` first, or pass --storage)")
    elif url.startswith("journal:") and not Path(url.removeprefix("journal:")).is_file():
        raise UsageError(f"no journal file {url.removeprefix('journal:')} (run tune first, or pass --storage)")
    return url, storage_for(url)


def has_heartbeat(storage: Any) -> bool:
    """RDB storages (SQLite, PostgreSQL) record heartbeats here; JournalStorage cannot."""
    return isinstance(storage, optuna.storages.RDBStorage) and storage.get_heartbeat_interval() is not None
