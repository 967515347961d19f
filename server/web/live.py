"""The live job view: the registry's snapshot turned into API models and heat-map cells.

The JSON API and the server-rendered page use these same functions, and the
page's script only re-applies `lag_bucket`, so a cell's colour means the same
thing on first paint and after every refresh.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import TypeVar

from hangwatch.analyzer.text import group_desc, seq_text
from hangwatch.server.incidents.store import IncidentStore, JobRow, disk_full, refusal
from hangwatch.server.live.registry import JobRegistry
from hangwatch.server.live.views import UNOBSERVED, GroupLive, JobSnapshot, RankLive
from hangwatch.server.web import schemas
from hangwatch.server.web.fmt import age

from hangwatch.wire import DEAD_PROCESS_STATES

log = logging.getLogger(__name__)
T = TypeVar("T")

DEAD_STATES = DEAD_PROCESS_STATES
# Lag buckets: under gloo a hung job is usually "1 behind" (everyone else is
# blocked waiting), so 1 already gets a colour of its own.
LAG_EDGES = ((0, "lag0"), (1, "lag1"), (2, "lag2"), (5, "lag3"), (20, "lag4"))


def progress_lag(r: RankLive, groups: dict[str, GroupLive]) -> int:
    """The registry's lag (RankLive.lag, server.live.views): one definition for API and page."""
    return r.lag


def lag_bucket(r: RankLive, lag: int) -> str:
    if not r.observed:
        return "unobserved"
    if r.process_state in DEAD_STATES:
        return "dead"
    bucket = "lag0"
    for edge, name in LAG_EDGES:
        if lag >= edge:
            bucket = name
    return bucket


def _oldest(r: RankLive) -> tuple[str, int | None, float | None]:
    best: tuple[str, int | None, float | None] = ("", None, None)
    for g in r.groups:
        if g.in_flight_age_s is not None and (best[2] is None or g.in_flight_age_s > best[2]):
            best = (g.in_flight_op, g.in_flight_seq, g.in_flight_age_s)
    return best


def rank_state(r: RankLive, suspects: set[int], groups: dict[str, GroupLive]) -> schemas.RankState:
    op, seq, in_age = _oldest(r)
    lag = progress_lag(r, groups)
    return schemas.from_record(
        schemas.RankState,
        r,
        lag=lag,
        p2p=any(g.counts_p2p for g in r.groups),
        lag_bucket=lag_bucket(r, lag),
        last_completed=r.groups[0].collectives_completed if r.groups else None,
        in_flight_op=op,
        in_flight_seq=seq,
        in_flight_age_s=in_age,
        suspect=r.rank in suspects,
        groups=[schemas.RankGroupState.model_validate(g, from_attributes=True) for g in r.groups],
    )


def tooltip(r: schemas.RankState) -> str:
    """The cell's hover text; app.js builds the same string from the same fields."""
    parts = [f"rank {r.rank}", r.host, r.process_state]
    if not r.observed:
        parts.append("unobserved (agent lost)")
    parts.append(f"lag {r.lag}" + (" (collectives; its p2p ops are not counted)" if r.p2p else ""))
    if r.last_completed is not None:
        parts.append(f"last completed {seq_text(r.last_completed)}")
    if r.in_flight_op:
        parts.append(
            f"in flight {r.in_flight_op} {seq_text(r.in_flight_seq)} for {age(r.in_flight_age_s)}"
        )
    if r.suspect:
        parts.append("has not entered a stalled collective")
    return " | ".join(parts)


