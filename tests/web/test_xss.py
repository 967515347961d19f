"""Everything from dumps is hostile: it must reach the browser as text, never as markup."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest
from hangwatch.analyzer.report import WaitEdge
from hangwatch.server.web import waitgraph
from hangwatch.server.web.offline import render_incident_html
from markupsafe import escape

from tests.web import harness
from tests.web.conftest import JOB, STUCK, WORLD, Served

pytestmark = pytest.mark.timeout(30)

RAW = [harness.HOSTILE_FRAME, harness.HOSTILE_FILE, harness.HOSTILE_DESC, "<img src=x"]


def _assert_inert(html: str) -> None:
    for raw in RAW:
        assert raw not in html, f"raw hostile text {raw!r} reached the page"
    # The only scripts are our own external file (served pages) or none (offline).
    for tag in re.findall(r"<script\b[^>]*>", html):
        assert tag == '<script src="/static/app.js" defer>', tag
    assert not re.search(r"<img\b", html)


def test_incident_page_shows_hostile_text_escaped(served_hostile: Served) -> None:
    html = served_hostile.client.get(f"/incidents/{served_hostile.incident}").text
    _assert_inert(html)
    assert str(escape(harness.HOSTILE_FRAME)) in html  # &lt;script&gt;alert(1)&lt;/script&gt;
    assert str(escape(harness.HOSTILE_FILE)) in html  # &#34;&gt;&lt;img src=x ...
    assert str(escape(harness.HOSTILE_DESC)) in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_job_page_and_lists_escape_group_descs(served_hostile: Served) -> None:
    c = served_hostile.client
    for path in (f"/jobs/{JOB}", "/", "/incidents"):
        html = c.get(path).text
        _assert_inert(html)
    job = c.get(f"/jobs/{JOB}").text
    assert str(escape(harness.HOSTILE_DESC)) in job
    # The JSON the page polls is JSON, served as JSON (never sniffed as HTML).
    r = c.get(f"/api/jobs/{JOB}/ranks")
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert json.loads(r.text)["groups"][0]["desc"] == harness.HOSTILE_DESC


def test_offline_report_escapes_hostile_text() -> None:
    report = harness.hang_report(world=WORLD, stuck=STUCK, hostile=True)
    html = render_incident_html(report, title=f"incident {harness.HOSTILE_FRAME}")
    for raw in RAW:
        assert raw not in html
    assert not re.search(r"<script\b", html)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert str(escape(harness.HOSTILE_FILE)) in html


def test_svg_text_is_escaped_and_well_formed() -> None:
    evil_group = '</text><script>alert("svg")</script><text>'
    edges = [
        WaitEdge(waiter=0, waits_on=1, group=evil_group, seq=3),
        WaitEdge(waiter=2, waits_on=1, group=evil_group, seq=3),
    ]
    svg = str(waitgraph.render_svg(waitgraph.build(edges)))
    assert "<script" not in svg
    root = ET.fromstring(svg)  # parses: nothing broke out of an element
    texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert any(evil_group in t for t in texts)  # shown to the user as text


def test_hostile_job_id_is_escaped_and_linkable(served_hostile: Served) -> None:
    # The gRPC validator allows any printable id without '/', '\\' or '..'.
    evil = '<b>"job?#1 &x'
    harness.feed_job(served_hostile.ctx.registry, job=evil, world=2, stuck=1, ranks_per_agent=2)
    c = served_hostile.client
    home = c.get("/").text
    _assert_inert(home)
    assert "<b>" not in home and str(escape(evil)) in home
    quoted = "%3Cb%3E%22job%3F%231%20%26x"
    assert f'href="/jobs/{quoted}"' in home
    page = c.get(f"/jobs/{quoted}")
    assert page.status_code == 200 and str(escape(evil)) in page.text
    assert c.get(f"/api/jobs/{quoted}/ranks").json()["job"] == evil
