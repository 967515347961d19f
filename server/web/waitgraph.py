"""The waits-for graph of an incident, drawn as inline SVG on the server.

A hang at scale is usually "1,023 ranks wait on one". Drawing 1,023 boxes says
nothing, so ranks that wait on exactly the same peers (and that nobody waits
on) are merged into one node. Terminal nodes are the culprits: a rank that
waits on nobody, or a cycle (cross-group deadlock) that nothing leaves.

Every string drawn comes from a dump and is untrusted: it goes through
`markupsafe.escape`, and the result is `Markup` so templates do not escape twice.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hangwatch.analyzer.graph import rank_terminals
from hangwatch.analyzer.report import Report, WaitEdge
from markupsafe import Markup, escape

from hangwatch.rankspec import format_ranks

BOX_W = 170
BOX_H = 36
COL_GAP = 150
ROW_GAP = 26
PAD = 20
MAX_NODES = 80  # beyond this the picture is unreadable anyway; the table below lists all
MAX_LABELS_PER_EDGE = 3
# Beyond this many edges, labels drawn on the lines only overlap each other:
# they move to each edge's tooltip and the table under the graph.
MAX_LABELLED_EDGES = 12
# Edge labels are set in an 11 px monospace font (app.css: .wf-label), so
# their width is known here, whatever fonts the viewer has (0.6 em a character).
LABEL_CHAR_W = 6.8
LABEL_H = 18  # a label with its line under it: the spacing between stacked labels
STRIP_PAD = 22  # clear space between a label and the boxes on either side
LOOP_W = 44  # how far an edge between two boxes of one column bends out


@dataclass(kw_only=True)
class Node:
    id: int
    ranks: list[int]
    kind: str = "waiter"  # "root" | "cycle" | "waiter"
    layer: int = 0
    x: float = 0.0
    y: float = 0.0

    @property
    def label(self) -> str:
        if len(self.ranks) == 1:
            return f"rank {self.ranks[0]}"
        return f"ranks {format_ranks(self.ranks, limit=2)} ({len(self.ranks)})"


@dataclass(kw_only=True)
class Edge:
    src: int
    dst: int
    waits: set[tuple[str, int]] = field(default_factory=set)  # (group, seq)
    # Where it is drawn (set by the layout): the SVG path, and the label's
    # centre and width; label_w 0 means the label is only in the tooltip.
    path: str = ""
    label_x: float = 0.0
    label_y: float = 0.0
    label_w: float = 0.0

    def label(self) -> str:
        items = sorted(self.waits, key=lambda gs: (gs[0], gs[1]))
        text = ", ".join(f"group {g} #{s}" for g, s in items[:MAX_LABELS_PER_EDGE])
        if len(items) > MAX_LABELS_PER_EDGE:
            text += f" +{len(items) - MAX_LABELS_PER_EDGE}"
        return text


@dataclass(kw_only=True)
class WaitGraph:
    nodes: list[Node]
    edges: list[Edge]
    dropped_nodes: int = 0
    box_w: float = BOX_W
    width: float = 0.0
    height: float = 0.0

    @property
    def roots(self) -> list[int]:
        return sorted(r for n in self.nodes if n.kind == "root" for r in n.ranks)

    @property
    def cycle_ranks(self) -> list[int]:
        return sorted(r for n in self.nodes if n.kind == "cycle" for r in n.ranks)


def build(
    source: Report | Sequence[WaitEdge],
    *,
    roots: Iterable[int] | None = None,
    cycles: Iterable[Iterable[int]] | None = None,
) -> WaitGraph:
    """Merge equivalent waiters, mark the culprits, and lay the graph out.

    The culprits are the analyzer's: a Report's `roots` and `cycles` (found
    on the whole graph, not on the capped edges drawn here), or the ones
    passed in. Bare edges, or a report written before it carried them, are
    classified by the analyzer's own graph code; nothing is derived here.
    """
    edges: Sequence[WaitEdge]
    if isinstance(source, Report):
        edges = source.waits_for
        if roots is None and cycles is None and (source.roots or source.cycles):
            roots, cycles = source.roots, source.cycles
    else:
        edges = source
    if roots is None and cycles is None:
        roots, cycles = rank_terminals((e.waiter, e.waits_on) for e in edges)
    root_set = set(roots or ())
    cycle_set = {r for c in cycles or () for r in c}

    out_edges: dict[int, set[tuple[int, str, int]]] = defaultdict(set)
    waited_on: set[int] = set()
    ranks: set[int] = set()
    for e in edges:
        if e.waiter == e.waits_on:
            continue
        out_edges[e.waiter].add((e.waits_on, e.group, e.seq))
        waited_on.add(e.waits_on)
        ranks.update((e.waiter, e.waits_on))
    if not ranks:
        return WaitGraph(nodes=[], edges=[])

    # Ranks nobody waits on, with identical out-edges, become one node; a
    # culprit always stands alone.
    node_of: dict[int, int] = {}
    nodes: list[Node] = []
    leaves_by_sig: dict[frozenset[tuple[int, str, int]], list[int]] = defaultdict(list)
    for r in sorted(ranks):
        if r in waited_on or r in root_set or r in cycle_set:
            node_of[r] = len(nodes)
            kind = "cycle" if r in cycle_set else "root" if r in root_set else "waiter"
            nodes.append(Node(id=len(nodes), ranks=[r], kind=kind))
        else:
            leaves_by_sig[frozenset(out_edges[r])].append(r)
    for group in sorted(leaves_by_sig.values(), key=lambda rs: rs[0]):
        nid = len(nodes)
        nodes.append(Node(id=nid, ranks=group))
        for r in group:
            node_of[r] = nid

    by_pair: dict[tuple[int, int], Edge] = {}
    for waiter, outs in out_edges.items():
        for target, group_name, seq in outs:
            key = (node_of[waiter], node_of[target])
            by_pair.setdefault(key, Edge(src=key[0], dst=key[1])).waits.add((group_name, seq))
    graph_edges = sorted(by_pair.values(), key=lambda e: (e.src, e.dst))

    pred: dict[int, set[int]] = defaultdict(set)
    for ge in graph_edges:
        pred[ge.dst].add(ge.src)
    terminal = [n.id for n in nodes if n.kind != "waiter"]

    # Layer = hops to the nearest terminal; drawn right to left so arrows
    # point towards the culprit on the right.
    layer = {v: 0 for v in terminal}
    queue = deque(terminal)
    while queue:
        v = queue.popleft()
        for u in pred[v]:
            if u not in layer:
                layer[u] = layer[v] + 1
                queue.append(u)
    # A rank whose way to a culprit fell past the analyzer's edge cap sits with the culprits.
    for n in nodes:
        n.layer = layer.get(n.id, 0)

    dropped = 0
    if len(nodes) > MAX_NODES:
        keep = sorted(nodes, key=lambda n: (n.layer, n.ranks[0]))[:MAX_NODES]
        kept = {n.id for n in keep}
        dropped = len(nodes) - len(kept)
        graph_edges = [e for e in graph_edges if e.src in kept and e.dst in kept]
        nodes = [n for n in nodes if n.id in kept]

    # Boxes as wide as the longest label (about 7 px a character at 12 px).
    box_w = max(BOX_W, 7.0 * max(len(n.label) for n in nodes) + 24)
    max_layer = max(n.layer for n in nodes)
    columns: dict[int, list[Node]] = defaultdict(list)
    for n in nodes:
        columns[n.layer].append(n)
    # Culprits in rank order; every other column ordered by where its targets
    # sit (barycentre), which keeps edges from crossing needlessly.
    slot: dict[int, float] = {}
    kept_succ: dict[int, list[int]] = defaultdict(list)
    for ge in graph_edges:
        kept_succ[ge.src].append(ge.dst)
    for lyr in sorted(columns):
        col = columns[lyr]

        def centre(n: Node) -> tuple[float, int]:
            ys = [slot[d] for d in kept_succ[n.id] if d in slot]
            return (sum(ys) / len(ys) if ys else math.inf, n.ranks[0])

        col.sort(key=centre if lyr > 0 else (lambda n: (0.0, n.ranks[0])))
        for i, n in enumerate(col):
            slot[n.id] = float(i)
            n.y = PAD + 24 + i * (BOX_H + ROW_GAP)
    width, height = _route(nodes, graph_edges, box_w, max_layer)
    return WaitGraph(
        nodes=nodes,
        edges=graph_edges,
        dropped_nodes=dropped,
        box_w=box_w,
        width=width,
        height=height,
    )


def _route(nodes: list[Node], edges: list[Edge], bw: float, max_layer: int) -> tuple[float, float]:
    """Place the columns and draw every edge through its label; returns (width, height).

    Each label sits in the strip between two columns (the one beside its
    target, on the side its waiter is; right of the column for an edge
    within one), never over a box. A strip is as wide as its longest label,
    and the labels in one strip are stacked apart, so none overlaps another;
    each edge runs through its own label.
    """
    ncols = max_layer + 1
    col = {n.id: max_layer - n.layer for n in nodes}
    by_id = {n.id: n for n in nodes}
    labelled = len(edges) <= MAX_LABELLED_EDGES
    strip = [col[e.dst] if col[e.src] < col[e.dst] else col[e.dst] + 1 for e in edges]
    widths = [0.0] + [float(COL_GAP)] * (ncols - 1) + [0.0]  # strip k is left of column k
    loop = [col[e.src] == col[e.dst] for e in edges]
    for e, k, lp in zip(edges, strip, loop, strict=True):
        e.label_w = LABEL_CHAR_W * len(e.label()) + 8 if labelled else 0.0
        need = (LOOP_W + e.label_w) if lp else e.label_w
        widths[k] = max(widths[k], need + 2 * STRIP_PAD)
    col_x = [PAD + sum(widths[1 : c + 1]) + c * bw for c in range(ncols)]
    for n in nodes:
        n.x = col_x[col[n.id]]

    def mid_y(n: Node) -> float:
        return n.y + BOX_H / 2

    wanted: dict[int, list[tuple[float, float, Edge]]] = defaultdict(list)
    for e, k, lp in zip(edges, strip, loop, strict=True):
        a, b = by_id[e.src], by_id[e.dst]
        left = col_x[k - 1] + bw
        # A loop's label starts where the loop turns; any other is centred in its strip.
        e.label_x = left + LOOP_W + e.label_w / 2 if lp else left + widths[k] / 2
        ax, bx = a.x + bw / 2, b.x + bw / 2
        t = 0.5 if abs(bx - ax) < 1 else min(1.0, max(0.0, (e.label_x - ax) / (bx - ax)))
        wanted[k].append((mid_y(a) + t * (mid_y(b) - mid_y(a)), mid_y(a), e))
    top = PAD + 24 + LABEL_H
    for items in wanted.values():
        prev = -math.inf
        for want, _, e in sorted(items, key=lambda it: (it[0], it[1])):
            e.label_y = max(want, top, prev + LABEL_H) if labelled else want
            prev = e.label_y

    for e in edges:
        a, b = by_id[e.src], by_id[e.dst]
        cx, ty, half = e.label_x, e.label_y, e.label_w / 2
        sx = a.x + bw if a.x + bw / 2 < cx else a.x
        ex = b.x + bw if b.x + bw / 2 < cx else b.x
        sy, ey = mid_y(a), mid_y(b)
        if sx < cx and ex < cx:  # both in the column left of the strip: loop out and back
            p = cx - half - 2
            m = (sx + p) / 2
            e.path = (
                f"M {_f(sx)} {_f(sy)} C {_f(m)} {_f(sy)} {_f(m)} {_f(ty)} {_f(p)} {_f(ty)} "
                f"C {_f(m)} {_f(ty)} {_f(m)} {_f(ey)} {_f(ex)} {_f(ey)}"
            )
            continue
        p, q = (cx - half, cx + half) if sx < cx else (cx + half, cx - half)
        m1, m2 = (sx + p) / 2, (q + ex) / 2
        e.path = (
            f"M {_f(sx)} {_f(sy)} C {_f(m1)} {_f(sy)} {_f(m1)} {_f(ty)} {_f(p)} {_f(ty)} "
            f"L {_f(q)} {_f(ty)} C {_f(m2)} {_f(ty)} {_f(m2)} {_f(ey)} {_f(ex)} {_f(ey)}"
        )
    width = col_x[-1] + bw + widths[ncols] + PAD
    bottom = max([n.y + BOX_H for n in nodes] + [e.label_y + LABEL_H / 2 for e in edges])
    return width, bottom + PAD + 10


def _f(v: float) -> str:
    return f"{v:.1f}"


def render_svg(graph: WaitGraph) -> Markup:
    """The graph as an `<svg>` element; presentation via classes defined in app.css."""
    if not graph.nodes:
        return Markup("")
    bw = graph.box_w
    width, height = graph.width, graph.height
    by_id = {n.id: n for n in graph.nodes}
    labelled = len(graph.edges) <= MAX_LABELLED_EDGES
    parts: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="waitgraph" role="img" '
        f'width="{_f(width)}" height="{_f(height)}" viewBox="0 0 {_f(width)} {_f(height)}" '
        f'aria-label="waits-for graph: {len(graph.nodes)} nodes, {len(graph.edges)} edges">',
        "<defs>"
        '<marker id="wf-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" '
        'class="wf-arrowhead"/></marker></defs>',
        f'<text class="wf-caption" x="{PAD}" y="{PAD}">waiting ranks &#8594; the ranks they wait on'
        + ("" if labelled else " (hover an edge for its group and sequence number)")
        + "</text>",
    ]
    labels: list[str] = []
    for e in graph.edges:
        a, b = by_id[e.src], by_id[e.dst]
        cls = "wf-edge wf-edge-cycle" if a.kind == "cycle" and b.kind == "cycle" else "wf-edge"
        label = escape(e.label())
        title = f"<title>{escape(a.label)} waits on {escape(b.label)}: {label}</title>"
        parts.append(
            f'<g class="{cls}">{title}<path d="{e.path}" marker-end="url(#wf-arrow)"/></g>'
        )
        if labelled:
            # Just above its own line, and drawn after the boxes: nothing hides a label.
            labels.append(
                f'<g class="wf-label">{title}<text x="{_f(e.label_x)}" y="{_f(e.label_y - 4)}" '
                f'text-anchor="middle">{label}</text></g>'
            )
    for n in graph.nodes:
        tip = f"{n.label}: {n.kind}; ranks {format_ranks(n.ranks, limit=0)}"
        parts.append(
            f'<g class="wf-node wf-{n.kind}" data-ranks="{escape(format_ranks(n.ranks, limit=0))}">'
            f"<title>{escape(tip)}</title>"
            f'<rect x="{_f(n.x)}" y="{_f(n.y)}" width="{_f(bw)}" height="{BOX_H}" rx="6"/>'
            f'<text x="{_f(n.x + bw / 2)}" y="{_f(n.y + BOX_H / 2 + 5)}" '
            f'text-anchor="middle">{escape(n.label)}</text></g>'
        )
    parts += labels
    parts.append("</svg>")
    return Markup("".join(parts))
