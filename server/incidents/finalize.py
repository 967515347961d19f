"""Finalizing an incident: analyse what was collected, store the verdict.

Runs on the manager's analysis worker, never on a gRPC handler: analysis of
a large bundle takes seconds. The verdict is adjusted for ranks nobody
could observe before it is stored, so that a rank behind a dead agent is
called unobserved rather than guilty.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from hangwatch.analyzer.report import Finding, Report
from hangwatch.server.incidents.bundle import (
    revise_outcome,
    write_incident_json,
    write_unreachable_meta,
)
from hangwatch.server.incidents.collection import Collection
from hangwatch.server.incidents.store import IncidentStore
from hangwatch.server.integrations.metrics import Metrics
from hangwatch.server.live.commands import Command
from hangwatch.server.live.registry import JobRegistry

from hangwatch.formats import MissingReason
from hangwatch.rankspec import format_ranks
from hangwatch.wire import pb

log = logging.getLogger("hangwatch.server.incidents.manager")

Analyze = Callable[[Path, int | None], Report]


def default_analyze(path: Path, world_size: int | None) -> Report:
    # Imported here: the analyzer pulls in pandas, which a coordinator that
    # analyses in a child process (the default) never needs in its own.
    from hangwatch.analyzer import analyze_path

    report: Report = analyze_path(path, world_size=world_size)
    return report


def analyse_and_store(
    inc: Collection,
    dumped: set[int],
    unreachable: dict[int, str],
    *,
    store: IncidentStore,
    registry: JobRegistry,
    metrics: Metrics,
    analyze: Analyze,
) -> Report:
    """Record the dump outcome, run the analysis and store its verdict."""
    store.set_dump_outcome(inc.incident_id, ranks_dumped=dumped, ranks_unreachable=unreachable)
    metrics.inc("hangwatch_ranks_unreachable_total", len(unreachable))
    bundle = store.incident_dir(inc.incident_id)
    write_incident_json(bundle, inc, None, dumped=dumped, unreachable=unreachable)
    write_unreachable_meta(inc, bundle, unreachable, registry.rank_meta)
    t0 = time.monotonic()
    # An attempt the full disk refused may have made this same verdict.
    outcome = (frozenset(dumped), frozenset(unreachable.items()))
    if inc.analysed is None or inc.analysed[0] != outcome:
        inc.analysed = (outcome, mark_unobserved(analyze(bundle, inc.world_size), unreachable))
        metrics.observe("hangwatch_analysis_seconds", time.monotonic() - t0)
    report = inc.analysed[1]
    detection_s = registry.now() - inc.onset
    store.finish_incident(inc.incident_id, report=report, detection_s=detection_s)
    metrics.inc(
        "hangwatch_incidents_total", labels={"verdict": report.verdict, "trigger": inc.trigger}
    )
    metrics.observe("hangwatch_detection_latency_seconds", detection_s)
    log.warning(
        "incident %s analysed in %.2fs (%.1fs after onset): %s",
        inc.incident_id,
        time.monotonic() - t0,
        detection_s,
        report.summary,
    )
    return report


def reanalyse_with_late(
    incident_id: str,
    world_size: int | None,
    dumped: set[int],
    unreachable: dict[int, str],
    *,
    store: IncidentStore,
    analyze: Analyze,
) -> Report:
    """An analysed incident whose missing ranks' dumps arrived after its verdict
    (an agent back from a partition longer than the lost-agent timeout, whose
    DUMP command it had already begun): record the new outcome, analyse the
    bundle again and store the revised verdict. The incident's status,
    detection time and actions stay: the page it sent was right about when."""
    store.set_dump_outcome(incident_id, ranks_dumped=dumped, ranks_unreachable=unreachable)
    bundle = store.incident_dir(incident_id)
    revise_outcome(bundle, dumped, unreachable)
    t0 = time.monotonic()
    report = mark_unobserved(analyze(bundle, world_size), unreachable)
    store.revise_report(incident_id, report=report)
    log.warning(
        "incident %s re-analysed in %.2fs with dumps that arrived after its verdict: %s",
        incident_id,
        time.monotonic() - t0,
        report.summary,
    )
    return report


def record_failure(
    inc: Collection, error: Exception, *, store: IncidentStore, metrics: Metrics
) -> None:
    """Finalizing raised: the incident is stored as failed, never left collecting."""
    try:
        store.fail_incident(inc.incident_id, error=f"{type(error).__name__}: {error}")
    except Exception:
        log.exception("incident %s: could not record the failure", inc.incident_id)
    metrics.inc("hangwatch_incidents_total", labels={"verdict": "failed", "trigger": inc.trigger})


def full_dump_commands(
    inc: Collection, report: Report, now: float, dump_deadline: float
) -> list[tuple[str, Command]]:
    """Phase two: (agent, command) asking for the lagging ranks' full FR history,
    for whoever reads the incident next. Only theirs: the verdict is already
    stored, and the other ranks' history stays on their nodes (docs/scaling.md)."""
    wanted = set(report.lagging_ranks)
    if not wanted:
        return []
    # At least a minute: nobody waits on these, and full dumps are large.
    expires = now + max(dump_deadline, 60.0)
    out: list[tuple[str, Command]] = []
    for agent_id, ranks in inc.asked.items():
        mine = tuple(sorted(wanted.intersection(ranks)))
        if mine:
            cmd = Command(
                kind=pb.COMMAND_KIND_UPLOAD_FULL,
                incident_id=inc.incident_id,
                reason=f"full FR history of lagging rank(s) {format_ranks(list(mine))}",
                deadline_s=expires - now,
                expires=expires,
                ranks=mine,
            )
            out.append((agent_id, cmd))
    return out


def mark_unobserved(report: Report, unreachable: dict[int, str]) -> Report:
    """Make the verdict say which ranks nobody could observe. Each gets an
    `agent-unreachable` finding (unless the analyzer already gave one, from the
    bundle's meta.json); those the FR evidence does not blame are called
    unobserved, not guilty."""
    codes = {r: MissingReason.of(why) for r, why in unreachable.items()}
    unobserved = sorted(r for r, code in codes.items() if code is not None and code.unobserved)
    if not unobserved:
        return report
    covered = {r for f in report.findings if f.kind == "agent-unreachable" for r in f.ranks}
    blamed = set(report.lagging_ranks)
    missing = [r for r in unobserved if r not in covered]
    if missing:
        reasons = sorted({unreachable[r] for r in missing})
        report.findings.append(
            Finding(
                kind="agent-unreachable",
                ranks=missing,
                detail=(
                    f"no dump could be collected from ranks {format_ranks(missing)} "
                    f"({'; '.join(reasons)[:500]}); they are unobserved"
                ),
            )
        )
    innocent = [r for r in unobserved if r not in blamed]
    seen = {codes[r] for r in unobserved}
    why = ", ".join(code for code in MissingReason if code in seen)
    note = f"Ranks {format_ranks(unobserved)} were unobserved ({why})"
    if innocent and len(innocent) < len(unobserved):
        note += f"; ranks {format_ranks(innocent)} are not blamed"
    elif innocent:
        note += " and are not blamed"
    report.summary = f"{report.summary.rstrip()} {note}.".strip()
    return report
