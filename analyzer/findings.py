"""The findings of a diagnosis, each step's as its own list; the report holds them in order.

Which kind of finding a rank gets is decided here; the words are wording's.
"""

from __future__ import annotations

from hangwatch.analyzer import wording
from hangwatch.analyzer.matching import Mismatch
from hangwatch.analyzer.progress import done_mask
from hangwatch.analyzer.report import Finding
from hangwatch.analyzer.report import FindingKind as K
from hangwatch.analyzer.scope import Scope
from hangwatch.analyzer.streams import HeadOp
from hangwatch.analyzer.verdict import wait_key
from hangwatch.analyzer.waits import Unmatched, Wait

_FROZEN_STATES = ("stopped", "tracing-stop", "frozen")


def mismatch_findings(mismatches: list[Mismatch]) -> list[Finding]:
    return [
        Finding(kind=m.kind, ranks=m.odd_ranks, group=m.group, seq=m.seq, detail=m.detail)
        for m in mismatches
    ]


def root_findings(
    scope: Scope,
    blamed: list[int],
    cycles: list[list[int]],
    waits: list[Wait],
    p2p_blocked: set[int],
    *,
    heads: dict[int, HeadOp] | None = None,
) -> list[Finding]:
    """One finding per cycle, then one per blamed rank outside the cycles."""
    out: list[Finding] = []
    in_cycle = {r for c in cycles for r in c}
    for c in cycles:
        gs = sorted({w.group for w in waits if w.waiters & set(c) and w.targets & set(c)})
        out.append(
            Finding(
                kind=K.CROSS_GROUP_DEADLOCK,
                ranks=c,
                group=gs[0] if gs else None,
                detail=wording.cross_group_deadlock(scope.groups, c, gs, waits),
            )
        )
    for r in blamed:
        if r in in_cycle:
            continue
        w0 = min((w for w in waits if r in w.targets), key=lambda w: wait_key(w, blamed))
        at = wording.where(scope.groups, w0)
        n_wait = len(w0.waiters)
        meta = scope.loaded.rank_meta.get(r)
        if r not in scope.dumped:
            if meta is not None and meta.reachable is False:
                state = meta.process_state or "unknown"
                kind = K.FROZEN if state in _FROZEN_STATES else K.AGENT_UNREACHABLE
                detail = wording.not_dumped_root(r, state, n_wait, at)
            else:
                kind, detail = K.MISSING_DUMP, wording.missing_root(r, n_wait, at)
        elif (head := (heads or {}).get(r)) is not None and all(
            w.queued for w in waits if r in w.targets
        ):
            # Everyone waiting on r waits on work r entered, queued behind r's
            # oldest op, which r's peers entered: r is stuck inside that op.
            kind = K.STUCK_INSIDE_OP
            detail = wording.stuck_inside_op_root(
                r, wording.head_where(scope.groups, head), n_wait, at
            )
        elif not (r in p2p_blocked or scope.in_collective(r)):
            kind = K.STUCK_OUTSIDE_COLLECTIVE
            detail = wording.outside_collective_root(
                r, at, completion_known=w0.group not in scope.loaded.completion_unknown_groups
            )
        else:
            kind, detail = K.NOT_ENTERED, wording.not_entered_root(r, n_wait, at)
        out.append(Finding(kind=kind, ranks=[r], group=w0.group, seq=w0.seq, detail=detail))
    return out


def unblamed_missing_findings(scope: Scope, lagging: list[int]) -> list[Finding]:
    """Ranks without a dump that the verdict does not blame: said, so that
    nobody reads their absence from the blame as evidence of their health."""
    ranks = sorted(set(scope.missing) - set(lagging))
    if not ranks:
        return []
    return [Finding(kind=K.MISSING_DUMP, ranks=ranks, detail=wording.unblamed_missing(ranks))]


