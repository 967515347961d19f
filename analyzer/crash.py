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
what FR shows (where the survivors waited) follows it in the summary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hangwatch.analyzer.report import Finding, FindingKind, Report


def crashed_rank(trigger: Mapping[str, Any]) -> int | None:
    rank = trigger.get("rank")
    return rank if type(rank) is int and rank >= 0 else None


def with_crash(report: Report, trigger: Mapping[str, Any], head: str) -> Report:
    """`report` (FR's and the stacks' reading) turned into a crash verdict; `head`
    is the sentence that names who died and how (wording.crash_head).

    Where the trigger does not say which rank died (an agent that saw a process
    go without knowing its rank), nobody is named: FR's verdict stands behind
    the crash sentence, rather than a guess."""
    summary = f"{head.rstrip('.')}. {report.summary.strip()}".strip()
    rank = crashed_rank(trigger)
    if rank is None:
        return dataclasses.replace(report, summary=summary)
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
