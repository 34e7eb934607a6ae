"""A throwaway PostgreSQL cluster for tests and benchmarks: ``initdb`` into a temporary folder,
``pg_ctl start`` on a free loopback port (its unix socket in the same folder), removed on exit.

Uses the Debian packages' binaries (``apt-get install postgresql``; ``.ci/run`` installs them).
Run as root, the server runs as the ``postgres`` user (PostgreSQL refuses root)::

    with throwaway_cluster() as cluster:
        url = cluster.new_database()       # postgresql://postgres@127.0.0.1:PORT/db_xxxx
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Cluster", "find_bindir", "throwaway_cluster"]


def find_bindir() -> Path | None:
    """The newest installed PostgreSQL's ``bin`` folder, or ``None`` when none is installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    folder: Path
    port: int
    _pg_ctl: Callable[..., None]

    def restart(self) -> None:
        """Stop the server at once (dropping every connection) and start it again."""
        self._pg_ctl("restart", "-m", "immediate")

    def stop(self) -> None:
        """Stop the server at once, dropping every connection (:meth:`start` brings it back)."""
        self._pg_ctl("stop", "-m", "immediate")

    def start(self) -> None:
        self._pg_ctl("start")

    def terminate_clients(self, database: str) -> int:
        """End every connection to ``database`` (its URL) from the server side, as an
        administrator or a failover would; returns how many."""
        import psycopg

        name = database.rsplit("/", 1)[-1]
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            return len(conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname=%s",
                                    (name,)).fetchall())

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def new_database(self) -> str:
        """A new, empty database on the cluster; its URL."""
        import psycopg

        name = f"db_{secrets.token_hex(4)}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"


@contextlib.contextmanager
def throwaway_cluster() -> Iterator[Cluster]:
    """Start a cluster in a new temporary folder; stop it and delete the folder afterwards."""
    bindir = find_bindir()
    if bindir is None:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    folder = Path(tempfile.mkdtemp(prefix="inferscale-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(folder, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = folder / "data", _free_port()
    log = folder / "server.log"

    def run(*cmd: str) -> None:
        done = subprocess.run([*as_user, *cmd], capture_output=True, text=True, timeout=120)  # noqa: PLW1510
        if done.returncode != 0:
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd[:2])} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}{tail}")

    options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"

    def pg_ctl(action: str, *args: str) -> None:
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", *args, action)

    started = False
    try:
        run(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        pg_ctl("start")
        started = True
        yield Cluster(folder, port, pg_ctl)
    finally:
        if started:
            with contextlib.suppress(Exception):
                pg_ctl("stop", "-m", "immediate")
        shutil.rmtree(folder, ignore_errors=True)
