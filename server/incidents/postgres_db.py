"""The shared store's engine: a PostgreSQL server that many jobs' coordinators write to.

Each coordinator holds a small `psycopg_pool.ConnectionPool` (the gRPC
handlers, the detector and the analysis worker write; the dashboard reads).
Every change is one transaction on one pooled connection, so a coordinator
killed half-way leaves nothing half-written: the server rolls its open
transaction back when the connection drops.

When the server goes away (a restart, a failover) the pool reconnects in the
background with psycopg_pool's back-off (1 s, doubling, jittered) for
`RECONNECT_TIMEOUT_S`, then the next call that needs a connection tries again
at once. Meanwhile a write fails within `POOL_TIMEOUT_S` with an error
`store.disk_full` counts as "the store refused it", and the coordinator keeps
what it held and writes it again later (server.incidents.manager), as it does
for a full disk; for `FAIL_FAST_S` after such a failure while the pool's
connects were failing, every call fails at once rather than wait again.

The URL never carries the password: it comes from `--store-password-file`,
HANGWATCH_STORE_PASSWORD, or libpq's own PGPASSFILE / PGPASSWORD.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

import psycopg
from hangwatch.server.incidents.database import (
    ADDED_COLUMNS,
    CULPRIT_HOSTS,
    SCHEMA,
    SCHEMA_VERSION,
    Row,
    statements,
)
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from hangwatch.config import check_store_url

REAL: Final = "DOUBLE PRECISION"
# How long a store call waits for a pooled connection before it fails (and the
# caller keeps its data for later): long enough for a busy pool, short enough
# that a gRPC handler answers well within an agent's deadline.
POOL_TIMEOUT_S: Final = 5.0
# A read's wait for a connection: the dashboard's reads take milliseconds, so
# a pool with none free for 1 s is a server out of reach, and a page that
# falls back to the live state alone (server.web.live) answers without it.
READ_TIMEOUT_S: Final = 1.0
# libpq's own wait for a server that does not answer a connect.
CONNECT_TIMEOUT_S: Final = 5
# After a call found no connection in its wait while the pool's attempts to
# connect were failing (the server out of reach, not a busy pool), the calls
# of the next second fail at once: a dashboard page makes several reads and
# each waited its second (measured: 5 s for /readyz, 3 s for a job's page,
# while the server was down), and a failover is seconds long anyway. A wait
# that ran out while connects succeeded (a pool renewing the sessions a
# server cut) does not: the next call may well get one.
FAIL_FAST_S: Final = 1.0
# The pool's background reconnection gives up after this long, and the next
# call that needs a connection starts a fresh attempt at once. psycopg_pool's
# default (5 min, its delay doubling from 1 s) left a store that had been away
# 16 s unnoticed for 12 s after its server was back.
RECONNECT_TIMEOUT_S: Final = 3.0
# Connections per coordinator: its writers are few (gRPC handlers, the
# detector, the analysis worker) and the dashboard's reads are short.
POOL_MAX: Final = 4
# Serialises schema migrations of coordinators that start together (two
# concurrent CREATE TABLE IF NOT EXISTS can both pass the check and one then
# fails on pg_type's unique index). An arbitrary constant: 'hwsc' in ASCII.
_MIGRATION_LOCK: Final = 0x68777363


@functools.lru_cache(maxsize=256)
def _pg(sql: str) -> str:
    """The store's `?` placeholders as psycopg's `%s` (its SQL has no literal % or ?)."""
    return sql.replace("%", "%%").replace("?", "%s")


class _Tx:
    def __init__(self, conn: psycopg.Connection[Row]) -> None:
        self._conn = conn

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self._conn.execute(_pg(sql), tuple(args)).rowcount

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        return self._conn.execute(_pg(sql), tuple(args)).fetchall()


class PostgresDatabase:
    kind = "postgresql"
    greatest = "GREATEST"
    distinct_json_array = "json_agg(DISTINCT {})::text"

    def __init__(self, url: str, *, password: str | None = None) -> None:
        # A URL with a password is refused before it can reach a log line.
        check_store_url(url)
        self.url = url
        kwargs: dict[str, Any] = {
            "autocommit": True,  # transactions are explicit: conn.transaction()
            "row_factory": dict_row,
            "connect_timeout": CONNECT_TIMEOUT_S,
            "application_name": "hangwatch",
        }
        if password:
            kwargs["password"] = password
        self._pool: ConnectionPool[psycopg.Connection[Row]] = ConnectionPool(
            url,
            kwargs=kwargs,
            min_size=1,
            max_size=POOL_MAX,
            timeout=POOL_TIMEOUT_S,
            # A connection the server dropped (a restart) is found and replaced
            # when it is taken, not when a statement fails on it.
            check=ConnectionPool.check_connection,
            open=False,
            name="hangwatch-store",
            reconnect_timeout=RECONNECT_TIMEOUT_S,
        )
        self._fail_fast_until = 0.0
        self._connect_errors = 0  # the pool's failed connects when last looked
        try:
            # At start the server must answer: a coordinator that cannot reach
            # its store says so at once rather than on its first incident. One
            # plain connect first: the pool would retry a wrong password or an
            # unknown database until its timeout, libpq says why at once.
            psycopg.connect(url, **kwargs).close()
            self._pool.open(wait=True, timeout=POOL_TIMEOUT_S + CONNECT_TIMEOUT_S)
        except Exception as e:
            self._pool.close()
            raise RuntimeError(f"cannot reach it: {e}") from e

    def describe(self) -> str:
        return self.url  # check_store_url: it carries no password

    @contextmanager
    def transaction(self, *, write: bool = True) -> Iterator[_Tx]:
        wait = POOL_TIMEOUT_S if write else READ_TIMEOUT_S
        if time.monotonic() < self._fail_fast_until:
            raise PoolTimeout("the store's server was out of reach a moment ago; not waiting again")
        try:
            conn = self._pool.getconn(timeout=wait)
        except PoolTimeout:
            if self._failed_connects():
                self._fail_fast_until = time.monotonic() + FAIL_FAST_S
            raise
        self._failed_connects()  # the count so far is not this outage's
        try:
            with conn.transaction():
                yield _Tx(conn)
        finally:
            self._pool.putconn(conn)

    def _failed_connects(self) -> bool:
        """Did the pool fail to connect since this was last asked? (A few µs:
        a copy of its counters under its lock.)"""
        errors = self._pool.get_stats().get("connections_errors", 0)
        new, self._connect_errors = errors > self._connect_errors, errors
        return new

    def migrate(self) -> int:
        with self.transaction() as tx:
            tx.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            tx.execute(
                "CREATE TABLE IF NOT EXISTS hangwatch_schema ("
                f"version INTEGER PRIMARY KEY, migrated {REAL} NOT NULL)"
            )
            found = tx.query("SELECT MAX(version) AS v FROM hangwatch_schema")[0]["v"] or 0
            if found > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.describe()} has schema version {found}; "
                    f"this hangwatch knows {SCHEMA_VERSION}"
                )
            for stmt in statements(SCHEMA, REAL):
                tx.execute(stmt)
            for name, decl in ADDED_COLUMNS:
                tx.execute(
                    f"ALTER TABLE incidents ADD COLUMN IF NOT EXISTS {name} {decl.format(REAL=REAL)}"
                )
            for stmt in statements(CULPRIT_HOSTS, REAL):
                tx.execute(stmt)
            return int(found)

    def set_version(self, version: int) -> None:
        with self.transaction() as tx:
            tx.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            tx.execute(
                "INSERT INTO hangwatch_schema (version, migrated) VALUES (?, ?) "
                "ON CONFLICT (version) DO NOTHING",
                (int(version), time.time()),
            )

    def ping(self) -> str:
        with self.transaction() as tx:
            tx.query("SELECT 1 AS ok")
        return "wal"  # PostgreSQL's write-ahead log is always on

    def close(self) -> None:
        # Its reconnect workers may be asleep in a back-off while the server is
        # away: the coordinator's bounded shutdown waits 2 s for them, not
        # psycopg_pool's default 5.
        self._pool.close(timeout=2.0)
