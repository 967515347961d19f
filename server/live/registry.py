"""Live, in-memory job state fed by the gRPC handlers; thread-safe.

Nothing here is durable: after a coordinator restart agents are told their
session is unknown, re-register, and the next progress reports rebuild it.
"Since when" questions are answered with the coordinator's own monotonic
clock (when a report arrived, when a number last changed); agents' clocks only
ever contribute durations they measured themselves.

The registry owns the lock and the records; what it hands out is built by
`views` (read-only copies), `stalls` (the stall scan) and `commands` (the
agents' mailboxes); callers import those names from those modules.
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Final

from hangwatch.server.live.cells import message_cells, store_cells
from hangwatch.server.live.commands import Command
from hangwatch.server.live.detector import JobQuiet, quiet_bound
from hangwatch.server.live.rates import RankRates
from hangwatch.server.live.records import (
    AgentRecord,
    CellPlan,
    GroupRecord,
    JobRecord,
    RankRecord,
)
from hangwatch.server.live.stalls import scan_quiet, scan_stalls
from hangwatch.server.live.views import (
    UNOBSERVED,
    JobCensus,
    JobSnapshot,
    StalledGroup,
    capture,
    stopped_reason,
)

from hangwatch import formats, progress_columns
from hangwatch.formats import JobStopped, MissingReason
from hangwatch.wire import (
    EXITED_PROCESS_STATES,
    group_members,
    next_seq,
    pb,
    process_state_name,
)

# Bounds on what agents can make the coordinator hold.
MAX_WORLD_SIZE: Final = 1 << 20
MAX_RANKS_PER_AGENT: Final = 4096
MAX_GROUPS_PER_RANK: Final = 4096
MAX_JOBS: Final = 1024
HANDLED_STALLS: Final = 4096  # (group, seq) pairs remembered per job for dedupe


def _run(cells: list[int]) -> int:
    """cells[0] when `cells` are consecutive indices, all known; else -1."""
    if not cells or cells[0] < 0:
        return -1
    return cells[0] if cells == list(range(cells[0], cells[0] + len(cells))) else -1


class StaleSession(Exception):
    """The session is not (or no longer) the agent's current one: re-register."""


