"""Read-only views of a job, handed to the dashboard and the incident manager.

Views are frozen copies taken under the registry's lock, so that a reader can
take its time without holding it. Ages are computed at snapshot time on the
coordinator's clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hangwatch.server.live.records import (
    AgentRecord,
    GroupRecord,
    JobRecord,
    group_sort_key,
    in_flight_age,
    sorted_groups,
)

from hangwatch.formats import JobStopped, StallKind
from hangwatch.wire import EXITED_PROCESS_STATES, event_kind_name


@dataclass(kw_only=True, frozen=True)
class RankGroupLive:
    group: str
    last_enqueued: int
    last_completed: int
    in_flight_seq: int | None
    in_flight_op: str
    in_flight_age_s: float | None  # agent-measured age plus time since the report
    # In collective numbering: the two counts above unless the group's
    # pg_status also counts p2p ops (then None while the agent cannot tell).
    collectives_enqueued: int | None = None
    collectives_completed: int | None = None
    counts_p2p: bool = False  # its pg_status counts p2p ops too (a pipeline's groups)


@dataclass(kw_only=True, frozen=True)
class RankLive:
    rank: int
    host: str
    agent_id: str
    pid: int
    connected: bool  # its agent's session is live
    observed: bool  # False when its agent is lost: "unobserved", not guilty
    process_state: str  # running, stopped, zombie, gone, unresponsive, unknown
    groups: list[RankGroupLive]
    lag: int  # collectives (never p2p) behind the furthest member of any of its groups (rank_views)
    backend: str = ""
    last_report_age_s: float | None = None


@dataclass(kw_only=True, frozen=True)
class GroupLive:
    name: str
    desc: str
    ranks: list[int]
    max_completed: int
    min_completed: int
    max_enqueued: int = -1
    no_progress_for_s: float = 0.0  # coordinator clock: since a member's last_completed changed


@dataclass(kw_only=True, frozen=True)
class StalledGroup:
    group: str
    seq: int
    op: str
    waiting_ranks: list[int]
    not_entered_ranks: list[int]
    stalled_for_s: float
    kind: StallKind = StallKind.STALL
    dead_ranks: list[int] = field(default_factory=list)
    unobserved_ranks: list[int] = field(default_factory=list)
    # A mismatch's ops at `seq`, each with the ranks that entered it.
    ops_entered: dict[str, list[int]] = field(default_factory=dict)
    over_timeout: bool = False  # True once stalled_for_s >= timeout_s
    # The not-entered ranks, when every one is working (stalls.busy_laggards):
    # then timeout_s is QUIET_BOUND_FACTOR stall timeouts, not one.
    busy_ranks: list[int] = field(default_factory=list)
    # Those of them counted as working for being inside torch.compile.
    compiling_ranks: list[int] = field(default_factory=list)
    # Not-entered ranks not heard from since the group last progressed
    # (stalls.unheard_since): not over its timeout until they report again.
    unheard_ranks: list[int] = field(default_factory=list)
    timeout_s: float = 0.0  # what stalled_for_s must reach to open an incident


@dataclass(kw_only=True, frozen=True)
class AgentLive:
    agent_id: str
    host: str
    ranks: list[int]
    connected: bool
    last_report_age_s: float | None
    session_id: str
    watching: bool = False  # has a WatchCommands stream open


@dataclass(kw_only=True, frozen=True)
class JobEvent:
    kind: str
    rank: int
    detail: str
    agent_id: str
    age_s: float  # since the agent saw it, on the coordinator's clock now


@dataclass(kw_only=True, frozen=True)
class JobCensus:
    """How many of a job's agents and ranks are in each state (for /metrics)."""

    job_id: str
    agents: dict[str, int]  # connected | lost
    ranks: dict[str, int]  # a process state, or unobserved (its agent is lost)
    collecting: bool  # an incident of the job is collecting its dumps


@dataclass(kw_only=True, frozen=True)
class JobSnapshot:
    job_id: str
    world_size: int | None
    ranks: list[RankLive]
    groups: list[GroupLive]
    stalled: list[StalledGroup]
    agents: list[AgentLive]
    open_incident: str | None
    events: list[JobEvent] = field(default_factory=list)
    ended: JobStopped | None = None  # why the job is over (stopped_reason), None while it may run


