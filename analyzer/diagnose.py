"""From loaded dumps to a verdict: who everyone is waiting for, and on what.

One pass, each step in its own module and handed what it needs:

1. `scope`: the entries, groups and ranks in scope, and their progress;
2. `waits`: which ranks are blocked where, and whom each waits on;
3. `graph`: the waits-for graph's roots and cycles, and who is blamed in a cycle;
4. `matching`: ranks that disagree on a collective's op, sizes or dtypes;
5. `verdict`: the decision (see there for what each verdict means);
6. `findings`, `wording`, `evidence`: what the report says and shows.
"""

from __future__ import annotations

import pandas as pd
from hangwatch.analyzer import findings as fnd
from hangwatch.analyzer import wording
from hangwatch.analyzer.crash import with_crash
from hangwatch.analyzer.evidence import group_progress, rank_evidence, stalled_for
from hangwatch.analyzer.graph import blame_in_cycles, edges, wait_terminals
from hangwatch.analyzer.groups import GroupMeta, build_groups
from hangwatch.analyzer.loader import LoadedDumps
from hangwatch.analyzer.matching import find_mismatches
from hangwatch.analyzer.reading import gc_paused
from hangwatch.analyzer.report import Finding, FindingKind, Report, StalledCollective
from hangwatch.analyzer.scope import build_scope
from hangwatch.analyzer.selection import known_roots, outside_waits
from hangwatch.analyzer.stackdiag import with_stack_diagnosis
from hangwatch.analyzer.streams import heads, pending_ops, stream_waits
from hangwatch.analyzer.timing import entered_none_finished
from hangwatch.analyzer.verdict import decide
from hangwatch.analyzer.waits import Wait, collective_waits, p2p_waits


def analyze(
    loaded: LoadedDumps, *, world_size: int | None = None, group: str | None = None
) -> Report:
    """Diagnose loaded dumps. Pure: reads `loaded`, returns a Report."""
    ws = world_size if world_size is not None else loaded.world_size
    groups = loaded.groups
    if ws != loaded.world_size:
        groups = build_groups(
            entries=loaded.entries,
            pg_status=loaded.pg_status,
            pg_config=loaded.pg_config,
            rank_meta=loaded.rank_meta,
            world_size=ws,
            complete_ranks=loaded.complete_ranks,
        )
    E = loaded.entries
    if group is not None:
        E = E.loc[(E["group"] == group).to_numpy()]  # categorical: compares codes
        groups = {group: groups[group]} if group in groups else {}
    # Collections during the analysis walked the young object columns and
    # tables it builds again and again: 0.4 of 1.1 s at 4,096 ranks.
    with gc_paused():
        return _diagnose(loaded, E, groups, ws, group)


