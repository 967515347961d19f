"""Durable incident store: one SQLite file in WAL mode, safe to share across threads.

The coordinator writes from its gRPC handlers, its detector thread and its
analysis worker; the dashboard reads concurrently. One connection guarded by a
lock keeps writes serialised and simple; WAL lets readers in other processes
(for example `sqlite3 hangwatch.db` during an incident) see committed rows
without blocking the writer. Incidents survive a coordinator restart; the live
job state does not (agents re-register and rebuild it).
"""

from __future__ import annotations

import errno
import json
import logging
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

from hangwatch.analyzer.report import Report
from hangwatch.server.incidents.action_records import ActionRecord
from hangwatch.server.incidents.hosts import (
    INCIDENTS_SHOWN,
    CulpritHost,
    HostHistory,
    culprit_hosts,
)

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

# 3: culprit_hosts (node history across jobs), filled in from the stored
# reports when a version-2 file is opened.
_SCHEMA_VERSION = 3
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id      TEXT PRIMARY KEY,
    first_seen  REAL NOT NULL,
    last_seen   REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS incidents (
    id                 TEXT PRIMARY KEY,
    job_id             TEXT NOT NULL,
    created            REAL NOT NULL,
    reason             TEXT NOT NULL,
    trigger            TEXT NOT NULL,
    status             TEXT NOT NULL,
    verdict            TEXT,
    summary            TEXT,
    lagging_ranks      TEXT NOT NULL DEFAULT '[]',
    ranks_expected     TEXT NOT NULL DEFAULT '[]',
    ranks_dumped       TEXT NOT NULL DEFAULT '[]',
    ranks_unreachable  TEXT NOT NULL DEFAULT '{}',
    detection_s        REAL,
    report             TEXT,
    error              TEXT,
    updated            REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS incidents_status ON incidents (status);
CREATE INDEX IF NOT EXISTS incidents_job_created ON incidents (job_id, created);
CREATE INDEX IF NOT EXISTS incidents_created ON incidents (created);
CREATE INDEX IF NOT EXISTS incidents_verdict ON incidents (verdict);
-- The list's filtered pages, newest first, without sorting every match
-- (benchmarks/store_history.py: a verdict's page of 100 among 100,000
-- incidents took 42-47 ms on the verdict index alone).
CREATE INDEX IF NOT EXISTS incidents_verdict_created ON incidents (verdict, created);
CREATE INDEX IF NOT EXISTS incidents_status_created ON incidents (status, created);
"""
# Per incident, the hosts that held its culprit ranks (server.incidents.hosts):
# rewritten with the incident's verdict, in the same transaction.
_CULPRIT_HOSTS = """
CREATE TABLE IF NOT EXISTS culprit_hosts (
    incident_id  TEXT NOT NULL REFERENCES incidents (id) ON DELETE CASCADE,
    host         TEXT NOT NULL,
    job_id       TEXT NOT NULL,
    created      REAL NOT NULL,
    ranks        TEXT NOT NULL,
    gpus         TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (incident_id, host)
);
CREATE INDEX IF NOT EXISTS culprit_hosts_host_created ON culprit_hosts (host, created);
CREATE INDEX IF NOT EXISTS culprit_hosts_created ON culprit_hosts (created);
"""
# Columns added after version 1, added to older databases on open (ALTER TABLE
# ADD COLUMN: existing rows get the default). Never removed or renamed.
_ADDED_COLUMNS: Final = (
    # unix seconds the incident was resolved or ended
    ("closed_at", "REAL"),
    # resolved: seconds from the stall's onset to the job's progress resuming
    ("stall_s", "REAL"),
    # resolved: the ranks that were late (the incident's lagging ranks)
    ("late_ranks", "TEXT NOT NULL DEFAULT '[]'"),
    # resolved/ended: what closed it, for people
    ("close_reason", "TEXT"),
    # what the coordinator did about it (server.action_records), JSON list
    ("actions", "TEXT NOT NULL DEFAULT '[]'"),
)


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


def disk_full(error: BaseException) -> bool:
    """The coordinator's data directory has no room (or quota) left: a file or
    the SQLite store could not be written. The incident waits for space; what
    it collected is on disk and its agents keep their copies."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(error, sqlite3.Error) and (
        getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
        or "database or disk is full" in str(error)
    )


