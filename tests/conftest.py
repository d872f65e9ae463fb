"""Shared fixtures: a tiny MovieLens-100K data root in the official ``u.data`` format, CPU-only, no network."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test of a throwaway PostgreSQL server (``tests/pg.py``) is an integration test, also where it asks for the
    server with ``request.getfixturevalue`` (a ``postgresql`` parameter): the inner loop ``-m "not integration"``
    starts no server. Under pytest-xdist (pyproject's ``--dist loadgroup``) these tests share one worker: one server
    starts, not one per worker, and only one worker adds the ``postgres`` user."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {}).values()
        if {"postgres_url", "password_url"} & set(getattr(item, "fixturenames", ())) or "postgresql" in params:
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.xdist_group("postgres"))
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        group_node_ids(items)


def group_node_ids(items: list[pytest.Item]) -> None:
    """The ``@GROUP`` suffix of an ``xdist_group`` test's node id, by which ``--dist loadgroup`` sends a group to one
    worker. pytest-xdist 3.8 writes it to ``item._nodeid``, which pytest 9.2 no longer reads (a node's id is
    ``item._id``, a ``NodeId``): without this, a group's tests are spread over the workers. No public way to set a
    node id exists; ``tests/test_xdist_groups.py`` fails if this one stops working."""
    for item in items:
        names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                        for mark in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix):
            from _pytest.nodes import NodeId  # pytest 9.2 and later only: earlier ones read xdist's suffix

            item._id = NodeId.parse(item.nodeid + suffix)


@pytest.fixture(autouse=True, scope="session")
def unverified_files():
    """``MTMOE_VERIFY=false`` for the session, restored after it: the tiny fixtures stand where the official files go
    (ml-100k/u.data, ...) with other contents, and every DataModule, tune worker and script the tests start uses them
    as they are. Tests of the check pass ``verify=True`` or set the variable themselves."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MTMOE_VERIFY", "false")
        yield


@pytest.fixture(autouse=True, scope="session")
def threads_per_worker():
    """Under pytest-xdist, each worker's share of the cores for torch's threads (and, via ``OMP_NUM_THREADS``, for
    the processes tests start), unless ``OMP_NUM_THREADS`` is set: N workers with N threads each would oversubscribe
    the machine. Restored after the session."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not workers or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads, share = torch.get_num_threads(), max(1, cores // workers)
    torch.set_num_threads(share)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", str(share))
        yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def signal_handlers():
    """Each test starts with Python's own Ctrl-C handler, and leaves SIGTERM's handler and the unraisable hook as it
    found them. A process that a shell starts in the background ignores Ctrl-C (and so would its children), and
    ``mtmoe.cli.main`` run in-process (:func:`run_cli`) keeps its handlers as a command's process does to its exit
    (after a stop, :func:`mtmoe.interrupts.stopping`, Ctrl-C ignored): either way a test that stops a command with
    ``_thread.interrupt_main``, a no-op while Ctrl-C is ignored, would not stop it."""
    import signal
    import sys
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigterm, hook = signal.getsignal(signal.SIGTERM), sys.unraisablehook
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sigterm is not None:  # None: a handler set outside Python, which Python cannot set back
        signal.signal(signal.SIGTERM, sigterm)
    sys.unraisablehook = hook


def require_dataset(name: str) -> None:
    """Skip the calling test unless the dataset ``name``'s files are under the data root (``$MTMOE_DATA``)."""
    from mtmoe.data.layout import data_root, files_status

    if files_status(name, data_root())[0] != "present":
        pytest.skip(f"needs {name} under $MTMOE_DATA")


def run_cli(argv: list[str]) -> int:
    """``python -m mtmoe ARGV`` in-process; the exit code (0 unless it exits)."""
    from mtmoe.cli import main

    try:
        main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def full_disk_for(prefixes: str | tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """The temporary files of :func:`mtmoe.files.atomic_path` for targets whose names start with ``prefixes`` are
    /dev/full, where every write fails with ENOSPC as on a full disk."""
    import tempfile

    mkstemp = tempfile.mkstemp

    def full_disk(*args, **kwargs):
        fd, name = mkstemp(*args, **kwargs)
        if Path(name).name.removeprefix(".").startswith(prefixes):
            os.close(fd)
            os.unlink(name)
            os.symlink("/dev/full", name)
            fd = os.open(name, os.O_WRONLY)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", full_disk)


def sqlite_file(path: Path, build: Callable[[Any], None]) -> str:
    """``build(storage)`` on an Optuna storage in an in-memory SQLite database, then that database written to ``path``
    in one go (sqlite3's backup): the ``sqlite:///`` URL of ``path``. The file is the one ``build`` would leave on
    it, without a commit, each a sync of the disk, per trial and attribute."""
    import sqlite3

    import optuna

    memory = optuna.storages.RDBStorage("sqlite:///:memory:")
    build(memory)
    target = sqlite3.connect(path)
    try:
        with memory.engine.connect() as connection:
            connection.connection.driver_connection.backup(target)
    finally:
        target.close()
        memory.engine.dispose()
    return f"sqlite:///{path}"


def write_u_data(root: Path, n_users: int = 60, per_user: int = 12, seed: int = 0) -> Path:
    """ML-100K ``u.data`` (tab-separated ``user item rating timestamp``) with a learnable rating pattern."""
    rng = np.random.default_rng(seed)
    lines = []
    for user in range(1, n_users + 1):
        for item in rng.choice(np.arange(1, 101), size=per_user, replace=False):
            rating = 1 + (user + item) % 5
            lines.append(f"{user}\t{item}\t{rating}\t{881250949 + user}\n")
    path = root / "ml-100k" / "u.data"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return path


@pytest.fixture
def tiny_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data root holding a tiny ML-100K; caches and run logs go to tmp_path, never the repository."""
    root = tmp_path / "data"
    write_u_data(root)
    monkeypatch.setenv("MTMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return root


@pytest.fixture(scope="session")
def postgres_url():
    """A throwaway PostgreSQL server on loopback (``tests/pg.py``): its ``postgresql+psycopg2://`` URL.

    No server binaries: fails when ``CI`` is set (``.ci/run`` installs them), skips otherwise.
    """
    import os

    from pg import find_bin_dir, postgres_server

    bin_dir = find_bin_dir()
    if bin_dir is None:
        message = "no PostgreSQL server binaries (initdb, pg_ctl, postgres): apt-get install postgresql"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with postgres_server(bin_dir) as url:
        yield url


@pytest.fixture
def root_and_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A tiny ML-100K root and the test's folder (cwd; caches there), for tests that start processes."""
    root = tmp_path / "data"
    write_u_data(root)
    monkeypatch.setenv("MTMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return root, tmp_path
