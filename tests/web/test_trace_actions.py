"""GET /api/incidents/{id}/trace.json and the incident's recorded actions, over real HTTP."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from hangwatch.server.incidents.action_records import ActionRecord, RankOutcome
from hangwatch.server.web.app import create_app

from tests.web import harness

pytestmark = pytest.mark.timeout(60)


def test_trace_json_and_actions_of_a_real_incident(tmp_path: Path) -> None:
    if not (harness.GOLDEN_SKIP / "manifest.json").is_file():
        pytest.skip(f"golden dumps absent: {harness.GOLDEN_SKIP} not in this tree")
    inc = harness.real_incident()
    ctx = harness.make_context(tmp_path / "data")
    iid = harness.insert_incident(ctx, job="zoo-skip", report=inc.report, bundle_from=inc.dumps)
    t = time.time()
    ctx.store.set_actions(
        iid,
        [
            ActionRecord(kind="exclude", status="done", started=t, finished=t, node="n1",
                         host="h1", argv=["kubectl", "cordon", "h1"], returncode=0,
                         summary="kubectl for h1 exited 0", output="<b>cordoned</b>"),
            ActionRecord(kind="abort", status="done", started=t, finished=t,
                         summary="ended ranks 0,1,2,3",
                         ranks=[RankOutcome(rank=r, pid=100 + r, node="n1", outcome="terminated",
                                            signals=["SIGTERM"], exit_s=0.1) for r in range(4)]),
        ],
    )  # fmt: skip
    try:
        with harness.serve(create_app(ctx)) as base, httpx.Client(base_url=base) as c:
            r = c.get(f"/api/incidents/{iid}/trace.json")
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            doc = r.json()
            assert c.get("/api/incidents/nope/trace.json").status_code == 404
            body = c.get(f"/api/incidents/{iid}").json()
            page = c.get(f"/incidents/{iid}").text
    finally:
        ctx.store.close()
    tracks = {e["pid"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert tracks == {0, 1, 2, 3}
    assert doc["otherData"]["lagging_ranks"] == inc.lagging_ranks
    stalled = {e["pid"] for e in doc["traceEvents"] if e.get("args", {}).get("stalled")}
    assert stalled == {0, 1, 2, 3} - set(inc.lagging_ranks)

    assert [a["kind"] for a in body["actions"]] == ["exclude", "abort"]
    assert body["actions"][1]["ranks"][0] == {
        "rank": 0, "pid": 100, "node": "n1", "outcome": "terminated", "signals": ["SIGTERM"],
        "exit_s": 0.1, "detail": "",
    }  # fmt: skip
    assert 'class="incident-action">abort (done): ended ranks 0,1,2,3<' in page
    assert "exclude (done): kubectl for h1 exited 0" in page
    assert "<b>cordoned</b>" not in page  # the output is in the API, never raw in the page
