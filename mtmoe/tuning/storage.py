"""Where the tuning studies live and how a storage is opened (``tune`` writes it, ``report`` and ``bootstrap`` read it).

Like Lightning's ``lightning_logs/``, everything the tuning commands write goes under the current directory unless
a flag says otherwise: the folder ``studies/`` (:data:`STUDIES_DIR`) holds the default SQLite storage
``studies/optuna.db``, the trials' logs ``studies/runs/`` and the reports ``studies/reports/<data>/``.
``--storage`` takes an RDB URL (PostgreSQL for many workers and machines), ``journal:PATH`` (Optuna's
JournalStorage: no server, many workers and machines sharing the file) or ``grpc://HOST:PORT`` (Optuna's
``GrpcStorageProxy``: a proxy server, ``optuna.storages.run_grpc_proxy_server``, in front of one storage, for
hundreds of workers).

* **Passwords** are never shown: every URL printed, written or quoted in an error goes through
  :func:`display_url` (``postgresql://user:***@host/db``, ``...?user=u&password=***``). A URL without a password
  lets the driver find it as PostgreSQL's own tools do: ``PGPASSWORD``, or the passfile ``~/.pgpass``
  (``PGPASSFILE``). A password holding an unencoded ``@`` is refused (SQLAlchemy and libpq would take its tail
  for the host): it is written ``%40``.
* **Heartbeats, every storage.** A running trial's worker records a heartbeat every interval (RDB storages: Optuna's
  own; JournalStorage and the gRPC proxy: the trial's ``heartbeat`` user attribute, :func:`beating`); a RUNNING trial silent for the
  grace period, on any host, is stale and failed by :func:`fail_stale_trials` (``MTMOE_HEARTBEAT_INTERVAL`` /
  ``MTMOE_HEARTBEAT_GRACE`` seconds, default 10/30).
* **Faults.** A ``--storage`` that cannot be used (empty, unparsable, a file in a missing folder) is refused before
  anything is created (:func:`check_url`); a damaged database is one line saying to restore it (:func:`readable`); a
  journal whose last record a crash tore is cut back to its last whole record by ``tune``, with a warning
  (:func:`repair_journal`; ``report`` and ``bootstrap`` read up to it and leave the file as it is,
  :func:`warn_torn_journal`), and a file that is no journal (a SQLite file given as ``journal:PATH``) is refused,
  left as it is (:func:`check_journal`).
* **First start.** :func:`setup_lock` serialises what processes starting together on one storage do first (creating
  the tables, the study, enqueuing its plan): PostgreSQL with an advisory lock, SQLite and journal files with a file
  lock.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import queue
import sys
import threading
import time
import urllib.parse
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import optuna
from optuna.trial import FrozenTrial, TrialState

from mtmoe.errors import UsageError

STUDIES_DIR = Path("studies")  # relative: under the current directory
HEARTBEAT_INTERVAL, GRACE_PERIOD = 10, 30  # seconds; MTMOE_HEARTBEAT_INTERVAL / MTMOE_HEARTBEAT_GRACE override
HEARTBEAT_ATTR = "heartbeat"  # JournalStorage: a running trial's last heartbeat, seconds since the epoch
SETUP_LOCK_KEY = 0x6D746D6F65  # PostgreSQL advisory lock of the first-start work ("mtmoe")


def default_storage_url() -> str:
    """The default storage: SQLite ``studies/optuna.db`` under the current directory (one worker)."""
    return f"sqlite:///{Path.cwd() / STUDIES_DIR / 'optuna.db'}"


def display_url(url: str, text: str | None = None) -> str:
    """``url`` with its password shown as ``***``; with ``text`` (a message about ``url``, a driver's error),
    ``text`` with ``url`` shown so and every other occurrence of its password, as written or decoded, masked.

    The password is where SQLAlchemy's URL parser finds it (spaces, quotes, percent-encoded characters; an
    unencoded ``@`` in it runs to the host's last ``@``) and in the ``password`` query parameter; a URL SQLAlchemy
    cannot parse (a port that is no number) is split as RFC 3986 says (the userinfo ends at the last ``@``)."""
    shown, secrets = _masked(url)
    if text is None:
        return shown
    pieces = text.split(url)
    for secret in sorted(secrets | {urllib.parse.quote(secret, safe="") for secret in secrets}, key=len, reverse=True):
        pieces = [piece.replace(secret, "***") for piece in pieces]
    return shown.join(pieces)


def journal_path(url: str) -> str | None:
    """The file of a ``journal:PATH`` storage URL; ``None`` for any other URL."""
    return url.removeprefix("journal:") if url.startswith("journal:") else None


def grpc_address(url: str) -> tuple[str, int] | None:
    """(host, port) of a ``grpc://HOST:PORT`` storage URL; ``None`` for any other URL; a malformed one is refused."""
    if not url.startswith("grpc://"):
        return None
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path not in ("", "/") or parts.query or parts.username:
        raise UsageError(f"--storage {url!r} is not a gRPC proxy address: write grpc://HOST:PORT (the host and port "
                         "of a running optuna.storages.run_grpc_proxy_server)")
    return parts.hostname, port


def _needs_sqlalchemy(url: str) -> bool:
    """An RDB URL; a journal or a gRPC proxy needs no SQLAlchemy (a lent GPU's image has none)."""
    return journal_path(url) is None and not url.startswith("grpc://")


def _masked(url: str) -> tuple[str, set[str]]:
    """(``url`` with its passwords shown as ``***``, the passwords as written and decoded)."""
    if not _needs_sqlalchemy(url):
        return url, set()
    from sqlalchemy.engine import make_url  # here: a journal storage needs no SQLAlchemy (a lent GPU has none)

    try:
        parsed = make_url(url)
    except Exception:  # ArgumentError, or ValueError for a port that is no number
        return _masked_rfc3986(url)
    passwords = parsed.query.get("password", ())
    if parsed.password is None and not passwords:  # nothing to mask: as given (SQLAlchemy would encode a path's "@")
        return url, set()
    secrets = {*([passwords] if isinstance(passwords, str) else passwords)}
    if parsed.password is not None:
        userinfo, _, host = (parsed.password + "@" + (parsed.host or "")).rpartition("@")
        secrets.add(userinfo)
        parsed = parsed.set(host=host or None)  # an unencoded "@" in the password: the host is after the last one
    if passwords:
        parsed = parsed.update_query_dict({"password": "***"})
    shown = parsed.render_as_string(hide_password=True).replace("password=%2A%2A%2A", "password=***")
    return shown, (secrets | _masked_rfc3986(url)[1]) - {""}


def _masked_rfc3986(url: str) -> tuple[str, set[str]]:
    """:func:`_masked` by ``urllib.parse``: the userinfo ends at the netloc's last ``@``; no ``scheme://``: all
    before the last ``@`` is masked."""
    parts = urllib.parse.urlsplit(url)
    if not parts.netloc:
        return ("***@" + url.rpartition("@")[2] if "@" in url else url), set()
    userinfo, at, host = parts.netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    secrets = {password, urllib.parse.unquote(password)} if at and colon else set()
    query = []
    for pair in parts.query.split("&") if parts.query else []:
        key, _, value = pair.partition("=")
        if urllib.parse.unquote_plus(key) == "password":
            secrets |= {value, urllib.parse.unquote_plus(value)}
            pair = f"{key}=***"
        query.append(pair)
    netloc = f"{user}:***@{host}" if at and colon else parts.netloc
    shown = urllib.parse.urlunsplit(parts._replace(netloc=netloc, query="&".join(query)))
    return shown, secrets - {""}


def heartbeat_settings() -> tuple[int, int]:
    """(interval, grace period) in seconds of the heartbeats; the environment may shorten them (tests)."""
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
    psycopg2 (``psycopg2-binary``), so a plain URL would fail with "Failed to import DB access module". A password
    with an unencoded ``@`` is refused: SQLAlchemy, as libpq, would take its tail for the host."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # the storage reports it
        parsed = None
    if parsed is not None and parsed.password is not None and "@" in (parsed.host or ""):
        raise UsageError(f"the password in the storage URL {display_url(url)!r} holds an unencoded '@': write it "
                         "as %40 (or leave the password out of the URL and set PGPASSWORD)")
    if url.startswith("postgresql://"):
        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + url.removeprefix("postgresql://")
    return url


def _storage_error(url: str, error: BaseException) -> UsageError:
    """A driver's or the filesystem's error as one line naming the storage, passwords masked, saying what to do: a
    damaged database (SQLite's "database disk image is malformed", a journal record before the last that is no
    JSON) is restored, an unreachable one checked. A journal or a gRPC proxy needs no SQLAlchemy (a lent GPU's image
    has none)."""
    while error.__cause__ is not None and isinstance(error, optuna.exceptions.StorageInternalError):
        error = error.__cause__  # Optuna's "An exception is raised during the commit" hides the driver's reason
    damaged = isinstance(error, json.JSONDecodeError)  # Optuna's journal reader: a torn last record is skipped
    if _needs_sqlalchemy(url):
        import sqlalchemy.exc

        damaged = isinstance(error, sqlalchemy.exc.DatabaseError) and not isinstance(error,
                                                                                   sqlalchemy.exc.OperationalError)
        if isinstance(error, sqlalchemy.exc.DBAPIError):
            error = error.orig or error  # the driver's message, without SQLAlchemy's statement and link
    reason = display_url(url, " ".join(str(error).split()))[:300]
    if damaged:
        how = " (a SQLite file: `sqlite3 FILE .recover`)" if url.startswith("sqlite") else ""
        return UsageError(f"the study storage {display_url(url)!r} cannot be read ({reason}): it is damaged; restore "
                          f"it from a backup{how}, or pass another --storage")
    return UsageError(f"cannot open the study storage {display_url(url)!r}: {reason}")


@contextmanager
def readable(url: str) -> Iterator[None]:
    """Storage errors met while reading or writing an open storage (a damaged SQLite file, a lost server) as one
    UsageError line (:func:`_storage_error`). A journal needs no SQLAlchemy (a lent GPU's image has none)."""
    errors: tuple[type[Exception], ...] = (optuna.exceptions.StorageInternalError,)
    if _needs_sqlalchemy(url):
        import sqlalchemy.exc

        errors += (sqlalchemy.exc.SQLAlchemyError,)
    elif url.startswith("grpc://"):
        import grpc

        errors += (grpc.RpcError,)
    try:
        yield
    except errors as error:
        raise _storage_error(url, error) from None


def check_url(url: str, writing: bool = False) -> None:
    """``--storage`` checked before anything is opened or created: not empty, a URL SQLAlchemy can parse (or
    ``journal:PATH``, which needs no SQLAlchemy, of a file that is a journal if it exists), a file's path a file in
    an existing folder, writable for ``tune`` (``writing``; :func:`check_file`)."""
    if not url.strip():
        raise UsageError("--storage is empty: pass postgresql://user@host/db, sqlite:///PATH, journal:PATH or "
                         "grpc://HOST:PORT, or leave the flag out for the default studies/optuna.db")
    path = journal_path(url)
    if path is not None and not path.strip():
        raise UsageError(f"--storage {url!r} names no file: write journal:PATH")
    if path is not None:
        check_journal(path)
    if grpc_address(url) is None and path is None:
        from sqlalchemy.engine import make_url

        try:
            parsed = make_url(url)
        except Exception:  # ArgumentError, or ValueError for a port that is no number
            raise UsageError(f"--storage {display_url(url)!r} is not a storage URL: write sqlite:///PATH (relative) "
                             "or sqlite:////PATH (absolute), postgresql://user@host/db, journal:PATH or "
                             "grpc://HOST:PORT") from None
        path = _sqlite_file(url) if parsed.drivername.startswith("sqlite") else None
        if path is not None and _file_start(path, url) == JOURNAL_RECORD_START:
            raise UsageError(f"--storage {display_url(url)!r}: the file is an Optuna journal, not a SQLite database: "
                             f"pass --storage journal:{path}")
    if path is not None:
        check_file(url, path, writing)


def check_file(url: str, path: str, writing: bool = False) -> None:
    """The file ``path`` of a SQLite or journal storage ``url``: not a folder, in an existing folder, and for
    ``tune`` (``writing``) in a writable one (SQLite's rollback journal and the journal's lock are written beside
    the file), the file writable if it exists."""
    file = Path(path).absolute()
    if file.is_dir():
        example = (f"sqlite:///{file / 'optuna.db'}" if url.startswith("sqlite")
                   else f"journal:{file / 'optuna.journal'}")
        raise UsageError(f"--storage {display_url(url)!r}: {path} is a folder, not a file: name the study file, e.g. "
                         f"--storage {example}")
    if not file.parent.is_dir():
        raise UsageError(f"--storage {display_url(url)!r}: there is no folder {file.parent} for its file; create it, "
                         "or pass another --storage")
    if writing and not (os.access(file.parent, os.W_OK | os.X_OK)
                        and (not file.exists() or os.access(file, os.R_OK | os.W_OK))):
        where = file if os.access(file.parent, os.W_OK | os.X_OK) else file.parent
        raise UsageError(f"--storage {display_url(url)!r}: {where} is not writable, and tune writes the study "
                         "there: pass a --storage in a writable folder")


def repair_journal(path: str) -> None:
    """Cut a journal file back to its last whole record when its last record is torn (a crash mid-append leaves a
    line without its end, or one that is no JSON), as a log-structured store recovers: the records after it would
    otherwise join the torn line and the file could not be read. Done under Optuna's append lock; one warning
    line. A file that is no journal (a SQLite file given as ``journal:PATH``) is refused, left as it is."""
    from optuna.storages.journal import JournalFileSymlinkLock

    check_journal(path)
    if _torn_tail(path) is None:
        return
    lock = JournalFileSymlinkLock(path)  # the lock JournalFileBackend appends under: no append is in flight
    lock.acquire()
    try:
        if (start := _torn_tail(path)) is None:
            return
        size = os.path.getsize(path)
        try:
            os.truncate(path, start)
            done = "cut off"
        except OSError:  # a read-only file: Optuna's reader skips the torn line too
            done = "skipped"
        print(f"warning: journal {path}: its last record is torn (a crash while writing it); its {size - start} "
              f"bytes {done}, the {start} bytes of records before it kept", file=sys.stderr, flush=True)
    finally:
        lock.release()


def warn_torn_journal(path: str) -> None:
    """What a read-only command (``report``, ``bootstrap``) does with a journal whose last record is torn: one warning
    line; the file is left as it is, and Optuna's reader reads the whole records before the torn one. The next
    ``tune`` on the journal cuts it off (:func:`repair_journal`)."""
    if (start := _torn_tail(path)) is not None:
        print(f"warning: journal {path}: its last record is torn (a crash while writing it); the {start} bytes of "
              f"whole records before it are read, the file is left as it is (the next `python -m mtmoe tune "
              f"--storage journal:{path}` cuts the torn record off)", file=sys.stderr, flush=True)


#: How every record of an Optuna journal file starts (``JournalStorage`` writes each as compact JSON, op code first).
JOURNAL_RECORD_START = b'{"op_code":'


def _file_start(path: str, url: str) -> bytes:
    """The first bytes of the storage file ``path`` (as many as :data:`JOURNAL_RECORD_START`), ``b""`` if missing
    or a folder (:func:`check_file` says so)."""
    try:
        with open(path, "rb") as file:
            return file.read(len(JOURNAL_RECORD_START))
    except (FileNotFoundError, IsADirectoryError):
        return b""
    except OSError as error:
        raise UsageError(f"--storage {display_url(url)!r}: cannot read it ({error.strerror or error})") from None


def check_journal(path: str) -> None:
    """A UsageError unless the file ``path`` is missing, empty or starts as an Optuna journal does: never cut or
    append to another file given as a journal."""
    start = _file_start(path, f"journal:{path}")
    if start and start != JOURNAL_RECORD_START:
        raise UsageError(f"--storage 'journal:{path}': the file is no Optuna journal (left as it is); a SQLite file is "
                         "--storage sqlite:///PATH")


def _torn_tail(path: str) -> int | None:
    """Where the torn last record of the journal ``path`` starts, or ``None`` (whole, empty or missing)."""
    try:
        with open(path, "rb") as file:
            end = file.seek(0, os.SEEK_END)
            if end == 0:
                return None
            file.seek(end - 1)
            whole = file.read(1) == b"\n"
            start = _line_start(file, end - whole)
            file.seek(start)
            last = file.read(end - start)
    except OSError:
        return None
    if whole:
        try:
            json.loads(last)
        except ValueError:
            return start
        return None
    return start


def _line_start(file: Any, end: int) -> int:
    """The offset just after the last newline before ``end`` in ``file`` (0: none)."""
    position = end
    while position > 0:
        step = min(65536, position)
        position -= step
        file.seek(position)
        found = file.read(step).rfind(b"\n")
        if found >= 0:
            return position + found + 1
    return 0


def storage_for(url: str, read_only: bool = False):
    """An Optuna storage: RDB URL (with heartbeats), ``journal:PATH`` (a torn last record cut off first,
    :func:`repair_journal`; ``read_only``: the file left as it is, :func:`warn_torn_journal`), ``grpc://HOST:PORT``
    (:func:`grpc_proxy`); unreachable -> one-line UsageError."""
    if (address := grpc_address(url)) is not None:
        return grpc_proxy(*address)
    try:
        if (path := journal_path(url)) is not None:
            from optuna.storages.journal import JournalFileBackend

            (warn_torn_journal if read_only else repair_journal)(path)
            return optuna.storages.JournalStorage(JournalFileBackend(path))
        interval, grace = heartbeat_settings()
        with warnings.catch_warnings():  # heartbeats are "experimental": not worth a warning on every command
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                rdb_url(url),
                engine_kwargs={"pool_pre_ping": True} if not url.startswith("sqlite") else None,
                heartbeat_interval=interval,
                grace_period=grace,
            )
    except UsageError:
        raise
    except Exception as error:  # sqlalchemy/driver errors: say what could not be reached
        raise _storage_error(url, error) from None


