"""GET /api/jobs/{job}/stragglers, the job page's lateness strip and /metrics, over real HTTP.

The monitor behind them is the real one, fed a replayed job with one slow rank."""

from __future__ import annotations

import re

import pytest
from hangwatch.server.live.stragglers import StragglerMonitor

from tests.support.simagents.lateness import SimJob, replay
from tests.web.conftest import JOB, Served

pytestmark = pytest.mark.timeout(60)

SLOW = 3


def _with_straggler(served: Served) -> None:
    r = replay(SimJob(ranks=16, slow={SLOW: 0.5}), 80, clock_error_s=0.0005, job_id=JOB)
    assert r.first_flag(SLOW) is not None
    served.ctx.stragglers = r.monitor


def test_api_names_the_straggler_and_scores_every_rank(served: Served) -> None:
    _with_straggler(served)
    body = served.client.get(f"/api/jobs/{JOB}/stragglers").json()
    assert body["job"] == JOB and body["window_s"] == 300.0 and body["tick_s"] == 1.0
    assert [r["rank"] for r in body["ranks"]] == list(range(16))
    row = body["ranks"][SLOW]
    assert row["straggler"] is True and row["score"] > 0.2 and row["late_ms"] > 5
    assert not any(r["long_run"] for r in body["ranks"])  # named: a straggler, not one long run
    assert row["host"] == "host-sim-0" and row["group"] == "0" and row["ticks"] > 50
    [s] = body["stragglers"]
    assert (s["rank"], s["kind"], s["host"]) == (SLOW, "host", "host-sim-0")
    assert s["since"] > 0 and s["score"] == row["score"]
    assert all(not r["straggler"] for r in body["ranks"] if r["rank"] != SLOW)


def test_job_page_lists_the_straggler(served: Served) -> None:
    _with_straggler(served)
    html = served.client.get(f"/jobs/{JOB}").text
    table = html[html.index('id="stragglers-table"') :]
    table = table[: table.index("</table>")]
    assert re.search(rf'<td class="num bad">{SLOW}</td><td>host-sim-0</td>', table)
    strip = html[html.index('id="lateness-map"') :]
    strip = strip[: strip.index("</div>\n")]
    assert strip.count('role="listitem"') == 16
    assert f'data-rank="{SLOW}"' in strip
    # The strip says which a red rank is, in the table's word (issue 24).
    [cell] = re.findall(
        rf'<div class="cell [^"]*" role="listitem" data-rank="{SLOW}" title="([^"]*)"', strip
    )
    assert cell.endswith("| a straggler"), cell
    assert strip.count("a straggler") == 1


def test_metrics_carry_worst_lateness_and_straggler_count_per_job(served: Served) -> None:
    _with_straggler(served)
    text = served.client.get("/metrics").text
    assert "# TYPE hangwatch_job_lateness_worst gauge" in text
    [count] = re.findall(rf'^hangwatch_job_stragglers\{{job="{JOB}"\}} (\S+)$', text, re.M)
    assert float(count) == 1
    [worst] = re.findall(rf'^hangwatch_job_lateness_worst\{{job="{JOB}"\}} (\S+)$', text, re.M)
    assert 0.2 < float(worst) <= 1
    assert "rank=" not in text.split("hangwatch_job_lateness_worst", 1)[1]


def test_a_job_without_lateness_yet_and_an_unknown_job(served: Served) -> None:
    served.ctx.stragglers = StragglerMonitor()
    body = served.client.get(f"/api/jobs/{JOB}/stragglers").json()
    assert body == {
        "job": JOB,
        "window_s": 300.0,
        "tick_s": 0.0,
        "ranks": [],
        "stragglers": [],
        "none_named": "No stragglers.",
    }
    assert "No stragglers." in served.client.get(f"/jobs/{JOB}").text
    assert served.client.get("/api/jobs/nope/stragglers").status_code == 404


def test_the_endpoint_is_described(served: Served) -> None:
    spec = served.client.get("/openapi.json").json()
    assert "/api/jobs/{job}/stragglers" in spec["paths"]
    assert {"JobStragglersOut", "StragglerOut", "RankLatenessOut"} <= set(
        spec["components"]["schemas"]
    )
