"""The waits-for graph's edge labels, measured in a real browser: none overlaps
another, none is hidden behind a box, none is cut off by the picture's edge.

On the hang zoo's graphs, cross-group deadlock loops included, and on the real
16-rank NCCL incidents (whose 20 edges are more than are labelled: drawn bare).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hangwatch.analyzer import analyze_path
from hangwatch.analyzer.report import Report
from hangwatch.server.web import waitgraph
from hangwatch.server.web.offline import render_incident_html
from helpers import CONFORMANCE_DIR, GOLDEN_DIR

from tests.web.browser import open_browser

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

Box = tuple[float, float, float, float]  # left, top, right, bottom

_MEASURE = """() => {
  const svg = document.querySelector("svg.waitgraph");
  const box = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  return {
    svg: box(svg),
    labels: [...svg.querySelectorAll(".wf-label text")].map((t) => [t.textContent, box(t)]),
    nodes: [...svg.querySelectorAll(".wf-node rect")].map(box),
  };
}"""


def _overlap(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _reports() -> list[tuple[str, Report]]:
    out = []
    for d in sorted(GOLDEN_DIR.iterdir()):
        if (d / "manifest.json").is_file():
            world = json.loads((d / "manifest.json").read_text())["world_size"]
            out.append((d.name, analyze_path(d, world_size=world)))
    for d in sorted(CONFORMANCE_DIR.iterdir()) if CONFORMANCE_DIR.is_dir() else []:
        if d.is_dir():
            out.append((f"nvrx/{d.name}", analyze_path(d)))
    return out


def test_edge_labels_do_not_overlap_in_chromium(tmp_path: Path) -> None:
    if not CONFORMANCE_DIR.is_dir():
        pytest.skip(f"conformance dumps absent: {CONFORMANCE_DIR} not found")
    measured: dict[str, int] = {}
    with open_browser() as b:
        page = b.new_page(javascript=True)
        for name, report in _reports():
            graph = waitgraph.build(report)
            if not graph.edges:
                continue
            path = tmp_path / f"{name.replace('/', '_')}.html"
            path.write_text(render_incident_html(report, title=name), encoding="utf-8")
            page.goto(path.as_uri())  # type: ignore[attr-defined]
            m = page.evaluate(_MEASURE)  # type: ignore[attr-defined]
            labels = [(text, tuple(bx)) for text, bx in m["labels"]]
            nodes = [tuple(bx) for bx in m["nodes"]]
            if len(graph.edges) <= waitgraph.MAX_LABELLED_EDGES:
                assert len(labels) == len(graph.edges), name
            for i, (text, lb) in enumerate(labels):
                assert lb[2] > lb[0] and lb[3] > lb[1], (name, text)  # drawn at all
                s = m["svg"]
                assert s[0] <= lb[0] and lb[2] <= s[2] and s[1] <= lb[1] and lb[3] <= s[3], (
                    name,
                    text,
                    "cut off by the picture's edge",
                )
                for nb in nodes:
                    assert not _overlap(lb, nb), (name, text, "behind a box")
                for other, ob in labels[i + 1 :]:
                    assert not _overlap(lb, ob), (name, text, other)
            measured[name] = len(labels)
    # The real incident was drawn and measured. With stream order its graph has 20
    # edges (each stage's queued collectives wait on its pending p2p), more than
    # can be labelled, so it is drawn without labels and nothing can overlap.
    assert "nvrx/gpu_error_2nd" in measured, measured
    assert measured.get("order", 0) >= 2, measured  # the cross-group deadlock's loops
