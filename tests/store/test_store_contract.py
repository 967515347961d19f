"""What every incident store promises, held against both: a real SQLite file
and a real PostgreSQL server (conftest.py: one fresh database per test)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from hangwatch.analyzer.report import Finding, RankEvidence, Report, StalledCollective
from hangwatch.server.incidents.action_records import ActionRecord
from hangwatch.server.incidents.store import UnknownIncident

from .conftest import OpenStore

HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-c"}


def _report(lagging: list[int], verdict: str = "hang") -> Report:
    return Report(
        verdict=verdict,
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
        evidence={r: RankEvidence(rank=r, host=h, pid=100 + r) for r, h in HOSTS.items()},
    )


@pytest.mark.timeout(60)
def test_roundtrip_filters_and_reopen(open_store: OpenStore, tmp_path: Path) -> None:
    store = open_store()
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
    assert a.created == t0  # unix seconds keep their microseconds (a 64-bit float)

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
    assert [r.id for r in store.list_incidents(status="failed")] == [b.id]
    assert [r.id for r in store.list_incidents(limit=1)] == [c.id]
    assert store.count_by_verdict() == {"hang": 1, "failed": 1, "collecting": 1}
    assert store.count_by_status()["collecting"] == 1
    assert store.count_by_verdict_status() == {
        ("hang", "analyzed"): 1,
        ("pending", "failed"): 1,
        ("pending", "collecting"): 1,
    }
    assert store.newest_open() == {"jobA": c.id}
    assert store.newest_open("jobB") == {}
    assert sorted(store.open_by_job()) == [
        ("jobA", "hang", "analyzed", 1, t0),
        ("jobA", "pending", "collecting", 1, t0 + 20),
    ]
    jobs = {j.job_id: j for j in store.list_jobs()}
    assert jobs["jobA"].incidents == 2 and jobs["jobB"].incidents == 1
    assert (jobs["jobA"].first_seen, jobs["jobA"].last_seen) == (t0, t0 + 20)
    store.touch_job("jobA", now=t0 - 100)  # an older sighting never moves last_seen back
    assert {j.job_id: j for j in store.list_jobs()}["jobA"].last_seen == t0 + 20
    assert store.get_incident("nope") is None
    with pytest.raises(UnknownIncident):
        store.fail_incident("nope", error="x")
    with pytest.raises(ValueError, match="trigger"):
        store.create_incident(job_id="j", reason="r", trigger="bogus", ranks_expected=[])
    with pytest.raises(ValueError):
        store.incident_dir("../../etc")
    assert store.incident_dir(a.id) == tmp_path / "data" / "incidents" / a.id
    store.close()

    again = open_store()
    row = again.get_incident(a.id)
    assert row is not None and row.report is not None
    assert row.report.stalled_collective is not None and row.report.stalled_collective.seq == 5
    assert row.detection_s == 12.5
    assert again.get_incident(b.id).error == "analyzer crashed: boom"  # type: ignore[union-attr]
    assert len(again.list_incidents()) == 3


@pytest.mark.timeout(60)
def test_closing_states_and_actions(open_store: OpenStore) -> None:
    store = open_store()
    seen: list[tuple[str, str]] = []
    store.on_status_change.append(lambda r: seen.append((r.id, r.status)))
    a = store.create_incident(job_id="j", reason="r", trigger="stall", ranks_expected=[0, 1])
    b = store.create_incident(job_id="j", reason="r", trigger="stall", ranks_expected=[0, 1])
    store.finish_incident(a.id, report=_report([1]), detection_s=3.0)
    r = store.resolve_incident(a.id, stall_s=7.5, late_ranks=[1], reason="progress resumed")
    assert (r.status, r.stall_s, r.late_ranks, r.transient, r.is_open) == (
        "resolved",
        7.5,
        [1],
        True,
        False,
    )
    e = store.end_incident(b.id, reason="job stopped", closed_at=1234.5)
    assert (e.status, e.closed_at, e.close_reason) == ("ended", 1234.5, "job stopped")
    act = ActionRecord(kind="exclude", status="done", started=1.0, summary="cordoned node-a")
    assert store.set_actions(a.id, [act]).actions == [act]
    # The report changes, the status stays: no status listener call.
    store.revise_report(a.id, report=_report([2]))
    assert seen == [
        (a.id, "collecting"),
        (b.id, "collecting"),
        (a.id, "analyzed"),
        (a.id, "resolved"),
        (b.id, "ended"),
    ]
    assert [h.host for h in store.host_history()] == ["node-b"]


@pytest.mark.timeout(60)
def test_a_host_that_held_the_culprit_of_three_incidents_over_two_jobs(
    open_store: OpenStore,
) -> None:
    store = open_store()

    def incident(job: str, t: float, report: Report) -> str:
        row = store.create_incident(
            job_id=job, reason="r", trigger="stall", ranks_expected=list(HOSTS), created=t
        )
        store.finish_incident(row.id, report=report, detection_s=1.0)
        return row.id

    a1 = incident("job-a", 1000.0, _report([1]))  # node-a
    a2 = incident("job-a", 2000.0, _report([0], "crash"))  # node-a: a crash counts
    b1 = incident("job-b", 3000.0, _report([0, 1]))  # node-a, one incident
    on_gpu_3 = _report([2])  # node-b, once; NVML lists rank 2's pid on GPU 3
    on_gpu_3.evidence[2] = RankEvidence(
        rank=2,
        host="node-b",
        pid=102,
        gpu={"available": True, "devices": [{"index": 3, "processes": [{"pid": 102}]}]},
    )
    incident("job-b", 3500.0, on_gpu_3)
    incident("job-b", 4000.0, _report([3], "mismatch"))  # the program's, not node-c's

    hist = store.host_history()
    assert [(h.host, h.incidents, h.jobs) for h in hist] == [("node-a", 3, 2), ("node-b", 1, 1)]
    assert hist[0].incident_ids == [b1, a2, a1] and hist[0].job_ids == ["job-a", "job-b"]
    assert (hist[0].first, hist[0].last) == (1000.0, 3000.0)
    assert (hist[0].gpus, hist[1].gpus) == ([], [3])
    assert store.count_hosts(since=0.0, min_incidents=3) == 1
    assert store.count_hosts(since=2500.0, min_incidents=1) == 2
    [recent] = store.host_history(since=1500.0, host="node-a")
    assert (recent.incidents, recent.jobs, recent.incident_ids) == (2, 2, [b1, a2])
    assert store.host_history(host="node-c") == []
    assert store.host_history(since=10_000.0) == []


@pytest.mark.timeout(60)
def test_concurrent_writers_lose_nothing(open_store: OpenStore) -> None:
    store = open_store()
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
        t.join(45)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert store.count_by_verdict() == {"hang": 100}
    assert [(h.host, h.incidents, h.jobs) for h in store.host_history()] == [("node-a", 100, 4)]


@pytest.mark.timeout(60)
def test_two_stores_on_one_database_see_each_others_rows(open_store: OpenStore) -> None:
    """Two coordinators sharing one store (on SQLite: one file, as two
    processes on one host could)."""
    one, two = open_store(), open_store()
    a = one.create_incident(job_id="job-1", reason="r", trigger="stall", ranks_expected=[0])
    b = two.create_incident(job_id="job-2", reason="r", trigger="stall", ranks_expected=[0])
    assert (
        {r.id for r in one.list_incidents()}
        == {r.id for r in two.list_incidents()}
        == {
            a.id,
            b.id,
        }
    )
    assert sorted(j.job_id for j in two.list_jobs()) == ["job-1", "job-2"]


@pytest.mark.timeout(60)
def test_pages_of_the_list_follow_each_other_under_every_filter(open_store: OpenStore) -> None:
    """Keyset paging: each page starts after the last id of the one before,
    also among incidents created in the same second."""
    store = open_store()
    ids = []
    for i in range(7):
        row = store.create_incident(
            job_id=f"job-{i % 2}",
            reason="r",
            trigger="stall",
            ranks_expected=[0],
            created=1000.0 + (i // 3),  # three incidents share each second
            incident_id=f"inc-{i:02d}",
        )
        store.finish_incident(row.id, report=_report([2] if i % 3 else [0]), detection_s=1.0)
        ids.append(row.id)
    newest_first = [r.id for r in store.list_incidents()]
    assert sorted(newest_first) == sorted(ids)
    pages, before = [], None
    while page := [r.id for r in store.list_incidents(limit=3, before=before)]:
        pages.append(page)
        before = page[-1]
    assert [i for p in pages for i in p] == newest_first and [len(p) for p in pages] == [3, 3, 1]
    # A host's incidents: those whose culprits it held (node-b holds rank 2).
    on_b = [r.id for r in store.list_incidents(host="node-b")]
    assert on_b == [i for i in newest_first if int(i[-2:]) % 3]
    assert [r.id for r in store.list_incidents(host="node-b", job_id="job-0", limit=1)] == [
        next(i for i in on_b if int(i[-2:]) % 2 == 0)
    ]
    first = store.list_incidents(host="node-b", limit=2)
    rest = store.list_incidents(host="node-b", before=first[-1].id)
    assert [r.id for r in first + rest] == on_b
    assert store.list_incidents(host="node-z") == []
    with pytest.raises(UnknownIncident):
        store.list_incidents(before="no-such-incident")
