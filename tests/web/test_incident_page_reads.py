"""The incident page (served and offline) reads right on real dumps: the hang
zoo's gloo dumps and the real 16-rank NCCL incident.

Each group's chart agrees with the stalled-collective panel, no raw FR
sentinel or torch placeholder reaches the page, groups are in numeric
order, reachability is claimed only for live incidents.
"""

from __future__ import annotations

import re

import pytest
from hangwatch.analyzer import analyze_path
from hangwatch.analyzer.report import Report
from hangwatch.analyzer.text import group_sort_key
from hangwatch.server.web import incident_view, timeline
from hangwatch.server.web.offline import render_incident_html
from helpers import CONFORMANCE_DIR, GOLDEN_DIR, conformance_incident, golden_report

pytestmark = pytest.mark.timeout(120)

GOLDEN = sorted(p.name for p in GOLDEN_DIR.iterdir() if (p / "manifest.json").is_file())
GPU_ERROR = CONFORMANCE_DIR / "gpu_error_2nd"


def _nvrx() -> Report:
    return analyze_path(conformance_incident(GPU_ERROR.name))


def _assert_charts_agree_with_the_stalled_panel(report: Report) -> None:
    sc = report.stalled_collective
    assert sc is not None
    charts = timeline.build(report).charts
    assert charts and charts[0].group == sc.group  # the stalled group first
    lane_of = {r: ln for ln in charts[0].lanes for r in ln.ranks}
    for r in sc.entered_ranks:
        ln = lane_of[r]
        assert ln.completed < sc.seq <= ln.entered, (r, ln)
        assert "nothing entered after" not in timeline.lane_text(ln)
    for r in set(sc.missing_ranks) & set(lane_of):
        assert lane_of[r].entered < sc.seq, (r, lane_of[r])
    assert set(sc.missing_ranks) & set(report.lagging_ranks) <= {
        r for ln in charts[0].lanes if ln.lagging for r in ln.ranks
    }


def test_nccl_group_charts_agree_with_the_stalled_panel() -> None:
    report = _nvrx()
    _assert_charts_agree_with_the_stalled_panel(report)
    [g72] = [c for c in timeline.build(report).charts if c.group == "72"]
    words = {ln.ranks: timeline.lane_text(ln) for ln in g72.lanes}
    assert words[(9, 14)] == "done #44787; in flight #44788-#44790"
    assert words[(8, 10, 11, 12, 13, 15)] == "done #44790; in flight #44791-#44796"


@pytest.mark.parametrize("name", ["skip", "subgroup", "two", "compute", "mismatch"])
def test_gloo_group_charts_agree_with_the_stalled_panel(name: str) -> None:
    _assert_charts_agree_with_the_stalled_panel(golden_report(name))


def _visible(html: str) -> str:
    """The page's text and attribute values, without the inlined stylesheet."""
    return re.sub(r"<style>.*?</style>", "", html, flags=re.S)


@pytest.mark.parametrize("name", GOLDEN)
def test_no_sentinel_or_placeholder_reaches_the_page(name: str) -> None:
    html = _visible(render_incident_html(golden_report(name), title=name))
    assert "undefined" not in html
    assert not re.search(r"#-1\b|>-1<", html)


def test_nccl_page_groups_in_numeric_order_and_no_sentinel() -> None:
    report = _nvrx()
    html = _visible(render_incident_html(report, title="nvrx"))
    assert "undefined" not in html and not re.search(r"#-1\b|>-1<", html)
    table = html[html.index("<h3>Progress per group</h3>") :]
    shown = re.findall(r'<tr><td class="mono">([^<]+)</td>', table)
    assert len(shown) == len(report.groups)
    assert shown == sorted(shown, key=group_sort_key) and shown[:3] == ["0", "1", "2"]
    assert '<span class="role role-blamed">blamed</span>' in html
    assert '<span class="role role-waiting">waiting</span>' in html
    assert "#44787 (op not in any dump)" in html
    assert "all_to_all #44790" in html  # rank 8's last completed, named from the dumps


def test_post_mortem_claims_no_reachability() -> None:
    report = golden_report("skip")
    assert not report.ranks_missing
    html = render_incident_html(report, title="post-mortem")
    assert "Unreachable ranks" not in html and "Every rank answered" not in html
    # A rank without a dump is still listed, as just that.
    frozen = render_incident_html(golden_report("frozen"), title="post-mortem")
    assert "Ranks without a dump" in frozen and "Unreachable ranks" not in frozen


def test_live_incident_says_every_rank_answered() -> None:
    report = golden_report("skip")
    view = incident_view.build(report, incident_view.IncidentInfo(id="i1", job="j"))
    assert view.live and view.unreachable == []