#: Seconds a worker waits for a gRPC proxy server to answer before it gives up.
GRPC_CONNECT_TIMEOUT = 20


def grpc_proxy(host: str, port: int):
    """Optuna's ``GrpcStorageProxy`` client of the proxy server at ``host:port``, once it answers (within
    :data:`GRPC_CONNECT_TIMEOUT` seconds; else one-line UsageError). Needs ``grpcio`` (the ``grpc`` extra)."""
    if importlib.util.find_spec("grpc") is None:
        raise UsageError("--storage grpc://... needs grpcio: pip install 'mtmoe[grpc]'")
    with warnings.catch_warnings():  # "experimental" (Optuna 4.2 onwards)
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.GrpcStorageProxy(host=host, port=port)
    try:
        storage.wait_server_ready(timeout=GRPC_CONNECT_TIMEOUT)
    except ConnectionError:
        storage.close()
        raise UsageError(f"no gRPC storage proxy answers at {host}:{port} within {GRPC_CONNECT_TIMEOUT} s: start "
                         "optuna.storages.run_grpc_proxy_server there (docs/clusters.md), or check --storage") from None
    return storage


@contextmanager
def setup_lock(url: str) -> Iterator[None]:
    """Hold the storage's first-start lock: processes starting together create its tables and studies one at a
    time (PostgreSQL: an advisory lock; SQLite and journal files: ``flock`` on the file, created if missing)."""
    if url.startswith("postgresql"):
        import sqlalchemy

        try:
            engine = sqlalchemy.create_engine(rdb_url(url), poolclass=sqlalchemy.pool.NullPool)
            connection = engine.connect()
            connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": SETUP_LOCK_KEY})
        except UsageError:
            raise
        except Exception as error:
            raise _storage_error(url, error) from None
        try:
            yield
        finally:
            connection.close()  # ends the session, which releases the lock
            engine.dispose()
        return
    path = journal_path(url)
    path = _sqlite_file(url) if path is None else path
    if path is None:  # another RDB, an in-memory SQLite or a gRPC proxy: nothing to lock here
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as error:
        raise _storage_error(url, error) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _sqlite_file(url: str) -> str | None:
    if not url.startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(url).database
    return None if database in (None, "", ":memory:") else database


