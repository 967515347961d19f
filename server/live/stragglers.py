"""Stragglers: ranks that are slow but not hung, named from the status polls alone.

The signal. Every agent reads its ranks' FR status on a grid of the poll
interval laid on the coordinator's clock (agent/lateness.py), so at each tick
the coordinator holds, per group, every member's enqueue counter read within
milliseconds of one instant. A rank that enters collectives late is, at a
random instant, behind its peers with probability (its lateness) / (the
step): the fraction of ticks at which it is behind the group's median member
*is* the fraction of the job's time its peers spend waiting for it. That
fraction is the score; no step boundary or collectives-per-step count is
needed, and the rank's training process does no extra work for it.

Corrections. Readings of one tick are not simultaneous (a few ms apart): each
counter is moved to the tick's median instant at the group's rate. A group
whose median counter has not moved for IDLE_TICKS is idle or hung: no
evidence either way (a hang is the stall detector's business, not a score).
With NCCL's `last_started_collective` the same test on the started counter
tells a rank that enqueues on time but starts late (device or link side)
from one that enqueues late (host side).

The decision. Per (group, rank) a CUSUM of the per-tick log-likelihood ratio
of "behind" under P1 (10% of instants) against P0 (2%), plus three guards
that a healthy job's noise does not pass: the window's score is at least
P_FLAG, at least RATIO times the median of the other members' scores, and
it came from at least MIN_EPISODES separate runs of "behind" (one long
pause, a checkpoint on rank 0, is one run, not a straggler). A flagged rank
is cleared once its score over the last CLEAR_TICKS falls below P_CLEAR.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from hangwatch.server.live.tracks import (
    CUSUM_H,
    NOT_THIS_TICK,
    WINDOW_TICKS,
    GroupHistory,
    TickReadings,
    Tracks,
    group_medians,
    group_medians_int,
    medians_without,
)

from hangwatch import pollgrid, progress_columns
from hangwatch.rankspec import format_ranks
from hangwatch.wire import pb

log = logging.getLogger("hangwatch.server")

P_FLAG: Final = 0.03  # the score (behind less ahead) must exceed the peers' median by this
Z_FLAG: Final = 4.0  # ... and by this many standard errors of the peers' noise
NOISE_FLOOR: Final = 0.01  # least per-tick variance assumed (a job with no noise at all)
MIN_TICKS: Final = 20
# The strip's top bucket (25%+ of the window): a rank this late and not named
# is said to have been late in one long run (RankLateness.long_run).
LONG_RUN_SCORE: Final = 0.25
MIN_EPISODES: Final = 5
P_CLEAR: Final = 0.01
CARRY_TICKS: Final = 5  # an unchanged rank's last reading stands for this many ticks
CLOSE_AFTER_TICKS: Final = 2  # a tick is scored once readings two ticks newer arrive
MAX_CLOCK_ERROR_NS: Final = 20_000_000  # readings from a worse-synchronised agent are left out
MAX_JOBS: Final = 1024
MAX_SKEW_TICKS: Final = 10  # a reading further than this from the coordinator's now is refused
KIND_HOST: Final = "host"
# The notification (server/integrations/notifications.py) a newly named straggler publishes.
STRAGGLER_EVENT: Final = "straggler"
KIND_DEVICE: Final = "device"


@dataclass(frozen=True)
class RankLateness:
    rank: int
    host: str
    # Share of the window's instants at which the rank was behind its group's
    # median member: the share of the job's time spent waiting for it.
    score: float
    # Mean lateness entering a collective, ms (its gap to the median member, in time).
    late_ms: float
    group: str  # the group of its worst score
    ticks: int  # instants observed in the window
    # Score on the started counter, where the backend records starts (NCCL); else None.
    started_score: float | None
    straggler: bool

    @property
    def long_run(self) -> bool:
        """Red on the strip (25%+) without being a straggler: its lateness came in
        one long run (a pause, or the start of a hang), not in repeated episodes."""
        return self.score >= LONG_RUN_SCORE and not self.straggler


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    score: float
    late_ms: float
    since: float  # unix seconds (coordinator clock) when it was flagged
    kind: str  # KIND_HOST: enqueues late; KIND_DEVICE: enqueues on time, starts late
    group: str


@dataclass(frozen=True)
class JobStragglers:
    job: str
    window_s: float
    tick_s: float
    ranks: list[RankLateness]
    stragglers: list[Straggler]

    @property
    def worst_score(self) -> float:
        return max((r.score for r in self.ranks), default=0.0)

    @property
    def none_named(self) -> str:
        """What the page says when nobody is named. A rank can score high from one
        long run of lateness (a pause, or the start of a hang) without being a
        straggler (MIN_EPISODES separate runs); the strip then shows it red, and
        a bare "No stragglers." beside it would read as a contradiction."""
        late = [r.rank for r in self.ranks if r.long_run]
        if not late:
            return "No stragglers."
        return (
            f"No stragglers: ranks {format_ranks(late)} kept their group waiting 25%+ of the"
            " window, in one long run rather than the repeated lateness of a straggler"
            " (a pause, or a hang: see the stalled collectives)."
        )


class RankHosts:
    """Each rank's host, for naming a straggler's node: an index a rank into
    the job's distinct host names. A dict of rank to host was ~100 bytes a
    rank (its entry and an int key past 256); this is 4, the array growing to
    the highest rank registered (at most MAX_WORLD_SIZE, 4 MiB)."""

    __slots__ = ("_ids", "_names", "_of")

    def __init__(self) -> None:
        self._of = array("i")
        self._names: list[str] = []
        self._ids: dict[str, int] = {}

    def set(self, ranks: list[int], host: str) -> None:
        i = self._ids.get(host)
        if i is None:
            i = self._ids[host] = len(self._names)
            self._names.append(host)
        top = max(ranks, default=-1)
        if top >= len(self._of):
            self._of.extend(array("i", [-1]) * (top + 1 - len(self._of)))
        for r in ranks:
            self._of[r] = i

    def get(self, rank: int) -> str:
        """Its host; "" for a rank no agent registered."""
        i = self._of[rank] if 0 <= rank < len(self._of) else -1
        return self._names[i] if i >= 0 else ""


@dataclass
class _Job:
    groups: GroupHistory = field(default_factory=GroupHistory)
    cells: Tracks = field(default_factory=Tracks)
    pending: dict[int, TickReadings] = field(default_factory=dict)
    hosts: RankHosts = field(default_factory=RankHosts)
    group_tables: dict[str, np.ndarray] = field(default_factory=dict)  # agent -> gid per index
    # Agent -> the rank, cell_rank and cell_group bytes of its newest filed
    # report. An agent sends the same ones report after report, and a report
    # is held until its tick is scored, two ticks on: the held reports share
    # one copy instead of one each: three ticks of filed reports 468 -> 406
    # bytes a rank (benchmarks/ingest_path.py), the copy being the registry's
    # plan's own when both took the same unpacked report.
    layouts: dict[str, tuple[bytes, bytes, bytes]] = field(default_factory=dict)
    epoch_ns: int | None = None  # instants in the group history are ns after this
    scored_through: int = -1
    newest_tick: int = -1
    dropped_late: int = 0


class StragglerMonitor:
    """Per job, the lateness of every rank and the stragglers; thread-safe.

    Fed by ReportProgress (`observe`), read by the API, the page and /metrics
    (`view`). `on_flag(job, straggler)` is called, outside the lock, once per
    rank each time it becomes a straggler.

    Over arrays: at 4,096 ranks in 6 groups a tick is 24,576 (group, rank)
    tracks. Scored one Python object at a time that was 19.5 µs a rank a tick
    and filing 11 µs a rank report (benchmarks/ingest_path.py), the largest
    part of a healthy coordinator's CPU; here each report files as a few
    arrays and each tick is scored for every group at once.
    """

    def __init__(
        self,
        *,
        tick_s: float = 1.0,
        clock_ns: Callable[[], int] = time.time_ns,
        on_flag: Callable[[str, Straggler], None] | None = None,
    ) -> None:
        self.tick_ns = int(tick_s * 1e9)
        self._clock_ns = clock_ns
        self.on_flag = on_flag
        self._lock = threading.Lock()
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self._near = pollgrid.NearestTick(self.tick_ns)  # under the lock: reports come in ticks

    @property
    def tick_s(self) -> float:
        return self.tick_ns / 1e9

    @property
    def window_s(self) -> float:
        return WINDOW_TICKS * self.tick_s

    # ---- input --------------------------------------------------------------

    def register(self, req: pb.RegisterRequest) -> None:
        with self._lock:
            job = self._job(req.job_id)
            job.hosts.set([ri.rank for ri in req.ranks], req.host)
            # ProgressColumns.cell_group indexes the agent's newest session's table.
            table = progress_columns.group_table(req.ranks)
            job.group_tables[req.agent_id] = np.array(
                [job.groups.gid(name) for name in table], np.int64
            )

    def observe(
        self, req: pb.ProgressReport, columns: progress_columns.Columns | None = None
    ) -> None:
        """One agent's report: each carried rank's counters at its instant (its
        `ranks`, and `columns`: req.columns unpacked). Only files them, as they
        came (the gRPC handler calls this); `score_ready` does the work."""
        err = req.clock_error_ns
        if err <= 0 or err > MAX_CLOCK_ERROR_NS:
            return  # instants not comparable with other hosts'
        now = self._clock_ns()
        offset = req.clock_offset_ns
        with self._lock:
            job = self._job(req.job_id)
            if len(req.ranks):
                self._observe_messages(job, req, now)
            if columns is None or not columns.cell_rank:
                return
            table = job.group_tables.get(req.agent_id)
            if table is None:
                return
            c = columns
            layout = job.layouts.get(req.agent_id)
            if layout != c.packed_layout:
                layout = job.layouts[req.agent_id] = c.packed_layout
            tick = self._one_tick(job, c, offset, now)
            if tick is not None:
                if tick > job.scored_through:
                    base = self._near.at - offset  # the tick's instant on the agent's clock
                    self._pending(job, tick).add(table, base, req, layout)
                return
            near = pollgrid.NearestTick(self.tick_ns)
            ticks = [
                self._tick(job, near, at, state, offset, now)
                for at, state in zip(c.status_at_ns, c.state, strict=True)
            ]
            for tick in set(ticks):
                if tick is not None:
                    at = [a if t == tick else 0 for a, t in zip(c.status_at_ns, ticks, strict=True)]
                    base = pollgrid.instant_ns(tick, self.tick_ns) - offset
                    self._pending(job, tick).add(table, base, req, layout, at)

    def _one_tick(
        self, job: _Job, c: progress_columns.Columns, offset: int, now: int
    ) -> int | None:
        """The tick of every rank of the report, where one tick takes them all
        (an agent reads its ranks within milliseconds of an instant), checked
        over whole columns with C builtins; None where the ranks must be
        filed one by one."""
        lo, hi = min(c.status_at_ns), max(c.status_at_ns)
        if lo <= 0 or min(c.state) != pb.PROCESS_STATE_RUNNING:
            return None
        if max(c.state) != pb.PROCESS_STATE_RUNNING:
            return None
        lo, hi = lo + offset, hi + offset
        if max(abs(lo - now), abs(hi - now)) > MAX_SKEW_TICKS * self.tick_ns:
            return None
        tick, off = self._near.find(lo)
        if off > self.tick_ns // 8 or abs(hi - self._near.at) > self.tick_ns // 8:
            return None
        if tick <= job.scored_through:
            job.dropped_late += len(c.rank)
        else:
            job.newest_tick = max(job.newest_tick, tick)
        return tick

    def _observe_messages(self, job: _Job, req: pb.ProgressReport, now: int) -> None:
        """The per-rank form: agents older than columns, and ranks whose groups
        came after their agent registered."""
        near = pollgrid.NearestTick(self.tick_ns)
        offset = req.clock_offset_ns
        for rp in req.ranks:
            tick = self._tick(job, near, rp.status_at_ns, rp.state, offset, now)
            if tick is None:
                continue
            pending = self._pending(job, tick)
            at = rp.status_at_ns + offset - pollgrid.instant_ns(tick, self.tick_ns)
            for gp in rp.groups:
                pending.add_message(
                    job.groups.gid(gp.group),
                    rp.rank,
                    at,
                    gp.last_enqueued,
                    gp.last_started,
                    req.clock_error_ns,
                )

    def _pending(self, job: _Job, tick: int) -> TickReadings:
        pending = job.pending.get(tick)
        if pending is None:
            pending = job.pending[tick] = TickReadings()
            if job.epoch_ns is None:
                job.epoch_ns = pollgrid.instant_ns(tick, self.tick_ns)
        return pending

    def _tick(
        self,
        job: _Job,
        near: pollgrid.NearestTick,
        status_at_ns: int,
        state: int,
        offset_ns: int,
        now: int,
    ) -> int | None:
        """The grid tick a rank's reading belongs to, or None (not filed)."""
        if status_at_ns <= 0 or state != pb.PROCESS_STATE_RUNNING:
            return None
        at = status_at_ns + offset_ns
        if abs(at - now) > MAX_SKEW_TICKS * self.tick_ns:
            job.dropped_late += 1  # not now on our clock: a wrong clock, or a replay
            return None
        tick, off = near.find(at)
        if off > self.tick_ns // 8:
            return None  # off the grid: an agent polling faster than the ticks
        if tick <= job.scored_through:
            job.dropped_late += 1
            return None
        job.newest_tick = max(job.newest_tick, tick)
        return tick

    def score_ready(self) -> int:
        """Score every tick that readings two ticks newer have closed; returns how
        many. Called by the coordinator's straggler thread (and tests, on a fake clock)."""
        done = 0
        flagged: list[tuple[str, Straggler]] = []
        with self._lock:
            for job_id, job in self._jobs.items():
                n, new = self._score_through(job, job.newest_tick - CLOSE_AFTER_TICKS)
                done += n
                flagged.extend((job_id, s) for s in new)
        for job_id, s in flagged:
            self._notify(job_id, s)
        return done

    def _notify(self, job_id: str, s: Straggler) -> None:
        log.warning(
            "job %s: rank %d (%s) is a straggler: behind its peers %.0f%% of the time, "
            "%.1f ms late per collective (%s side, group %s)",
            job_id,
            s.rank,
            s.host,
            100 * s.score,
            s.late_ms,
            s.kind,
            s.group,
        )
        if self.on_flag is not None:
            try:
                self.on_flag(job_id, s)
            except Exception:
                log.exception("straggler notification failed")

    # ---- scoring --------------------------------------------------------------

    def _score_through(self, job: _Job, last_tick: int) -> tuple[int, list[Straggler]]:
        flagged: list[Straggler] = []
        ticks = sorted(t for t in job.pending if t <= last_tick)
        for tick in ticks:
            flagged.extend(self._score_tick(job, tick, job.pending.pop(tick)))
            job.scored_through = tick
        return len(ticks), flagged

    def _score_tick(self, job: _Job, tick: int, pending: TickReadings) -> list[Straggler]:
        """One tick, every group of the job at once."""
        cells, groups = job.cells, job.groups
        n_groups = len(groups.names)
        seq, gid, rank, at, enq, started, err = pending.readings()
        keep = (at != NOT_THIS_TICK) & (gid >= 0) & (rank >= 0) & (enq >= 0)
        pick = np.flatnonzero(keep)
        if len(pick) > 1 and bool((seq[pick[1:]] < seq[pick[:-1]]).any()):
            pick = pick[np.argsort(seq[pick], kind="stable")]  # both forms in one tick
        rows = cells.find(gid[pick], rank[pick])
        if len(rows) and np.bincount(rows).max() > 1:
            # A rank given twice in a tick: the later reading stands.
            last = len(rows) - 1 - np.unique(rows[::-1], return_index=True)[1]
            rows, pick = rows[last], pick[last]
        at, enq, started, err = at[pick], enq[pick], started[pick], err[pick]
        # A tick's arrays are its working set, which the heap keeps resident
        # between ticks: what is done with is dropped (benchmarks/ingest_path.py).
        del seq, rank, keep, pick
        cells.last_tick[rows] = tick
        cells.last_enq[rows] = enq
        cells.last_started[rows] = started
        cells.last_err[rows] = err
        # Agents report only ranks whose numbers changed: an unreported rank
        # still has its last counters, read at about this tick.
        live = cells.last_tick[: cells.n_rows]
        carried = np.flatnonzero((live != tick) & (tick - live <= CARRY_TICKS))
        if len(carried):
            rows = np.concatenate([rows, carried])
            at = np.concatenate([at, np.zeros(len(carried), np.int64)])
            enq = np.concatenate([enq, cells.last_enq[carried]])
            started = np.concatenate([started, cells.last_started[carried]])
            err = np.concatenate([err, cells.last_err[carried]])
        gid = cells.gid[rows]
        count = np.bincount(gid, minlength=n_groups)
        at_f, enq_f = at.astype(np.float64), enq.astype(np.float64)
        ref_at = group_medians_int(gid, at, count)
        med = group_medians_int(gid, enq, count)
        del at, enq
        # Groups with two readings or more: the rate over RATE_TICKS scored
        # ticks (steps longer than a tick still give a rate, not a run of zeros).
        active = np.flatnonzero(count >= 2)
        assert job.epoch_ns is not None
        base = float(pollgrid.instant_ns(tick, self.tick_ns) - job.epoch_ns)
        ref_abs = base + ref_at[active]
        med_a = med[active]
        rate, idle = groups.step(active, ref_abs, med_a)
        scored = active[(rate > 0) & ~idle]
        if not len(scored):
            return []
        groups.rate[scored] = rate[(rate > 0) & ~idle]
        is_scored = np.zeros(n_groups, bool)
        is_scored[scored] = True
        sel = is_scored[gid]
        rows, gid, at_f, enq_f, started, err = (
            a[sel] for a in (rows, gid, at_f, enq_f, started, err)
        )
        g_rate = groups.rate[gid]
        shift = g_rate * (at_f - ref_at[gid]) / 1e9
        adj = enq_f - shift
        count = np.bincount(gid, minlength=n_groups)
        gap = group_medians(gid, adj, count)[gid] - adj
        with_started = np.bincount(gid, weights=started < 0, minlength=n_groups) == 0
        sadj = started.astype(np.float64) - shift
        del at_f, enq_f, shift, adj, started
        started_gap = np.where(
            with_started[gid], group_medians(gid, sadj, count)[gid] - sadj, np.nan
        )
        del sadj
        cells.push(rows, gap, gap / g_rate, started_gap, err)
        return self._decide(job, is_scored)

    def _decide(self, job: _Job, is_scored: np.ndarray) -> list[Straggler]:
        """Flag and clear, in the groups just scored (`is_scored`, by gid): every
        group at once."""
        cells, groups = job.cells, job.groups
        n = cells.n_rows
        tracked = np.flatnonzero(is_scored[cells.gid[:n]] & (cells.n[:n] > 0))
        flagged = ~np.isnan(cells.flagged_at[tracked])
        hot = cells.cusum[tracked] >= CUSUM_H
        if not (flagged | hot).any():
            return []
        started = np.nan_to_num(cells.started_score(tracked), nan=0.0)
        cleared = flagged & (cells.score_clear(tracked) < P_CLEAR) & (started < P_CLEAR)
        for row in tracked[cleared].tolist():
            log.info(
                "group %s: rank %d is no longer a straggler",
                groups.names[cells.gid[row]],
                cells.rank[row],
            )
            cells.flagged_at[row], cells.cusum[row] = np.nan, 0.0
        gid = cells.gid[tracked]
        size = np.bincount(gid, minlength=len(groups.names))
        seen = cells.seen(tracked)
        cand = ~flagged & hot & (seen >= MIN_TICKS) & (size[gid] >= 2)
        if not cand.any():
            return []
        # Only the groups with a candidate; in each, the peers' medians for
        # every candidate from one sort: a median over the others per
        # candidate was O(members²) per tick once noise lifted many CUSUMs at
        # thousands of ranks.
        mine = np.isin(gid, np.unique(gid[cand]))
        members, gid, pick = tracked[mine], gid[mine], np.flatnonzero(cand[mine])
        scores, started = cells.score(members), started[mine]
        err_s, noise = cells.err_s[members], cells.noise(members)
        p = np.maximum(scores[pick], started[pick])
        rate = groups.rate[gid[pick]]
        # A clock error of e shifts a rank's share behind by up to rate * e:
        # that much of the excess proves nothing (NTP's bound is half the round trip).
        err = err_s[pick] + medians_without(gid, err_s, pick)
        excess = p - medians_without(gid, scores, pick) - rate * err
        # The peers' own behind-or-ahead share is the noise a healthy rank shows.
        var = np.maximum(NOISE_FLOOR, medians_without(gid, noise, pick))
        rows = members[pick]
        hit = (
            (excess >= P_FLAG)
            & (excess * np.sqrt(cells.seen(rows) / var) >= Z_FLAG)
            & (cells.episodes[rows] >= MIN_EPISODES)
        )
        out: list[Straggler] = []
        named = rows[hit]
        for row in named[np.argsort(cells.gid[named], kind="stable")].tolist():
            cells.flagged_at[row] = self._clock_ns() / 1e9
            out.append(self._straggler(job, groups.names[cells.gid[row]], row))
        return out

    def _straggler(self, job: _Job, name: str, row: int) -> Straggler:
        cells = job.cells
        one = np.array([row])
        score = float(cells.score(one)[0])
        started = float(cells.started_score(one)[0])
        # Late to start because late to enqueue: the host. Started late though
        # enqueued on time: the device or the link.
        host_side = math.isnan(started) or score >= 0.5 * started
        rank = int(cells.rank[row])
        return Straggler(
            rank=rank,
            host=job.hosts.get(rank),
            score=max(score, 0.0 if math.isnan(started) else started),
            late_ms=max(0.0, float(cells.late_s[row]) * 1e3),
            since=float(cells.flagged_at[row]),
            kind=KIND_HOST if host_side else KIND_DEVICE,
            group=name,
        )

    # ---- output -------------------------------------------------------------

    def view(self, job_id: str) -> JobStragglers | None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            cells = job.cells
            rows = np.flatnonzero(cells.n[: cells.n_rows] > 0)
            scores = cells.score(rows)
            flagged = ~np.isnan(cells.flagged_at[rows])
            # Each rank's worst group: flagged first, then the highest score,
            # then the group seen first.
            order = np.lexsort((cells.gid[rows], -scores, ~flagged, cells.rank[rows]))
            ranked = cells.rank[rows][order]
            first = np.ones(len(order), bool)
            first[1:] = ranked[1:] != ranked[:-1]
            best = rows[order[first]]
            b_scores, b_started = scores[order[first]], cells.started_score(best)
            b_seen, b_late = cells.seen(best), cells.late_s[best]
            names = job.groups.names
            ranks = [
                RankLateness(
                    rank=int(cells.rank[row]),
                    host=job.hosts.get(int(cells.rank[row])),
                    score=float(b_scores[i]),
                    late_ms=max(0.0, float(b_late[i]) * 1e3),
                    group=names[cells.gid[row]],
                    ticks=int(b_seen[i]),
                    started_score=None if math.isnan(b_started[i]) else float(b_started[i]),
                    straggler=not math.isnan(cells.flagged_at[row]),
                )
                for i, row in enumerate(best.tolist())
            ]
            stragglers = [
                self._straggler(job, names[cells.gid[row]], row)
                for row in best.tolist()
                if not math.isnan(cells.flagged_at[row])
            ]
        return JobStragglers(
            job=job_id,
            window_s=self.window_s,
            tick_s=self.tick_s,
            ranks=ranks,
            stragglers=stragglers,
        )

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job()
            while len(self._jobs) > MAX_JOBS:
                self._jobs.popitem(last=False)
        else:
            self._jobs.move_to_end(job_id)
        return job
