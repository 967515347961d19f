"""The dashboard in headless Chromium: real server, real store, real browser.

Covers what only a browser can show: the login form sets a cookie that the
page's own polling then uses, the heat map refreshes without a reload, the
CSP lets our own assets run and nothing is fetched from anywhere else, and
the incident page reads the same with scripts off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hangwatch.server.web.app import create_app

from hangwatch.wire import pb
from tests.web import harness
from tests.web.browser import open_browser, screenshot

pytestmark = [pytest.mark.browser, pytest.mark.timeout(90)]

TOKEN = "browser-test-token"
JOB = "llama-70b-pretrain"
WORLD = 1024
STUCK = 700


def test_dashboard_in_chromium(tmp_path: Path) -> None:
    ctx = harness.make_context(tmp_path, token=TOKEN)
    sessions = harness.feed_job(ctx.registry, job=JOB, world=WORLD, stuck=STUCK, ranks_per_agent=64)
    # A rank's report once it has entered #42 (the stuck rank's, then every rank's last).
    at_42 = functools.partial(
        harness.report_rank, ctx.registry, job=JOB, sessions=sessions, last_enqueued=42,
        last_completed=41,
    )  # fmt: skip
    inc = harness.demo_incident()
    incident_id = harness.insert_incident(
        ctx, job="zoo-skip", report=inc.report, bundle_from=inc.dumps
    )
    try:
        with harness.serve(create_app(ctx)) as base, open_browser() as b:
            page = b.new_page()

            # Not logged in: the login form, then back to the page asked for.
            page.goto(f"{base}/jobs/{JOB}")  # type: ignore[attr-defined]
            page.fill("#token", TOKEN)  # type: ignore[attr-defined]
            page.click("form.login button[type=submit]")  # type: ignore[attr-defined]
            page.wait_for_url(f"{base}/jobs/{JOB}")  # type: ignore[attr-defined]
            b.console_errors.clear()  # the login page itself is a 401, by design

            heat = page.locator("#heatmap")  # type: ignore[attr-defined]
            assert heat.is_visible()
            cells = page.locator("#heatmap .cell")  # type: ignore[attr-defined]
            assert cells.count() == WORLD
            stuck = page.locator(f'#heatmap .cell[data-rank="{STUCK}"]')  # type: ignore[attr-defined]
            assert stuck.get_attribute("class") == "cell lag1 stalled"
            assert f"rank {STUCK} " in (stuck.get_attribute("title") or "")
            assert stuck.bounding_box()["width"] >= 8  # still a visible cell at 1,024 ranks
            stalled = page.locator("#stalled-table tbody")  # type: ignore[attr-defined]
            assert str(STUCK) in stalled.inner_text()
            # A stalled live job is not shown as a green "live", and the header
            # names its state once.
            badge = page.locator("h1 .job-state")  # type: ignore[attr-defined]
            assert (badge.inner_text(), badge.get_attribute("class")) == (
                "stalled",
                "badge badge-hang job-state",
            )
            page.wait_for_selector("#live-status:has-text('updated')", timeout=5000)  # type: ignore[attr-defined]
            assert page.locator("h1").inner_text().count("live") == 0  # type: ignore[attr-defined]
            screenshot(page, "job.png")

            # The culprit enters #42: the page follows by polling, without a reload.
            page.evaluate("window.__sameDocument = true")  # type: ignore[attr-defined]
            at_42(rank=STUCK, report_seq=2)
            page.wait_for_selector(  # type: ignore[attr-defined]
                f'#heatmap .cell.lag0[data-rank="{STUCK}"]:not(.stalled)', timeout=6000
            )
            assert page.evaluate("window.__sameDocument === true")  # type: ignore[attr-defined]
            page.wait_for_selector("h1 .job-state.badge-healthy", timeout=6000)  # type: ignore[attr-defined]

            # Every rank exits: the open page says ended, and so does the jobs list.
            for r in range(WORLD):
                at_42(rank=r, report_seq=3 + r, state=pb.PROCESS_STATE_GONE)
            page.wait_for_selector("h1 .job-state.badge-ended", timeout=6000)  # type: ignore[attr-defined]
            # The state is the badge's to say, once: the status line only says how fresh.
            status = page.locator("#live-status").inner_text()  # type: ignore[attr-defined]
            assert status.startswith("updated "), status
            page.wait_for_selector('#oldest-inflight:text-is("-")', timeout=6000)  # type: ignore[attr-defined]
            page.goto(f"{base}/")  # type: ignore[attr-defined]
            page.wait_for_selector("#live-status:has-text('updated')", timeout=6000)  # type: ignore[attr-defined]
            row = page.locator(f'#jobs-table tr:has(a:text-is("{JOB}")) .job-state')  # type: ignore[attr-defined]
            assert row.inner_text() == "ended"
            assert row.get_attribute("title") == "every rank of the job exited"

            # The incident page.
            page.goto(f"{base}/incidents/{incident_id}")  # type: ignore[attr-defined]
            summary = page.locator("#summary").inner_text()  # type: ignore[attr-defined]
            lag = ",".join(map(str, inc.lagging_ranks))
            assert summary.startswith(f"Rank {lag} never entered {inc.op} #{inc.seq}"), summary
            stalled_text = page.locator("#stalled").inner_text()  # type: ignore[attr-defined]
            assert inc.op in stalled_text and f"#{inc.seq}" in stalled_text
            for r in inc.lagging_ranks:
                card = page.locator(f"#rank-{r}")  # type: ignore[attr-defined]
                assert card.is_visible()
                assert "source:" in card.inner_text()
            graph = page.locator("svg.waitgraph")  # type: ignore[attr-defined]
            assert graph.is_visible()
            roots = page.locator("svg.waitgraph .wf-root text").all_text_contents()  # type: ignore[attr-defined]
            assert roots == [f"rank {r}" for r in inc.lagging_ranks]
            screenshot(page, "incident.png")

            # The incident page without JavaScript: same content, server-rendered.
            nojs = b.new_page(javascript=False)
            nojs.context.add_cookies(page.context.cookies())  # type: ignore[attr-defined]
            nojs.goto(f"{base}/incidents/{incident_id}")  # type: ignore[attr-defined]
            assert nojs.locator("#summary").inner_text() == summary  # type: ignore[attr-defined]
            assert nojs.locator("svg.waitgraph").is_visible()  # type: ignore[attr-defined]

            # The Hosts page, from the top bar: the culprit's host, one incident
            # (under the 3 of a repeat offender), linking back to the incident.
            page.click("nav a:text-is('Hosts')")  # type: ignore[attr-defined]
            page.wait_for_url(f"{base}/hosts")  # type: ignore[attr-defined]
            culprit = inc.report.evidence[inc.lagging_ranks[0]].host
            host_row = page.locator(f'#hosts tr[data-host="{culprit}"]')  # type: ignore[attr-defined]
            assert host_row.get_attribute("data-offender") == "false"
            cells = host_row.locator("td").all_inner_texts()
            assert (cells[0], cells[1]) == (culprit, "1"), cells
            host_row.locator(f'a:text-is("{incident_id}")').click()
            page.wait_for_url(f"{base}/incidents/{incident_id}")  # type: ignore[attr-defined]

            assert b.foreign_requests(base) == [], "the dashboard must not reach outside"
            assert b.page_errors == []
            assert b.console_errors == []  # CSP violations would show up here
    finally:
        ctx.store.close()
