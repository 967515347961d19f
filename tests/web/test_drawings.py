"""The server-drawn SVGs: waits-for graph and per-group timeline."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from hangwatch.analyzer.report import CollectiveRef, RankEvidence, Report, WaitEdge
from hangwatch.server.web import timeline, waitgraph

from tests.web import harness

pytestmark = pytest.mark.timeout(30)
SVG = "{http://www.w3.org/2000/svg}"


def _svg(markup: object) -> ET.Element:
    return ET.fromstring(str(markup))


def test_many_waiters_on_one_rank_collapse_into_one_node() -> None:
    edges = [WaitEdge(waiter=r, waits_on=517, group="0", seq=42) for r in range(1024) if r != 517]
    g = waitgraph.build(edges)
    assert g.roots == [517]
    assert len(g.nodes) == 2 and len(g.edges) == 1
    waiters = next(n for n in g.nodes if n.kind == "waiter")
    assert len(waiters.ranks) == 1023
    assert waiters.label == "ranks 0-516,518-1023 (1023)"
    root = _svg(waitgraph.render_svg(g))
    rects = root.findall(f".//{SVG}g[@class='wf-node wf-root']/{SVG}rect")
    assert len(rects) == 1
    # The root sits right of its waiters: arrows point at the culprit.
    root_node = next(n for n in g.nodes if n.kind == "root")
    assert root_node.x > waiters.x


def test_cross_group_deadlock_is_a_cycle_not_a_root() -> None:
    edges = [
        WaitEdge(waiter=0, waits_on=1, group="1", seq=5),
        WaitEdge(waiter=1, waits_on=0, group="2", seq=7),
        WaitEdge(waiter=2, waits_on=0, group="0", seq=9),
        WaitEdge(waiter=3, waits_on=1, group="0", seq=9),
    ]
    g = waitgraph.build(edges)
    assert g.roots == []
    assert g.cycle_ranks == [0, 1]
    svg = _svg(waitgraph.render_svg(g))
    cycle_edges = svg.findall(f".//{SVG}g[@class='wf-edge wf-edge-cycle']")
    assert len(cycle_edges) == 2
    # Both directions of the two-way pair are drawn as distinct curves.
    paths = [e.find(f"{SVG}path").get("d") for e in cycle_edges]  # type: ignore[union-attr]
    assert paths[0] != paths[1]
    labels = {t.text for t in svg.iter(f"{SVG}text")}
    assert "group 1 #5" in labels and "group 2 #7" in labels


def test_chain_layers_and_self_edges() -> None:
    edges = [
        WaitEdge(waiter=0, waits_on=1, group="0", seq=1),
        WaitEdge(waiter=1, waits_on=2, group="1", seq=1),
        WaitEdge(waiter=2, waits_on=2, group="1", seq=1),  # ignored: not a wait on anyone
    ]
    g = waitgraph.build(edges)
    layer = {n.ranks[0]: n.layer for n in g.nodes}
    assert layer == {2: 0, 1: 1, 0: 2}
    assert g.roots == [2]
    assert waitgraph.build([]).nodes == []
    assert str(waitgraph.render_svg(waitgraph.build([]))) == ""


def test_big_graphs_are_capped_and_unlabelled() -> None:
    # 200 distinct chains: far beyond what a picture can show.
    edges = [WaitEdge(waiter=2 * i, waits_on=2 * i + 1, group="0", seq=i) for i in range(200)]
    g = waitgraph.build(edges)
    assert len(g.nodes) == waitgraph.MAX_NODES
    assert g.dropped_nodes == 400 - waitgraph.MAX_NODES
    svg = _svg(waitgraph.render_svg(g))
    edge_texts = svg.findall(f".//{SVG}g[@class='wf-edge']/{SVG}text")
    assert edge_texts == []  # too many edges to label inline
    assert all(
        e.find(f"{SVG}title") is not None
        for e in svg.iter(f"{SVG}g")
        if "wf-edge" in (e.get("class") or "")
    )


def test_timeline_lanes_group_identical_ranks() -> None:
    report = harness.hang_report(world=64, stuck=37)
    # A report without per-group positions (older ones): drawn from the evidence.
    [tl] = timeline.build(report).charts
    assert tl.group == "0" and tl.group_desc == "default_pg"
    assert (tl.seq_lo, tl.seq_hi) == (41, 42)
    assert [ln.ranks for ln in tl.lanes] == [(37,), tuple(r for r in range(64) if r != 37)]
    assert tl.lanes[0].lagging and tl.lanes[0].entered <= tl.lanes[0].completed
    svg = _svg(tl.svg)
    lanes = svg.findall(f"{SVG}g")
    assert lanes[0].get("class") == "tl-lane tl-lagging"
    assert lanes[0].get("data-ranks") == "37"
    # Ranks in flight show their entered collective as a ring at #42, right of #41.
    ring = lanes[1].find(f"{SVG}circle[@class='tl-entered']")
    dot = lanes[1].find(f"{SVG}circle[@class='tl-completed']")
    assert ring is not None and dot is not None
    assert float(ring.get("cx", "0")) > float(dot.get("cx", "0"))


def test_timeline_one_chart_per_group_stalled_first() -> None:
    ev = {
        0: RankEvidence(
            rank=0,
            last_completed=CollectiveRef(group="3", seq=8, op="all_reduce", state="completed"),
            last_entered=CollectiveRef(group="10", seq=2, op="broadcast", state="started"),
        ),
        1: RankEvidence(
            rank=1,
            last_completed=CollectiveRef(group="10", seq=1, op="broadcast", state="completed"),
        ),
    }
    from hangwatch.analyzer.report import StalledCollective

    report = Report(
        verdict="hang",
        summary="s",
        stalled_collective=StalledCollective(
            group="10", group_desc="tp", group_ranks=[0, 1], seq=2, op="broadcast"
        ),
        evidence=ev,
    )
    names = [t.group for t in timeline.build(report).charts]
    assert names == ["10", "3"]
    assert timeline.build(Report(verdict="healthy", summary="ok")).charts == []