def open_storage(url: str | None):
    """(URL, storage) of an existing storage, for the read-only commands: a missing SQLite or journal file is an
    error, never created, and a journal's torn last record is read past, not cut off (:func:`warn_torn_journal`).
    ``None``: the default storage."""
    url = default_storage_url() if url is None else url
    file = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else journal_path(url)
    if file and Path(file).is_dir():  # not "no file": a folder, and what to name instead
        check_file(url, file)
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        if not path.is_file():
            raise UsageError(f"no study storage at {path} (run `python -m mtmoe tune` first, or pass --storage)")
    elif (path := journal_path(url)) and not Path(path).is_file():  # "journal:" alone: check_url says so
        raise UsageError(f"no journal file {path} (run tune first, or pass --storage)")
    check_url(url)
    return url, storage_for(url, read_only=True)


def has_heartbeat(storage: Any) -> bool:
    """RDB storages (SQLite, PostgreSQL; :func:`storage_for`'s, not the study's cached view of them) record Optuna's
    heartbeats; JournalStorage and the gRPC proxy record :data:`HEARTBEAT_ATTR`."""
    return isinstance(storage, optuna.storages.RDBStorage) and storage.get_heartbeat_interval() is not None


def trial_id(storage: Any, study: optuna.Study, number: int) -> int:
    """The storage's id of ``study``'s trial ``number``, by the public storage API (a trial's id is private to it:
    ``_trial_id``)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)


def record_heartbeat(storage: Any, trial_id: int) -> None:
    """One heartbeat of a running trial, in any storage."""
    if has_heartbeat(storage):
        storage.record_heartbeat(trial_id)
    else:
        storage.set_trial_user_attr(trial_id, HEARTBEAT_ATTR, time.time())


def past(deadline: float | None) -> bool:
    """Whether ``deadline`` (a ``time.time()``, as ``tune --timeout`` sets it; ``None``: none) has passed."""
    return deadline is not None and time.time() >= deadline


class Periodic:
    """Calls ``action()`` every heartbeat interval in a daemon thread until :meth:`stop`. A call that raises (the
    storage unreachable for a moment) is warned about on stderr, once per kind of error, and the next interval calls
    again: heartbeats and the reclaiming of dead workers' trials outlive a transient fault."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action, self.stopped = action, threading.Event()
        self.warned: set[str] = set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(heartbeat_settings()[0]):
            try:
                self.action()
            except Exception as error:  # noqa: BLE001 - any storage fault; the next interval tries again
                kind = type(error).__name__
                if kind not in self.warned:
                    self.warned.add(kind)
                    print(f"warning: a periodic storage call failed ({kind}: {str(error).splitlines()[0][:200]}); "
                          f"retrying every {heartbeat_settings()[0]} s", file=sys.stderr, flush=True)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


