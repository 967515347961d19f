"""Every sentence the report prints: summaries and finding details.

Kept apart from the decisions so that the words can change without touching
what is decided, and so that one place says how ranks, groups and
collectives are named.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from hangwatch.analyzer.graph import cycle_sides
from hangwatch.analyzer.groups import GroupMeta
from hangwatch.analyzer.matching import Mismatch
from hangwatch.analyzer.report import StalledCollective
from hangwatch.analyzer.scope import Scope
from hangwatch.analyzer.streams import HeadOp
from hangwatch.analyzer.text import UNNAMED_DESCS, plural
from hangwatch.analyzer.timing import CLOCKS_MEASURED, CLOCKS_ONE_HOST, Arrival
from hangwatch.analyzer.waits import Unmatched, Wait

from hangwatch.formats import TriggerKind
from hangwatch.rankspec import format_ranks

# ---------- names ----------


def gname(groups: dict[str, GroupMeta], g: str) -> str:
    """'0 (default_pg)'; an unnamed group by its members: '1 (ranks 2,3)'."""
    meta = groups.get(g)
    if meta is None:
        return g
    if meta.desc not in UNNAMED_DESCS:
        return f"{g} ({meta.desc})"
    return f"{g} (ranks {format_ranks(meta.ranks)})" if meta.ranks else g


def coll_name(sc: StalledCollective | None) -> str:
    if sc is None:
        return "?"
    return f"{sc.op or 'collective'} #{sc.seq}"


def ranks_word(ranks: list[int]) -> str:
    return f"Rank {ranks[0]}" if len(ranks) == 1 else f"Ranks {format_ranks(ranks)}"


def ranks_lower(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


def where(groups: dict[str, GroupMeta], w: Wait) -> str:
    """Where a wait is: 'all_reduce #42 in group 0 (default_pg)'."""
    return f"{w.op or w.kind} #{w.seq} in group {gname(groups, w.group)}"


# ---------- summaries ----------


def mismatch_summary(
    groups: dict[str, GroupMeta], m: Mismatch, lagging: list[int], sc: StalledCollective
) -> str:
    return (
        f"{ranks_word(lagging)} {'disagrees' if len(lagging) == 1 else 'disagree'} with "
        f"the rest of group {gname(groups, m.group)} at {coll_name(sc)}: {m.kind.replace('-', ' ')}."
    )


def hang_summary(
    groups: dict[str, GroupMeta],
    *,
    roots: list[int],
    cycles: list[list[int]],
    best: Wait,
    sc: StalledCollective,
    deadlock_groups: list[str],
    targeted: list[Wait],
    no_dump: set[int] | frozenset[int] = frozenset(),
) -> str:
    """The hang verdict's sentence.

    `roots` are the blamed ranks, `deadlock_groups` the groups of the
    cross-group-deadlock findings, `targeted` every wait that waits on someone,
    `no_dump` the ranks without a readable dump: of those the sentence says
    only that (their dumps prove nothing), never that they never entered.
    """
    g = gname(groups, best.group)
    if cycles:
        c = cycles[0]
        gs = deadlock_groups
        odd = sorted(set(c) & set(roots))
        if gs and len(odd) < len(c):
            rest = sorted(set(c) - set(odd))
            both = sorted({grp for grp, _ in cycle_sides(c, targeted)})
            return (
                f"Cross-group deadlock: {ranks_lower(odd)} entered groups "
                f"{' and '.join(gname(groups, x) for x in both)} in a different order than "
                f"{ranks_lower(rest)}, which wait in {sc.op or 'collective'} #{sc.seq} "
                f"in group {g} for {'it' if len(odd) == 1 else 'them'}."
            )
        return (
            f"Cross-group deadlock: ranks {format_ranks(c)} wait on each other in different groups "
            f"(entered in opposite orders), e.g. {sc.op or 'collective'} #{sc.seq} in group {g}."
            if gs
            else f"Ranks {format_ranks(c)} wait on each other in a cycle."
        )
    blamed = sorted(best.targets & set(roots))
    proven = [r for r in blamed if r not in no_dump]
    unseen = [r for r in blamed if r in no_dump]
    others = sorted(set(roots) - set(blamed))
    verb = "never entered" if best.kind == "collective" else "never posted the peer op for"
    what = f"{sc.op or best.op or 'collective'} #{best.seq} in group {g}"
    waiters = sorted(best.waiters)
    are = "is" if len(waiters) == 1 else "are"
    if proven:
        nodump = f" (no dump from {ranks_lower(unseen)})" if unseen else ""
        s = f"{ranks_word(proven)} {verb} {what}{nodump}; {ranks_lower(waiters)} {are} waiting in it."
    else:
        s = f"No dump from {ranks_lower(unseen)}, which {ranks_lower(waiters)} {are} waiting on in {what}."
    if others:
        lag = [r for r in others if r not in no_dump]
        nd = [r for r in others if r in no_dump]
        parts = ([format_ranks(lag)] if lag else []) + (
            [f"no dump from {format_ranks(nd)}"] if nd else []
        )
        s = s[:-1] + f" (also lagging: {'; '.join(parts)})."
    behind = set().union(*(w.waiters for w in targeted)) - set(best.waiters) - set(roots)
    if behind:
        s = (
            s[:-1]
            + f"; {plural(len(behind), 'other rank')} {'is' if len(behind) == 1 else 'are'} blocked behind it."
        )
    return s


def unknown_summary(unknown_groups: list[str]) -> str:
    return (
        "FR cannot tell: every member entered every collective it recorded, and "
        f"the recorder of group(s) {', '.join(unknown_groups)} does not record "
        "completion, so a collective stuck after everyone entered it looks the same "
        "as a finished one; see the per-rank stacks and GPU state."
    )


def membership_unknown_summary(scope: Scope, groups_unknown: list[str]) -> str:
    blocked = scope.progress.table["coll_blocked"].dropna()
    g = groups_unknown[0]
    sub = blocked.loc[blocked.index.get_level_values("group") == g]
    ranks = sorted({int(r) for r in sub.index.get_level_values("rank")})
    more = (
        f" (and {plural(len(groups_unknown) - 1, 'other group')})"
        if len(groups_unknown) > 1
        else ""
    )
    return (
        f"FR cannot tell: {ranks_lower(ranks)} {'is' if len(ranks) == 1 else 'are'} in an "
        f"unfinished {scope.op_at(g, int(sub.min())) or 'collective'} #{int(sub.min())} of group {gname(scope.groups, g)}{more}, whose "
        "membership is unknown (no pg_config ranks, no bundle metadata, no --world-size): "
        "whether its other members entered it is not in the dumps; pass --world-size or "
        "analyze the whole bundle."
    )


def nothing_dumped_summary(missing: list[int]) -> str:
    who = f" (expected from {ranks_lower(missing)})" if missing else ""
    return (
        f"FR cannot tell: no rank's dump was loaded{who}, so nothing is known of where the "
        "job is; see the stacks, or analyse a directory that holds the dumps."
    )


def outside_selection_summary(outside: list[Wait]) -> str:
    waiters = sorted(set().union(*(w.waiters for w in outside)))
    others = sorted(set().union(*(w.targets for w in outside)))
    kinds = sorted({"send/recv" if w.kind == "p2p" else "collectives" for w in outside})
    return (
        f"FR cannot tell: {ranks_lower(waiters)} {'has' if len(waiters) == 1 else 'have'} "
        f"unfinished {' and '.join(kinds)} with {ranks_lower(others)}, whose dumps are not "
        "selected (--selected-ranks): whether they are waiting on those ranks is not in the "
        "selected dumps; analyse with those ranks too."
    )


def outside_selection(groups: dict[str, GroupMeta], outside: list[Wait]) -> str:
    shown = "; ".join(
        f"{format_ranks(sorted(w.waiters))} with {format_ranks(sorted(w.targets))} at {where(groups, w)}"
        for w in outside[:6]
    )
    more = f" and {len(outside) - 6} more" if len(outside) > 6 else ""
    return f"unfinished work with ranks whose dumps are not selected: {shown}{more}"


def no_culprit_summary(blocked_any: bool, crashed: bool = False) -> str:
    # After a crash nothing "stalled": the survivors' dumps are what is read.
    if blocked_any:
        return (
            ("In the survivors' dumps, " if crashed else "A stall was reported; ")
            + "every collective in flight has been entered by all of its members, so FR "
            "cannot say which rank is slow inside it; see the per-rank stacks."
        )
    return (
        ("In the survivors' dumps, " if crashed else "A stall was reported, but ")
        + "the flight recorder shows no rank waiting on a lagging rank: the culprit is not "
        "visible in FR; see the per-rank stacks."
    )


def late_summary(groups: dict[str, GroupMeta], a: Arrival) -> str:
    on_time = [r for r in a.entered_ns if r not in a.late]
    return (
        f"{ranks_word(a.late)} entered {a.op} #{a.seq} in group {gname(groups, a.group)} "
        f"{a.lateness_s:.1f}s after {ranks_lower(sorted(on_time))}; every member entered it and "
        "none finished it: the others waited for "
        + ("it" if len(a.late) == 1 else "them")
        + (
            f", past their {a.timeout_s:g}s timeout."
            if a.timeout_s is not None and a.lateness_s >= a.timeout_s
            else "."
        )
    )


def late_arrival(a: Arrival) -> str:
    first = min(a.entered_ns.values())
    times = ", ".join(
        f"rank {r} +{(t - first) / 1e9:.3f}s" for r, t in sorted(a.entered_ns.items())
    )
    return (
        f"entered {a.lateness_s:.3f}s after the others ({times}); "
        + _clock_words(a)
        + (f"; timeout {a.timeout_s:g}s" if a.timeout_s is not None else "")
    )


def below_fr_summary(groups: dict[str, GroupMeta], a: Arrival) -> str:
    return (
        f"Every member entered {a.op} #{a.seq} in group {gname(groups, a.group)} and none "
        "finished it"
        + (
            f" ({a.unfinished_s:.1f}s after the last one entered, as the dumps show)"
            if a.unfinished_s is not None
            else ""
        )
        + ": no rank is behind in FR; the fault is below it (network, GPU). See the per-rank "
        "stacks and GPU state."
    )


def entered_none_finished(a: Arrival) -> str:
    spread = (max(a.entered_ns.values()) - min(a.entered_ns.values())) / 1e9
    return (
        f"all {len(a.entered_ns)} members entered within {spread:.3f}s; "
        + (
            f"still unfinished {a.unfinished_s:.1f}s after the last entered; "
            if a.unfinished_s is not None
            else ""
        )
        + _clock_words(a)
    )


def _clock_words(a: Arrival) -> str:
    if a.clocks == CLOCKS_ONE_HOST:
        return "one host's clock"
    if a.clocks == CLOCKS_MEASURED:
        return f"hosts' clocks put on the coordinator's by the agents' offsets, within {a.clock_error_s:.3f}s"
    return (
        f"clocks of different or unknown hosts, not measured against each other: "
        f"assumed within {a.clock_error_s:g}s"
    )


def crash_head(trigger: Mapping[str, Any]) -> str | None:
    """A crash incident's opening (who died, how, the exception), from the
    trigger incident.json records; None for every other incident. It comes
    first: the survivors' verdict follows it, so one story names the cause."""
    if trigger.get("kind") != TriggerKind.CRASH:
        return None
    rank = trigger.get("rank")
    who = f"Rank {rank}" if type(rank) is int and rank >= 0 else "A rank"
    how = _printable(trigger.get("how"), 120) or "process gone"
    exc = _printable(trigger.get("exception"), 300)
    return f"{who} crashed ({how})" + (f": {exc}" if exc else "")


