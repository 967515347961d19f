"""The incident page of an FR-blind hang, in chromium: the verdict says it comes from the
stacks, and every rank's main thread is listed with the odd ones marked.

The report is the real analyzer's, on the zoo's real gloo p2p bundle with the
peer stacks the agent takes (tests/analyzer/stacks, captured from real ranks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hangwatch.analyzer import load_dumps
from hangwatch.analyzer.diagnose import analyze
from hangwatch.server.web.app import create_app

from hangwatch import formats
from tests.web import harness
from tests.web.browser import open_browser

pytestmark = pytest.mark.timeout(60)

TESTS = Path(__file__).resolve().parents[1]


def _p2p_bundle(dest: Path) -> Path:
    shutil.copytree(TESTS / "golden" / "p2p", dest)
    for r in range(4):
        meta_path = dest / f"rank_{r}" / formats.META_FILE
        meta = json.loads(meta_path.read_text())
        meta[formats.PEER_STACKS_KEY] = (
            TESTS / "analyzer" / "stacks" / f"p2p-rank{r}.txt"
        ).read_text()
        meta_path.write_text(json.dumps(meta))
    return dest


def test_the_page_of_a_p2p_deadlock_found_in_the_stacks(tmp_path: Path) -> None:
    bundle = _p2p_bundle(tmp_path / "bundle")
    report = analyze(load_dumps(bundle))
    ctx = harness.make_context(tmp_path / "data")
    incident_id = harness.insert_incident(ctx, job="zoo-p2p", report=report, bundle_from=bundle)
    try:
        with harness.serve(create_app(ctx)) as base, open_browser() as b:
            page = b.new_page()
            page.goto(f"{base}/incidents/{incident_id}")  # type: ignore[attr-defined]
            label = page.locator(".verdict-label").text_content().strip()  # type: ignore[attr-defined]
            assert label == "Hang, from the Python stacks (the flight recorder shows no culprit)"
            summary = page.locator("#summary").inner_text()  # type: ignore[attr-defined]
            assert summary.startswith("From the stacks, not FR"), summary
            assert "ranks 0,1 deadlock in p2p" in summary
            rows = page.locator("#stack-diagnosis tbody tr")  # type: ignore[attr-defined]
            assert rows.count() == 4
            odd = page.locator("#stack-diagnosis tbody tr.bad")  # type: ignore[attr-defined]
            assert [odd.nth(i).get_attribute("data-rank") for i in range(odd.count())] == ["0", "1"]
            assert {rows.nth(i).get_attribute("data-state") for i in range(4)} == {"p2p"}
            waits = page.locator("#stack-diagnosis tbody td:nth-child(4)").all_text_contents()  # type: ignore[attr-defined]
            assert waits == ["1", "0", "0", "1"]
            assert page.locator("#rank-0").is_visible()  # type: ignore[attr-defined]
            # Rank 0's stacks box, as read (issue 24): it opens with the thread
            # blocked in torch.distributed, the innermost frame of the job's own
            # code is marked, and hangwatch's helper thread is folded, counted.
            # First, the rank's frame in the job's own code, named on one line.
            where = page.locator("#rank-0 .user-frame-line")  # type: ignore[attr-defined]
            assert where.inner_text() == "In the job's own code: _inject (job.py:268)"
            box = page.locator("#rank-0 pre.stacks").first  # type: ignore[attr-defined]
            shown = box.inner_text().splitlines()
            assert shown[0].startswith("Thread ") and "in recv" in shown[1], shown[:3]
            mark = page.locator("#rank-0 mark.user-frame")  # type: ignore[attr-defined]
            assert mark.count() == 1
            assert mark.inner_text().strip().endswith("line 268 in _inject"), mark.inner_text()
            folded = page.locator("#rank-0 details.helper-threads")  # type: ignore[attr-defined]
            assert folded.locator("summary").inner_text() == "1 hangwatch helper thread"
            assert not folded.locator("pre").is_visible()
            assert b.page_errors == [] and b.console_errors == []
    finally:
        ctx.store.close()
