"""Where each rank stands in each process group, drawn as inline SVG.

Sequence numbers only compare within one group, so there is one chart per
group, read from the group's own per-rank positions (`GroupProgress.positions`:
each member's last completed and last entered collective *in that group*). A
rank's evidence names only its newest collective of any group, so charts
drawn from it alone could say a rank entered nothing in a group where it is
in fact waiting. Ranks at the same position share one lane: at 1,024 ranks a
healthy majority is one lane and the laggards stand out as their own.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hangwatch.analyzer.report import GroupProgress, Report, StalledCollective
from hangwatch.analyzer.text import group_desc, group_sort_key
from markupsafe import Markup, escape

from hangwatch.rankspec import format_ranks

LABEL_W = 190
PLOT_W = 720
LANE_H = 30
TOP = 34
PAD = 12
MAX_LANES = 40
# Charts drawn: the stalled group first, then groups where members disagree.
MAX_CHARTS = 12


@dataclass(frozen=True, kw_only=True)
class Lane:
    ranks: tuple[int, ...]
    completed: int  # last completed seq in the group; -1: none known
    entered: int  # last entered seq in the group; -1: none known
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


@dataclass(frozen=True, kw_only=True)
class Timelines:
    charts: list[GroupTimeline]
    # Groups not drawn: every member at one position, or past MAX_CHARTS.
    level_groups: int = 0
    hidden_groups: int = 0


def build(report: Report) -> Timelines:
    sc = report.stalled_collective
    stalled = sc.group if sc else None
    drawn: list[tuple[GroupProgress, list[Lane]]] = []
    level = 0
    for gp in sorted(
        (g for g in report.groups if g.positions),
        key=lambda g: (g.group != stalled, group_sort_key(g.group)),
    ):
        lanes = [
            Lane(
                ranks=tuple(p.ranks),
                completed=p.completed,
                entered=p.enqueued,
                lagging=bool(set(p.ranks) & set(gp.lagging)),
            )
            for p in gp.positions
        ]
        if gp.group != stalled and len(lanes) < 2 and not gp.lagging:
            level += 1
            continue
        drawn.append((gp, lanes))
    if not drawn and not level:
        drawn = _from_evidence(report)
    charts = [_chart(gp, lanes, sc) for gp, lanes in drawn[:MAX_CHARTS]]
    return Timelines(
        charts=charts, level_groups=level, hidden_groups=max(0, len(drawn) - MAX_CHARTS)
    )


def _from_evidence(report: Report) -> list[tuple[GroupProgress, list[Lane]]]:
    """A report written before it carried positions: each rank's newest
    completed and entered collective, in the group each one is in."""
    at: dict[str, dict[int, list[int]]] = defaultdict(dict)
    for rank, ev in report.evidence.items():
        for slot, ref in enumerate((ev.last_completed, ev.last_entered)):
            if ref is not None:
                at[ref.group].setdefault(rank, [-1, -1])[slot] = ref.seq
    known = {g.group: g for g in report.groups}
    lagging = set(report.lagging_ranks)
    sc = report.stalled_collective
    out = []
    for name in sorted(at, key=lambda g: (sc is None or g != sc.group, group_sort_key(g))):
        by_pos: dict[tuple[int, int], list[int]] = defaultdict(list)
        for rank, (c, e) in sorted(at[name].items()):
            by_pos[(c, max(c, e))].append(rank)
        desc = sc.group_desc if sc is not None and sc.group == name else ""
        gp = known.get(name) or GroupProgress(
            group=name, group_desc=desc, ranks=[], min_completed=-1, max_enqueued=-1
        )
        lanes = [
            Lane(ranks=tuple(rs), completed=c, entered=e, lagging=bool(set(rs) & lagging))
            for (c, e), rs in by_pos.items()
        ]
        out.append((gp, lanes))
    return out


def _chart(gp: GroupProgress, lanes: list[Lane], sc: StalledCollective | None) -> GroupTimeline:
    lanes = sorted(lanes, key=lambda ln: (not ln.lagging, ln.ranks[0]))
    hidden = max(0, len(lanes) - MAX_LANES)
    lanes = lanes[:MAX_LANES]
    seqs = [s for ln in lanes for s in (ln.completed, ln.entered) if s >= 0]
    seqs += [s for s in (gp.min_completed, gp.max_enqueued) if s >= 0]
    lo, hi = (min(seqs), max(seqs)) if seqs else (0, 0)
    stalled = sc if sc is not None and sc.group == gp.group else None
    return GroupTimeline(
        group=gp.group,
        group_desc=group_desc(gp.group_desc),
        lanes=lanes,
        seq_lo=lo,
        seq_hi=hi,
        hidden_lanes=hidden,
        svg=_render(gp.group, lanes, lo, hi, stalled),
    )


def lane_text(ln: Lane) -> str:
    """What a lane says: what its ranks finished and entered in this group."""
    done = f"done #{ln.completed}" if ln.completed >= 0 else "none completed"
    if ln.entered <= ln.completed:
        return f"{done}, nothing entered after" if ln.completed >= 0 else "nothing recorded"
    first = ln.completed + 1 if ln.completed >= 0 else None
    span = f"#{ln.entered}" if first is None or first == ln.entered else f"#{first}-#{ln.entered}"
    return f"{done}; in flight {span}"


def lane_title(who: str, ln: Lane, stalled: StalledCollective | None) -> str:
    """The lane's tooltip: its words, and whether the stalled collective is among those in flight."""
    text = f"{who}: {lane_text(ln)}"
    if stalled is not None and ln.completed < stalled.seq <= ln.entered:
        text += f" (the stalled {stalled.op or 'collective'} #{stalled.seq} among them)"
    elif stalled is not None and ln.entered < stalled.seq:
        text += f" (never entered the stalled {stalled.op or 'collective'} #{stalled.seq})"
    return text


def _render(
    group: str, lanes: list[Lane], lo: int, hi: int, stalled: StalledCollective | None
) -> Markup:
    span = max(1, hi - lo)
    x0 = LABEL_W + 30
    plot = PLOT_W - 380  # room on the right for the lane's words

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
            else (f"ranks {format_ranks(ln.ranks, limit=2)} ({len(ln.ranks)})")
        )
        words = lane_text(ln)
        cls = "tl-lane tl-lagging" if ln.lagging else "tl-lane"
        parts.append(f'<g class="{cls}" data-ranks="{escape(format_ranks(ln.ranks, limit=0))}">')
        parts.append(f"<title>{escape(lane_title(who, ln, stalled))}</title>")
        parts.append(f'<text class="tl-who" x="{PAD}" y="{y + 4:.1f}">{escape(who)}</text>')
        end = ln.completed
        if ln.completed >= 0:
            parts.append(
                f'<line class="tl-done" x1="{x(lo):.1f}" y1="{y:.1f}" x2="{x(ln.completed):.1f}" y2="{y:.1f}"/>'
                f'<circle class="tl-completed" cx="{x(ln.completed):.1f}" cy="{y:.1f}" r="5"/>'
            )
        if ln.entered > ln.completed:
            end = ln.entered
            parts.append(
                f'<circle class="tl-entered" cx="{x(ln.entered):.1f}" cy="{y:.1f}" r="6"/>'
            )
        parts.append(
            f'<text class="tl-label" x="{x(max(end, lo)) + 10:.1f}" y="{y + 4:.1f}">'
            f"{escape(words)}</text>"
        )
        parts.append("</g>")
    parts.append("</svg>")
    return Markup("".join(parts))
