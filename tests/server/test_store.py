from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hangwatch.analyzer.report import Finding, RankEvidence, Report, StalledCollective
from hangwatch.server.incidents.store import IncidentStore


def _report(lagging: list[int]) -> Report:
    return Report(
        verdict="hang",
        summary=f"rank {lagging} never entered all_reduce #5 in group 0",
        stalled_collective=StalledCollective(
            group="0",
            group_desc="default_pg",
            group_ranks=[0, 1, 2, 3],
            seq=5,
            op="all_reduce",
            profiling_name="gloo:all_reduce",
            entered_ranks=[0, 1, 3],
            missing_ranks=lagging,
            input_sizes=[[1024]],
            dtypes=["Float"],
        ),
        lagging_ranks=lagging,
        findings=[Finding(kind="not-entered", ranks=lagging, group="0", seq=5, detail="x")],
        ranks_loaded=[0, 1, 2, 3],
        evidence={2: RankEvidence(rank=2, host="h", pid=7, process_state="running")},
    )


@pytest.mark.timeout(30)
def test_another_process_sees_committed_rows_in_wal_mode(tmp_path: Path) -> None:
    """What only the SQLite engine promises; the store's contract on both engines
    (filters, reopening, concurrent writers) is tests/store/test_store_contract.py."""
    db = tmp_path / "hangwatch.db"
    store = IncidentStore(db)
    assert store.journal_mode() == "wal"
    a = store.create_incident(job_id="jobA", reason="stall", trigger="stall", ranks_expected=[0, 1])
    store.finish_incident(a.id, report=_report([1]), detection_s=12.5)
    store.create_incident(job_id="jobB", reason="t", trigger="timeout", ranks_expected=[0])
    # A second process (here: a plain sqlite3 connection) sees committed rows while
    # the store is open, in WAL mode.
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("SELECT COUNT(*) FROM incidents").fetchone()[0] == 2
    raw.close()
    store.close()