class IncidentStore:
    """Incidents and the jobs they belong to, in `<data_dir>/hangwatch.db`."""

    def __init__(self, path: Path, *, incidents_root: Path | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.incidents_root = (
            Path(incidents_root) if incidents_root else self.path.parent / INCIDENTS_DIR
        )
        self.incidents_root.mkdir(parents=True, exist_ok=True)
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
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > _SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has schema version {version}; this hangwatch knows {_SCHEMA_VERSION}"
            )
        self._db.executescript(_SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(incidents)").fetchall()}
        for name, decl in _ADDED_COLUMNS:
            if name not in have:
                self._db.execute(f"ALTER TABLE incidents ADD COLUMN {name} {decl}")
        self._migrate_culprit_hosts()
        self._db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        self._closed = False
        # Called with the fresh row after every committed change of an
        # incident's status (server/integrations/notifications.py); a listener must not block.
        self.on_status_change: list[Callable[[IncidentRow], None]] = []

    def _migrate_culprit_hosts(self) -> None:
        """Create culprit_hosts; in a file that had none, fill it in from every
        stored report, in one transaction (a crash leaves the file as it was)."""
        had = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'culprit_hosts'"
        ).fetchone()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for stmt in _CULPRIT_HOSTS.split(";"):
                if stmt.strip():
                    self._db.execute(stmt)
            n = 0
            if had is None:
                for r in self._db.execute(
                    "SELECT id, report FROM incidents WHERE report IS NOT NULL"
                ).fetchall():
                    try:
                        report = Report.from_dict(json.loads(r["report"]))
                    except (ValueError, TypeError, KeyError) as e:
                        log.warning("incident %s: stored report unreadable (%s)", r["id"], e)
                        continue
                    n += self._write_culprits(r["id"], culprit_hosts(report))
            self._db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        if had is None and n:
            log.info("%s: node history filled in from %d stored incidents", self.path, n)

    def _write_culprits(self, incident_id: str, hosts: list[CulpritHost]) -> int:
        """Replace the incident's culprit hosts; inside the caller's transaction."""
        self._db.execute("DELETE FROM culprit_hosts WHERE incident_id = ?", (incident_id,))
        for h in hosts:
            self._db.execute(
                "INSERT INTO culprit_hosts (incident_id, host, job_id, created, ranks, gpus) "
                "SELECT id, ?, job_id, created, ?, ? FROM incidents WHERE id = ?",
                (h.host, json.dumps(h.ranks), json.dumps(h.gpus), incident_id),
            )
        return 1 if hosts else 0

    @classmethod
    def in_dir(cls, data_dir: Path) -> IncidentStore:
        return cls(Path(data_dir) / DB_FILE)

    # ---- files ---------------------------------------------------------------

    def incident_dir(self, incident_id: str) -> Path:
        """Bundle directory of an incident (layout: hangwatch.formats)."""
        if not INCIDENT_ID_RE.match(incident_id):
            raise ValueError(f"invalid incident id {incident_id!r}")
        return self.incidents_root / incident_id

    # ---- writes --------------------------------------------------------------

    def touch_job(self, job_id: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (job_id, first_seen, last_seen) VALUES (?, ?, ?) "
                "ON CONFLICT(job_id) DO UPDATE SET last_seen = MAX(last_seen, excluded.last_seen)",
                (job_id, now, now),
            )

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
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT INTO jobs (job_id, first_seen, last_seen) VALUES (?, ?, ?) "
                    "ON CONFLICT(job_id) DO UPDATE SET last_seen = MAX(last_seen, excluded.last_seen)",
                    (job_id, created, created),
                )
                self._db.execute(
                    "INSERT INTO incidents (id, job_id, created, reason, trigger, status, "
                    "ranks_expected, updated) VALUES (?, ?, ?, ?, ?, 'collecting', ?, ?)",
                    (
                        incident_id,
                        job_id,
                        created,
                        reason,
                        trigger,
                        _ranks(ranks_expected),
                        created,
                    ),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
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

    def _rollback(self) -> None:
        # SQLite ends a transaction itself on some errors (SQLITE_FULL among
        # them): a ROLLBACK then raises "no transaction is active" and would
        # hide the error that matters ("database or disk is full").
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def _update(
        self, incident_id: str, *, culprits: list[CulpritHost] | None = None, **cols: Any
    ) -> IncidentRow:
        """Set `cols`; with `culprits`, replace its culprit hosts in the same transaction."""
        cols["updated"] = time.time()
        assignments = ", ".join(f"{k} = ?" for k in cols)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute(
                    f"UPDATE incidents SET {assignments} WHERE id = ?",
                    (*cols.values(), incident_id),
                )
                if cur.rowcount != 1:
                    raise UnknownIncident(incident_id)
                if culprits is not None:
                    self._write_culprits(incident_id, culprits)
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
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
        with self._lock:
            r = self._db.execute("SELECT * FROM incidents WHERE id = ?", (incident_id,)).fetchone()
        return _row(r) if r is not None else None

    def list_incidents(
        self,
        *,
        job_id: str | None = None,
        since: float | None = None,
        until: float | None = None,
        verdict: str | None = None,
        status: str | None = None,
        limit: int = 200,
    ) -> list[IncidentRow]:
        """Newest first. `since`/`until` bound `created` (unix seconds, inclusive)."""
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
        sql = "SELECT * FROM incidents"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created DESC, id DESC LIMIT ?"
        args.append(max(0, int(limit)))
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [_row(r) for r in rows]

    def list_jobs(self) -> list[JobRow]:
        """Most recently seen first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT j.job_id, j.first_seen, j.last_seen, COUNT(i.id) AS n "
                "FROM jobs j LEFT JOIN incidents i ON i.job_id = j.job_id "
                "GROUP BY j.job_id ORDER BY j.last_seen DESC"
            ).fetchall()
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
        with self._lock:
            rows = self._db.execute(
                "SELECT COALESCE(verdict, status) AS k, COUNT(*) AS n FROM incidents GROUP BY k"
            ).fetchall()
        return {r["k"]: r["n"] for r in rows}

    def count_by_status(self) -> dict[str, int]:
        """Incidents per status; every status in STATUSES is present."""
        with self._lock:
            rows = self._db.execute(
                "SELECT status, COUNT(*) AS n FROM incidents GROUP BY status"
            ).fetchall()
        out: dict[str, int] = dict.fromkeys(STATUSES, 0)
        out.update({r["status"]: r["n"] for r in rows})
        return out

    def count_by_verdict_status(self) -> dict[tuple[str, str], int]:
        """Incidents per (verdict, status); "pending" while no verdict is stored."""
        with self._lock:
            rows = self._db.execute(
                "SELECT COALESCE(verdict, 'pending') AS v, status, COUNT(*) AS n "
                "FROM incidents GROUP BY v, status"
            ).fetchall()
        return {(r["v"], r["status"]): r["n"] for r in rows}

    def open_by_job(self) -> list[tuple[str, str, str, int, float]]:
        """Open incidents per (job, verdict or "pending", status): count and oldest `created`."""
        marks = ", ".join("?" for _ in OPEN_STATUSES)
        with self._lock:
            rows = self._db.execute(
                "SELECT job_id, COALESCE(verdict, 'pending') AS v, status, COUNT(*) AS n, "
                f"MIN(created) AS oldest FROM incidents WHERE status IN ({marks}) "
                "GROUP BY job_id, v, status",
                OPEN_STATUSES,
            ).fetchall()
        return [(r["job_id"], r["v"], r["status"], r["n"], r["oldest"]) for r in rows]

    def newest_open(self, job_id: str | None = None) -> dict[str, str]:
        """job -> the id of its newest open incident (collecting, or analyzed and
        not yet resolved or ended): what a job's "open incident" is, after
        collection as well as during it."""
        marks = ", ".join("?" for _ in OPEN_STATUSES)
        where = "" if job_id is None else " AND job_id = ?"
        args = (*OPEN_STATUSES, *(() if job_id is None else (job_id,)))
        with self._lock:
            rows = self._db.execute(
                f"SELECT job_id, id, created FROM incidents WHERE status IN ({marks}){where}",
                args,
            ).fetchall()
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
        start = since if since is not None else float("-inf")
        where: list[str] = ["created >= ?"]
        args: list[Any] = [start]
        if host is not None:
            where.append("host = ?")
            args.append(host)
        cond = " AND ".join(where)
        with self._lock:
            heads = self._db.execute(
                "SELECT host, COUNT(*) AS n, COUNT(DISTINCT job_id) AS j, MIN(created) AS first, "
                f"MAX(created) AS last FROM culprit_hosts WHERE {cond} GROUP BY host "
                "ORDER BY n DESC, last DESC, host LIMIT ?",
                (*args, max(0, int(limit))),
            ).fetchall()
            # The listed hosts' rows in one query, not one query a host.
            marks = ", ".join("?" for _ in heads)
            by_host: dict[str, list[sqlite3.Row]] = {h["host"]: [] for h in heads}
            for r in self._db.execute(
                "SELECT host, incident_id, job_id, gpus FROM culprit_hosts "
                f"WHERE created >= ? AND host IN ({marks}) "
                "ORDER BY created DESC, incident_id DESC",
                (start, *by_host),
            ).fetchall():
                by_host[r["host"]].append(r)
            out = []
            for h in heads:
                rows = by_host[h["host"]]
                out.append(
                    HostHistory(
                        host=h["host"],
                        incidents=h["n"],
                        jobs=h["j"],
                        first=h["first"],
                        last=h["last"],
                        incident_ids=[r["incident_id"] for r in rows[:INCIDENTS_SHOWN]],
                        job_ids=sorted({r["job_id"] for r in rows}),
                        gpus=sorted({g for r in rows for g in json.loads(r["gpus"])}),
                    )
                )
        return out

    def count_hosts(self, *, since: float, min_incidents: int) -> int:
        """Hosts with at least `min_incidents` culprit incidents since `since`:
        one indexed scan, for a scrape (host_history reads each host's rows)."""
        with self._lock:
            r = self._db.execute(
                "SELECT COUNT(*) FROM (SELECT host FROM culprit_hosts WHERE created >= ? "
                "GROUP BY host HAVING COUNT(*) >= ?)",
                (since, min_incidents),
            ).fetchone()
        return int(r[0])

    def journal_mode(self) -> str:
        with self._lock:
            return str(self._db.execute("PRAGMA journal_mode").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()


def _row(r: sqlite3.Row) -> IncidentRow:
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
