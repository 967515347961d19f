"""A real browser on the dashboard during a real demo run.

Headless Debian Chromium loads the job page while a real 4-rank gloo job runs
and hangs under a real agent, watches the stall appear without a reload, then
opens the incident page and checks that the lagging rank and the stalled
collective are shown. Screenshots land in test-artifacts/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hangwatch.config import env_var
from tests.live.conftest import STALL_TIMEOUT
from tests.web.browser import open_browser, screenshot

pytestmark = [pytest.mark.torch, pytest.mark.browser, pytest.mark.slow]


def _ranks_registered(http: str, job: str) -> int:
    try:
        with urllib.request.urlopen(f"{http}/api/jobs/{job}/ranks", timeout=5) as r:
            return len(json.loads(r.read()).get("ranks", []))
    except OSError:
        return 0


@pytest.mark.timeout(240)
def test_job_and_incident_pages_during_a_real_demo(
    coordinator: dict[str, str], tmp_path: Path
) -> None:
    job = f"browser-{os.getpid()}"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    environ.update(
        {
            env_var("job_id"): job,
            env_var("run_dir"): str(tmp_path / "run"),
            env_var("poll_interval"): "0.5",
        }
    )
    demo = subprocess.Popen(
        [sys.executable, "-m", "hangwatch", "demo", "--scenario", "skip", "--ranks", "4",
         "--coordinator", coordinator["grpc"], "--stall-timeout", str(STALL_TIMEOUT), "--json",
         "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while _ranks_registered(coordinator["http"], job) < 4:
            assert demo.poll() is None, demo.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the demo's ranks never registered"
            time.sleep(0.5)

        with open_browser() as session:
            page = session.new_page()
            page.goto(f"{coordinator['http']}/jobs/{job}")  # type: ignore[attr-defined]
            assert page.locator("#heatmap .cell").count() == 4  # type: ignore[attr-defined]
            # The stall shows up by polling, with no reload: rank 1 is flagged
            # as not having entered the stalled collective.
            page.locator('#heatmap .cell.stalled[data-rank="1"]').wait_for(timeout=60_000)  # type: ignore[attr-defined]
            # The op's name comes with the FR entries the agent fetches once the
            # collective has been in flight a while: the row can show before it
            # (seen under load: "#10" with no op yet); the page fills it in by polling.
            stalled_row = page.locator("#stalled-table tbody tr").first  # type: ignore[attr-defined]
            page.locator("#stalled-table tbody tr:has-text('all_reduce')").wait_for(timeout=30_000)  # type: ignore[attr-defined]
            assert "#10" in stalled_row.inner_text()
            # Once the incident opens, the header says the job is hung, in red
            # (issue 24), still without a reload.
            page.locator("h1 .job-state.badge-hang:text-is('hung')").wait_for(timeout=60_000)  # type: ignore[attr-defined]
            screenshot(page, "live-job.png")

            out, err = demo.communicate(timeout=150)
            assert demo.returncode == 0, err[-3000:]
            incident = json.loads(out)
            page.goto(f"{coordinator['http']}/incidents/{incident['incident_id']}")  # type: ignore[attr-defined]
            summary = page.locator("#summary").inner_text()  # type: ignore[attr-defined]
            assert "Rank 1" in summary and "all_reduce #10" in summary, summary
            stalled = page.locator("#stalled").inner_text()  # type: ignore[attr-defined]
            assert "all_reduce" in stalled and "#10" in stalled, stalled
            assert page.locator('#lagging .rank-card[data-rank="1"]').count() == 1  # type: ignore[attr-defined]
            screenshot(page, "live-incident.png")
            assert session.foreign_requests(coordinator["http"]) == []
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
