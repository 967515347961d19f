"""Durable incident store: every incident's row and the jobs they belong to.

One class holds every query; a `Database` (server.incidents.database) runs
them: an SQLite file in the coordinator's data directory (the embedded default,
`IncidentStore(path)` / `in_dir`), or a PostgreSQL server that many jobs'
coordinators share (`IncidentStore.open("postgresql://...")`). The bundle
files always live under `incidents_root`, in the coordinator's data directory.
Incidents survive a coordinator restart; the live job state does not (agents
re-register and rebuild it).
"""

from __future__ import annotations

import errno
import json
import logging
import re
import secrets
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

from hangwatch.analyzer.report import Report
from hangwatch.server.incidents.action_records import ActionRecord
from hangwatch.server.incidents.database import SCHEMA_VERSION, Database, Row, Transaction
from hangwatch.server.incidents.hosts import (
    INCIDENTS_SHOWN,
    CulpritHost,
    HostHistory,
    culprit_hosts,
)
from hangwatch.server.incidents.sqlite_db import SQLiteDatabase

from hangwatch.formats import TriggerKind

log = logging.getLogger(__name__)

DB_FILE: Final = "hangwatch.db"
INCIDENTS_DIR: Final = "incidents"

TRIGGERS: Final = tuple(TriggerKind)


class IncidentStatus(StrEnum):
    """The store's status column, as the API and the dashboard spell it.

    collecting -> analyzed -> resolved (the stall cleared by itself: a
    transient stall) or ended (the job stopped with it unresolved); failed:
    finalizing raised. See docs/operations.md, "Incident states".
    """

    COLLECTING = "collecting"
    ANALYZED = "analyzed"
    RESOLVED = "resolved"
    ENDED = "ended"
    FAILED = "failed"


STATUSES: Final = tuple(IncidentStatus)
# Statuses of incidents that still need someone: not resolved, ended or failed.
OPEN_STATUSES: Final = (IncidentStatus.COLLECTING, IncidentStatus.ANALYZED)

# Incident ids name directories, so they are restricted to a safe alphabet.
INCIDENT_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass(kw_only=True, frozen=True)
class IncidentRow:
    id: str
    job_id: str
    created: float  # unix seconds
    reason: str
    trigger: str  # one of TRIGGERS
    status: str  # one of STATUSES
    verdict: str | None = None
    summary: str | None = None
    lagging_ranks: list[int] = field(default_factory=list)
    ranks_expected: list[int] = field(default_factory=list)
    ranks_dumped: list[int] = field(default_factory=list)
    ranks_unreachable: dict[int, str] = field(default_factory=dict)
    # From the stall's onset (the coordinator's last sight of progress in the
    # stalled group, or an event's own age) to the verdict being stored.
    detection_s: float | None = None
    report: Report | None = None
    error: str | None = None
    updated: float = 0.0  # unix seconds of the last change
    closed_at: float | None = None  # unix seconds it became resolved or ended
    stall_s: float | None = None  # resolved: onset to progress resuming
    late_ranks: list[int] = field(default_factory=list)  # resolved: who was late
    close_reason: str | None = None  # resolved/ended: what closed it
    actions: list[ActionRecord] = field(default_factory=list)  # --on-hang, --exclude-command

    @property
    def is_open(self) -> bool:
        """Still needs someone: collecting or analyzed (a hang nobody cleared)."""
        return self.status in OPEN_STATUSES

    @property
    def transient(self) -> bool:
        """A stall that cleared by itself."""
        return self.status == IncidentStatus.RESOLVED

    def summary_fields(self) -> dict[str, Any]:
        """The incident as every list shows it: the API's `IncidentSummary`, a
        webhook's `incident` and the action events are all this, so a field added
        here reaches each of them under one name (`job`, `created`)."""
        return {
            "id": self.id,
            "job": self.job_id,
            "created": self.created,
            "status": self.status,
            "open": self.is_open,
            "transient": self.transient,
            "trigger": self.trigger,
            "verdict": self.verdict,
            "summary": self.summary,
            "lagging_ranks": list(self.lagging_ranks),
            "detection_s": self.detection_s,
            "closed_at": self.closed_at,
            "stall_s": self.stall_s,
            "late_ranks": list(self.late_ranks),
            "close_reason": self.close_reason,
        }


