"""A real PostgreSQL server for the store tests: initdb + pg_ctl in a temporary directory.

`initdb` refuses to run as root, so where the tests run as root the server runs
as the `postgres` user (Debian's package creates it), in a directory it owns, on
a free port, listening on 127.0.0.1 only with `trust` authentication for local
TCP (nothing else can reach it). Each test gets its own database
(`PgServer.new_database`), so tests share one server and never each other's rows.

Where the binaries are missing the tests are skipped with the reason, except on
CI (`CI` set), where .ci/run installs Debian's `postgresql` and a missing server
is a failure.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

PG_USER = "postgres"  # Debian's package creates this user; initdb refuses root


def _bindir() -> Path | None:
    initdb = shutil.which("initdb")
    if initdb:  # pg_ctl and postgres sit next to the real file, not a link to it
        return Path(initdb).resolve().parent
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        d = Path(out.stdout.strip())
        if (d / "initdb").exists():
            return d
    # Debian keeps the server binaries out of PATH, one directory per major version.
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def require_postgres() -> Path:
    bindir = _bindir()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL's initdb is missing on CI (.ci/run must install postgresql)")
        pytest.skip("PostgreSQL is not installed here (apt-get install postgresql)")
    return bindir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    """One running server; `stop`, `start`, `restart` as its owner would."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="hangwatch-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = _free_port()
        if os.geteuid() == 0:
            pw = pwd.getpwnam(PG_USER)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.user = PG_USER if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            self.user,
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",  # a test server: nothing needs to survive an OS crash
        )
        with open(self.data / "postgresql.conf", "a", encoding="utf-8") as f:
            f.write(
                f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                # The socket directory Debian defaults to may not be writable here.
                f"unix_socket_directories = '{self.root}'\n"
                "fsync = off\nmax_connections = 200\n"
            )
        self.start()

    def _run(self, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
        # As root, through runuser, not subprocess's user=/group=: with those
        # Python forks instead of vforking, and the fork runs gRPC's atfork
        # handlers in the child of a test process that holds gRPC channels
        # (seen once in five full runs: pg_ctl aborted in ev_epoll1's check).
        prefix = ["runuser", "-u", PG_USER, "--"] if os.geteuid() == 0 else []
        p = subprocess.run(
            [*prefix, str(self.bindir / tool), *args],
            capture_output=True,
            text=True,
            check=False,
            cwd=self.root,
            timeout=120,
        )
        if p.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed: {p.stdout}{p.stderr}")
        return p

    def pg_ctl(self, action: str, *args: str) -> None:
        self._run("pg_ctl", action, "-D", str(self.data), "-l", str(self.log), "-w", *args)

    def start(self) -> None:
        self.pg_ctl("start")

    def stop(self) -> None:
        self.pg_ctl("stop", "-m", "fast")

    def restart(self) -> None:
        self.pg_ctl("restart", "-m", "fast")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def sql(self, statement: str, database: str = "postgres") -> str:
        """Run one statement as the superuser; its rows' first column, a line each."""
        import psycopg  # the `test` extra's; only a test that runs a server needs it

        with psycopg.connect(self.url(database), autocommit=True) as conn:
            cur = conn.execute(statement.encode())
            return "\n".join(str(r[0]) for r in cur.fetchall()) if cur.description else ""

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        name = "t_" + uuid.uuid4().hex[:12]
        self.sql(f"CREATE DATABASE {name}")
        return self.url(name)

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
