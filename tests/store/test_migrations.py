"""Each store's schema version and migration: an SQLite file of the previous
release is upgraded in place; a database newer than this hangwatch is refused."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hangwatch.analyzer.report import RankEvidence, Report
from hangwatch.server.incidents.database import SCHEMA_VERSION
from hangwatch.server.incidents.store import IncidentStore

from tests.support.pgserver import PgServer

# The schema of release version 2 (before culprit_hosts), verbatim as that
# release created it: the version-1 tables, then its added columns.
_V2 = """
CREATE TABLE jobs (
    job_id      TEXT PRIMARY KEY,
    first_seen  REAL NOT NULL,
    last_seen   REAL NOT NULL
);
CREATE TABLE incidents (
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
CREATE INDEX incidents_status ON incidents (status);
CREATE INDEX incidents_job_created ON incidents (job_id, created);
CREATE INDEX incidents_created ON incidents (created);
CREATE INDEX incidents_verdict ON incidents (verdict);
ALTER TABLE incidents ADD COLUMN closed_at REAL;
ALTER TABLE incidents ADD COLUMN stall_s REAL;
ALTER TABLE incidents ADD COLUMN late_ranks TEXT NOT NULL DEFAULT '[]';
ALTER TABLE incidents ADD COLUMN close_reason TEXT;
ALTER TABLE incidents ADD COLUMN actions TEXT NOT NULL DEFAULT '[]';
PRAGMA user_version=2;
"""


def _v2_report(host: str) -> str:
    # A stored report as version 2 wrote it: the report format did not change.
    return Report(
        verdict="hang",
        summary="rank 1 never entered all_reduce #5",
        lagging_ranks=[1],
        evidence={1: RankEvidence(rank=1, host=host, pid=42)},
    ).to_json()


@pytest.mark.timeout(60)
def test_a_version_2_sqlite_file_is_upgraded_and_every_incident_found(tmp_path: Path) -> None:
    db = tmp_path / "hangwatch.db"
    raw = sqlite3.connect(db)
    raw.executescript(_V2)
    rows = [
        # id, job, created, status, verdict, report
        ("20260101T000000Z-aaaa0001", "job-a", 1000.0, "analyzed", "hang", _v2_report("node-x")),
        ("20260101T000000Z-aaaa0002", "job-b", 2000.0, "ended", "hang", _v2_report("node-x")),
        ("20260101T000000Z-aaaa0003", "job-b", 3000.0, "collecting", None, None),
        ("20260101T000000Z-aaaa0004", "job-a", 4000.0, "failed", None, None),
    ]
    for iid, job, t, status, verdict, report in rows:
        raw.execute("INSERT INTO jobs VALUES (?, ?, ?) ON CONFLICT DO NOTHING", (job, t, t))
        raw.execute(
            "INSERT INTO incidents (id, job_id, created, reason, trigger, status, verdict, "
            "report, updated) VALUES (?, ?, ?, 'stall', 'stall', ?, ?, ?, ?)",
            (iid, job, t, status, verdict, report, t),
        )
    raw.commit()
    raw.close()

    store = IncidentStore(db)
    # Every incident, with or without a verdict.
    assert [r.id for r in store.list_incidents()] == [r[0] for r in reversed(rows)]
    assert store.get_incident(rows[0][0]).report.evidence[1].host == "node-x"  # type: ignore[union-attr]
    assert {j.job_id: j.incidents for j in store.list_jobs()} == {"job-a": 2, "job-b": 2}
    # The node history is filled in from the stored reports.
    [h] = store.host_history()
    assert (h.host, h.incidents, h.jobs) == ("node-x", 2, 2)
    store.close()
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    # The new indexes are there: the list's filtered pages use them.
    names = {r[0] for r in sqlite3.connect(db).execute("SELECT name FROM sqlite_master")}
    assert {"incidents_verdict_created", "culprit_hosts_host_created"} <= names


@pytest.mark.timeout(30)
def test_a_newer_sqlite_file_is_refused_untouched(tmp_path: Path) -> None:
    db = tmp_path / "hangwatch.db"
    IncidentStore(db).close()
    raw = sqlite3.connect(db)
    raw.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(RuntimeError, match=f"schema version {SCHEMA_VERSION + 1}"):
        IncidentStore(db)
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1


@pytest.mark.timeout(60)
def test_postgresql_records_its_version_and_refuses_a_newer_one(
    pg: PgServer, tmp_path: Path
) -> None:
    url = pg.new_database()
    db = url.rsplit("/", 1)[1]
    IncidentStore.open(url, tmp_path).close()
    IncidentStore.open(url, tmp_path).close()  # reopening migrates nothing twice
    assert pg.sql("SELECT version FROM hangwatch_schema", db) == str(SCHEMA_VERSION)
    pg.sql(f"INSERT INTO hangwatch_schema VALUES ({SCHEMA_VERSION + 1}, 0)", db)
    with pytest.raises(RuntimeError, match=f"schema version {SCHEMA_VERSION + 1}"):
        IncidentStore.open(url, tmp_path)