def job_ranks(
    snap: JobSnapshot, oldest: float | None, open_incident: str | None = None
) -> schemas.JobRanks:
    """`open_incident`: the job's newest open incident as stored, shown when
    none is being collected (the registry knows only the one it collects)."""
    suspects = {r for st in snap.stalled for r in st.not_entered_ranks}
    by_name = {g.name: g for g in snap.groups}
    # torch's "undefined" for a group nobody named reaches people as "".
    descs = {g.name: group_desc(g.desc) for g in snap.groups}
    registered = {r.rank for r in snap.ranks}
    missing = [r for r in range(snap.world_size or 0) if r not in registered]
    return schemas.JobRanks(
        job=snap.job_id,
        live=snap.ended is None,
        state="live" if snap.ended is None else "ended",
        ended_reason=snap.ended,
        world_size=snap.world_size,
        ranks=[rank_state(r, suspects, by_name) for r in snap.ranks],
        missing_ranks=missing,
        groups=[
            schemas.from_record(schemas.GroupState, g, desc=descs[g.name]) for g in snap.groups
        ],
        stalled=[
            schemas.from_record(schemas.StalledState, st, group_desc=descs.get(st.group, ""))
            for st in snap.stalled
        ],
        agents=[
            schemas.AgentState.model_validate(a, from_attributes=True)
            for a in sorted(snap.agents, key=lambda a: (a.connected, _natural(a.agent_id)))
        ],
        open_incident=snap.open_incident or open_incident,
        oldest_inflight_age_s=None if snap.ended else oldest,
    )


def without_store(read: Callable[[], T], default: T) -> T:
    """`read()`, or `default` while the incident store is out of reach (a
    PostgreSQL restart, a full disk): the live view is the registry's and keeps
    answering; only what the store adds (stored jobs, open incident ids) is
    missing until it is back. Any other error is raised."""
    try:
        return read()
    except Exception as e:
        if not disk_full(e):
            raise
        log.warning("the live view answers without the incident store: %s", refusal(e))
        return default


def job_summaries(registry: JobRegistry, store: IncidentStore) -> list[schemas.JobSummary]:
    """Live jobs first (by name), then jobs known only from stored incidents."""
    none: list[JobRow] = []
    stored = {j.job_id: j for j in without_store(store.list_jobs, none)}
    open_ids: dict[str, str] = without_store(store.newest_open, {})
    out: list[schemas.JobSummary] = []
    # Counts, not snapshots: a 16,384-rank job's snapshot takes over a second.
    for c in sorted(registry.census(), key=lambda c: c.job_id):
        job_id = c.job_id
        row = stored.pop(job_id, None)
        out.append(
            schemas.JobSummary(
                job=job_id,
                live=c.ended is None,
                state="live" if c.ended is None else "ended",
                ended_reason=c.ended,
                world_size=c.world_size,
                ranks_registered=sum(c.ranks.values()),
                ranks_observed=sum(n for s, n in c.ranks.items() if s != UNOBSERVED),
                agents_connected=c.agents["connected"],
                agents_total=sum(c.agents.values()),
                # Past the stall timeout, as the detector counts them: a full
                # scan holds the registry's lock ~0.1 s a 4,096-rank job, and
                # a healthy job always has members between two collectives.
                stalled_groups=len(registry.stalls(job_id, over_timeout_only=True)),
                oldest_inflight_age_s=None if c.ended else registry.oldest_in_flight_age(job_id),
                open_incident=c.open_incident or open_ids.get(job_id),
                progress_moves=c.progress_moves,
                quiet_rule=c.quiet_rule,
                incidents=row.incidents if row else 0,
                first_seen=row.first_seen if row else None,
                last_seen=row.last_seen if row else None,
            )
        )
    out.extend(
        schemas.JobSummary(
            job=row.job_id,
            live=False,
            open_incident=open_ids.get(row.job_id),
            incidents=row.incidents,
            first_seen=row.first_seen,
            last_seen=row.last_seen,
        )
        for row in stored.values()
    )
    return out


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """ "agent-2" before "agent-10"."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part
    )


def heat_columns(n: int) -> str:
    """A wide fixed grid for big jobs so rank i sits at a predictable spot."""
    return "large" if n > 256 else ""


def ranks_or_missing(job: schemas.JobRanks) -> Iterable[tuple[int, schemas.RankState | None]]:
    """Every rank slot in order, registered or not, for the heat map."""
    by_rank = {r.rank: r for r in job.ranks}
    top = max([*by_rank, *job.missing_ranks, (job.world_size or 0) - 1], default=-1)
    for i in range(top + 1):
        yield i, by_rank.get(i)
