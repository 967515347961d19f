from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hangwatch.analyzer.report import Report
from hangwatch.server.incidents.store import IncidentStore


@pytest.mark.timeout(30)
def test_another_process_sees_committed_rows_in_wal_mode(tmp_path: Path) -> None:
    """What only the SQLite engine promises; the store's contract on both engines
    (filters, reopening, concurrent writers) is tests/store/test_store_contract.py."""
    db = tmp_path / "hangwatch.db"
    store = IncidentStore(db)
    assert store.journal_mode() == "wal"
    a = store.create_incident(job_id="jobA", reason="stall", trigger="stall", ranks_expected=[0, 1])
    store.finish_incident(
        a.id, report=Report(verdict="hang", summary="", lagging_ranks=[1]), detection_s=12.5
    )
    store.create_incident(job_id="jobB", reason="t", trigger="timeout", ranks_expected=[0])
    # A second process (here: a plain sqlite3 connection) sees committed rows while
    # the store is open, in WAL mode.
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("SELECT COUNT(*) FROM incidents").fetchone()[0] == 2
    raw.close()
    store.close()