def _printable(value: object, limit: int) -> str:
    """The first line of an agent-reported text, control characters out, capped:
    it came from the crashed process and is shown in terminals and pages."""
    text = str(value or "").strip()
    first = text.splitlines()[0] if text else ""
    return "".join(c for c in first if c.isprintable())[:limit].strip()


def healthy_summary(blocked_any: bool) -> str:
    return (
        "FR shows no stalled collective: every collective in flight has been entered by all "
        "of its members and nothing is unmatched."
        if blocked_any
        else "FR shows no stalled collective: every rank has completed everything it enqueued."
    )


# ---------- finding details ----------

GLOO_P2P_BLIND_SPOT = "gloo records no send/recv in the flight recorder: a p2p deadlock leaves dumps that look healthy."
BUFFER_WRAPPED = (
    "these ranks' FR ring buffers wrapped; entries that fell out are not evidence of anything "
    "(progress is read from pg_status and the newest entries)"
)


def unwaited_missing(missing: list[int]) -> str:
    return f"no dump from {ranks_word(missing)}; nobody with a dump is waiting on them"


def unblamed_missing(missing: list[int]) -> str:
    return (
        f"no dump from {ranks_lower(missing)} (absent or unreadable); not blamed: "
        "the ranks with dumps explain the stall, and nothing is known of these"
    )


