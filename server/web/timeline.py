"""Each rank's last collectives, per process group, drawn as inline SVG.

Sequence numbers only compare within one group, so there is one chart per
group. Ranks in the same position (same last completed and last entered
collective in that group) share one lane: at 1,024 ranks a healthy majority is
one lane and the laggards stand out as their own.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hangwatch.analyzer.report import CollectiveRef, Report
from hangwatch.server.web.fmt import rank_ranges
from markupsafe import Markup, escape

LABEL_W = 190
PLOT_W = 720
LANE_H = 30
TOP = 34
PAD = 12
MAX_LANES = 40


@dataclass(frozen=True, kw_only=True)
class Lane:
    ranks: tuple[int, ...]
    completed: CollectiveRef | None
    entered: CollectiveRef | None
    lagging: bool


@dataclass(frozen=True, kw_only=True)
class GroupTimeline:
    group: str
    group_desc: str
    lanes: list[Lane]
    seq_lo: int
    seq_hi: int
    hidden_lanes: int
    svg: Markup


def _sig(ref: CollectiveRef | None) -> tuple[int, str, str] | None:
    return None if ref is None else (ref.seq, ref.op, ref.state)


def build(report: Report) -> list[GroupTimeline]:
    per_group: dict[str, dict[int, list[CollectiveRef | None]]] = defaultdict(dict)
    for rank, ev in report.evidence.items():
        for slot, ref in enumerate((ev.last_completed, ev.last_entered)):
            if ref is None:
                continue
            per_group[ref.group].setdefault(rank, [None, None])[slot] = ref
    progress = {g.group: g for g in report.groups}
    lagging = set(report.lagging_ranks)
    stalled = report.stalled_collective.group if report.stalled_collective else None

    def order(name: str) -> tuple[int, int, str]:
        return (0 if name == stalled else 1, 0 if name.isdigit() else 1, name.zfill(12))

    out: list[GroupTimeline] = []
    for name in sorted(per_group, key=order):
        ranks = per_group[name]
        lanes_by: dict[tuple[object, object], list[int]] = defaultdict(list)
        refs: dict[tuple[object, object], tuple[CollectiveRef | None, CollectiveRef | None]] = {}
        for rank, (comp, ent) in sorted(ranks.items()):
            if ent is not None and comp is not None and ent.seq <= comp.seq:
                ent = None  # its last entered is the one it completed: nothing in flight
            key = (_sig(comp), _sig(ent))
            lanes_by[key].append(rank)
            refs[key] = (comp, ent)
        lanes = [
            Lane(
                ranks=tuple(rs),
                completed=refs[k][0],
                entered=refs[k][1],
                lagging=any(r in lagging for r in rs),
            )
            for k, rs in lanes_by.items()
        ]
        lanes.sort(key=lambda ln: (not ln.lagging, ln.ranks[0]))
        hidden = max(0, len(lanes) - MAX_LANES)
        lanes = lanes[:MAX_LANES]
        seqs = [ref.seq for ln in lanes for ref in (ln.completed, ln.entered) if ref is not None]
        gp = progress.get(name)
        if gp is not None:
            seqs += [s for s in (gp.min_completed, gp.max_enqueued) if s >= 0]
        lo, hi = min(seqs), max(seqs)
        sc = report.stalled_collective
        if gp is not None:
            desc = gp.group_desc
        elif sc is not None and sc.group == name:
            desc = sc.group_desc
        else:
            desc = ""
        out.append(
            GroupTimeline(
                group=name,
                group_desc=desc,
                lanes=lanes,
                seq_lo=lo,
                seq_hi=hi,
                hidden_lanes=hidden,
                svg=_render(name, lanes, lo, hi),
            )
        )
    return out


def _render(group: str, lanes: list[Lane], lo: int, hi: int) -> Markup:
    span = max(1, hi - lo)
    x0 = LABEL_W + 30
    plot = PLOT_W - 300  # room on the right for the last label

    def x(seq: int) -> float:
        return x0 + (seq - lo) * plot / span

    width = LABEL_W + PLOT_W
    height = TOP + len(lanes) * LANE_H + PAD
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" role="img" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" '
        f'aria-label="last collectives of each rank in group {escape(group)}">',
        f'<text class="tl-axis" x="{x(lo):.1f}" y="16" text-anchor="middle">#{lo}</text>',
    ]
    if hi != lo:
        parts.append(
            f'<text class="tl-axis" x="{x(hi):.1f}" y="16" text-anchor="middle">#{hi}</text>'
        )
    parts.append(f'<line class="tl-axisline" x1="{x(lo):.1f}" y1="22" x2="{x(hi):.1f}" y2="22"/>')
    for i, ln in enumerate(lanes):
        y = TOP + i * LANE_H + LANE_H / 2
        who = (
            f"rank {ln.ranks[0]}"
            if len(ln.ranks) == 1
            else (f"ranks {rank_ranges(ln.ranks, limit=2)} ({len(ln.ranks)})")
        )
        cls = "tl-lane tl-lagging" if ln.lagging else "tl-lane"
        parts.append(f'<g class="{cls}" data-ranks="{escape(rank_ranges(ln.ranks))}">')
        parts.append(f'<text class="tl-who" x="{PAD}" y="{y + 4:.1f}">{escape(who)}</text>')
        if ln.completed is not None:
            c = ln.completed
            parts.append(
                f'<line class="tl-done" x1="{x(lo):.1f}" y1="{y:.1f}" x2="{x(c.seq):.1f}" y2="{y:.1f}"/>'
                f'<circle class="tl-completed" cx="{x(c.seq):.1f}" cy="{y:.1f}" r="5">'
                f"<title>{escape(f'{who}: last completed {c.op} #{c.seq} ({c.state})')}</title></circle>"
            )
        if ln.entered is not None:
            e = ln.entered
            parts.append(
                f'<circle class="tl-entered" cx="{x(e.seq):.1f}" cy="{y:.1f}" r="6">'
                f"<title>{escape(f'{who}: last entered {e.op} #{e.seq} ({e.state})')}</title></circle>"
                f'<text class="tl-label" x="{x(e.seq) + 10:.1f}" y="{y + 4:.1f}">'
                f"{escape(f'{e.op} #{e.seq} {e.state}')}</text>"
            )
        elif ln.completed is not None:
            c = ln.completed
            parts.append(
                f'<text class="tl-label" x="{x(c.seq) + 10:.1f}" y="{y + 4:.1f}">'
                f"{escape(f'{c.op} #{c.seq} done, nothing entered after')}</text>"
            )
        parts.append("</g>")
    parts.append("</svg>")
    return Markup("".join(parts))
