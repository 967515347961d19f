"""The embedded store's engine: one SQLite file in WAL mode, safe to share across threads.

The coordinator writes from its gRPC handlers, its detector thread and its
analysis worker; the dashboard reads concurrently. One connection guarded by a
lock keeps writes serialised and simple; WAL lets readers in other processes
(for example `sqlite3 hangwatch.db` during an incident) see committed rows
without blocking the writer.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hangwatch.server.incidents.database import (
    ADDED_COLUMNS,
    CULPRIT_HOSTS,
    SCHEMA,
    SCHEMA_VERSION,
    Row,
    statements,
)


class _Tx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self._db.execute(sql, tuple(args)).rowcount

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        return [dict(r) for r in self._db.execute(sql, tuple(args)).fetchall()]


class SQLiteDatabase:
    kind = "sqlite"
    greatest = "MAX"
    distinct_json_array = "json_group_array(DISTINCT {})"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so each
        # multi-statement change is one transaction.
        self._db = sqlite3.connect(
            str(self.path), check_same_thread=False, isolation_level=None, timeout=10.0
        )
        self._db.row_factory = sqlite3.Row
        mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RuntimeError(f"{self.path}: SQLite refused WAL mode (got {mode!r})")
        # NORMAL is durable across process crashes in WAL mode; only an OS
        # crash can lose the last transactions, which costs at most an incident
        # row whose bundle files are still on disk.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._closed = False

    def describe(self) -> str:
        return str(self.path)

    @contextmanager
    def transaction(self, *, write: bool = True) -> Iterator[_Tx]:
        with self._lock:
            # IMMEDIATE: take the write lock now, so that another process's
            # writer makes this wait (timeout=10 s), not fail half-way. A
            # reader's plain BEGIN reads one WAL snapshot and blocks no one.
            self._db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield _Tx(self._db)
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def _rollback(self) -> None:
        # SQLite ends a transaction itself on some errors (SQLITE_FULL among
        # them): a ROLLBACK then raises "no transaction is active" and would
        # hide the error that matters ("database or disk is full").
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def migrate(self) -> int:
        with self._lock:
            version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.path} has schema version {version}; this hangwatch knows {SCHEMA_VERSION}"
                )
            with self.transaction() as tx:
                for stmt in statements(SCHEMA, "REAL"):
                    tx.execute(stmt)
                have = {r["name"] for r in tx.query("PRAGMA table_info(incidents)")}
                for name, decl in ADDED_COLUMNS:
                    if name not in have:
                        tx.execute(
                            f"ALTER TABLE incidents ADD COLUMN {name} {decl.format(REAL='REAL')}"
                        )
                for stmt in statements(CULPRIT_HOSTS, "REAL"):
                    tx.execute(stmt)
            return version

    def set_version(self, version: int) -> None:
        with self._lock:
            self._db.execute(f"PRAGMA user_version={int(version)}")

    def ping(self) -> str:
        with self._lock:
            return str(self._db.execute("PRAGMA journal_mode").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()
