"""Live, in-memory job state fed by the gRPC handlers; thread-safe.

Nothing here is durable: after a coordinator restart agents are told their
session is unknown, re-register, and the next progress reports rebuild it.
"Since when" questions are answered with the coordinator's own monotonic
clock (when a report arrived, when a number last changed); agents' clocks only
ever contribute durations they measured themselves.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from hangwatch.server.detector import MemberProgress, find_group_stall

from hangwatch.wire import pb

# Bounds on what agents can make the coordinator hold.
MAX_WORLD_SIZE: Final = 1 << 20
MAX_RANKS_PER_AGENT: Final = 4096
MAX_GROUPS_PER_RANK: Final = 4096
MAX_JOBS: Final = 1024
ENTRY_RING: Final = 256  # recent FR entries kept per rank
EVENT_RING: Final = 256  # recent events kept per job
PENDING_COMMANDS: Final = 16  # undelivered commands kept per agent
HANDLED_STALLS: Final = 4096  # (group, seq) pairs remembered per job for dedupe

_PROCESS_STATE_NAMES: Final[dict[int, str]] = {
    pb.PROCESS_STATE_UNSPECIFIED: "unknown",
    pb.PROCESS_STATE_RUNNING: "running",
    pb.PROCESS_STATE_STOPPED: "stopped",
    pb.PROCESS_STATE_ZOMBIE: "zombie",
    pb.PROCESS_STATE_GONE: "gone",
    pb.PROCESS_STATE_UNRESPONSIVE: "unresponsive",
}


def process_state_name(value: int) -> str:
    return _PROCESS_STATE_NAMES.get(value, "unknown")


# ---- read-only views handed to the dashboard and the incident manager --------


@dataclass(kw_only=True, frozen=True)
class RankGroupLive:
    group: str
    last_enqueued: int
    last_completed: int
    in_flight_seq: int | None
    in_flight_op: str
    in_flight_age_s: float | None  # agent-measured age plus time since the report


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
    lag: int  # max over its groups of (group max last_completed - its last_completed)
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
    kind: str = "stall"  # "stall" | "rank-lost" | "agent-lost"
    dead_ranks: list[int] = field(default_factory=list)
    unobserved_ranks: list[int] = field(default_factory=list)
    over_timeout: bool = False  # True once stalled_for_s >= the stall timeout


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
class JobSnapshot:
    job_id: str
    world_size: int | None
    ranks: list[RankLive]
    groups: list[GroupLive]
    stalled: list[StalledGroup]
    agents: list[AgentLive]
    open_incident: str | None
    events: list[JobEvent] = field(default_factory=list)
    entries_dropped: int = 0  # FR entries agents dropped from their bounded buffers


@dataclass(kw_only=True, frozen=True)
class Command:
    kind: int  # pb.CommandKind
    incident_id: str
    reason: str
    deadline_s: float
    expires: float  # coordinator monotonic
    tail_context: int = 0
    ranks: tuple[int, ...] = ()

    def to_pb(self, now: float) -> pb.Command:
        return pb.Command(
            kind=self.kind,  # type: ignore[arg-type]
            incident_id=self.incident_id,
            reason=self.reason,
            deadline_s=max(0.0, self.expires - now),
            tail_context=self.tail_context,
            ranks=self.ranks,
        )


# ---- mutable internals ---------------------------------------------------------


@dataclass
class _RankGroup:
    last_enqueued: int = -1
    last_completed: int = -1
    # Its recorder does not record completion (RankProgress.completion_unknown).
    completion_unknown: bool = False
    in_flight_seq: int | None = None
    in_flight_op: str = ""
    in_flight_age_s: float | None = None
    reported_at: float = 0.0


@dataclass
class _Rank:
    rank: int
    agent_id: str
    host: str
    pid: int
    local_rank: int
    world_size: int
    backend: str
    torch_version: str
    fr_source: str
    process_state: str = "unknown"
    fr_age_s: float | None = None
    last_report: float | None = None
    groups: dict[str, _RankGroup] = field(default_factory=dict)
    entries: deque[pb.FrEntry] = field(default_factory=lambda: deque(maxlen=ENTRY_RING))


@dataclass
class _Group:
    name: str
    desc: str
    ranks: tuple[int, ...]
    last_progress: float  # coordinator monotonic time a member's last_completed last changed


@dataclass
class _Agent:
    agent_id: str
    host: str
    session_id: str
    ranks: set[int]
    registered: float
    last_report: float
    agent_version: str = ""
    lost: bool = False
    report_seq: int = 0
    pending: deque[Command] = field(default_factory=lambda: deque(maxlen=PENDING_COMMANDS))
    wakers: dict[int, Callable[[], None]] = field(default_factory=dict)


@dataclass
class _Job:
    job_id: str
    world_size: int | None = None
    agents: dict[str, _Agent] = field(default_factory=dict)
    ranks: dict[int, _Rank] = field(default_factory=dict)
    groups: dict[str, _Group] = field(default_factory=dict)
    open_incident: str | None = None
    handled: OrderedDict[tuple[str, int], str] = field(default_factory=OrderedDict)
    events: deque[tuple[float, pb.Event]] = field(default_factory=lambda: deque(maxlen=EVENT_RING))
    entries_dropped: int = 0
    last_seen: float = 0.0
    last_progress: float = 0.0  # coordinator monotonic: any member of any group completed more


class StaleSession(Exception):
    """The session is not (or no longer) the agent's current one: re-register."""


