"""The dashboard while its PostgreSQL store is away (a restart, a failover):
the live view answers from memory, what needs the store is a 503 that says
so and when to ask again, and everything answers again once it is back."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from hangwatch.server.incidents.store import IncidentStore
from hangwatch.server.web.app import RETRY_AFTER_S, create_app

from tests.support.clock import FakeClock
from tests.support.pgserver import PgServer
from tests.web import harness

JOB = "llama-70b"


@pytest.mark.realtime
@pytest.mark.timeout(90)
def test_the_live_view_answers_while_the_store_is_away(pg: PgServer, tmp_path: Path) -> None:
    store = IncidentStore.open(pg.new_database(), tmp_path)
    clock = FakeClock()
    ctx = harness.make_context(tmp_path, store=store, clock=clock)
    harness.feed_job(ctx.registry, job=JOB, world=16, stuck=3)
    clock.advance(6.0)  # past the 5 s stall timeout, within the 10 s agent-lost one
    incident = harness.insert_incident(ctx, job=JOB, report=harness.hang_report(world=16, stuck=3))
    try:
        with harness.serve(create_app(ctx)) as base, httpx.Client(base_url=base, timeout=20) as c:
            assert c.get("/api/incidents").json()[0]["id"] == incident
            pg.stop()
            try:
                r = c.get("/api/incidents")
                assert r.status_code == 503, r.text
                assert "the incident store is unavailable" in r.json()["detail"]
                assert r.headers["retry-after"] == str(RETRY_AFTER_S)
                assert c.get("/readyz").status_code == 503
                # The live view: from the registry, without the stored parts.
                jobs = c.get("/api/jobs")
                assert jobs.status_code == 200, jobs.text
                [job] = jobs.json()
                assert (job["job"], job["live"], job["stalled_groups"]) == (JOB, True, 1)
                ranks = c.get(f"/api/jobs/{JOB}/ranks")
                assert ranks.status_code == 200 and len(ranks.json()["ranks"]) == 16
                assert c.get(f"/jobs/{JOB}").status_code == 200
                assert JOB in c.get("/").text
                # /metrics: the live series scraped, the stored ones missing.
                metrics = c.get("/metrics")
                assert metrics.status_code == 200, metrics.text
                assert f'hangwatch_job_stalled{{job="{JOB}"}} 1.0' in metrics.text
                assert "hangwatch_incidents_stored" not in metrics.text
            finally:
                pg.start()
            deadline = time.monotonic() + 30
            while (r := c.get(f"/api/incidents/{incident}")).status_code == 503:
                assert time.monotonic() < deadline, "the store never came back"
                time.sleep(0.2)
            assert r.status_code == 200 and r.json()["verdict"] == "hang"
            assert c.get("/readyz").status_code == 200
            assert 'hangwatch_incidents_stored{state="analyzed",verdict="hang"} 1.0' in (
                c.get("/metrics").text
            )
    finally:
        store.close()
