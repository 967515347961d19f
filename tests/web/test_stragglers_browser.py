"""The job page's lateness strip and stragglers table in headless Chromium: they follow
the coordinator by polling, without a reload, and break no CSP."""

from __future__ import annotations

from pathlib import Path

import pytest
from hangwatch.server.live.stragglers import StragglerMonitor
from hangwatch.server.web.app import create_app

from tests.support.simagents.lateness import SimJob, replay
from tests.web import harness
from tests.web.browser import open_browser

pytestmark = [pytest.mark.browser, pytest.mark.timeout(90)]

JOB = "straggling-job"
SLOW = 5


def test_stragglers_panel_follows_the_monitor(tmp_path: Path) -> None:
    ctx = harness.make_context(tmp_path)
    harness.feed_job(ctx.registry, job=JOB, world=16, stuck=0, ranks_per_agent=8)
    ctx.stragglers = StragglerMonitor()
    named = replay(SimJob(ranks=16, slow={SLOW: 0.5}), 80, clock_error_s=0.0005, job_id=JOB)
    assert named.first_flag(SLOW) is not None
    try:
        with harness.serve(create_app(ctx)) as base, open_browser() as b:
            page = b.new_page()
            page.goto(f"{base}/jobs/{JOB}")  # type: ignore[attr-defined]
            rows = page.locator("#stragglers-table tbody")  # type: ignore[attr-defined]
            assert rows.inner_text().strip() == "No stragglers."
            assert page.locator("#lateness-map .cell").count() == 0  # type: ignore[attr-defined]

            page.evaluate("window.__sameDocument = true")  # type: ignore[attr-defined]
            ctx.stragglers = named.monitor  # the coordinator has now named rank 5
            page.wait_for_selector(  # type: ignore[attr-defined]
                "#stragglers-table tbody td.bad", timeout=6000
            )
            cells = rows.locator("td").all_text_contents()
            assert cells[0] == str(SLOW) and cells[1] == "host-sim-0" and cells[4] == "host"
            assert cells[6].endswith(" UTC")
            strip = page.locator("#lateness-map .cell")  # type: ignore[attr-defined]
            assert strip.count() == 16
            slow = page.locator(f'#lateness-map .cell[data-rank="{SLOW}"]')  # type: ignore[attr-defined]
            assert slow.get_attribute("class") == "cell lag4 stalled"
            assert "behind " in (slow.get_attribute("title") or "")
            assert page.evaluate("window.__sameDocument === true")  # type: ignore[attr-defined]

            assert b.foreign_requests(base) == []
            assert b.page_errors == []
            assert b.console_errors == []
    finally:
        ctx.store.close()