def _diagnose(
    loaded: LoadedDumps,
    entries: pd.DataFrame,
    groups: dict[str, GroupMeta],
    world_size: int | None,
    only_group: str | None,
) -> Report:
    scope = build_scope(loaded, entries, groups, world_size, only_group)
    p2p = p2p_waits(scope)
    waits = collective_waits(scope) + p2p.waits
    pending = pending_ops(scope)
    head_ops = heads(pending)
    waits += stream_waits(scope, pending, scope.dumped - _waiting(waits))
    outside = outside_waits(scope, pending)
    targeted = [w for w in waits if w.targets]
    waits, not_roots = _without_weak_blame(waits)
    single_roots, cycles = wait_terminals(waits)
    single_roots = [
        r for r in known_roots(single_roots, waits, outside, head_ops) if r not in not_roots
    ]
    roots = sorted(set(single_roots) | {r for c in cycles for r in c})
    blamed = blame_in_cycles(roots, cycles, waits)
    mismatches = find_mismatches(entries, groups)
    d = decide(scope, waits, blamed, mismatches, p2p.blocked, outside, entered_none_finished(scope))
    crash = wording.crash_head(loaded.incident.trigger) if loaded.incident else None

    found: list[Finding] = fnd.mismatch_findings(mismatches)
    stalled: StalledCollective | None = None
    if d.mismatch is not None:
        m = d.mismatch
        stalled = stalled_for(scope, m.group, m.seq, "collective", None, m.odd_ranks)
        summary = wording.mismatch_summary(groups, m, d.lagging, stalled)
    elif d.arrival is not None:
        a = d.arrival
        stalled = stalled_for(scope, a.group, a.seq, "collective", None)
        if a.late:
            summary = wording.late_summary(groups, a)
            found.append(
                Finding(
                    kind=FindingKind.LATE_ARRIVAL,
                    ranks=a.late,
                    group=a.group,
                    seq=a.seq,
                    detail=wording.late_arrival(a),
                )
            )
        else:
            summary = wording.below_fr_summary(groups, a)
            found.append(
                Finding(
                    kind=FindingKind.ENTERED_NONE_FINISHED,
                    ranks=sorted(a.entered_ns),
                    group=a.group,
                    seq=a.seq,
                    detail=wording.entered_none_finished(a),
                )
            )
    elif d.best is not None:
        best = d.best
        stalled = stalled_for(scope, best.group, best.seq, best.kind, best)
        roots_found = fnd.root_findings(scope, blamed, cycles, waits, p2p.blocked, heads=head_ops)
        found += roots_found
        found += fnd.unblamed_missing_findings(scope, d.lagging)
        summary = wording.hang_summary(
            groups,
            roots=blamed,
            cycles=cycles,
            best=best,
            sc=stalled,
            deadlock_groups=sorted(
                {
                    f.group
                    for f in roots_found
                    if f.kind == FindingKind.CROSS_GROUP_DEADLOCK and f.group
                }
            ),
            targeted=targeted,
            no_dump=set(blamed) - scope.dumped,
        )
    else:
        found += fnd.no_culprit_findings(scope, blocked_any=d.blocked_any, incident=d.incident)
        if d.verdict == "unknown" and not scope.dumped:
            summary = wording.nothing_dumped_summary(scope.missing)
        elif d.verdict == "unknown" and outside:
            summary = wording.outside_selection_summary(outside)
        elif d.verdict == "unknown" and scope.membership_unknown():
            summary = wording.membership_unknown_summary(scope, scope.membership_unknown())
        elif d.verdict == "unknown":
            summary = wording.unknown_summary(scope.unknown_groups())
        elif d.verdict == "no-culprit-visible":
            summary = wording.no_culprit_summary(d.blocked_any, crashed=crash is not None)
        else:
            summary = wording.healthy_summary(d.blocked_any)
    found += fnd.p2p_findings(scope, p2p.unmatched, set(d.lagging))
    found += fnd.wrap_findings(scope)
    found += fnd.completion_unknown_findings(scope)
    found += fnd.membership_unknown_findings(scope)
    found += fnd.outside_selection_findings(scope, outside)
    found += fnd.exception_findings(scope)
    report = Report(
        verdict=d.verdict,
        summary=summary,
        stalled_collective=stalled,
        lagging_ranks=sorted(d.lagging),
        findings=found,
        ranks_loaded=sorted(scope.dumped),
        ranks_missing=scope.missing,
        tail_ranks=list(loaded.tail_ranks),
        errors=list(loaded.errors),
        groups=group_progress(scope, waits),
        waits_for=edges(waits),
        roots=single_roots,
        cycles=cycles,
        evidence=rank_evidence(scope, sorted(d.lagging), waits, stalled),
    )
    report = with_stack_diagnosis(report, loaded.rank_meta)  # where FR sees no culprit
    if crash is not None and loaded.incident is not None:
        report = with_crash(report, loaded.incident.trigger, crash)
    return report


def _without_weak_blame(waits: list[Wait]) -> tuple[list[Wait], set[int]]:
    """The waits to blame from, and ranks that are not roots although nobody
    they wait on is in that graph.

    A missing dump proves nothing: waits on ranks without a dump are dropped
    when ranks with dumps explain the stall by themselves (a root that waits
    on nobody, or a cycle). A rank whose only wait is on a rank without a
    dump is then not blamed either: it is blocked on that rank, whose
    absence is reported, not on something of its own.
    """
    weak = [w for w in waits if w.on_missing]
    if not weak:
        return waits, set()
    strong = [w for w in waits if not w.on_missing]
    on_missing = set().union(*(w.waiters for w in weak))
    roots, cycles = wait_terminals(strong)
    if cycles or set(roots) - on_missing:
        return strong, on_missing
    return waits, set()


def _waiting(waits: list[Wait]) -> set[int]:
    return {r for w in waits if w.targets for r in w.waiters}