class JobRegistry:
    """Every job's agents, ranks, groups and progress, as last reported."""

    def __init__(
        self,
        *,
        agent_lost_timeout: float = 10.0,
        stall_timeout: float = 10.0,
        startup_grace: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent_lost_timeout = agent_lost_timeout
        self.stall_timeout = stall_timeout
        self.startup_grace = startup_grace
        self._clock = clock
        self._lock = threading.RLock()
        self._jobs: dict[str, JobRecord] = {}
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
        """Largest in-flight age over the job's observed ranks still running,
        seconds: an exited rank's last report is not a collective in flight."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            now = self._clock()
            ages = [
                a
                for r in job.ranks.values()
                if job.observed(r) and r.process_state not in EXITED_PROCESS_STATES
                for _, cell in job.cells_of(r)
                if (a := cell.in_flight_age(now)) is not None
            ]
            return max(ages) if ages else None

    def census(self) -> list[JobCensus]:
        """Every job's agents and ranks counted by state, in one pass (no views built)."""
        out: list[JobCensus] = []
        with self._lock:
            for job in self._jobs.values():
                agents = {"connected": 0, "lost": 0}
                for a in job.agents.values():
                    agents["lost" if a.lost else "connected"] += 1
                ranks: dict[str, int] = {}
                for r in job.ranks.values():
                    state = r.process_state if job.observed(r) else UNOBSERVED
                    ranks[state] = ranks.get(state, 0) + 1
                out.append(
                    JobCensus(
                        job_id=job.job_id,
                        agents=agents,
                        ranks=ranks,
                        world_size=job.world_size,
                        open_incident=job.open_incident,
                        ended=stopped_reason(job),
                        progress_moves=job.progress_moves,
                    )
                )
        return out

    def snapshot(self, job_id: str) -> JobSnapshot | None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            now = self._clock()
            stalled = scan_stalls(
                job,
                now,
                self.stall_timeout,
                startup_grace=self.startup_grace,
                first_report_s=self.agent_lost_timeout,
            )
            numbers = capture(job, now)
        # The views are built without the lock (views.JobCapture).
        return numbers.snapshot(stalled)

    # ---- writes from the gRPC handlers -------------------------------------

    def register(self, req: pb.RegisterRequest) -> str:
        """Record an agent and its ranks; returns the new session id. The
        request must already be validated (hangwatch.server.ingest.validate)."""
        now = self._clock()
        session_id = secrets.token_hex(16)
        with self._lock:
            job = self._jobs.get(req.job_id)
            if job is None:
                self._evict_if_full()
                job = self._jobs[req.job_id] = JobRecord(job_id=req.job_id)
            job.last_seen = now
            job.layout += 1
            if req.ranks and not job.started:
                # From its first rank, not its first agent: an agent starts
                # before its ranks and registers none, and the ranks' import of
                # torch took 9 s in a loaded test run, all of it counted as the
                # job being quiet (a compiling job was paged 0.4 s after its
                # ranks appeared, their CPU not yet known).
                job.started = now
            restarted = False
            # Each rank number read once: the job's key, its record and its
            # agent's tuple share one int (a read of a message's field makes
            # a new one, 32 bytes each past 256).
            numbers = [ri.rank for ri in req.ranks]
            for rank, ri in zip(numbers, req.ranks, strict=True):
                cur = job.ranks.get(rank)
                before = cur.pid if cur is not None else job.left_pids.get(rank)
                restarted |= before is not None and before != ri.pid
                if before != ri.pid:
                    job.last_new_rank = now
            if restarted:
                # A new process holds a rank: the job was restarted under the
                # same id and will reach the same (group, seq) pairs again. A
                # stall there is a new hang, not one an earlier incident covered.
                job.handled.clear()
                job.started = now
            old = job.agents.get(req.agent_id)
            dropped: dict[int, RankRecord] = {}
            if old is not None:
                self._sessions.pop(old.session_id, None)
                for r in old.ranks:
                    cur = job.ranks.get(r)
                    if cur is not None and cur.agent_id == req.agent_id:
                        dropped[r] = job.ranks.pop(r)
            agent = AgentRecord(
                agent_id=req.agent_id,
                host=req.host,
                session_id=session_id,
                ranks=tuple(sorted(set(numbers))),
                registered=now,
                last_report=now,
                agent_version=req.agent_version,
            )
            job.agents[req.agent_id] = agent
            self._sessions[session_id] = (req.job_id, req.agent_id)
            for rank, ri in zip(numbers, req.ranks, strict=True):
                job.left_pids.pop(rank, None)
                self._register_rank(job, req, rank, ri, now, dropped.get(rank))
            for r in dropped.values():
                cur = job.ranks.get(r.rank)
                # What its new record did not take over is given up.
                if cur is None:
                    job.left_pids[r.rank] = r.pid
                if cur is None or cur.first_cell != r.first_cell:
                    job.cells.release(r.cell_count)
                if cur is None or cur.rate_slot != r.rate_slot:
                    job.rates.release(r.rate_slot)
            if job.cells.wants_compacting():
                self._compact(job)
            # The group records' own name strings, not the message's copies.
            agent.group_names = tuple(
                g.name if (g := job.groups.get(name)) is not None else name
                for name in progress_columns.group_table(req.ranks)
            )
            if old is not None:
                agent.mailbox.inherit(old.mailbox, now)
        return session_id

    def _register_rank(
        self,
        job: JobRecord,
        req: pb.RegisterRequest,
        rank_no: int,
        ri: pb.RankInfo,
        now: float,
        mine_before: RankRecord | None,
    ) -> None:
        """`rank_no`: ri.rank, read once; `mine_before`: this agent's record of
        the rank under its previous session."""
        # A rank that moved to this agent leaves its old one.
        prev = job.ranks.get(rank_no) or mine_before
        if prev is not None and prev.agent_id != req.agent_id:
            other = job.agents.get(prev.agent_id)
            if other is not None:
                other.ranks = tuple(r for r in other.ranks if r != rank_no)
        # The same process registered again (its agent restarted, or reconnected
        # after a partition): keep the numbers it last reported, so that its next
        # report is compared with them. Read as a fresh baseline, a rank still
        # stuck where it was would look like progress and resolve a live hang.
        kept_from = prev if prev is not None and prev.pid == ri.pid and ri.pid > 0 else None
        replaced = job.ranks.get(rank_no)  # its span is released unless reused below
        # The agent's strings, and one copy of each rank's few distinct ones:
        # a str per rank and field read from the message was 300 B a rank.
        agent = job.agents[req.agent_id]
        rank = job.ranks[rank_no] = RankRecord(
            rank=rank_no,
            agent_id=agent.agent_id,
            host=agent.host,
            pid=ri.pid,
            backend=sys.intern(ri.backend),
        )
        if ri.world_size > 0:
            job.world_size = max(job.world_size or 0, ri.world_size)
        gids = array("i")
        for gi in ri.groups:
            g = job.groups.get(gi.name)
            # Arrays, not tuples: a tuple of ranks holds an int object for
            # each past 256 (36 bytes a member, against 4 or 8 here).
            sent_as = array("q", gi.rank_ranges) or array("i", gi.ranks)
            if g is None or g.sent_as != sent_as or g.desc != gi.desc:
                # Not another member's view of the same group, sent the same way.
                ranks = array("i", group_members(gi))
                if sent_as == ranks:
                    sent_as = ranks  # sent as its members, ascending: one array
                if g is None or g.ranks != ranks or g.desc != gi.desc:
                    # A re-created group (or a fuller view of it) starts its clock again.
                    # A job's group descriptions are a few ("tp", "dp", "undefined"):
                    # one str each, not ~60 bytes a group.
                    g = job.groups[gi.name] = GroupRecord(
                        name=gi.name,
                        desc=sys.intern(gi.desc),
                        ranks=ranks,
                        last_progress=now,
                        sent_as=sent_as,
                    )
                else:
                    g.sent_as = sent_as
            # Keyed by the group record's own name: every read of a message's
            # string field makes a new str (~55 B a rank and group, kept).
            gids.append(job.cells.group_id(g.name))
        t = job.cells
        rank.cell_count = len(gids)
        if prev is not None and t.span_groups(prev.first_cell, prev.cell_count) == gids:
            # The same groups as before: the same cells, kept or started over.
            rank.first_cell = prev.first_cell
            if kept_from is None:
                t.reset(prev.first_cell, prev.cell_count, now)
        else:
            rank.first_cell = t.allocate(gids, now)
            if kept_from is not None:
                for k, gid in enumerate(gids):
                    was = t.find(kept_from.first_cell, kept_from.cell_count, gid)
                    if was >= 0:
                        t.copy(was, rank.first_cell + k)
            if replaced is not None:
                t.release(replaced.cell_count)
        # Its rates' row: the one it had, its CPU kept for the same process;
        # storage I/O starts over either way.
        rates = job.rates
        if prev is None:
            rank.rate_slot = rates.allocate()
        else:
            rank.rate_slot = prev.rate_slot
            if kept_from is None:
                rates.cpu.clear(prev.rate_slot)
            rates.io.clear(prev.rate_slot)

    def session(self, session_id: str, job_id: str, agent_id: str) -> None:
        """Raise StaleSession unless the session is the agent's current one."""
        with self._lock:
            if self._sessions.get(session_id) != (job_id, agent_id):
                raise StaleSession(session_id)

    def report_progress(
        self, req: pb.ProgressReport, columns: progress_columns.Columns | None = None
    ) -> None:
        """Apply a report: its `ranks`, and `columns` (req.columns, unpacked and
        checked by ingest.validate) when it had any."""
        now = self._clock()
        with self._lock:
            job, agent = self._live(req.session_id, req.job_id, req.agent_id)
            if req.report_seq and req.report_seq <= agent.report_seq:
                return  # a retried or reordered report: already applied
            # Every rank resolved before anything is stored: a report naming a
            # rank the agent no longer holds changes nothing (StaleSession).
            rows = [self._reported_rank(job, agent, rp.rank) for rp in req.ranks]
            plan = None if columns is None else self._cell_plan(job, agent, columns)
            agent.report_seq = max(agent.report_seq, req.report_seq)
            agent.last_report = now
            agent.lost = False
            job.last_seen = now
            moved = False
            for r, rp in zip(rows, req.ranks, strict=True):
                demand = rp.cpu_time_ns + rp.runqueue_wait_ns if rp.cpu_time_ns else 0
                self._apply_rank(
                    job.rates,
                    r,
                    now,
                    rp.state,
                    rp.finished,
                    demand,
                    rp.in_compile,
                    rp.compiler_running,
                    rp.io_bytes,
                )
            if req.ranks:
                moved |= store_cells(job, *message_cells(job, rows, req.ranks), now)
            if columns is not None and plan is not None:
                moved |= self._apply_columns(job, plan, columns, now)
            if moved:
                job.note_move(now)

    def _reported_rank(self, job: JobRecord, agent: AgentRecord, rank: int) -> RankRecord:
        if rank not in agent.ranks:
            raise StaleSession(f"rank {rank} was not registered by {agent.agent_id}")
        return job.ranks[rank]

    def _apply_rank(
        self,
        rates: RankRates,
        r: RankRecord,
        now: float,
        state: int,
        finished: bool,
        demand: int,
        in_compile: bool,
        compiler_running: bool = False,
        io_bytes: int = 0,
    ) -> None:
        r.process_state = process_state_name(state)
        r.finished = finished
        r.last_report = now
        # Time waiting for a CPU is demand for one (RankProgress.runqueue_wait_ns).
        rates.cpu.note(r.rate_slot, now, demand, self.stall_timeout, zero_known=False)
        rates.io.note(r.rate_slot, now, io_bytes, self.stall_timeout, zero_known=True)
        r.in_compile = in_compile
        r.compiler_running = compiler_running

    def _apply_columns(
        self, job: JobRecord, plan: CellPlan, c: progress_columns.Columns, now: float
    ) -> bool:
        """The columnar form: the same steps as `ranks`, over unpacked tuples
        (`plan` the records they resolved to)."""
        for r, state, flags, cpu, wait, io in zip(
            plan.rows,
            c.state,
            c.rank_flags,
            c.cpu_time_ns,
            c.runqueue_wait_ns,
            c.io_bytes,
            strict=True,
        ):
            self._apply_rank(
                job.rates,
                r,
                now,
                state,
                bool(flags & progress_columns.FINISHED),
                cpu + wait if cpu else 0,
                bool(flags & progress_columns.IN_COMPILE),
                bool(flags & progress_columns.COMPILER_RUNNING),
                io,
            )
        return store_cells(job, plan.cells, plan.groups, c, now, plan.run)

    def _cell_plan(
        self, job: JobRecord, agent: AgentRecord, c: progress_columns.Columns
    ) -> CellPlan:
        """The records `c`'s ranks and cells are applied to: the agent's last
        plan when the job's layout and the report's ranks and cells are the
        same as then (their packed bytes compared, in C), else resolved and
        checked again."""
        p = agent.plan
        if p is not None and p.layout == job.layout and p.packed_layout == c.packed_layout:
            return p
        table = agent.group_names
        if c.cell_group and max(c.cell_group) >= len(table):
            # Checked here, not in validate: only the session knows its table.
            raise progress_columns.ColumnsError(
                f"columns.cell_group: {max(c.cell_group)} is not one of the session's"
                f" {len(table)} groups"
            )
        rows = tuple(self._reported_rank(job, agent, rank) for rank in c.rank)
        cells: list[int] = []
        groups: list[GroupRecord | None] = []
        t = job.cells
        gids = [t.known_group(name) for name in table]
        for i, gi in zip(c.cell_rank, c.cell_group, strict=True):
            r = rows[i]
            k = t.find(r.first_cell, r.cell_count, gids[gi])
            g = job.groups.get(table[gi])
            # A group it never registered: membership unknown, not applied.
            known = k >= 0 and g is not None
            cells.append(k if known else -1)
            groups.append(g if known else None)
        run = _run(cells)
        p = agent.plan = CellPlan(
            layout=job.layout,
            packed_layout=c.packed_layout,
            rows=rows,
            # A run (the usual plan) as a range: 48 bytes, where an array of
            # its cells was 37 bytes a rank (benchmarks/ingest_path.py).
            cells=range(run, run + len(cells)) if run >= 0 else array("q", cells),
            groups=tuple(groups),
            run=run,
        )
        return p

    def report_entries(self, req: pb.EntryBatch) -> None:
        """Accepted and discarded: nothing ever read the entries (the dashboard
        shows progress, incidents carry full dumps), and current agents no
        longer send them. Older agents still may, so the call stays a sign of
        life and still tells a stale session to re-register."""
        now = self._clock()
        with self._lock:
            _, agent = self._live(req.session_id, req.job_id, req.agent_id)
            agent.last_report = now
            agent.lost = False

    def record_event(self, ev: pb.Event) -> None:
        now = self._clock()
        with self._lock:
            job, agent = self._live(ev.session_id, ev.job_id, ev.agent_id)
            agent.last_report = now
            agent.lost = False
            job.events.append((now, ev))
            exited = (pb.EVENT_KIND_RANK_EXITED, pb.EVENT_KIND_RANK_CRASHED)
            if ev.kind in exited and ev.rank in job.ranks:
                job.ranks[ev.rank].process_state = "gone"

    # ---- command streams ------------------------------------------------------

    def add_waker(
        self, session_id: str, job_id: str, agent_id: str, wake: Callable[[], None]
    ) -> int:
        with self._lock:
            _, agent = self._live(session_id, job_id, agent_id)
            self._next_waker += 1
            agent.mailbox.wakers[self._next_waker] = wake
            return self._next_waker

    def remove_waker(self, job_id: str, agent_id: str, token: int) -> None:
        with self._lock:
            agent = self._agent(job_id, agent_id)
            if agent is not None:
                agent.mailbox.wakers.pop(token, None)

    def pending_commands(self, session_id: str, job_id: str, agent_id: str) -> list[Command]:
        """Unexpired commands for the agent; raises StaleSession when the stream's
        session was replaced (the stream must end)."""
        now = self._clock()
        with self._lock:
            _, agent = self._live(session_id, job_id, agent_id)
            return agent.mailbox.unexpired(now)

    def push_command(self, job_id: str, agent_id: str, cmd: Command) -> bool:
        """Queue a command for an agent and wake its streams; False if unknown."""
        with self._lock:
            agent = self._agent(job_id, agent_id)
            if agent is None:
                return False
            agent.mailbox.push(cmd)
            return True

    def retire_command(
        self, job_id: str, agent_id: str, incident_id: str, kind: int | None = None
    ) -> None:
        """The agent answered (or the incident closed): stop re-delivering it
        (every command of the incident, or only those of `kind`)."""
        with self._lock:
            agent = self._agent(job_id, agent_id)
            if agent is not None:
                agent.mailbox.retire(incident_id, kind)

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
            if job is None:
                return []
            return scan_stalls(
                job,
                self._clock(),
                self.stall_timeout,
                over_timeout_only,
                self.startup_grace,
                first_report_s=self.agent_lost_timeout,
            )

    @property
    def quiet_bound_s(self) -> float:
        """The most any hang may stay silent (detector.quiet_bound)."""
        return quiet_bound(self.stall_timeout, self.startup_grace)

    def quiet(self, job_id: str) -> JobQuiet | None:
        """The job stopped making progress with no collective in flight, past
        its threshold (detector.find_job_quiet), or None."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            return scan_quiet(job, self._clock(), self.stall_timeout, self.quiet_bound_s)

    def in_flight_key(self, job_id: str) -> tuple[str, int] | None:
        """The oldest (group, seq) any observed rank of the job is inside, if any."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            keys = [
                (g, next_seq(c[1]))
                for r in job.ranks.values()
                if job.observed(r)
                for g, cell in job.cells_of(r)
                if (c := cell.collectives()) is not None and c[0] > c[1]
            ]
            return min(keys, key=lambda k: (k[1], k[0])) if keys else None

    def progressed_since(self, job_id: str, t: float) -> bool:
        """Did any rank of the job complete a collective after coordinator time t?"""
        with self._lock:
            job = self._jobs.get(job_id)
            return job is not None and job.last_progress > t

    def moved_past(
        self, job_id: str, since: float, waits: Iterable[tuple[str, int, Sequence[int]]]
    ) -> bool:
        """Has the job moved on past an incident opened at coordinator time
        `since`: a rank completed a collective after it, and every rank its
        stall waited on (`waits`: group, seq, ranks) is observed, alive and has
        entered collective seq of its group (group "": alive and observed,
        a crashed rank)? Counters that move as a job dies
        are no recovery: a stopped job's survivors fail the collective they
        waited in, gloo counts it completed, and the lost connection crashes
        them (live, that resolved a hang a moment before the crash opened a
        second incident)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.last_progress <= since:
                return False
            for group, seq, ranks in waits:
                for rank in ranks:
                    r = job.ranks.get(rank)
                    if r is None or not job.observed(r) or r.process_state in EXITED_PROCESS_STATES:
                        return False
                    if not group:
                        continue  # a crashed rank: alive again is all it takes
                    cell = job.cell(r, group)
                    if cell is None or cell.counts()[0] < seq:
                        return False
            return True

    def restarted_since(self, job_id: str, t: float) -> bool:
        """Did new processes take the job's ranks (a restart under the same id) after t?"""
        with self._lock:
            job = self._jobs.get(job_id)
            return job is not None and job.started > t

    def last_progress(self, job_id: str) -> float | None:
        """Coordinator time any rank of the job last completed more, if ever."""
        with self._lock:
            job = self._jobs.get(job_id)
            return job.last_progress if job is not None and job.last_progress > 0 else None

    def job_stopped(self, job_id: str) -> JobStopped | None:
        """Why the job is over (views.stopped_reason), or None while any of its
        ranks may still run. The coordinator forgetting the job counts too."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return JobStopped.FORGOTTEN
            return stopped_reason(job)

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

    def world_size(self, job_id: str) -> int | None:
        """The job's world size as its ranks registered it; None when unknown."""
        with self._lock:
            job = self._jobs.get(job_id)
            return job.world_size or None if job is not None else None

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
                        unreachable[r] = MissingReason.AGENT_UNREACHABLE.text(
                            f"{a.agent_id} silent for {now - a.last_report:.1f}s"
                        )
                else:
                    agents[a.agent_id] = sorted(a.ranks)
            for r in range(job.world_size or 0):
                if r not in job.ranks:
                    unreachable[r] = MissingReason.AGENT_UNREACHABLE.text(
                        "no agent registered this rank"
                    )
            return agents, unreachable

    def rank_meta(self, job_id: str, rank: int) -> formats.RankMeta | None:
        """What registration and the last report say about a rank (for bundles of
        ranks no agent could dump)."""
        now = self._clock()
        with self._lock:
            job = self._jobs.get(job_id)
            r = job.ranks.get(rank) if job else None
            if job is None or r is None:
                return None
            return formats.RankMeta(
                rank=r.rank,
                host=r.host,
                pid=r.pid,
                process_state=r.process_state,
                last_report_age_s=None if r.last_report is None else now - r.last_report,
                groups=tuple(
                    # pg_id None: it is the rank's own local index, which registration lacks.
                    formats.GroupInfo(name=g.name, desc=g.desc, ranks=list(g.ranks))
                    for name, _ in job.cells_of(r)
                    if (g := job.groups.get(name)) is not None
                ),
            )

    # ---- internals ----------------------------------------------------------

    def _live(self, session_id: str, job_id: str, agent_id: str) -> tuple[JobRecord, AgentRecord]:
        if self._sessions.get(session_id) != (job_id, agent_id):
            raise StaleSession(session_id)
        job = self._jobs[job_id]
        return job, job.agents[agent_id]

    def _compact(self, job: JobRecord) -> None:
        """Drop the cells no rank holds: every rank's span moves. Only under a
        registration, which bumped `job.layout`: no plan made before is used."""
        ranks = list(job.ranks.values())
        job.cells, starts = job.cells.compacted([(r.first_cell, r.cell_count) for r in ranks])
        for r, start in zip(ranks, starts, strict=True):
            r.first_cell = start

    def _agent(self, job_id: str, agent_id: str) -> AgentRecord | None:
        job = self._jobs.get(job_id)
        return job.agents.get(agent_id) if job else None

    def _evict_if_full(self) -> None:
        if len(self._jobs) < MAX_JOBS:
            return
        idle = [j for j in self._jobs.values() if all(a.lost for a in j.agents.values())]
        victims = sorted(idle or self._jobs.values(), key=lambda j: j.last_seen)
        victim = victims[0]
        for a in victim.agents.values():
            self._sessions.pop(a.session_id, None)
            a.mailbox.wake()  # its command streams find their session gone and end
        del self._jobs[victim.job_id]