class JobRegistry:
    """Every job's agents, ranks, groups and progress, as last reported."""

    def __init__(
        self,
        *,
        agent_lost_timeout: float = 10.0,
        stall_timeout: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent_lost_timeout = agent_lost_timeout
        self.stall_timeout = stall_timeout
        self._clock = clock
        self._lock = threading.RLock()
        self._jobs: dict[str, _Job] = {}
        self._sessions: dict[str, tuple[str, str]] = {}  # session_id -> (job_id, agent_id)
        self._next_waker = 0

    # ---- reads (the dashboard's interface) ---------------------------------

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def agents_connected(self) -> int:
        with self._lock:
            return sum(1 for j in self._jobs.values() for a in j.agents.values() if not a.lost)

    def ranks_connected(self) -> int:
        with self._lock:
            return sum(
                len(a.ranks) for j in self._jobs.values() for a in j.agents.values() if not a.lost
            )

    def oldest_in_flight_age(self, job_id: str) -> float | None:
        """Largest in-flight age over the job's observed ranks, seconds."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            now = self._clock()
            ages = [
                a
                for r in job.ranks.values()
                if self._rank_observed(job, r)
                for rg in r.groups.values()
                if (a := _age(rg, now)) is not None
            ]
            return max(ages) if ages else None

    def snapshot(self, job_id: str) -> JobSnapshot | None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            now = self._clock()
            return JobSnapshot(
                job_id=job.job_id,
                world_size=job.world_size,
                ranks=self._rank_views(job, now),
                groups=[self._group_view(job, g, now) for g in _sorted_groups(job.groups)],
                stalled=self._stalls(job, now),
                agents=[
                    self._agent_view(job, a, now)
                    for a in sorted(job.agents.values(), key=lambda a: a.agent_id)
                ],
                open_incident=job.open_incident,
                events=[
                    JobEvent(
                        kind=pb.EventKind.Name(ev.kind),
                        rank=ev.rank,
                        detail=ev.detail,
                        agent_id=ev.agent_id,
                        age_s=now - at + ev.age_s,
                    )
                    for at, ev in job.events
                ],
                entries_dropped=job.entries_dropped,
            )

    def recent_entries(self, job_id: str, rank: int) -> list[pb.FrEntry]:
        with self._lock:
            job = self._jobs.get(job_id)
            r = job.ranks.get(rank) if job else None
            return list(r.entries) if r else []

    # ---- writes from the gRPC handlers -------------------------------------

    def register(self, req: pb.RegisterRequest) -> str:
        """Record an agent and its ranks; returns the new session id. The
        request must already be validated (hangwatch.server.validate)."""
        now = self._clock()
        session_id = secrets.token_hex(16)
        with self._lock:
            job = self._jobs.get(req.job_id)
            if job is None:
                self._evict_if_full()
                job = self._jobs[req.job_id] = _Job(job_id=req.job_id)
            job.last_seen = now
            old = job.agents.get(req.agent_id)
            pending: Iterable[Command] = ()
            wakers: dict[int, Callable[[], None]] = {}
            if old is not None:
                self._sessions.pop(old.session_id, None)
                pending = old.pending
                wakers = old.wakers
                for r in old.ranks:
                    cur = job.ranks.get(r)
                    if cur is not None and cur.agent_id == req.agent_id:
                        del job.ranks[r]
            agent = _Agent(
                agent_id=req.agent_id,
                host=req.host,
                session_id=session_id,
                ranks={ri.rank for ri in req.ranks},
                registered=now,
                last_report=now,
                agent_version=req.agent_version,
            )
            # An undelivered dump request survives the agent's reconnect.
            agent.pending.extend(c for c in pending if c.expires > now)
            job.agents[req.agent_id] = agent
            self._sessions[session_id] = (req.job_id, req.agent_id)
            for ri in req.ranks:
                # A rank that moved to this agent leaves its old one.
                prev = job.ranks.get(ri.rank)
                if prev is not None and prev.agent_id != req.agent_id:
                    other = job.agents.get(prev.agent_id)
                    if other is not None:
                        other.ranks.discard(ri.rank)
                job.ranks[ri.rank] = _Rank(
                    rank=ri.rank,
                    agent_id=req.agent_id,
                    host=req.host,
                    pid=ri.pid,
                    local_rank=ri.local_rank,
                    world_size=ri.world_size,
                    backend=ri.backend,
                    torch_version=ri.torch_version,
                    fr_source=ri.fr_source,
                )
                if ri.world_size > 0:
                    job.world_size = max(job.world_size or 0, ri.world_size)
                for gi in ri.groups:
                    g = job.groups.get(gi.name)
                    ranks = tuple(sorted(set(gi.ranks)))
                    if g is None:
                        job.groups[gi.name] = _Group(
                            name=gi.name, desc=gi.desc, ranks=ranks, last_progress=now
                        )
                    elif g.ranks != ranks or g.desc != gi.desc:
                        # Re-created group (or a fuller view of it): start its clock again.
                        job.groups[gi.name] = _Group(
                            name=gi.name, desc=gi.desc, ranks=ranks, last_progress=now
                        )
                    job.ranks[ri.rank].groups[gi.name] = _RankGroup(reported_at=now)
            # Wake the old session's command streams so they notice and end.
            for w in wakers.values():
                w()
        return session_id

    def session(self, session_id: str, job_id: str, agent_id: str) -> None:
        """Raise StaleSession unless the session is the agent's current one."""
        with self._lock:
            if self._sessions.get(session_id) != (job_id, agent_id):
                raise StaleSession(session_id)

    def report_progress(self, req: pb.ProgressReport) -> None:
        now = self._clock()
        with self._lock:
            job, agent = self._live(req.session_id, req.job_id, req.agent_id)
            if req.report_seq and req.report_seq <= agent.report_seq:
                return  # a retried or reordered report: already applied
            agent.report_seq = max(agent.report_seq, req.report_seq)
            agent.last_report = now
            agent.lost = False
            job.last_seen = now
            for rp in req.ranks:
                if rp.rank not in agent.ranks:
                    raise StaleSession(f"rank {rp.rank} was not registered by {req.agent_id}")
                r = job.ranks[rp.rank]
                r.process_state = process_state_name(rp.state)
                r.fr_age_s = rp.fr_age_s
                r.last_report = now
                for gp in rp.groups:
                    rg = r.groups.get(gp.group)
                    g = job.groups.get(gp.group)
                    if rg is None or g is None:
                        continue  # a group it never registered: membership unknown
                    # Where completion is not recorded, entering collectives is
                    # the only progress there is to see.
                    moved = (
                        gp.last_enqueued != rg.last_enqueued
                        if gp.completion_unknown
                        else gp.last_completed != rg.last_completed
                    )
                    if moved:
                        g.last_progress = now
                        job.last_progress = now
                    rg.last_enqueued = gp.last_enqueued
                    rg.last_completed = gp.last_completed
                    rg.completion_unknown = gp.completion_unknown
                    rg.reported_at = now
                    if gp.completion_unknown and gp.HasField("oldest_in_flight"):
                        # The agent names the op of the newest collective entered.
                        rg.in_flight_seq = gp.oldest_in_flight.seq
                        rg.in_flight_op = gp.oldest_in_flight.op
                        rg.in_flight_age_s = gp.oldest_in_flight.age_s
                    elif gp.HasField("oldest_in_flight") and gp.last_enqueued > gp.last_completed:
                        rg.in_flight_seq = gp.oldest_in_flight.seq
                        rg.in_flight_op = gp.oldest_in_flight.op
                        rg.in_flight_age_s = gp.oldest_in_flight.age_s
                    elif gp.last_enqueued > gp.last_completed:
                        rg.in_flight_seq = gp.last_completed + 1
                        rg.in_flight_op = ""
                        rg.in_flight_age_s = None
                    else:
                        rg.in_flight_seq = None
                        rg.in_flight_op = ""
                        rg.in_flight_age_s = None

    def report_entries(self, req: pb.EntryBatch) -> None:
        now = self._clock()
        with self._lock:
            job, agent = self._live(req.session_id, req.job_id, req.agent_id)
            agent.last_report = now
            agent.lost = False
            job.entries_dropped += req.dropped
            for e in req.entries:
                r = job.ranks.get(e.rank)
                if r is not None and r.agent_id == agent.agent_id:
                    r.entries.append(e)

    def record_event(self, ev: pb.Event) -> None:
        now = self._clock()
        with self._lock:
            job, agent = self._live(ev.session_id, ev.job_id, ev.agent_id)
            agent.last_report = now
            agent.lost = False
            job.events.append((now, ev))
            if ev.kind == pb.EVENT_KIND_RANK_EXITED and ev.rank in job.ranks:
                job.ranks[ev.rank].process_state = "gone"

    # ---- command streams ------------------------------------------------------

    def add_waker(
        self, session_id: str, job_id: str, agent_id: str, wake: Callable[[], None]
    ) -> int:
        with self._lock:
            _, agent = self._live(session_id, job_id, agent_id, touch=False)
            self._next_waker += 1
            agent.wakers[self._next_waker] = wake
            return self._next_waker

    def remove_waker(self, job_id: str, agent_id: str, token: int) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            agent = job.agents.get(agent_id) if job else None
            if agent is not None:
                agent.wakers.pop(token, None)

    def pending_commands(self, session_id: str, job_id: str, agent_id: str) -> list[Command]:
        """Unexpired commands for the agent; raises StaleSession when the stream's
        session was replaced (the stream must end)."""
        now = self._clock()
        with self._lock:
            _, agent = self._live(session_id, job_id, agent_id, touch=False)
            while agent.pending and agent.pending[0].expires <= now:
                agent.pending.popleft()
            return list(agent.pending)

    def push_command(self, job_id: str, agent_id: str, cmd: Command) -> bool:
        """Queue a command for an agent and wake its streams; False if unknown."""
        with self._lock:
            job = self._jobs.get(job_id)
            agent = job.agents.get(agent_id) if job else None
            if agent is None:
                return False
            agent.pending.append(cmd)
            for w in list(agent.wakers.values()):
                w()
            return True

    def retire_command(self, job_id: str, agent_id: str, incident_id: str) -> None:
        """The agent answered (or the incident closed): stop re-delivering it."""
        with self._lock:
            job = self._jobs.get(job_id)
            agent = job.agents.get(agent_id) if job else None
            if agent is not None:
                agent.pending = deque(
                    (c for c in agent.pending if c.incident_id != incident_id),
                    maxlen=PENDING_COMMANDS,
                )

    # ---- used by the incident manager -------------------------------------

    def now(self) -> float:
        return self._clock()

    def mark_lost_agents(self) -> list[tuple[str, str]]:
        """Flag agents silent for agent_lost_timeout; returns newly lost (job, agent)."""
        now = self._clock()
        lost: list[tuple[str, str]] = []
        with self._lock:
            for job in self._jobs.values():
                for a in job.agents.values():
                    if not a.lost and now - a.last_report > self.agent_lost_timeout:
                        a.lost = True
                        lost.append((job.job_id, a.agent_id))
        return lost

    def stalls(self, job_id: str, *, over_timeout_only: bool = False) -> list[StalledGroup]:
        """Every group's stall pattern, or (for the detector) only those past
        the stall timeout, which skips every group that progressed recently
        without looking at its members."""
        with self._lock:
            job = self._jobs.get(job_id)
            return self._stalls(job, self._clock(), over_timeout_only) if job else []

    def in_flight_key(self, job_id: str) -> tuple[str, int] | None:
        """The oldest (group, seq) any observed rank of the job is inside, if any."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            keys = [
                (g, rg.last_completed + 1)
                for r in job.ranks.values()
                if self._rank_observed(job, r)
                for g, rg in r.groups.items()
                if rg.last_enqueued > rg.last_completed
            ]
            return min(keys, key=lambda k: (k[1], k[0])) if keys else None

    def progressed_since(self, job_id: str, t: float) -> bool:
        """Did any rank of the job complete a collective after coordinator time t?"""
        with self._lock:
            job = self._jobs.get(job_id)
            return job is not None and job.last_progress > t

    def set_open_incident(self, job_id: str, incident_id: str | None) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None:
                job.open_incident = incident_id

    def open_incident(self, job_id: str) -> str | None:
        with self._lock:
            job = self._jobs.get(job_id)
            return job.open_incident if job else None

    def mark_handled(self, job_id: str, keys: Iterable[tuple[str, int]], incident_id: str) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            for k in keys:
                job.handled[k] = incident_id
                job.handled.move_to_end(k)
            while len(job.handled) > HANDLED_STALLS:
                job.handled.popitem(last=False)

    def handled_by(self, job_id: str, key: tuple[str, int]) -> str | None:
        with self._lock:
            job = self._jobs.get(job_id)
            return job.handled.get(key) if job else None

    def expected_ranks(self, job_id: str) -> list[int]:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return []
            if job.world_size:
                return list(range(job.world_size))
            return sorted(job.ranks)

    def dump_targets(self, job_id: str) -> tuple[dict[str, list[int]], dict[int, str]]:
        """(connected agent -> its ranks, rank -> why it cannot be asked) for an incident."""
        now = self._clock()
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return {}, {}
            agents: dict[str, list[int]] = {}
            unreachable: dict[int, str] = {}
            for a in job.agents.values():
                if a.lost:
                    for r in a.ranks:
                        unreachable[r] = (
                            f"agent unreachable: {a.agent_id} silent for {now - a.last_report:.1f}s"
                        )
                else:
                    agents[a.agent_id] = sorted(a.ranks)
            for r in range(job.world_size or 0):
                if r not in job.ranks:
                    unreachable[r] = "agent unreachable: no agent registered this rank"
            return agents, unreachable

    def rank_meta(self, job_id: str, rank: int) -> dict[str, object] | None:
        """What registration and the last report say about a rank (for bundles of
        ranks no agent could dump)."""
        now = self._clock()
        with self._lock:
            job = self._jobs.get(job_id)
            r = job.ranks.get(rank) if job else None
            if job is None or r is None:
                return None
            return {
                "rank": r.rank,
                "host": r.host,
                "pid": r.pid,
                "process_state": r.process_state,
                "last_report_age_s": None if r.last_report is None else now - r.last_report,
                "groups": [
                    {"name": g.name, "desc": g.desc, "pg_id": None, "ranks": list(g.ranks)}
                    for name in r.groups
                    if (g := job.groups.get(name)) is not None
                ],
            }

    # ---- internals ----------------------------------------------------------

    def _live(
        self, session_id: str, job_id: str, agent_id: str, *, touch: bool = True
    ) -> tuple[_Job, _Agent]:
        if self._sessions.get(session_id) != (job_id, agent_id):
            raise StaleSession(session_id)
        job = self._jobs[job_id]
        return job, job.agents[agent_id]

    def _evict_if_full(self) -> None:
        if len(self._jobs) < MAX_JOBS:
            return
        idle = [j for j in self._jobs.values() if all(a.lost for a in j.agents.values())]
        victims = sorted(idle or self._jobs.values(), key=lambda j: j.last_seen)
        victim = victims[0]
        for a in victim.agents.values():
            self._sessions.pop(a.session_id, None)
        del self._jobs[victim.job_id]

    def _rank_observed(self, job: _Job, r: _Rank) -> bool:
        a = job.agents.get(r.agent_id)
        return a is not None and not a.lost

    def _stalls(self, job: _Job, now: float, over_timeout_only: bool = False) -> list[StalledGroup]:
        out: list[StalledGroup] = []
        for g in _sorted_groups(job.groups):
            if over_timeout_only and now - g.last_progress < self.stall_timeout:
                continue
            members: list[tuple[_Rank, _RankGroup]] = []
            for rank in g.ranks:
                r = job.ranks.get(rank)
                rg = r.groups.get(g.name) if r else None
                if r is not None and rg is not None:
                    members.append((r, rg))
            assumed = _assumed_completed(members, lambda r: self._rank_observed(job, r))
            progress: dict[int, MemberProgress] = {}
            for r, rg in members:
                comp, op = rg.last_completed, rg.in_flight_op
                if rg.completion_unknown and assumed is not None:
                    comp = assumed
                    op = op if rg.in_flight_seq == assumed + 1 else ""
                progress[r.rank] = MemberProgress(
                    rank=r.rank,
                    last_enqueued=rg.last_enqueued,
                    last_completed=comp,
                    in_flight_op=op,
                    observed=self._rank_observed(job, r),
                    process_state=r.process_state,
                )
            st = find_group_stall(
                group=g.name,
                members=g.ranks,
                progress=progress,
                no_progress_for_s=now - g.last_progress,
            )
            if st is not None:
                out.append(
                    StalledGroup(
                        group=st.group,
                        seq=st.seq,
                        op=st.op,
                        waiting_ranks=st.waiting_ranks,
                        not_entered_ranks=st.not_entered_ranks,
                        stalled_for_s=st.stalled_for_s,
                        kind=st.kind,
                        dead_ranks=st.dead_ranks,
                        unobserved_ranks=st.unobserved_ranks,
                        over_timeout=st.stalled_for_s >= self.stall_timeout,
                    )
                )
        return out

    def _rank_views(self, job: _Job, now: float) -> list[RankLive]:
        max_completed = {
            name: max(
                (r.groups[name].last_completed for r in job.ranks.values() if name in r.groups),
                default=-1,
            )
            for name in job.groups
        }
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
                    in_flight_age_s=_age(rg, now),
                )
                for name, rg in sorted(r.groups.items(), key=lambda kv: _group_sort_key(kv[0]))
            ]
            lag = max(
                (
                    max(0, max_completed.get(name, -1) - rg.last_completed)
                    for name, rg in r.groups.items()
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
                    observed=self._rank_observed(job, r),
                    process_state=r.process_state,
                    groups=groups,
                    lag=lag,
                    backend=r.backend,
                    last_report_age_s=None if r.last_report is None else now - r.last_report,
                )
            )
        return views

    def _group_view(self, job: _Job, g: _Group, now: float) -> GroupLive:
        rgs = [
            job.ranks[r].groups[g.name]
            for r in g.ranks
            if r in job.ranks and g.name in job.ranks[r].groups
        ]
        completed = [rg.last_completed for rg in rgs]
        return GroupLive(
            name=g.name,
            desc=g.desc,
            ranks=list(g.ranks),
            max_completed=max(completed, default=-1),
            min_completed=min(completed, default=-1),
            max_enqueued=max((rg.last_enqueued for rg in rgs), default=-1),
            no_progress_for_s=now - g.last_progress,
        )

    def _agent_view(self, job: _Job, a: _Agent, now: float) -> AgentLive:
        return AgentLive(
            agent_id=a.agent_id,
            host=a.host,
            ranks=sorted(a.ranks),
            connected=not a.lost,
            last_report_age_s=now - a.last_report,
            session_id=a.session_id,
            watching=bool(a.wakers),
        )


def _assumed_completed(
    members: list[tuple[_Rank, _RankGroup]], observed: Callable[[_Rank], bool]
) -> int | None:
    """For a group whose recorder does not record completion: what to take as completed.

    Only entering is known, so a collective counts as finished once every
    observed member has entered it, except the newest one they all entered
    when none has gone further: that one may be what they are all stuck in
    (a mismatch, a dead peer). A rank behind the others is then "not entered"
    in the collective its peers wait in, as with gloo. A hang *inside* a
    collective every member entered is invisible here; the coordinator learns
    of it from torch's watchdog (dump-on-timeout, health check, abort hooks).
    """
    enq = [rg.last_enqueued for r, rg in members if rg.completion_unknown and observed(r)]
    if not enq:
        return None
    lo, hi = min(enq), max(enq)
    return lo if hi > lo else lo - 1


def _age(rg: _RankGroup, now: float) -> float | None:
    if rg.in_flight_seq is None or rg.in_flight_age_s is None:
        return None
    return rg.in_flight_age_s + (now - rg.reported_at)


def _group_sort_key(name: str) -> tuple[int, int, str]:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _sorted_groups(groups: dict[str, _Group]) -> list[_Group]:
    return [groups[k] for k in sorted(groups, key=_group_sort_key)]