def stopped_reason(job: JobRecord) -> JobStopped | None:
    """Why the job is over, or None while any of its ranks may still run:
    every rank it registered (at least world_size of them) has exited, or
    every agent of it is lost."""
    if not job.ranks:
        return None
    if job.agents and all(a.lost for a in job.agents.values()):
        return JobStopped.AGENTS_GONE
    enough = len(job.ranks) >= (job.world_size or 0)
    if enough and all(r.process_state in EXITED_PROCESS_STATES for r in job.ranks.values()):
        return JobStopped.RANKS_EXITED
    return None


def job_snapshot(job: JobRecord, now: float, stalled: list[StalledGroup]) -> JobSnapshot:
    return JobSnapshot(
        job_id=job.job_id,
        world_size=job.world_size,
        ranks=rank_views(job, now),
        groups=[group_view(job, g, now) for g in sorted_groups(job.groups)],
        stalled=stalled,
        agents=[agent_view(a, now) for a in sorted(job.agents.values(), key=lambda a: a.agent_id)],
        open_incident=job.open_incident,
        events=[
            JobEvent(
                kind=event_kind_name(ev.kind),
                rank=ev.rank,
                detail=ev.detail,
                agent_id=ev.agent_id,
                age_s=now - at + ev.age_s,
            )
            for at, ev in job.events
        ],
        ended=stopped_reason(job),
    )


def rank_views(job: JobRecord, now: float) -> list[RankLive]:
    def furthest(name: str, i: int) -> int:
        return max(
            (
                c[i]
                for r in job.ranks.values()
                if name in r.groups and (c := r.groups[name].collectives()) is not None
            ),
            default=-1,
        )

    max_enqueued = {name: furthest(name, 0) for name in job.groups}
    max_completed = {name: furthest(name, 1) for name in job.groups}
    views = []
    for r in sorted(job.ranks.values(), key=lambda r: r.rank):
        agent = job.agents.get(r.agent_id)
        groups = [
            RankGroupLive(
                group=name,
                last_enqueued=rg.last_enqueued,
                last_completed=rg.last_completed,
                in_flight_seq=rg.in_flight_seq,
                in_flight_op=rg.in_flight_op,
                in_flight_age_s=in_flight_age(rg, now),
                collectives_enqueued=rg.coll_enqueued,
                collectives_completed=rg.coll_completed,
                counts_p2p=rg.counts_p2p,
            )
            for name, rg in sorted(r.groups.items(), key=lambda kv: group_sort_key(kv[0]))
        ]
        # The one definition of lag: collectives behind the furthest member,
        # over completed AND enqueued counts. Completed counts alone miss the
        # classic hang: the culprit never enqueues #N, so nobody completes it.
        # Collectives only: a pipeline's middle stage does twice the p2p of
        # its ends, and that puts nobody behind. A count not known now (p2p
        # since the agent last read FR entries) puts nobody behind either.
        lag = max(
            (
                max(
                    0,
                    max_completed.get(name, -1) - c[1],
                    max_enqueued.get(name, -1) - c[0],
                )
                for name, rg in r.groups.items()
                if (c := rg.collectives()) is not None
            ),
            default=0,
        )
        views.append(
            RankLive(
                rank=r.rank,
                host=r.host,
                agent_id=r.agent_id,
                pid=r.pid,
                connected=agent is not None and not agent.lost,
                observed=job.observed(r),
                process_state=r.process_state,
                groups=groups,
                lag=lag,
                backend=r.backend,
                last_report_age_s=None if r.last_report is None else now - r.last_report,
            )
        )
    return views


def group_view(job: JobRecord, g: GroupRecord, now: float) -> GroupLive:
    counts = [c for _, rg in job.members(g) if (c := rg.collectives()) is not None]
    completed = [c[1] for c in counts]
    return GroupLive(
        name=g.name,
        desc=g.desc,
        ranks=list(g.ranks),
        max_completed=max(completed, default=-1),
        min_completed=min(completed, default=-1),
        max_enqueued=max((c[0] for c in counts), default=-1),
        no_progress_for_s=now - g.last_progress,
    )


def agent_view(a: AgentRecord, now: float) -> AgentLive:
    return AgentLive(
        agent_id=a.agent_id,
        host=a.host,
        ranks=sorted(a.ranks),
        connected=not a.lost,
        last_report_age_s=now - a.last_report,
        session_id=a.session_id,
        watching=bool(a.mailbox.wakers),
    )