class OrderedWrites:
    """Runs the calls given to :meth:`put` one after another, in order, in a daemon thread: storage writes a pack
    makes by the hundred an epoch (its trials' intermediate values, results and tells), which training need not wait
    for. A call that raises stops the thread's work: the calls queued after it are dropped, and :meth:`put` and
    :meth:`join` raise that error in the caller's thread from then on (without it, :meth:`join` would wait forever
    for calls no thread runs)."""

    def __init__(self) -> None:
        self.calls: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, daemon=True).start()

    def put(self, call: Callable[[], None]) -> None:
        self._raise()
        self.calls.put(call)

    def join(self, check: bool = True) -> None:
        """Wait until every call put so far has run (or was dropped after a failed one); with ``check``, raise the
        error of one that failed."""
        self.calls.join()
        if check:
            self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            call = self.calls.get()
            try:
                if self.error is None:
                    call()
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                self.error = error
            finally:
                self.calls.task_done()


class Heartbeats:
    """Records a heartbeat for every trial in ``ids`` now and every interval (:class:`Periodic`), in any storage
    (:func:`record_heartbeat`): what ``optimize`` does for its one trial, for the several trials a pack runs at once;
    a trial failed as stale meanwhile is dropped."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.ids, self.lock = set(), threading.Lock()
        self.ticker = Periodic(self._beat)

    def add(self, trial_id: int) -> None:
        with self.lock:
            self.ids.add(trial_id)
        record_heartbeat(self.storage, trial_id)

    def remove(self, trial_id: int) -> None:
        with self.lock:
            self.ids.discard(trial_id)

    def _beat(self) -> None:
        with self.lock:
            ids = list(self.ids)
        for trial_id in ids:
            try:
                record_heartbeat(self.storage, trial_id)
            except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale meanwhile
                self.remove(trial_id)

    def stop(self) -> None:
        self.ticker.stop()


@contextmanager
def beating(storage: Any, trial_id: int) -> Iterator[None]:
    """Record ``trial_id``'s heartbeat now and every interval while the block runs, where Optuna's ``optimize``
    does not (JournalStorage); RDB storages: nothing to add."""
    if has_heartbeat(storage):
        yield
        return
    heartbeats = Heartbeats(storage)
    heartbeats.add(trial_id)
    try:
        yield
    finally:
        heartbeats.stop()


def fail_stale_trials(study: optuna.Study, storage: Any,
                      alive: Callable[[FrozenTrial], bool] = lambda trial: False) -> None:
    """Fail the RUNNING trials silent for the grace period, on any host: RDB storages by Optuna's heartbeats,
    JournalStorage and the gRPC proxy by :data:`HEARTBEAT_ATTR` (or, for a trial whose worker died before its first
    beat, its start time), there except those ``alive(trial)`` vouches for. ``storage``: the study's
    (:func:`storage_for`)."""
    if has_heartbeat(storage):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        return
    grace, now = heartbeat_settings()[1], time.time()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        last = trial.user_attrs.get(HEARTBEAT_ATTR)
        if last is None and trial.datetime_start is not None:
            last = trial.datetime_start.timestamp()  # Optuna's start times are naive local times, as timestamp() reads
        if last is None or now - float(last) <= grace or alive(trial):
            continue
        try:
            storage.set_trial_state_values(trial_id(storage, study, trial.number), TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:  # another process failed or finished it meanwhile
            pass
