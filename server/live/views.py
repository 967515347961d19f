"""Read-only views of a job, handed to the dashboard and the incident manager.

Views are frozen copies taken under the registry's lock, so that a reader can
take its time without holding it. Ages are computed at snapshot time on the
coordinator's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hangwatch.server.live.detector import steady
from hangwatch.server.live.records import (
    AgentRecord,
    JobRecord,
    group_sort_key,
    sorted_groups,
)

from hangwatch.formats import JobStopped, StallKind
from hangwatch.wire import EXITED_PROCESS_STATES, event_kind_name, seq_count


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


# JobCensus.ranks' state for a rank whose agent is lost.
UNOBSERVED = "unobserved"


@dataclass(kw_only=True, frozen=True)
class JobCensus:
    """How many of a job's agents and ranks are in each state (for /metrics
    and the jobs list: counting needs no snapshot, which at 16,384 ranks costs
    over a second)."""

    job_id: str
    agents: dict[str, int]  # connected | lost
    ranks: dict[str, int]  # a process state, or unobserved (its agent is lost)
    world_size: int | None = None
    open_incident: str | None = None  # the incident collecting its dumps, if any
    ended: JobStopped | None = None  # stopped_reason
    progress_moves: int = 0  # JobRecord.progress_moves

    @property
    def collecting(self) -> bool:
        return self.open_incident is not None

    @property
    def quiet_rule(self) -> str:
        """Which no-progress rule would page a quiet period now (detector.find_job_quiet):
        "rhythm" once the job made steady progress, else only "bound"."""
        return "rhythm" if steady(self.progress_moves) else "bound"


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


# A rank's numbers for one group as captured: name, last_enqueued,
# last_completed, in_flight_seq, in_flight_op, in_flight_age_s,
# collectives_enqueued, collectives_completed, counts_p2p.
_GroupRow = tuple[
    str, int, int, "int | None", str, "float | None", "int | None", "int | None", bool
]
# rank, host, agent_id, pid, its agent live (RankLive.connected and
# .observed are both that), process_state, backend, last_report_age_s, its groups.
_RankRow = tuple[int, str, str, int, bool, str, str, "float | None", list[_GroupRow]]


@dataclass(slots=True)
class JobCapture:
    """What a job's snapshot needs, copied as plain tuples under the registry's
    lock (`capture`); the view objects are built from it after the lock is
    released (`snapshot`). Building them under the lock held it for 0.23 s at
    4,096 simulated ranks and 1.0 s at 16,384 (benchmarks/live_snapshot.py),
    every 1.5 s while a dashboard showed the job, and no report was applied
    meanwhile; the copy is a fraction of that."""

    job_id: str
    world_size: int | None
    now: float
    ranks: list[_RankRow]
    # name, desc, members, last_progress, in the groups' display order
    groups: list[tuple[str, str, Sequence[int], float]]
    agents: list[AgentLive]
    open_incident: str | None
    events: list[JobEvent]
    ended: JobStopped | None

    def snapshot(self, stalled: list[StalledGroup]) -> JobSnapshot:
        known = {name for name, _, _, _ in self.groups}
        return JobSnapshot(
            job_id=self.job_id,
            world_size=self.world_size,
            ranks=_rank_views(self.ranks, known),
            groups=_group_views(self.ranks, self.groups, self.now),
            stalled=stalled,
            agents=self.agents,
            open_incident=self.open_incident,
            events=self.events,
            ended=self.ended,
        )


def capture(job: JobRecord, now: float) -> JobCapture:
    """The job's numbers for a snapshot; call under the registry's lock."""
    ranks: list[_RankRow] = []
    agents = job.agents
    for r in job.ranks.values():
        a = agents.get(r.agent_id)
        ranks.append(
            (
                r.rank,
                r.host,
                r.agent_id,
                r.pid,
                a is not None and not a.lost,
                r.process_state,
                r.backend,
                None if r.last_report is None else now - r.last_report,
                [
                    (
                        name,
                        rg.last_enqueued,
                        rg.last_completed,
                        rg.in_flight_seq,
                        rg.in_flight_op,
                        rg.in_flight_age(now),
                        rg.coll_enqueued,
                        rg.coll_completed,
                        rg.counts_p2p,
                    )
                    for name, rg in job.cells_of(r)
                ],
            )
        )
    return JobCapture(
        job_id=job.job_id,
        world_size=job.world_size,
        now=now,
        ranks=ranks,
        groups=[(g.name, g.desc, g.ranks, g.last_progress) for g in sorted_groups(job.groups)],
        agents=[agent_view(a, now) for a in sorted(agents.values(), key=lambda a: a.agent_id)],
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


def _collectives(row: _GroupRow) -> tuple[int, int] | None:
    """RankGroupRecord.collectives, from a captured row."""
    enq, comp = row[6], row[7]
    return None if enq is None or comp is None else (enq, comp)


def _rank_views(rows: list[_RankRow], known: set[str]) -> list[RankLive]:
    # The furthest member of each group, in one pass over every rank's groups:
    # a scan of every rank per group was O(groups x ranks), 1.4 s at 4,096
    # simulated ranks and 51 s at 16,384 (6,177 groups), all of it under the
    # registry's lock, which stops ingest for as long.
    max_enqueued: dict[str, int] = {}
    max_completed: dict[str, int] = {}
    for row in rows:
        for g in row[8]:
            c = _collectives(g)
            if c is None or g[0] not in known:
                continue
            if c[0] > max_enqueued.get(g[0], -1):
                max_enqueued[g[0]] = c[0]
            if c[1] > max_completed.get(g[0], -1):
                max_completed[g[0]] = c[1]
    views = []
    for rank, host, agent_id, pid, live, state, backend, age, grows in sorted(
        rows, key=lambda row: row[0]
    ):
        groups = [
            RankGroupLive(
                group=g[0],
                last_enqueued=g[1],
                last_completed=g[2],
                in_flight_seq=g[3],
                in_flight_op=g[4],
                in_flight_age_s=g[5],
                collectives_enqueued=g[6],
                collectives_completed=g[7],
                counts_p2p=g[8],
            )
            for g in sorted(grows, key=lambda g: group_sort_key(g[0]))
        ]
        # The one definition of lag: collectives behind the furthest member,
        # over completed AND enqueued counts. Completed counts alone miss the
        # classic hang: the culprit never enqueues #N, so nobody completes it.
        # Collectives only: a pipeline's middle stage does twice the p2p of
        # its ends, and that puts nobody behind. A count not known now (p2p
        # since the agent last read FR entries) puts nobody behind either.
        # Counted, not numbered (wire.seq_count): as numbers a rank in the
        # first collective, not yet completed, was 2 behind one that completed
        # it (1 - (-1)): a healthy pipeline's first stage read lag 2 (CI, stop 52).
        lag = max(
            (
                max(
                    0,
                    seq_count(max_completed.get(g[0], -1)) - seq_count(c[1]),
                    seq_count(max_enqueued.get(g[0], -1)) - seq_count(c[0]),
                )
                for g in grows
                if (c := _collectives(g)) is not None
            ),
            default=0,
        )
        views.append(
            RankLive(
                rank=rank,
                host=host,
                agent_id=agent_id,
                pid=pid,
                connected=live,
                observed=live,
                process_state=state,
                groups=groups,
                lag=lag,
                backend=backend,
                last_report_age_s=age,
            )
        )
    return views


def _group_views(
    rows: list[_RankRow], groups: list[tuple[str, str, Sequence[int], float]], now: float
) -> list[GroupLive]:
    """Each group's furthest and slowest member (JobRecord.members: the
    group's ranks that registered it), from the captured rows."""
    counts_of: dict[int, dict[str, tuple[int, int] | None]] = {
        row[0]: {g[0]: _collectives(g) for g in row[8]} for row in rows
    }
    out = []
    for name, desc, members, last_progress in groups:
        counts = [
            c
            for rank in members
            if (mine := counts_of.get(rank)) is not None and (c := mine.get(name)) is not None
        ]
        completed = [c[1] for c in counts]
        out.append(
            GroupLive(
                name=name,
                desc=desc,
                ranks=list(members),
                max_completed=max(completed, default=-1),
                min_completed=min(completed, default=-1),
                max_enqueued=max((c[0] for c in counts), default=-1),
                no_progress_for_s=now - last_progress,
            )
        )
    return out


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
