from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from hangwatch.analyzer.report import Finding, RankEvidence, Report, StalledCollective
from hangwatch.server.incidents.store import IncidentStore, UnknownIncident


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
def test_roundtrip_filters_and_reopen(tmp_path: Path) -> None:
    db = tmp_path / "hangwatch.db"
    store = IncidentStore(db)
    assert store.journal_mode() == "wal"
    t0 = time.time()
    a = store.create_incident(
        job_id="jobA", reason="stall", trigger="stall", ranks_expected=[3, 1, 0, 2], created=t0
    )
    b = store.create_incident(
        job_id="jobB", reason="timeout", trigger="timeout", ranks_expected=[0, 1], created=t0 + 10
    )
    c = store.create_incident(
        job_id="jobA", reason="exit", trigger="rank-lost", ranks_expected=[0, 1], created=t0 + 20
    )
    assert a.status == "collecting" and a.ranks_expected == [0, 1, 2, 3] and a.report is None

    store.set_dump_outcome(
        a.id, ranks_dumped=[0, 1, 3], ranks_unreachable={2: "process stopped (SIGSTOP)"}
    )
    rep = _report([2])
    done = store.finish_incident(a.id, report=rep, detection_s=12.5)
    assert done.status == "analyzed" and done.verdict == "hang" and done.lagging_ranks == [2]
    assert done.ranks_unreachable == {2: "process stopped (SIGSTOP)"}
    assert done.report is not None and done.report.to_dict() == rep.to_dict()
    store.fail_incident(b.id, error="analyzer crashed: boom")

    assert [r.id for r in store.list_incidents()] == [c.id, b.id, a.id]
    assert [r.id for r in store.list_incidents(job_id="jobA")] == [c.id, a.id]
    assert [r.id for r in store.list_incidents(since=t0 + 5, until=t0 + 15)] == [b.id]
    assert [r.id for r in store.list_incidents(verdict="hang")] == [a.id]
    assert [r.id for r in store.list_incidents(limit=1)] == [c.id]
    assert store.count_by_verdict() == {"hang": 1, "failed": 1, "collecting": 1}
    jobs = {j.job_id: j for j in store.list_jobs()}
    assert jobs["jobA"].incidents == 2 and jobs["jobB"].incidents == 1
    assert store.get_incident("nope") is None
    with pytest.raises(UnknownIncident):
        store.fail_incident("nope", error="x")
    with pytest.raises(ValueError, match="trigger"):
        store.create_incident(job_id="j", reason="r", trigger="bogus", ranks_expected=[])
    with pytest.raises(ValueError):
        store.incident_dir("../../etc")
    assert store.incident_dir(a.id) == tmp_path / "incidents" / a.id
    store.close()

    # A second process (here: a plain sqlite3 connection) sees committed rows, in WAL mode.
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("SELECT COUNT(*) FROM incidents").fetchone()[0] == 3
    raw.close()

    again = IncidentStore(db)
    row = again.get_incident(a.id)
    assert row is not None and row.report is not None
    assert row.report.stalled_collective is not None and row.report.stalled_collective.seq == 5
    assert row.detection_s == 12.5
    assert again.get_incident(b.id).error == "analyzer crashed: boom"  # type: ignore[union-attr]
    again.close()


@pytest.mark.timeout(30)
def test_concurrent_writers(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path / "hangwatch.db")
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for k in range(25):
                row = store.create_incident(
                    job_id=f"j{i}", reason=f"r{k}", trigger="stall", ranks_expected=[0]
                )
                store.finish_incident(row.id, report=_report([0]), detection_s=1.0)
                store.list_incidents(job_id=f"j{i}")
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert store.count_by_verdict() == {"hang": 100}
    store.close()
