"""Many coordinators, one history: real `hangwatch server` processes of
different jobs write to one real PostgreSQL (`--store`), with agents speaking
the wire protocol and real FR dumps.

- Either coordinator's API and dashboard, and those of a third coordinator
  of no job (a fleet dashboard), list both jobs' incidents, filtered and
  paged, and serve both jobs' bundles (a shared --incidents-dir); a host that
  was the culprit in both jobs is a repeat offender in each view.
- A PostgreSQL restart, or a read-only database, while a coordinator runs:
  the live view keeps answering, and the incident it could not open is stored
  once the database takes writes again.
- Two coordinators store incidents at once and one is killed -9 in the
  middle of its own: one incident a job, each whole, none twice.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from hangwatch.wire import rpc
from tests.hardening.util import analyzer_worker, rank_files
from tests.server.conftest import (
    hang_rank_2,
    two_nodes,
    wait_for,
)
from tests.support.chaos import CoordinatorProc
from tests.support.pgserver import PgServer

HOSTS = ("gpu-node-3", "gpu-node-7")  # node a's ranks, node b's (rank 2: the culprit)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _status(coord: CoordinatorProc, iid: str) -> str | None:
    """The incident's status; None while the store is out of reach (a 503 that
    says so: the pool reconnects to a database that is back within seconds)."""
    try:
        return str(coord.api(f"/api/incidents/{iid}")["status"])
    except urllib.error.HTTPError as e:
        body = e.read().decode()
        e.close()  # the error holds the response open
        if e.code != 503:
            raise
        assert "the incident store is unavailable" in body, body
        return None


def _analysed(coord: CoordinatorProc, iid: str) -> None:
    wait_for(lambda: _status(coord, iid) == "analyzed", 40, f"{iid} analysed")


@pytest.mark.timeout(240)
def test_two_coordinators_of_two_jobs_share_one_history(pg: PgServer, tmp_path: Path) -> None:
    url = pg.new_database()
    shared = tmp_path / "shared-incidents"  # as on a filesystem both coordinators mount
    store = ("--store", url, "--repeat-offender-incidents", "3", "--incidents-dir", str(shared))
    # The agents are idle while the views are checked: not lost meanwhile.
    with (
        CoordinatorProc(tmp_path / "c1", agent_lost_timeout=120.0, extra_args=store) as c1,
        CoordinatorProc(tmp_path / "c2", agent_lost_timeout=120.0, extra_args=store) as c2,
        grpc.insecure_channel(c1.grpc) as ch1,
        grpc.insecure_channel(c2.grpc) as ch2,
    ):
        a1, b1 = two_nodes(rpc.CoordinatorStub(ch1), "job-1", ("job-1-a", "job-1-b"))
        a2, b2 = two_nodes(rpc.CoordinatorStub(ch2), "job-2", ("job-2-a", "job-2-b"))
        ids: dict[str, list[str]] = {"job-1": [], "job-2": []}
        for job, coord, a, b, seq in (
            ("job-1", c1, a1, b1, 5),
            ("job-2", c2, a2, b2, 5),
            ("job-1", c1, a1, b1, 9),
        ):
            iid = hang_rank_2(a, b, seq=seq, hosts=HOSTS)
            _analysed(coord, iid)
            ids[job].append(iid)
            # The stall clears: the job trains on (the next hang is a new incident).
            a.progress({0: (seq, seq), 1: (seq, seq)})
            b.progress({2: (seq, seq), 3: (seq, seq)})
            wait_for(
                lambda c=coord, i=iid: c.api(f"/api/incidents/{i}")["status"] == "resolved",
                40,
                f"{iid} resolved",
            )

        every = {*ids["job-1"], *ids["job-2"]}
        # A fleet dashboard: a coordinator of no job, on the same store and bundles.
        fleet = CoordinatorProc(tmp_path / "fleet", extra_args=store)
        fleet.start()
        views = (c1, c2, fleet)
        for coord in views:
            # One fleet view, whichever coordinator serves it.
            assert {i["id"] for i in coord.api("/api/incidents")} == every
            assert {i["id"] for i in coord.api("/api/incidents?job=job-2")} == set(ids["job-2"])
            assert {i["id"] for i in coord.api("/api/incidents?verdict=hang&status=resolved")} == (
                every
            )
            assert {i["id"] for i in coord.api(f"/api/incidents?host={HOSTS[1]}")} == every
            assert coord.api(f"/api/incidents?host={HOSTS[0]}") == []  # it only waited
            first = coord.api("/api/incidents?limit=2")
            rest = coord.api(f"/api/incidents?limit=2&before={first[-1]['id']}")
            assert len(first) == 2 and {i["id"] for i in first + rest} == every
            # Each coordinator's jobs: its own live, the others from the shared history.
            assert {j["job"]: j["live"] for j in coord.api("/api/jobs")} == {
                "job-1": coord is c1,
                "job-2": coord is c2,
            }
            # The culprit host over both jobs: a repeat offender in either view.
            [h] = coord.api("/api/hosts?offenders=true")["hosts"]
            assert (h["host"], h["incidents"], h["jobs"]) == (HOSTS[1], 3, 2)
            page = _get(coord.http + "/incidents")
            assert all(i in page for i in every)
        # Each bundle is in the shared bundle directory, and every dashboard
        # serves any of them (the other job's included).
        for coord in views:
            for iid in every:
                assert (shared / iid).is_dir()
                with urllib.request.urlopen(
                    f"{coord.http}/api/incidents/{iid}/bundle", timeout=10
                ) as r:
                    assert r.headers["content-type"] == "application/gzip" and r.read(2) == (
                        b"\x1f\x8b"
                    )
        assert not (c1.data_dir / "incidents").exists() or not any(
            (c1.data_dir / "incidents").iterdir()
        )
        fleet.stop()
        for ag in (a1, b1, a2, b2):
            ag.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["restart", "read-only"])
def test_a_database_that_goes_away_while_a_coordinator_runs_costs_nothing(
    pg: PgServer, tmp_path: Path, fault: str
) -> None:
    """restart: the server stops and starts again (`pg_ctl`); read-only: as
    after a failover to a standby (sessions cut, new ones read-only). Either
    way the stall is shown live, the refusal said, nothing stored lost, and the
    incident stored once the database takes writes again."""
    url = pg.new_database()
    db = url.rsplit("/", 1)[1]

    def read_only(on: bool) -> None:
        pg.sql(f"ALTER DATABASE {db} SET default_transaction_read_only = {'on' if on else 'off'}")
        pg.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{db}' AND pid <> pg_backend_pid()"
        )

    with (
        # Its agents send nothing while the database is away: not lost meanwhile.
        CoordinatorProc(
            tmp_path / "c1", agent_lost_timeout=120.0, extra_args=("--store", url)
        ) as coord,
        grpc.insecure_channel(coord.grpc) as ch,
    ):
        a, b = two_nodes(rpc.CoordinatorStub(ch), "job-1", ("job-1-a", "job-1-b"))
        first = hang_rank_2(a, b, seq=5, hosts=HOSTS)
        _analysed(coord, first)
        a.progress({0: (5, 5), 1: (5, 5)})
        b.progress({2: (5, 5), 3: (5, 5)})
        wait_for(
            lambda: coord.api(f"/api/incidents/{first}")["status"] == "resolved", 40, "resolved"
        )

        def database_away_while_stalled() -> None:
            if fault == "restart":
                pg.stop()
            else:
                read_only(True)
            # The stall is seen live, the incident cannot be opened: said, and waited out.
            wait_for(
                lambda: "cannot open an incident" in coord.log(), 60, "the refused incident said"
            )
            ranks = coord.api("/api/jobs/job-1/ranks")
            assert ranks["live"] and [s["group"] for s in ranks["stalled"]] == ["0"], ranks
            [job] = coord.api("/api/jobs")
            assert (job["job"], job["live"], job["stalled_groups"]) == ("job-1", True, 1)
            if fault == "read-only":
                # What was stored stays readable.
                assert [i["id"] for i in coord.api("/api/incidents")] == [first]
            # Away long enough for the pool to back off more than once (1 s, 2 s, ...).
            time.sleep(3)
            if fault == "restart":
                pg.start()
            else:
                read_only(False)

        try:
            second = hang_rank_2(
                a,
                b,
                seq=9,
                hosts=HOSTS,
                on_stalled=database_away_while_stalled,
                dump_timeout=90,
            )
        finally:
            if not pg_running(pg):
                pg.start()
            read_only(False)
        _analysed(coord, second)
        assert [i["id"] for i in coord.api("/api/incidents")] == [second, first]
        assert coord.api(f"/api/incidents/{first}")["status"] == "resolved"
        assert "refused the write" in coord.log()
        for ag in (a, b):
            ag.close()


def pg_running(pg: PgServer) -> bool:
    return (pg.data / "postmaster.pid").exists()


@pytest.mark.timeout(240)
def test_two_coordinators_store_at_once_and_one_is_killed_mid_incident(
    pg: PgServer, tmp_path: Path
) -> None:
    """Both coordinators hold an incident at once; c1 is SIGKILLed while its
    verdict is being made (its analyzer worker SIGSTOPped, so the incident is
    collected, every dump on disk, the verdict not stored) and c2 stores its own
    meanwhile. Restarted on its data directory, c1 finishes its one incident:
    one incident a job in the shared store, each whole, none twice."""
    url = pg.new_database()
    c1 = CoordinatorProc(tmp_path / "c1", dump_deadline=60.0, extra_args=("--store", url))
    # job-2's agents send nothing while c1 restarts: not lost (its incident stays analysed).
    c2 = CoordinatorProc(tmp_path / "c2", agent_lost_timeout=120.0, extra_args=("--store", url))
    worker = None
    with c1, c2, grpc.insecure_channel(c1.grpc) as ch1, grpc.insecure_channel(c2.grpc) as ch2:
        worker = wait_for(lambda: analyzer_worker(c1.pid), 30, "c1's analyzer worker")
        a1, b1 = two_nodes(rpc.CoordinatorStub(ch1), "job-1", ("job-1-a", "job-1-b"))
        a2, b2 = two_nodes(rpc.CoordinatorStub(ch2), "job-2", ("job-2-a", "job-2-b"))
        os.kill(worker, signal.SIGSTOP)
        first = hang_rank_2(a1, b1, seq=5, hosts=HOSTS)
        doc = c1.data_dir / "incidents" / first / "incident.json"
        wait_for(doc.is_file, 30, "c1's incident collected")
        assert c1.api(f"/api/incidents/{first}")["status"] == "collecting"
        # c2 stores its incident while c1 holds its own.
        second = hang_rank_2(a2, b2, seq=5, hosts=HOSTS)
        c1.kill()
        os.kill(worker, signal.SIGKILL)  # what is left of the killed one's analysis
        for ag in (a1, b1):
            ag.close()
        _analysed(c2, second)
        held = rank_files(c1.data_dir / "incidents" / first)
        c1.start()
        _analysed(c1, first)
        for coord in (c1, c2):
            rows = coord.api("/api/incidents")
            assert sorted(r["id"] for r in rows) == sorted([first, second])
            assert {(r["job"], r["status"], tuple(r["lagging_ranks"])) for r in rows} == {
                ("job-1", "analyzed", (2,)),
                ("job-2", "analyzed", (2,)),
            }
        assert rank_files(c1.data_dir / "incidents" / first) == held and len(held) == 8
        [h] = c2.api("/api/hosts")["hosts"]
        assert (h["host"], h["incidents"], h["jobs"]) == (HOSTS[1], 2, 2)
        for ag in (a2, b2):
            ag.close()
