"""After the verdict: does an incident resolve by itself, or end with its job?

    collecting -> analyzed -> resolved   the job's progress resumed after the
                                         incident opened, the ranks its stall
                                         waited on having entered the stalled
                                         collective: a transient stall
                          -> ended       the job stopped (every rank exited, or
                                         every agent is gone) with it unresolved
    collecting -> failed                 finalizing raised (unchanged)

The manager keeps one `Watch` per incident it opened in this run and calls
`step` for each on every tick. Progress is noticed while the incident is
still collecting (when it resumed is recorded then), but the state changes
only once the verdict is stored, so the analysis never overwrites it. A crash
incident is never resolved by progress: the crashed rank is gone whatever the
survivors do next; it ends when the job stops.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Final

from hangwatch.server.incidents.store import (
    OPEN_STATUSES,
    IncidentRow,
    IncidentStatus,
    IncidentStore,
)
from hangwatch.server.integrations.metrics import Metrics
from hangwatch.server.live.registry import JobRegistry

from hangwatch.formats import JobStopped, TriggerKind
from hangwatch.rankspec import format_ranks

log = logging.getLogger("hangwatch.server.incidents.manager")

# Triggers whose incident can clear by itself when progress resumes.
NOT_RESOLVABLE: Final = frozenset({TriggerKind.CRASH})


@dataclass
class Watch:
    incident_id: str
    job_id: str
    trigger: str
    opened: float  # coordinator monotonic
    onset: float  # coordinator monotonic: the stall's best-estimated start
    late_hint: list[int] = field(default_factory=list)  # trigger's not-entered ranks
    # (group, seq, not-entered ranks) of each stalled collective the trigger saw:
    # resolved only once those ranks entered it (registry.moved_past).
    waits_on: list[tuple[str, int, list[int]]] = field(default_factory=list)
    resumed_at: float | None = None  # coordinator monotonic: progress seen after opening
    outcome: IncidentStatus | None = None  # None while collecting; then analyzed or failed
    # Recovered after a restart: the job cannot be judged stopped before its
    # agents had the time to re-register (coordinator monotonic), only resolved.
    end_not_before: float | None = None

    @classmethod
    def recovered(
        cls,
        row: IncidentRow,
        now: float,
        *,
        onset: float | None = None,
        end_not_before: float | None = None,
    ) -> Watch:
        """An incident a previous run left open, watched from `now` (only progress
        seen from then counts): collecting (its outcome comes with its
        collection) or analysed. `onset`: when its stall began, on this run's
        clock (default `now`)."""
        analysed = row.status == IncidentStatus.ANALYZED
        return cls(
            incident_id=row.id,
            job_id=row.job_id,
            trigger=row.trigger,
            opened=now,
            onset=now if onset is None else onset,
            outcome=IncidentStatus.ANALYZED if analysed else None,
            end_not_before=end_not_before,
        )


def late_hint(info: dict[str, Any]) -> list[int]:
    """The ranks a stall trigger saw not entering, as the fallback for late ranks."""
    out: set[int] = set()
    for s in info.get("stalled") or []:
        out.update(int(r) for r in s.get("not_entered_ranks") or [])
        out.update(int(r) for r in s.get("dead_ranks") or [])
    return sorted(out)


def waits_on(info: dict[str, Any]) -> list[tuple[str, int, list[int]]]:
    """What the job must get past for a new symptom to be a new incident
    (JobRegistry.moved_past): a stall trigger's stalled collectives, each with
    the ranks not entered in it; a crash trigger's dead rank, with no group
    ("": alive and observed again, which takes a restart). Without the
    crash's, the survivors' failed collective, which gloo counts completed,
    was the job moving on, and their own "connection closed by peer" crash a
    moment later opened a second incident (seen live in a full test run)."""
    waits = [
        (str(s["group"]), int(s["seq"]), [int(r) for r in s["not_entered_ranks"]])
        for s in info.get("stalled") or []
        if s.get("not_entered_ranks")
    ]
    if info.get("kind") == TriggerKind.CRASH and int(info.get("rank", -1)) >= 0:
        waits.append(("", 0, [int(info["rank"])]))
    return waits


def step(w: Watch, *, registry: JobRegistry, store: IncidentStore, metrics: Metrics) -> bool:
    """One tick's look at one incident; True when it is done with (closed or failed)."""
    if w.outcome == IncidentStatus.FAILED:
        return True
    resolvable = w.resumed_at is None and w.trigger not in NOT_RESOLVABLE
    if resolvable and registry.moved_past(w.job_id, w.opened, w.waits_on):
        w.resumed_at = registry.last_progress(w.job_id) or registry.now()
    if w.outcome != IncidentStatus.ANALYZED:
        return False  # still collecting: the verdict is stored first
    if w.resumed_at is not None:
        resolve(w, store=store, registry=registry, metrics=metrics)
        return True
    if w.end_not_before is not None and registry.now() < w.end_not_before:
        return False
    why = registry.job_stopped(w.job_id)
    if why is not None:
        end(w, why, store=store, metrics=metrics)
        return True
    return False


def resolve(w: Watch, *, store: IncidentStore, registry: JobRegistry, metrics: Metrics) -> None:
    assert w.resumed_at is not None
    row = store.get_incident(w.incident_id)
    if row is None or row.status not in OPEN_STATUSES:
        return
    late = row.lagging_ranks or w.late_hint
    stall_s = max(0.0, w.resumed_at - w.onset)
    reason = f"progress resumed {stall_s:.1f}s after the stall began"
    if late:
        reason += f"; late: ranks {format_ranks(late)}"
    closed_at = time.time() - max(0.0, registry.now() - w.resumed_at)
    store.resolve_incident(
        w.incident_id, stall_s=stall_s, late_ranks=late, reason=reason, closed_at=closed_at
    )
    metrics.inc(
        "hangwatch_incident_transitions_total",
        labels={"state": IncidentStatus.RESOLVED, "trigger": w.trigger},
    )
    log.warning("incident %s resolved (transient stall): %s", w.incident_id, reason)


def end(w: Watch, why: JobStopped, *, store: IncidentStore, metrics: Metrics) -> None:
    row = store.get_incident(w.incident_id)
    if row is None or row.status not in OPEN_STATUSES:
        return
    store.end_incident(w.incident_id, reason=f"the job stopped: {why}")
    metrics.inc(
        "hangwatch_incident_transitions_total",
        labels={"state": IncidentStatus.ENDED, "trigger": w.trigger},
    )
    log.warning("incident %s ended unresolved: %s", w.incident_id, why)


def publish_states(store: IncidentStore, metrics: Metrics) -> None:
    """The by-state gauges, from the store (cheap: one indexed GROUP BY)."""
    counts = store.count_by_status()
    for state, n in counts.items():
        metrics.set("hangwatch_incidents_by_state", n, labels={"state": state})
    metrics.set("hangwatch_incidents_open", sum(counts[s] for s in OPEN_STATUSES))