def no_culprit_findings(scope: Scope, *, blocked_any: bool, incident: bool) -> list[Finding]:
    """What can be said when nobody waits on a rank that is behind."""
    out: list[Finding] = []
    if scope.missing and scope.world_size:
        out.append(
            Finding(
                kind=K.MISSING_DUMP,
                ranks=scope.missing,
                detail=wording.unwaited_missing(scope.missing),
            )
        )
    gloo = scope.loaded.backend == "gloo"
    if not blocked_any and incident:
        out.append(
            Finding(
                kind=K.NO_COLLECTIVE_IN_FLIGHT,
                ranks=[],
                detail=wording.no_collective_in_flight(gloo),
            )
        )
    if gloo:
        out.append(
            Finding(kind=K.GLOO_P2P_BLIND_SPOT, ranks=[], detail=wording.GLOO_P2P_BLIND_SPOT)
        )
    return out


def p2p_findings(scope: Scope, unmatched: list[Unmatched], lagging: set[int]) -> list[Finding]:
    """One finding per peer that left p2p ops unmatched; when there are
    lagging ranks, only for them (the others are blocked behind them)."""
    by_peer: dict[int, list[Unmatched]] = {}
    for u in unmatched:
        if lagging and u.peer not in lagging:
            continue
        by_peer.setdefault(u.peer, []).append(u)
    return [
        Finding(
            kind=K.P2P_UNMATCHED,
            ranks=sorted({peer, *(u.waiter for u in items)}),
            group=items[0].group,
            seq=items[0].seq,
            detail=wording.p2p_unmatched(scope.groups, peer, items, dumped=peer in scope.dumped),
        )
        for peer, items in sorted(by_peer.items())
    ]


def wrap_findings(scope: Scope) -> list[Finding]:
    E = scope.entries
    if not len(E):
        return []
    done = done_mask(E)
    g = E.assign(done=done).groupby("rank").agg(first=("record_id", "min"), anydone=("done", "any"))
    # A tail starts past record 0 by construction: that says nothing
    # about the ring buffer (tail_ranks says where the history went).
    tails = set(scope.loaded.tail_ranks)
    # Columns zipped, not iterrows: a Series per rank cost 0.13 s at 4,096 ranks.
    wrapped = [
        int(r)
        for r, first, anydone in zip(g.index, g["first"], g["anydone"], strict=True)
        if first > 0 and anydone and int(r) not in tails
    ]
    if not wrapped:
        return []
    return [Finding(kind=K.BUFFER_WRAPPED, ranks=wrapped, detail=wording.BUFFER_WRAPPED)]


def exception_findings(scope: Scope) -> list[Finding]:
    """A rank whose threads died of uncaught exceptions (its bundle says so)."""
    out = []
    for r, meta in sorted(scope.loaded.rank_meta.items()):
        if meta.exceptions:
            detail = f"rank {r}: uncaught exception in " + "; ".join(meta.exceptions)
            out.append(Finding(kind=K.THREAD_EXCEPTION, ranks=[r], detail=detail))
    return out


def completion_unknown_findings(scope: Scope) -> list[Finding]:
    unknown = scope.unknown_groups()
    if not unknown:
        return []
    return [
        Finding(kind=K.COMPLETION_UNKNOWN, ranks=[], detail=wording.completion_unknown(unknown))
    ]


def outside_selection_findings(scope: Scope, outside: list[Wait]) -> list[Finding]:
    if not outside:
        return []
    ranks = sorted(set().union(*(w.waiters | w.targets for w in outside)))
    first = outside[0]
    return [
        Finding(
            kind=K.OUTSIDE_SELECTION,
            ranks=ranks,
            group=first.group,
            seq=first.seq,
            detail=wording.outside_selection(scope.groups, outside),
        )
    ]


def membership_unknown_findings(scope: Scope) -> list[Finding]:
    """One finding per group a rank is blocked in whose membership is unknown."""
    out = []
    blocked = scope.progress.table["coll_blocked"].dropna()
    for g in scope.membership_unknown():
        sub = blocked.loc[blocked.index.get_level_values("group") == g]
        ranks = sorted({int(r) for r in sub.index.get_level_values("rank")})
        out.append(
            Finding(
                kind=K.MEMBERSHIP_UNKNOWN,
                ranks=ranks,
                group=g,
                seq=int(sub.min()),
                detail=wording.membership_unknown(scope.groups, g, ranks),
            )
        )
    return out
