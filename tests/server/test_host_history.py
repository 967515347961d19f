"""Node history across jobs in the real SQLite store: which hosts held the culprits.

Reports are built the way the analyzer writes them (verdict, lagging ranks,
each rank's evidence with its host); the store derives the history when the
verdict is stored, and an older file gets it filled in when opened.
"""

from __future__ import annotations

import sqlite3
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from hangwatch.analyzer.report import RankEvidence, Report
from hangwatch.server.incidents.hosts import OffenderRule, culprit_hosts
from hangwatch.server.incidents.store import IncidentStore
from hangwatch.server.integrations.offenders import EVENT

from hangwatch.wire import rpc
from tests.hardening.util import wait_for
from tests.support.chaos import CoordinatorProc
from tests.support.webhook import receiver

from .conftest import hang_rank_2, two_nodes

HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-c"}


def _report(verdict: str, lagging: list[int], **gpu: Any) -> Report:
    ev = {r: RankEvidence(rank=r, host=h, pid=100 + r) for r, h in HOSTS.items()}
    if gpu:
        ev[lagging[0]] = RankEvidence(rank=lagging[0], host=HOSTS[lagging[0]], pid=7, gpu=gpu)
    return Report(verdict=verdict, summary="x", lagging_ranks=lagging, evidence=ev)  # type: ignore[arg-type]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


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
    rule = OffenderRule(incidents=3, window_s=3600.0)
    assert rule.applies(a) and not rule.applies(hist[1])
    assert store.count_hosts(since=0.0, min_incidents=3) == 1
    assert store.count_hosts(since=0.0, min_incidents=1) == 2
    assert store.count_hosts(since=2500.0, min_incidents=1) == 2  # node-a 3000, node-b 3500
    assert store.count_hosts(since=3200.0, min_incidents=1) == 1
    assert rule.since(5000.0) == 1400.0
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


@pytest.mark.timeout(120)
def test_a_repeat_offender_across_two_jobs_is_in_the_api_the_page_the_metric_and_a_webhook(
    tmp_path: Path,
) -> None:
    """A real `hangwatch server`, two jobs' agents speaking its gRPC protocol with
    real FR dumps: rank 2 (on gpu-node-7) hangs job-1 twice and job-2 once, its
    peers (on gpu-node-3) waiting. The third incident makes gpu-node-7 a repeat
    offender: /api/hosts, the /hosts page, /metrics and one webhook event say
    so; gpu-node-3, which only waited, appears nowhere."""
    hosts = ("gpu-node-3", "gpu-node-7")
    with (
        receiver() as rx,
        CoordinatorProc(
            tmp_path / "data",
            extra_args=("--notify-url", rx.url, "--repeat-offender-incidents", "3"),
        ) as coord,
        grpc.insecure_channel(coord.grpc) as ch,
    ):
        stub = rpc.CoordinatorStub(ch)
        agents = {job: two_nodes(stub, job, (f"{job}-a", f"{job}-b")) for job in ("job-1", "job-2")}
        ids = []
        for job, seq in (("job-1", 5), ("job-2", 5), ("job-1", 9)):
            a, b = agents[job]
            iid = hang_rank_2(a, b, seq=seq, hosts=hosts)
            wait_for(
                lambda i=iid: coord.api(f"/api/incidents/{i}")["status"] == "analyzed",
                30,
                "analysed",
            )
            ids.append(iid)
            if len(ids) < 3:
                assert coord.api("/api/hosts?offenders=true")["hosts"] == []
            # The stall clears: the job trains on.
            a.progress({0: (seq, seq), 1: (seq, seq)})
            b.progress({2: (seq, seq), 3: (seq, seq)})
            wait_for(
                lambda i=iid: coord.api(f"/api/incidents/{i}")["status"] == "resolved",
                30,
                "resolved",
            )

        out = coord.api("/api/hosts")
        assert (out["threshold"], out["window_s"]) == (3, 7 * 24 * 3600.0)
        [h] = out["hosts"]
        assert (h["host"], h["incidents"], h["jobs"], h["repeat_offender"]) == (
            "gpu-node-7", 3, 2, True,
        )  # fmt: skip
        assert h["incident_ids"] == ids[::-1] and h["job_ids"] == ["job-1", "job-2"]
        assert coord.api("/api/hosts/gpu-node-7")["incidents"] == 3
        with pytest.raises(urllib.error.HTTPError) as e:
            coord.api("/api/hosts/gpu-node-3")
        e.value.close()  # the error holds the response open
        assert e.value.code == 404

        page = _get(coord.http + "/hosts")
        assert 'data-host="gpu-node-7"' in page and "repeat offender" in page
        assert "gpu-node-3" not in page
        metrics = _get(coord.http + "/metrics")
        assert "hangwatch_repeat_offender_hosts 1.0" in metrics

        got = rx.wait(lambda r: any(x.body["event"] == EVENT for x in r), 10)
        [event] = [x.body for x in got if x.body["event"] == EVENT]
        assert event["incident"]["id"] == ids[2]
        assert event["incident"]["host"]["host"] == "gpu-node-7"
        assert event["text"].startswith("host gpu-node-7 held the culprit of 3 incidents in 2 jobs")
        for a, b in agents.values():
            a.close()
            b.close()
