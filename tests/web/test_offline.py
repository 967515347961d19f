"""The offline HTML report: one self-contained file with the whole incident view."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hangwatch.analyzer.report import Report
from hangwatch.server.web.offline import render_incident_html
from markupsafe import escape

from tests.web import harness

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
NVRX = REPO.parent / "shared" / "conformance" / "nvrx"


def _assert_self_contained(html: str) -> None:
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)
    assert not re.search(r"<link\b", html, re.I)  # no external stylesheet
    assert not re.search(r"<script\b", html, re.I)  # nothing to run
    assert not re.search(r"@import|url\(\s*['\"]?(?:https?:)?//", html, re.I)
    assert "<style>" in html and ".heatmap" in html  # the stylesheet is inlined
    assert "default-src 'none'" in html  # and the file forbids fetching anything


def test_offline_report_is_self_contained_and_complete(tmp_path: Path) -> None:
    report = harness.hang_report(world=16, stuck=5)
    html = render_incident_html(report, title="hangwatch: job 7 hang")
    _assert_self_contained(html)
    assert "<title>hangwatch: job 7 hang</title>" in html
    assert "Rank 5 never entered all_reduce #42 of group 0" in html  # verdict sentence
    assert 'id="stalled"' in html and "gloo:all_reduce" in html and "#42" in html
    assert "Lagging ranks: 5" in html and 'id="rank-5"' in html
    assert "slow_data_loader" in html and "source: py-spy" in html
    assert 'class="waitgraph"' in html and "wf-node wf-root" in html
    assert 'class="timeline"' in html
    assert "not-entered" in html
    out = tmp_path / "report.html"
    out.write_text(html, encoding="utf-8")  # what `hangwatch analyze --html` writes
    assert out.stat().st_size < 200_000


def test_offline_report_with_store_row_shows_unreachable_ranks(tmp_path: Path) -> None:
    ctx = harness.make_context(tmp_path)
    try:
        report = harness.hang_report(world=8, stuck=2)
        incident_id = harness.insert_incident(ctx, job="j", report=report)
        ctx.store.set_dump_outcome(
            incident_id, ranks_dumped=range(7), ranks_unreachable={7: "process stopped (SIGSTOP)"}
        )
        row = ctx.store.get_incident(incident_id)
        assert row is not None
        html = render_incident_html(report, title="t", incident=row)
    finally:
        ctx.store.close()
    _assert_self_contained(html)
    assert incident_id in html
    assert "process stopped (SIGSTOP)" in html
    assert "13.5 s" in html  # detection latency from the store


def test_offline_report_of_a_report_without_culprit() -> None:
    report = Report(
        verdict="no-culprit-visible",
        summary="Every rank's flight recorder looks healthy; gloo records no send/recv.",
        ranks_loaded=[0, 1],
    )
    html = render_incident_html(report, title="p2p")
    _assert_self_contained(html)
    assert "No culprit visible in the flight recorder" in html
    assert "The analyzer found no stalled collective." in html
    assert "No wait edges" in html


def test_offline_report_of_real_nccl_dumps() -> None:
    """The real analyzer on real 16-GPU NCCL dumps, rendered offline."""
    if not NVRX.is_dir():
        pytest.skip(f"conformance dumps absent: {NVRX} (shared/conformance/nvrx) not found")
    from hangwatch.analyzer import analyze_path

    incidents = sorted(p for p in NVRX.iterdir() if p.is_dir())
    assert incidents, f"no incident folders in {NVRX}"
    report = analyze_path(incidents[0])
    html = render_incident_html(report, title=incidents[0].name)
    _assert_self_contained(html)
    assert str(escape(report.summary)) in html
    for rank in report.lagging_ranks:
        assert f'id="rank-{rank}"' in html


@pytest.mark.timeout(30)
def test_a_member_without_a_dump_is_no_dump_not_never_entered() -> None:
    """The frozen rank (SIGSTOP) left no dump: the page must not say it never entered."""
    from hangwatch.analyzer import analyze_path
    from helpers import GOLDEN_DIR

    report = analyze_path(GOLDEN_DIR / "frozen", world_size=4)
    assert report.stalled_collective is not None and 1 in report.ranks_missing
    html = render_incident_html(report, title="t")
    assert re.search(r"<th>No dump</th><td[^>]*>1</td>", html), html[:2000]
    assert re.search(r"<th>Never entered</th><td[^>]*>none</td>", html)