def no_collective_in_flight(gloo: bool) -> str:
    return (
        "No collective is in flight that a member has not entered. This happens when the job "
        "hangs outside collectives (a compute hang, a data-loader or I/O stall, a deadlock "
        "between Python threads) or in point-to-point traffic"
        + (", which gloo does not record in the flight recorder at all" if gloo else "")
        + ". The per-rank stacks show where each rank is."
    )


def membership_unknown(groups: dict[str, GroupMeta], g: str, ranks: list[int]) -> str:
    return (
        f"membership unknown: group {gname(groups, g)} names no members (no pg_config ranks, "
        f"no bundle metadata, no --world-size); only the dumps of {ranks_lower(ranks)} show it, "
        "and its other members, and whether they entered, are not known"
    )


def completion_unknown(unknown_groups: list[str]) -> str:
    return (
        f"group(s) {', '.join(unknown_groups)} are recorded by torch's "
        "FlightRecorderHook on a backend whose completion it does not record "
        "(entries are 'retired' when the call returns): hangwatch counts a "
        "collective as finished once every member entered it"
    )


def cross_group_deadlock(
    groups: dict[str, GroupMeta], cycle: list[int], cycle_groups: list[str], waits: list[Wait]
) -> str:
    c = set(cycle)
    parts = [
        f"rank {r} waits in {gname(groups, w.group)} #{w.seq} on {format_ranks(w.targets & c)}"
        for w in waits
        for r in sorted(w.waiters & c)
        if w.targets & c
    ]
    return (
        f"ranks {format_ranks(cycle)} wait on each other across groups {', '.join(cycle_groups)} "
        f"(collectives entered in different orders): " + "; ".join(parts[:8])
    )


