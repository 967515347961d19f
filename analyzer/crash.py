"""A crash incident's verdict: the first rank to die is the cause, the survivors' errors its consequences.

A rank that dies of an uncaught exception takes the job with it: its peers
block in the next collective until the launcher kills them, or fail with
"Connection closed by peer" or a collective timeout. Read alone, the dumps
show a hang (everybody waits on the dead rank), or nothing at all when the
launcher killed the survivors before anyone dumped them; the thread
exceptions they carry are the consequence, not the cause. The incident's
trigger (`incident.json`, written by the coordinator from the agent's
RANK_CRASHED event) says who died first and of what, so a crash incident's
verdict is `crash`, its lagging rank the one that died, whatever FR shows;
what FR shows follows it in the summary: where each rank stood in its own
FR (`positions`: the survivors' dumps, written by the hook as they died,
say which collective they had entered that the dead rank never reached),
then FR's own reading where it names a stall.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hangwatch.analyzer.report import CollectiveRef, Finding, FindingKind, Report
from hangwatch.analyzer.text import collective_text
from hangwatch.analyzer.wording import ranks_lower

# FR readings that speak of a hang nobody is blamed for: after a crash the
# crash is the cause, and the positions say what FR saw.
_NO_STALL_READINGS = frozenset({"no-culprit-visible", "healthy"})
# Positions listed in the summary; the evidence holds every rank's.
MAX_POSITIONS = 6


def crashed_rank(trigger: Mapping[str, Any]) -> int | None:
    rank = trigger.get("rank")
    return rank if type(rank) is int and rank >= 0 else None


def with_crash(report: Report, trigger: Mapping[str, Any], head: str) -> Report:
    """`report` (FR's and the stacks' reading) turned into a crash verdict; `head`
    is the sentence that names who died and how (wording.crash_head).

    Where the trigger does not say which rank died (an agent that saw a process
    go without knowing its rank), nobody is named: FR's verdict stands behind
    the crash sentence, rather than a guess."""
    rank = crashed_rank(trigger)
    if rank is None:
        summary = f"{head.rstrip('.')}. {report.summary.strip()}".strip()
        return dataclasses.replace(report, summary=summary)
    fr = "" if report.verdict in _NO_STALL_READINGS else report.summary.strip()
    summary = " ".join(x for x in (f"{head.rstrip('.')}.", positions(report, rank), fr) if x)
    findings = [Finding(kind=FindingKind.RANK_CRASHED, ranks=[rank], detail=head)]
    for f in report.findings:
        if f.kind == FindingKind.STUCK_OUTSIDE_COLLECTIVE and f.ranks == [rank]:
            continue  # not stuck: dead, which the rank-crashed finding says
        if f.kind == FindingKind.THREAD_EXCEPTION and rank not in f.ranks:
            f = dataclasses.replace(
                f,
                kind=FindingKind.CRASH_CONSEQUENCE,
                detail=f"{f.detail} (after rank {rank} crashed: a consequence, not the cause)",
            )
        findings.append(f)
    return dataclasses.replace(
        report, verdict="crash", lagging_ranks=[rank], findings=findings, summary=summary
    )


def positions(report: Report, dead: int) -> str:
    """Where each rank stood in its own FR when `dead` died, from the report's
    evidence: "In FR, rank 1 last entered all_reduce #15 in group 0; rank 0 had
    entered all_reduce #16 in group 0, which rank 1 never reached." "" when no
    evidence was kept (a job too large: see the per-rank evidence)."""
    ev = report.evidence
    if not ev:
        return ""
    loaded = set(report.ranks_loaded)
    mine = ev.get(dead)
    last = mine.last_entered if mine is not None and dead in loaded else None
    head = (
        f"In FR, rank {dead} last entered {_where(last)}"
        if last is not None
        else f"Rank {dead} left no FR"
    )
    by_place: dict[tuple[str, int, str] | str, list[int]] = {}
    for r, e in sorted(ev.items()):
        if r == dead:
            continue
        if r not in loaded:
            by_place.setdefault("no dump", []).append(r)
        elif e.last_entered is None:
            by_place.setdefault("no collective entered", []).append(r)
        else:
            c = e.last_entered
            by_place.setdefault((c.group, c.seq, c.op), []).append(r)
    parts: list[str] = []
    for place, ranks in by_place.items():
        who = ranks_lower(ranks)
        if isinstance(place, str):
            parts.append(f"{who}: {place}")
            continue
        group, seq, op = place
        beyond = (
            f", which rank {dead} never reached"
            if last is not None and last.group == group and seq > last.seq
            else ""
        )
        parts.append(f"{who} had entered {collective_text(op, seq)} in group {group}{beyond}")
    if len(parts) > MAX_POSITIONS:
        parts = [*parts[:MAX_POSITIONS], f"{len(parts) - MAX_POSITIONS} more positions"]
    return "; ".join([head, *parts]) + "."


def _where(c: CollectiveRef) -> str:
    return f"{collective_text(c.op, c.seq)} in group {c.group}"
