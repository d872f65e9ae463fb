"""A throwaway PostgreSQL server for the tests: ``initdb`` into a temporary folder, loopback only, stopped at the end.

The server binaries come from Debian's ``postgresql`` package (``.ci/run`` installs it when missing): ``initdb``,
``pg_ctl`` and ``postgres`` on ``PATH`` or under ``/usr/lib/postgresql/<version>/bin``. ``initdb`` refuses to run
as root, so as root the server runs as the ``postgres`` system user (created when absent) in a folder it owns.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

SUPERUSER = "mtmoe"
DATABASE = "mtmoe_test"


def find_bin_dir() -> Path | None:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres`` (the newest Debian version when not on PATH)."""
    candidates = []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(os.path.realpath(on_path)).parent)
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
                      if Path(p).parent.name.isdigit() else 0, reverse=True)
    candidates += [Path(p) for p in versions]
    for folder in candidates:
        if all((folder / name).is_file() for name in ("initdb", "pg_ctl", "postgres")):
            return folder
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_server_user(command: list[str]) -> list[str]:
    """``command`` as the server's user: ``postgres`` when we are root (initdb refuses root), else ourselves."""
    if os.geteuid() != 0:
        return command
    if shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--", *command]
    return ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(f"'{c}'" for c in command)]


def _ensure_postgres_user() -> None:
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh", "postgres"], check=True,
                       capture_output=True)


def _run(command: list[str], what: str) -> None:
    proc = subprocess.run(_as_server_user(command), capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")


def create_database(url: str, name: str) -> str:
    """A new, empty database ``name`` on the server of ``url``; its URL."""
    import psycopg2
    from sqlalchemy.engine import make_url

    server = make_url(url)
    connection = psycopg2.connect(host=server.host, port=server.port, user=server.username, password=server.password,
                                  dbname="postgres")
    connection.autocommit = True
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {name}")
    connection.close()
    return server.set(database=name).render_as_string(hide_password=False)


@contextmanager
def postgres_server(bin_dir: Path, password: str | None = None) -> Iterator[str]:
    """Start a server on 127.0.0.1 (a free port), create ``mtmoe_test``, yield its SQLAlchemy URL, then stop it.

    With a ``password``, the server asks every client for it (scram-sha-256) and the URL carries it."""
    import psycopg2

    base = Path(tempfile.mkdtemp(prefix="mtmoe-pg-"))
    data, sockets, log = base / "data", base / "sockets", base / "server.log"
    sockets.mkdir()
    if os.geteuid() == 0:
        _ensure_postgres_user()
        user = pwd.getpwnam("postgres")
        for path in (base, sockets):
            os.chown(path, user.pw_uid, user.pw_gid)
    started = False
    try:
        auth = ["--auth=trust"]
        if password is not None:
            (base / "pwfile").write_text(password + "\n")
            (base / "pwfile").chmod(0o644)  # read by initdb as the server's user
            auth = ["--auth=scram-sha-256", f"--pwfile={base / 'pwfile'}"]
        _run([str(bin_dir / "initdb"), "-D", str(data), "-U", SUPERUSER, *auth, "--no-locale",
              "-E", "UTF8", "--no-sync"], "initdb")
        port = free_port()
        options = (f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        _run([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(log), "-w", "-t", "60", "start"],
             "pg_ctl start")
        started = True
        deadline = time.monotonic() + 30
        while True:
            try:
                connection = psycopg2.connect(host="127.0.0.1", port=port, user=SUPERUSER, dbname="postgres",
                                              password=password)
                break
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {DATABASE}")
        connection.close()
        credentials = SUPERUSER if password is None else f"{SUPERUSER}:{password}"
        yield f"postgresql+psycopg2://{credentials}@127.0.0.1:{port}/{DATABASE}"
    finally:
        if started:
            subprocess.run(_as_server_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w",
                                            "stop"]), capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)