def not_dumped_root(r: int, state: str, n_wait: int, at: str) -> str:
    return f"rank {r} could not be dumped (process state: {state}); {plural(n_wait, 'rank')} wait on it at {at}"


def missing_root(r: int, n_wait: int, at: str) -> str:
    return f"no dump from rank {r}; {plural(n_wait, 'rank')} wait on it at {at}"


def outside_collective_root(r: int, at: str, *, completion_known: bool) -> str:
    return (
        f"rank {r} finished every collective it enqueued and never entered {at}; "
        if completion_known
        # Completion is not recorded there: say only what is known.
        else f"rank {r} is in no collective its peers have not all entered, "
        f"and never entered {at}; "
    ) + "it is stuck outside any collective (compute, I/O, Python); see its stacks"


def head_where(groups: dict[str, GroupMeta], h: HeadOp) -> str:
    """Where a rank's oldest unfinished op is: 'all_gather #7 in group 42 (TP)'."""
    return f"{h.op or h.kind} #{h.seq} in group {gname(groups, h.group)}"


def stuck_inside_op_root(r: int, head: str, n_wait: int, at: str) -> str:
    return (
        f"rank {r} has not finished {head}, its oldest unfinished op, which all its peers "
        f"entered; {plural(n_wait, 'rank')} wait on its side of {at}, queued behind it: "
        f"it is stuck inside that op (GPU, network); see its GPU state and stacks"
    )


def not_entered_root(r: int, n_wait: int, at: str) -> str:
    return (
        f"rank {r} never entered {at}, where {plural(n_wait, 'rank')} wait; "
        f"its own older work has not finished although all its peers entered it"
    )


_P2P_PEERS = re.compile(r"(?P<a>\d+)\s*(?P<arrow>->|<-)\s*(?P<b>\d+)")


def p2p_op(groups: dict[str, GroupMeta], name: str, group: str) -> str:
    """A p2p op's name with its ranks made plain: torch names them in the
    group's own numbering ('nccl:send 0->1' in group 42 of ranks 1,9 is
    global 1->9)."""
    meta = groups.get(group)
    members = sorted(meta.ranks) if meta else []
    m = _P2P_PEERS.search(name)
    if m is None or (members and members == list(range(len(members)))):
        return name  # no peers named, or the group's numbering is the global one
    a, b = int(m["a"]), int(m["b"])
    if a < len(members) and b < len(members):
        return f"{name} (group ranks; global {members[a]}{m['arrow']}{members[b]})"
    return f"{name} (group ranks)"


def p2p_unmatched(
    groups: dict[str, GroupMeta], peer: int, items: Sequence[Unmatched], *, dumped: bool
) -> str:
    shown = "; ".join(
        f"{p2p_op(groups, u.name, u.group)} #{u.seq} in group {u.group}, posted by rank {u.waiter}"
        for u in items[:6]
    )
    more = f" and {len(items) - 6} more" if len(items) > 6 else ""
    nodump = "" if dumped else " (no dump from it)"
    return f"rank {peer}{nodump} has not posted the peer side of: {shown}{more}"
