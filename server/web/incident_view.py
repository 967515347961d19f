"""What the incident page shows, computed once from a `Report`.

The served page and the offline HTML file render the same template from this
one view model, so the two can never disagree about what an incident says.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hangwatch.analyzer.report import Finding, GroupProgress, RankEvidence, Report
from hangwatch.analyzer.text import finding_roles, group_sort_key
from hangwatch.server.web import timeline, waitgraph
from markupsafe import Markup

from hangwatch.stacktext import ReadingOrder, reading_order

if TYPE_CHECKING:
    from hangwatch.server.incidents.store import IncidentRow

VERDICT_TEXT = {
    "hang": "Hang",
    "mismatch": "Collective mismatch",
    "crash": "Crash: a rank died and the job stopped with it",
    "healthy": "Healthy",
    "no-culprit-visible": "No culprit visible in the flight recorder",
    "unknown": "Unknown: the flight recorder cannot tell (see the findings)",
}

# A verdict the ranks' stacks made where FR showed no culprit (Report.basis).
STACKS_BASIS = ", from the Python stacks (the flight recorder shows no culprit)"


@dataclass(frozen=True, kw_only=True)
class IncidentInfo:
    """The store's facts about an incident that the report itself does not carry."""

    id: str
    job: str
    created_unix: float | None = None
    status: str = ""
    reason: str = ""
    ranks_unreachable: dict[int, str] = field(default_factory=dict)
    detection_latency_s: float | None = None
    # The lifecycle after the verdict (store.IncidentRow): resolved or ended.
    closed_unix: float | None = None
    stall_s: float | None = None
    late_ranks: list[int] = field(default_factory=list)
    close_reason: str = ""
    trigger: str = ""
    # One line per action taken on it (server.action_records), oldest first.
    actions: list[str] = field(default_factory=list)


def with_lifecycle(info: IncidentInfo, row: IncidentRow) -> IncidentInfo:
    """`info` with what the lifecycle recorded (when and why it closed)."""
    return dataclasses.replace(
        info,
        closed_unix=row.closed_at,
        stall_s=row.stall_s,
        late_ranks=list(row.late_ranks),
        close_reason=row.close_reason or "",
        trigger=row.trigger,
        actions=[f"{a.kind} ({a.status}): {a.summary}" for a in row.actions],
    )


@dataclass(frozen=True, kw_only=True)
class RankCard:
    rank: int
    evidence: RankEvidence | None
    stack_source: str
    fr_source: str
    gpu_items: list[tuple[str, str]]
    # The rank's stacks as read: the thread that matters first (the CLI's choice),
    # its innermost frame of the job's own code marked, hangwatch's own threads
    # folded (the dump-handler thread can be 100 lines of imports).
    stacks: ReadingOrder | None = None


@dataclass(frozen=True, kw_only=True)
class StackGroup:
    ranks: list[int]
    text: str
    sources: list[str]


@dataclass(frozen=True, kw_only=True)
class Unreachable:
    rank: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class IncidentView:
    report: Report
    info: IncidentInfo | None
    verdict_label: str
    lagging: list[RankCard]
    other_stacks: list[StackGroup]
    unreachable: list[Unreachable]
    graph: waitgraph.WaitGraph
    graph_svg: Markup
    timelines: timeline.Timelines
    edge_rows: list[tuple[list[int], list[int], str]]  # waiting, waits on, "group g #seq"
    findings: list[FindingRow]
    evidence_rows: list[RankEvidence]
    groups: list[GroupProgress]  # in numeric order
    # Reachability is known only for a live incident (the coordinator asked
    # every rank); a post-mortem knows only which ranks left no dump.
    live: bool


@dataclass(frozen=True, kw_only=True)
class FindingRow:
    finding: Finding
    roles: list[tuple[str, list[int]]]  # text.finding_roles: blamed vs waiting


def _gpu_items(gpu: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not gpu:
        return []
    return [(str(k), str(v)) for k, v in sorted(gpu.items(), key=lambda kv: str(kv[0]))]


def _card(rank: int, ev: RankEvidence | None) -> RankCard:
    if ev is None:
        return RankCard(
            rank=rank, evidence=None, stack_source="none", fr_source="none", gpu_items=[]
        )
    return RankCard(
        rank=rank,
        evidence=ev,
        stack_source=ev.sources.get("stacks", "unknown" if ev.stacks else "none"),
        fr_source=ev.sources.get("fr", "unknown"),
        gpu_items=_gpu_items(ev.gpu),
        stacks=reading_order(ev.stacks) if ev.stacks else None,
    )


def build(report: Report, info: IncidentInfo | None = None) -> IncidentView:
    lagging_set = set(report.lagging_ranks)
    # Ranks with no stacks or that the graph/report names as roots also deserve
    # a card when the analyzer named no laggard (e.g. a p2p deadlock under gloo).
    focus = sorted(lagging_set)
    graph = waitgraph.build(report)
    if not focus:
        focus = graph.roots
    lagging = [_card(r, report.evidence.get(r)) for r in focus]

    # Everyone else's stacks, grouped by identical text: 1,000 ranks parked in
    # the same all_reduce are one block, the odd one out its own.
    groups: dict[str, list[int]] = defaultdict(list)
    srcs: dict[str, set[str]] = defaultdict(set)
    for rank, ev in sorted(report.evidence.items()):
        if rank in focus or not ev.stacks:
            continue
        groups[ev.stacks].append(rank)
        srcs[ev.stacks].add(ev.sources.get("stacks", "unknown"))
    other = sorted(
        (StackGroup(ranks=rs, text=t, sources=sorted(srcs[t])) for t, rs in groups.items()),
        key=lambda g: (len(g.ranks), g.ranks[0]),
    )

    unreachable: dict[int, str] = {}
    if info is not None:
        unreachable.update(info.ranks_unreachable)
    for rank, ev in report.evidence.items():
        if not ev.reachable and rank not in unreachable:
            unreachable[rank] = f"no dump could be taken (process {ev.process_state or 'unknown'})"
    for rank in report.ranks_missing:
        unreachable.setdefault(rank, "no dump in the bundle")

    by_id = {n.id: n for n in graph.nodes}
    return IncidentView(
        report=report,
        info=info,
        verdict_label=VERDICT_TEXT.get(report.verdict, report.verdict)
        + (STACKS_BASIS if report.basis == "stacks" else ""),
        lagging=lagging,
        other_stacks=other,
        unreachable=[Unreachable(rank=r, reason=unreachable[r]) for r in sorted(unreachable)],
        graph=graph,
        graph_svg=waitgraph.render_svg(graph),
        timelines=timeline.build(report),
        edge_rows=[(by_id[e.src].ranks, by_id[e.dst].ranks, e.label()) for e in graph.edges],
        findings=[
            FindingRow(finding=f, roles=finding_roles(f.kind, f.ranks, report.lagging_ranks))
            for f in report.findings
        ],
        evidence_rows=[report.evidence[r] for r in sorted(report.evidence)],
        groups=sorted(report.groups, key=lambda g: group_sort_key(g.group)),
        live=info is not None,
    )
