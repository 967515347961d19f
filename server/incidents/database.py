"""The one interface both incident stores sit behind: a database that runs
`IncidentStore`'s SQL, one transaction at a time.

`IncidentStore` (server.incidents.store) holds every query, written once with
`?` placeholders and the types below; a `Database` runs them on its engine:

- `SQLiteDatabase` (server.incidents.sqlite_db): one file in the coordinator's
  data directory, the embedded default (the demo's, a single job's);
- `PostgresDatabase` (server.incidents.postgres_db): a PostgreSQL server that
  the coordinators of many jobs share (`--store postgresql://...`).

Each keeps its own schema version and migrates its own way (SQLite's
`PRAGMA user_version`, PostgreSQL's `hangwatch_schema` table); the tables,
columns and indexes are the same, from `SCHEMA` below.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, Protocol

Row = dict[str, Any]

# The schema every store holds, as of SCHEMA_VERSION. `{REAL}` is the engine's
# 64-bit float (unix seconds need it: PostgreSQL's REAL is 32 bits, a second's
# resolution lost after 2^24 s). JSON lists and maps are TEXT on both engines,
# so one reader (`store._row`) reads both.
# 3: culprit_hosts (node history across jobs).
SCHEMA_VERSION: Final = 3
SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id      TEXT PRIMARY KEY,
    first_seen  {REAL} NOT NULL,
    last_seen   {REAL} NOT NULL
);
CREATE TABLE IF NOT EXISTS incidents (
    id                 TEXT PRIMARY KEY,
    job_id             TEXT NOT NULL,
    created            {REAL} NOT NULL,
    reason             TEXT NOT NULL,
    trigger            TEXT NOT NULL,
    status             TEXT NOT NULL,
    verdict            TEXT,
    summary            TEXT,
    lagging_ranks      TEXT NOT NULL DEFAULT '[]',
    ranks_expected     TEXT NOT NULL DEFAULT '[]',
    ranks_dumped       TEXT NOT NULL DEFAULT '[]',
    ranks_unreachable  TEXT NOT NULL DEFAULT '{}',
    detection_s        {REAL},
    report             TEXT,
    error              TEXT,
    updated            {REAL} NOT NULL
);
CREATE INDEX IF NOT EXISTS incidents_status ON incidents (status);
CREATE INDEX IF NOT EXISTS incidents_job_created ON incidents (job_id, created);
CREATE INDEX IF NOT EXISTS incidents_created ON incidents (created);
CREATE INDEX IF NOT EXISTS incidents_verdict ON incidents (verdict);
-- The list's filtered pages, newest first, without sorting every match
-- (benchmarks/store_history.py: a verdict's page of 100 among 100,000
-- incidents took 42-47 ms on SQLite with the verdict index alone).
CREATE INDEX IF NOT EXISTS incidents_verdict_created ON incidents (verdict, created);
CREATE INDEX IF NOT EXISTS incidents_status_created ON incidents (status, created);
"""
# Columns added after version 1, added to older databases on open (ADD COLUMN:
# existing rows get the default). Never removed or renamed.
ADDED_COLUMNS: Final = (
    # unix seconds the incident was resolved or ended
    ("closed_at", "{REAL}"),
    # resolved: seconds from the stall's onset to the job's progress resuming
    ("stall_s", "{REAL}"),
    # resolved: the ranks that were late (the incident's lagging ranks)
    ("late_ranks", "TEXT NOT NULL DEFAULT '[]'"),
    # resolved/ended: what closed it, for people
    ("close_reason", "TEXT"),
    # what the coordinator did about it (server.action_records), JSON list
    ("actions", "TEXT NOT NULL DEFAULT '[]'"),
)
# Per incident, the hosts that held its culprit ranks (server.incidents.hosts):
# rewritten with the incident's verdict, in the same transaction.
CULPRIT_HOSTS: Final = """
CREATE TABLE IF NOT EXISTS culprit_hosts (
    incident_id  TEXT NOT NULL REFERENCES incidents (id) ON DELETE CASCADE,
    host         TEXT NOT NULL,
    job_id       TEXT NOT NULL,
    created      {REAL} NOT NULL,
    ranks        TEXT NOT NULL,
    gpus         TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (incident_id, host)
);
CREATE INDEX IF NOT EXISTS culprit_hosts_host_created ON culprit_hosts (host, created);
CREATE INDEX IF NOT EXISTS culprit_hosts_created ON culprit_hosts (created);
"""


def statements(script: str, real: str) -> list[str]:
    """`script`'s statements, `{REAL}` spelled for the engine; comments dropped."""
    lines = [ln for ln in script.replace("{REAL}", real).splitlines() if not ln.startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


class Transaction(Protocol):
    """One open transaction: statements with `?` placeholders."""

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        """Run a statement; the number of rows it changed."""
        ...

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        """Run a query; its rows, by column name."""
        ...


class Database(Protocol):
    """What `IncidentStore` needs of an engine."""

    # "sqlite" or "postgresql"
    kind: str
    # The engine's `max(a, b)` of two values: SQLite's MAX, PostgreSQL's GREATEST.
    greatest: str
    # An aggregate of a group's distinct values of column `{}` as a JSON array,
    # in text: SQLite's json_group_array, PostgreSQL's json_agg.
    distinct_json_array: str

    def transaction(self, *, write: bool = True) -> AbstractContextManager[Transaction]:
        """A transaction that commits on a clean exit and rolls back on any
        exception (which it re-raises): every change the store makes is one.
        `write=False`: it only reads (SQLite then takes no write lock)."""
        ...

    def migrate(self) -> int:
        """Bring the schema up to SCHEMA_VERSION (tables, indexes, added
        columns); the version found before, 0 for a new database. Raises
        RuntimeError for a database newer than this hangwatch."""
        ...

    def set_version(self, version: int) -> None:
        """Record that the schema is at `version` (after the store's data migrations)."""
        ...

    def ping(self) -> str:
        """A cheap round trip (readiness); the journal mode, for people."""
        ...

    def close(self) -> None: ...

    def describe(self) -> str:
        """Where the data is, for logs: a path, or a URL without its password."""
        ...
