"""Node history across jobs in the real SQLite store: which hosts held the culprits.

Reports are built the way the analyzer writes them (verdict, lagging ranks,
each rank's evidence with its host); the store derives the history when the
verdict is stored, and an older file gets it filled in when opened.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hangwatch.analyzer.report import RankEvidence, Report
from hangwatch.server.incidents.hosts import culprit_hosts, is_repeat_offender
from hangwatch.server.incidents.store import IncidentStore

HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-c"}


def _report(verdict: str, lagging: list[int], **gpu: Any) -> Report:
    ev = {r: RankEvidence(rank=r, host=h, pid=100 + r) for r, h in HOSTS.items()}
    if gpu:
        ev[lagging[0]] = RankEvidence(rank=lagging[0], host=HOSTS[lagging[0]], pid=7, gpu=gpu)
    return Report(verdict=verdict, summary="x", lagging_ranks=lagging, evidence=ev)  # type: ignore[arg-type]


def _incident(store: IncidentStore, job: str, t: float, report: Report) -> str:
    row = store.create_incident(
        job_id=job, reason="r", trigger="stall", ranks_expected=list(HOSTS), created=t
    )
    store.finish_incident(row.id, report=report, detection_s=1.0)
    return row.id


@pytest.mark.timeout(30)
def test_a_host_that_held_the_culprit_of_three_incidents_over_two_jobs_repeats(
    tmp_path: Path,
) -> None:
    store = IncidentStore(tmp_path / "hangwatch.db")
    a1 = _incident(store, "job-a", 1000.0, _report("hang", [1]))  # node-a
    a2 = _incident(store, "job-a", 2000.0, _report("crash", [0]))  # node-a: a crash counts
    b1 = _incident(store, "job-b", 3000.0, _report("hang", [0, 1]))  # node-a, one incident
    _incident(store, "job-b", 3500.0, _report("hang", [2]))  # node-b, once
    # A mismatch is the program's; a verdict that names nobody blames no host.
    _incident(store, "job-b", 4000.0, _report("mismatch", [3]))
    _incident(store, "job-b", 4100.0, _report("unknown", []))

    hist = store.host_history()
    assert [(h.host, h.incidents, h.jobs) for h in hist] == [("node-a", 3, 2), ("node-b", 1, 1)]
    a = hist[0]
    assert a.incident_ids == [b1, a2, a1] and a.job_ids == ["job-a", "job-b"]
    assert (a.first, a.last) == (1000.0, 3000.0)
    assert is_repeat_offender(a, 3) and not is_repeat_offender(hist[1], 3)
    # A window leaves the older incidents out; one host asked for alone.
    [recent] = store.host_history(since=1500.0, host="node-a")
    assert (recent.incidents, recent.jobs, recent.incident_ids) == (2, 2, [b1, a2])
    # node-c waited in every incident and was blamed only for a mismatch: never counted.
    assert store.host_history(host="node-c") == []


@pytest.mark.timeout(30)
def test_a_revised_verdict_replaces_its_culprit_hosts(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path / "hangwatch.db")
    iid = _incident(store, "job", 1000.0, _report("hang", [2]))
    assert [h.host for h in store.host_history()] == ["node-b"]
    store.revise_report(iid, report=_report("hang", [3]))
    assert [(h.host, h.incident_ids) for h in store.host_history()] == [("node-c", [iid])]
    store.revise_report(iid, report=_report("no-culprit-visible", []))
    assert store.host_history() == []


def test_the_gpu_is_the_one_whose_processes_list_the_rank() -> None:
    gpu = {
        "available": True,
        "devices": [
            {"index": 0, "processes": [{"pid": 6}]},
            {"index": 3, "processes": [{"pid": 5}, {"pid": 7}]},
        ],
    }
    [h] = culprit_hosts(_report("hang", [2], **gpu))
    assert (h.host, h.ranks, h.gpus) == ("node-b", [2], [3])
    # NVML unavailable, or the pid on no device: no GPU named, the host still is.
    [h] = culprit_hosts(_report("hang", [2], available=False, reason="no NVML"))
    assert h.gpus == []
    # A culprit whose dump never came has no host in its evidence: left out.
    rep = _report("hang", [2])
    rep.evidence.pop(2)
    assert culprit_hosts(rep) == []


@pytest.mark.timeout(30)
def test_a_file_of_the_previous_schema_gets_its_history_filled_in(tmp_path: Path) -> None:
    """Schema 2 is schema 3 without culprit_hosts: a file written by the release
    before this one is made by dropping the table and the version."""
    db = tmp_path / "hangwatch.db"
    store = IncidentStore(db)
    ids = [_incident(store, f"job-{i % 2}", 1000.0 + i, _report("hang", [1])) for i in range(3)]
    store.close()
    raw = sqlite3.connect(db)
    raw.executescript("DROP TABLE culprit_hosts; PRAGMA user_version=2;")
    raw.close()

    store = IncidentStore(db)
    [h] = store.host_history()
    assert (h.host, h.incidents, h.jobs, h.incident_ids) == ("node-a", 3, 2, ids[::-1])
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == 3
    # Reopening does not fill it in twice.
    store.close()
    assert IncidentStore(db).host_history()[0].incidents == 3