@dataclass(kw_only=True, frozen=True)
class JobRow:
    job_id: str
    first_seen: float  # unix seconds
    last_seen: float
    incidents: int


class UnknownIncident(KeyError):
    """No incident with that id."""


def new_incident_id(now: float | None = None) -> str:
    """Sortable by creation time, unguessable enough to not collide across restarts."""
    t = time.gmtime(time.time() if now is None else now)
    return time.strftime("%Y%m%dT%H%M%SZ", t) + "-" + secrets.token_hex(4)


def _ranks(value: Iterable[int]) -> str:
    return json.dumps(sorted({int(r) for r in value}))


def _unreachable(value: Mapping[int, str]) -> str:
    return json.dumps({str(int(k)): str(v) for k, v in sorted(value.items())})


# PostgreSQL's refusals of a write that a later try may get through, by
# SQLSTATE (its class 53, disk full among them, and class 08, the connection,
# are psycopg OperationalErrors and count whatever their code): the database
# was made read-only, or the role lost its grant.
_PG_REFUSED: Final = frozenset({"25006", "42501"})


def disk_full(error: BaseException) -> bool:
    """The store could not take a write, and a later try may: the coordinator's
    data directory has no room (or quota) left for a file or the SQLite store,
    or the PostgreSQL store is full, read-only, refusing this role, or out of
    reach (restarting). The incident waits; what it collected is on disk and
    its agents keep their copies."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(error, sqlite3.Error):
        return getattr(
            error, "sqlite_errorcode", None
        ) == sqlite3.SQLITE_FULL or "database or disk is full" in str(error)
    # Only a process that opened a PostgreSQL store has psycopg loaded; the
    # embedded default needs no psycopg installed.
    psycopg: Any = sys.modules.get("psycopg")
    if psycopg is None or not isinstance(error, psycopg.Error):
        return False
    return isinstance(error, psycopg.OperationalError) or error.sqlstate in _PG_REFUSED


def refusal(error: BaseException) -> str:
    """What refused a write `disk_full` counts, for a log line."""
    if isinstance(error, (OSError, sqlite3.Error)):
        return "the data directory is full"
    return "the incident store's database refused the write (full, read-only or unreachable)"


class StoreOpenError(RuntimeError):
    """The coordinator's store cannot be opened: unreachable, a schema newer
    than this hangwatch, psycopg missing, a file it may not write. One line."""


class IncidentStore:
    """Incidents and the jobs they belong to: in `<data_dir>/hangwatch.db`
    (`IncidentStore(path)`, `in_dir`), or in a shared PostgreSQL (`open`)."""

    def __init__(self, target: Path | Database, *, incidents_root: Path | None = None) -> None:
        """`target`: an SQLite file's path, or an open `Database`. The bundle
        files go under `incidents_root` (default: `incidents/` next to the SQLite
        file; a `Database` needs one)."""
        if isinstance(target, (str, Path)):
            self.path: Path | None = Path(target)
            self._db: Database = SQLiteDatabase(self.path)
            root = Path(incidents_root) if incidents_root else self.path.parent / INCIDENTS_DIR
        else:
            if incidents_root is None:
                raise ValueError("a database store needs incidents_root (the bundles' directory)")
            self.path = None
            self._db = target
            root = Path(incidents_root)
        self.incidents_root = root
        self.incidents_root.mkdir(parents=True, exist_ok=True)
        try:
            found = self._db.migrate()
            if found < SCHEMA_VERSION:
                self._fill_culprit_hosts(found)
            self._db.set_version(SCHEMA_VERSION)
        except BaseException:
            self._db.close()
            raise
        self._closed = False
        # Called with the fresh row after every committed change of an
        # incident's status (server/integrations/notifications.py); a listener must not block.
        self.on_status_change: list[Callable[[IncidentRow], None]] = []

    @property
    def kind(self) -> str:
        """ "sqlite" or "postgresql"."""
        return self._db.kind

    def describe(self) -> str:
        """Where the rows are, for logs (a path, or a URL without a password)."""
        return self._db.describe()

    def _fill_culprit_hosts(self, found: int) -> None:
        """Fill culprit_hosts in from every stored report (a database from before
        version 3), in one transaction: a crash leaves the version as it was, and
        the next open fills it in again (each incident's rows are replaced)."""
        n = 0
        with self._db.transaction() as tx:
            for r in tx.query("SELECT id, report FROM incidents WHERE report IS NOT NULL"):
                try:
                    report = Report.from_dict(json.loads(r["report"]))
                except (ValueError, TypeError, KeyError) as e:
                    log.warning("incident %s: stored report unreadable (%s)", r["id"], e)
                    continue
                n += _write_culprits(tx, r["id"], culprit_hosts(report))
        if n:
            log.info(
                "%s (schema version %d): node history filled in from %d stored incidents",
                self.describe(),
                found,
                n,
            )

    @classmethod
    def in_dir(cls, data_dir: Path) -> IncidentStore:
        return cls(Path(data_dir) / DB_FILE)

    @classmethod
    def open(
        cls,
        store: str | None,
        data_dir: Path,
        *,
        password: str | None = None,
        incidents_root: Path | None = None,
    ) -> IncidentStore:
        """The coordinator's store: SQLite in `data_dir` when `store` is None or
        empty, else the PostgreSQL at the `store` URL. Bundles go under
        `incidents_root` (default: `incidents/` in `data_dir`) either way."""
        root = Path(incidents_root) if incidents_root else Path(data_dir) / INCIDENTS_DIR
        if not store:
            where = str(Path(data_dir) / DB_FILE)
            try:
                return cls(Path(data_dir) / DB_FILE, incidents_root=root)
            except Exception as e:
                raise StoreOpenError(f"cannot open the incident store {where}: {e}") from e
        try:
            # Imported here: psycopg is the optional `postgresql` extra.
            from hangwatch.server.incidents.postgres_db import PostgresDatabase
        except ImportError as e:
            raise StoreOpenError(
                f"--store needs psycopg 3 and psycopg-pool: pip install 'hangwatch[postgresql]' ({e})"
            ) from e
        try:
            return cls(PostgresDatabase(store, password=password), incidents_root=root)
        except ValueError:
            raise  # a URL that carries a password: said without it
        except StoreOpenError:
            raise
        except Exception as e:
            # The URL carries no password (PostgresDatabase refused it above).
            raise StoreOpenError(f"cannot open the incident store {store}: {e}") from e

    # ---- files ---------------------------------------------------------------

    def incident_dir(self, incident_id: str) -> Path:
        """Bundle directory of an incident (layout: hangwatch.formats)."""
        if not INCIDENT_ID_RE.match(incident_id):
            raise ValueError(f"invalid incident id {incident_id!r}")
        return self.incidents_root / incident_id

    # ---- writes --------------------------------------------------------------

    def _touch_job_sql(self) -> str:
        # The existing row's last_seen, qualified: PostgreSQL has both rows in scope.
        return (
            "INSERT INTO jobs (job_id, first_seen, last_seen) VALUES (?, ?, ?) "
            f"ON CONFLICT (job_id) DO UPDATE SET last_seen = "
            f"{self._db.greatest}(jobs.last_seen, excluded.last_seen)"
        )

    def touch_job(self, job_id: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._db.transaction() as tx:
            tx.execute(self._touch_job_sql(), (job_id, now, now))

    def create_incident(
        self,
        *,
        job_id: str,
        reason: str,
        trigger: str,
        ranks_expected: Iterable[int],
        incident_id: str | None = None,
        created: float | None = None,
    ) -> IncidentRow:
        if trigger not in TRIGGERS:
            raise ValueError(f"unknown trigger {trigger!r}; expected one of {TRIGGERS}")
        created = time.time() if created is None else created
        incident_id = incident_id or new_incident_id(created)
        if not INCIDENT_ID_RE.match(incident_id):
            raise ValueError(f"invalid incident id {incident_id!r}")
        with self._db.transaction() as tx:
            tx.execute(self._touch_job_sql(), (job_id, created, created))
            tx.execute(
                "INSERT INTO incidents (id, job_id, created, reason, trigger, status, "
                "ranks_expected, updated) VALUES (?, ?, ?, ?, ?, 'collecting', ?, ?)",
                (incident_id, job_id, created, reason, trigger, _ranks(ranks_expected), created),
            )
        row = self.get_incident(incident_id)
        assert row is not None
        self._status_changed(row)
        return row

    def set_dump_outcome(
        self,
        incident_id: str,
        *,
        ranks_dumped: Iterable[int],
        ranks_unreachable: Mapping[int, str],
    ) -> IncidentRow:
        return self._update(
            incident_id,
            ranks_dumped=_ranks(ranks_dumped),
            ranks_unreachable=_unreachable(ranks_unreachable),
        )

    def finish_incident(
        self, incident_id: str, *, report: Report, detection_s: float | None
    ) -> IncidentRow:
        """Store the analyzer's verdict; the incident becomes `analyzed`."""
        return self._update(
            incident_id,
            culprits=culprit_hosts(report),
            status=IncidentStatus.ANALYZED,
            verdict=report.verdict,
            summary=report.summary,
            lagging_ranks=_ranks(report.lagging_ranks),
            report=report.to_json(),
            detection_s=detection_s,
            error=None,
        )

    def revise_report(self, incident_id: str, *, report: Report) -> IncidentRow:
        """A verdict re-analysed with dumps that arrived after it: the report
        changes; status, detection time and close state stay as they were."""
        return self._update(
            incident_id,
            culprits=culprit_hosts(report),
            verdict=report.verdict,
            summary=report.summary,
            lagging_ranks=_ranks(report.lagging_ranks),
            report=report.to_json(),
        )

    def set_actions(self, incident_id: str, actions: Iterable[ActionRecord]) -> IncidentRow:
        """Replace the incident's action records (the action runner owns them)."""
        return self._update(incident_id, actions=json.dumps([a.to_dict() for a in actions]))

    def fail_incident(self, incident_id: str, *, error: str) -> IncidentRow:
        return self._update(incident_id, status=IncidentStatus.FAILED, error=error)

    def resolve_incident(
        self,
        incident_id: str,
        *,
        stall_s: float | None,
        late_ranks: Iterable[int],
        reason: str,
        closed_at: float | None = None,
    ) -> IncidentRow:
        """The stall cleared by itself: the incident becomes `resolved`."""
        return self._close(
            incident_id,
            IncidentStatus.RESOLVED,
            reason,
            closed_at,
            stall_s=stall_s,
            late_ranks=_ranks(late_ranks),
        )

    def end_incident(
        self, incident_id: str, *, reason: str, closed_at: float | None = None
    ) -> IncidentRow:
        """The job stopped with the incident unresolved: it becomes `ended`."""
        return self._close(incident_id, IncidentStatus.ENDED, reason, closed_at)

    def _close(
        self,
        incident_id: str,
        status: IncidentStatus,
        reason: str,
        closed_at: float | None,
        **cols: Any,
    ) -> IncidentRow:
        when = time.time() if closed_at is None else closed_at
        return self._update(incident_id, status=status, closed_at=when, close_reason=reason, **cols)

    def _update(
        self, incident_id: str, *, culprits: list[CulpritHost] | None = None, **cols: Any
    ) -> IncidentRow:
        """Set `cols`; with `culprits`, replace its culprit hosts in the same transaction."""
        cols["updated"] = time.time()
        assignments = ", ".join(f"{k} = ?" for k in cols)
        with self._db.transaction() as tx:
            n = tx.execute(
                f"UPDATE incidents SET {assignments} WHERE id = ?", (*cols.values(), incident_id)
            )
            if n != 1:
                raise UnknownIncident(incident_id)
            if culprits is not None:
                _write_culprits(tx, incident_id, culprits)
        row = self.get_incident(incident_id)
        assert row is not None
        if "status" in cols:
            self._status_changed(row)
        return row

    def _status_changed(self, row: IncidentRow) -> None:
        for listener in list(self.on_status_change):
            try:
                listener(row)
            except Exception:
                # The change is committed: a listener's bug must not undo the caller's work.
                log.exception("incident %s: status listener failed", row.id)

    # ---- reads ---------------------------------------------------------------

    def get_incident(self, incident_id: str) -> IncidentRow | None:
        rows = self._read("SELECT * FROM incidents WHERE id = ?", (incident_id,))
        return _row(rows[0]) if rows else None

    def list_incidents(
        self,
        *,
        job_id: str | None = None,
        since: float | None = None,
        until: float | None = None,
        verdict: str | None = None,
        status: str | None = None,
        host: str | None = None,
        before: str | None = None,
        limit: int = 200,
    ) -> list[IncidentRow]:
        """Newest first. `since`/`until` bound `created` (unix seconds, inclusive);
        `host`: incidents whose culprits it held (server.incidents.hosts);
        `before`: the page after the incident with that id (keyset paging: the
        next page of 100,000 costs what the first does, where an OFFSET reads
        every row it skips). An unknown `before` is UnknownIncident."""
        where: list[str] = []
        args: list[Any] = []
        for col, op, val in (
            ("job_id", "=", job_id),
            ("created", ">=", since),
            ("created", "<=", until),
            ("verdict", "=", verdict),
            ("status", "=", status),
        ):
            if val is not None:
                where.append(f"{col} {op} ?")
                args.append(val)
        if host is not None:
            where.append("id IN (SELECT incident_id FROM culprit_hosts WHERE host = ?)")
            args.append(host)
        if before is not None:
            mark = self._read("SELECT created FROM incidents WHERE id = ?", (before,))
            if not mark:
                raise UnknownIncident(before)
            where.append("(created < ? OR (created = ? AND id < ?))")
            args.extend((mark[0]["created"], mark[0]["created"], before))
        sql = "SELECT * FROM incidents"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created DESC, id DESC LIMIT ?"
        args.append(max(0, int(limit)))
        return [_row(r) for r in self._read(sql, args)]

    def list_jobs(self) -> list[JobRow]:
        """Most recently seen first."""
        rows = self._read(
            "SELECT j.job_id, j.first_seen, j.last_seen, COUNT(i.id) AS n "
            "FROM jobs j LEFT JOIN incidents i ON i.job_id = j.job_id "
            "GROUP BY j.job_id ORDER BY j.last_seen DESC"
        )
        return [
            JobRow(
                job_id=r["job_id"],
                first_seen=r["first_seen"],
                last_seen=r["last_seen"],
                incidents=r["n"],
            )
            for r in rows
        ]

    def count_by_verdict(self) -> dict[str, int]:
        """Analyzed incidents per verdict; incidents without one count under their status."""
        rows = self._read(
            "SELECT COALESCE(verdict, status) AS k, COUNT(*) AS n FROM incidents GROUP BY k"
        )
        return {r["k"]: r["n"] for r in rows}

    def count_by_status(self) -> dict[str, int]:
        """Incidents per status; every status in STATUSES is present."""
        rows = self._read("SELECT status, COUNT(*) AS n FROM incidents GROUP BY status")
        out: dict[str, int] = dict.fromkeys(STATUSES, 0)
        out.update({r["status"]: r["n"] for r in rows})
        return out

    def count_by_verdict_status(self) -> dict[tuple[str, str], int]:
        """Incidents per (verdict, status); "pending" while no verdict is stored."""
        rows = self._read(
            "SELECT COALESCE(verdict, 'pending') AS v, status, COUNT(*) AS n "
            "FROM incidents GROUP BY v, status"
        )
        return {(r["v"], r["status"]): r["n"] for r in rows}

    def open_by_job(self) -> list[tuple[str, str, str, int, float]]:
        """Open incidents per (job, verdict or "pending", status): count and oldest `created`."""
        marks = ", ".join("?" for _ in OPEN_STATUSES)
        rows = self._read(
            "SELECT job_id, COALESCE(verdict, 'pending') AS v, status, COUNT(*) AS n, "
            f"MIN(created) AS oldest FROM incidents WHERE status IN ({marks}) "
            "GROUP BY job_id, v, status",
            OPEN_STATUSES,
        )
        return [(r["job_id"], r["v"], r["status"], r["n"], r["oldest"]) for r in rows]

    def newest_open(self, job_id: str | None = None) -> dict[str, str]:
        """job -> the id of its newest open incident (collecting, or analyzed and
        not yet resolved or ended): what a job's "open incident" is, after
        collection as well as during it."""
        marks = ", ".join("?" for _ in OPEN_STATUSES)
        where = "" if job_id is None else " AND job_id = ?"
        args = (*OPEN_STATUSES, *(() if job_id is None else (job_id,)))
        rows = self._read(
            f"SELECT job_id, id, created FROM incidents WHERE status IN ({marks}){where}", args
        )
        newest: dict[str, tuple[float, str]] = {}
        for r in rows:
            if r["job_id"] not in newest or r["created"] > newest[r["job_id"]][0]:
                newest[r["job_id"]] = (r["created"], r["id"])
        return {job: iid for job, (_, iid) in newest.items()}

    def host_history(
        self, *, since: float | None = None, host: str | None = None, limit: int = 200
    ) -> list[HostHistory]:
        """Hosts that held an incident's culprits since `since` (unix seconds;
        None: ever), most incidents first, then the most recent; `host` for one."""
        where: list[str] = []
        args: list[Any] = []
        if since is not None:
            where.append("created >= ?")
            args.append(since)
        if host is not None:
            where.append("host = ?")
            args.append(host)
        cond = " AND ".join(where) or "1 = 1"
        # One transaction: the heads and their rows read the same snapshot.
        with self._db.transaction(write=False) as tx:
            # Each host's distinct jobs and GPU lists as a JSON array of its own,
            # in the one scan that counts them: a separate DISTINCT over the
            # listed hosts' rows took 65 ms on SQLite and 116 ms on PostgreSQL at
            # 100,000 incidents (benchmarks/store_history.py).
            agg = self._db.distinct_json_array
            heads = tx.query(
                "SELECT host, COUNT(*) AS n, COUNT(DISTINCT job_id) AS j, MIN(created) AS first, "
                f"MAX(created) AS last, {agg.format('job_id')} AS job_ids, "
                f"{agg.format('gpus')} AS gpu_lists FROM culprit_hosts WHERE {cond} "
                "GROUP BY host ORDER BY n DESC, last DESC, host LIMIT ?",
                (*args, max(0, int(limit))),
            )
            if not heads:  # `IN ()` is an error on PostgreSQL
                return []
            # The listed hosts' newest ids in one query (not one a host), by a
            # window function: reading every culprit row of the window instead
            # (about 23,000 of 100,000 incidents in benchmarks/store_history.py)
            # took 225 ms on PostgreSQL.
            marks = ", ".join("?" for _ in heads)
            window = "" if since is None else "created >= ? AND "
            hargs = (*(() if since is None else (since,)), *(h["host"] for h in heads))
            ids: dict[str, list[str]] = {h["host"]: [] for h in heads}
            for r in tx.query(
                "SELECT host, incident_id FROM (SELECT host, incident_id, created, ROW_NUMBER() "
                "OVER (PARTITION BY host ORDER BY created DESC, incident_id DESC) AS rn "
                f"FROM culprit_hosts WHERE {window}host IN ({marks})) AS newest "
                "WHERE rn <= ? ORDER BY host, rn",
                (*hargs, INCIDENTS_SHOWN),
            ):
                ids[r["host"]].append(r["incident_id"])
        return [
            HostHistory(
                host=h["host"],
                incidents=h["n"],
                jobs=h["j"],
                first=h["first"],
                last=h["last"],
                incident_ids=ids[h["host"]],
                job_ids=sorted(json.loads(h["job_ids"])),  # Python's order, whatever the collation
                gpus=sorted({g for lst in json.loads(h["gpu_lists"]) for g in json.loads(lst)}),
            )
            for h in heads
        ]

    def count_hosts(self, *, since: float, min_incidents: int) -> int:
        """Hosts with at least `min_incidents` culprit incidents since `since`:
        one indexed scan, for a scrape (host_history reads each host's rows)."""
        rows = self._read(
            "SELECT COUNT(*) AS n FROM (SELECT host FROM culprit_hosts WHERE created >= ? "
            "GROUP BY host HAVING COUNT(*) >= ?) AS offenders",
            (since, min_incidents),
        )
        return int(rows[0]["n"])

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._db.transaction(write=False) as tx:
            return tx.query(sql, args)

    def ping(self) -> str:
        """A round trip to the database (readiness): raises when it cannot answer."""
        return self._db.ping()

    def journal_mode(self) -> str:
        """SQLite's journal mode ("wal"); PostgreSQL's write-ahead log is always on ("wal")."""
        return self._db.ping()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._db.close()


def _write_culprits(tx: Transaction, incident_id: str, hosts: list[CulpritHost]) -> int:
    """Replace the incident's culprit hosts; inside the caller's transaction."""
    tx.execute("DELETE FROM culprit_hosts WHERE incident_id = ?", (incident_id,))
    for h in hosts:
        tx.execute(
            "INSERT INTO culprit_hosts (incident_id, host, job_id, created, ranks, gpus) "
            "SELECT id, ?, job_id, created, ?, ? FROM incidents WHERE id = ?",
            (h.host, json.dumps(h.ranks), json.dumps(h.gpus), incident_id),
        )
    return 1 if hosts else 0


def _row(r: Row) -> IncidentRow:
    report = Report.from_dict(json.loads(r["report"])) if r["report"] else None
    return IncidentRow(
        id=r["id"],
        job_id=r["job_id"],
        created=r["created"],
        reason=r["reason"],
        trigger=r["trigger"],
        status=r["status"],
        verdict=r["verdict"],
        summary=r["summary"],
        lagging_ranks=list(json.loads(r["lagging_ranks"])),
        ranks_expected=list(json.loads(r["ranks_expected"])),
        ranks_dumped=list(json.loads(r["ranks_dumped"])),
        ranks_unreachable={int(k): v for k, v in json.loads(r["ranks_unreachable"]).items()},
        detection_s=r["detection_s"],
        report=report,
        error=r["error"],
        updated=r["updated"],
        closed_at=r["closed_at"],
        stall_s=r["stall_s"],
        late_ranks=list(json.loads(r["late_ranks"] or "[]")),
        close_reason=r["close_reason"],
        actions=[ActionRecord.from_dict(a) for a in json.loads(r["actions"] or "[]")],
    )
