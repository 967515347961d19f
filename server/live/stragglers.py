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

import bisect
import logging
import math
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from hangwatch import pollgrid, progress_columns
from hangwatch.rankspec import format_ranks
from hangwatch.wire import pb

log = logging.getLogger("hangwatch.server")

WINDOW_TICKS: Final = 300  # the sliding window: 5 minutes at 1 Hz
# The sequential test's two hypotheses, as shares of instants behind / ahead
# of the median member. Healthy: noise, as often behind as ahead. Straggler:
# behind a tenth of the time, almost never ahead (it is the one waited for).
P0: Final = 0.02
P1_BEHIND: Final = 0.06
P1_AHEAD: Final = 0.005
LLR_BEHIND: Final = math.log(P1_BEHIND / P0)
LLR_AHEAD: Final = math.log(P1_AHEAD / P0)
LLR_LEVEL: Final = math.log((1 - P1_BEHIND - P1_AHEAD) / (1 - 2 * P0))
CUSUM_H: Final = 6.0  # decision threshold on the summed log-likelihood ratio
P_FLAG: Final = 0.03  # the score (behind less ahead) must exceed the peers' median by this
Z_FLAG: Final = 4.0  # ... and by this many standard errors of the peers' noise
NOISE_FLOOR: Final = 0.01  # least per-tick variance assumed (a job with no noise at all)
MIN_TICKS: Final = 20
# The strip's top bucket (25%+ of the window): a rank this late and not named
# is said to have been late in one long run (RankLateness.long_run).
LONG_RUN_SCORE: Final = 0.25
MIN_EPISODES: Final = 5
CLEAR_TICKS: Final = 150
P_CLEAR: Final = 0.01
IDLE_TICKS: Final = 5
# A gap, in collectives, that counts as behind (or ahead). Below a half: with an
# even number of members the median sits halfway, and a two-rank group's
# straggler is exactly 0.5 behind, less the instant correction's rounding.
GAP: Final = 0.4
LATE_TICKS: Final = 60  # late_ms follows about the last minute
RATE_TICKS: Final = 30  # baseline for the group's collectives-per-second rate
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


@dataclass
class _Reading:
    at_ns: int
    enqueued: int
    started: int
    err_ns: int  # bound on the reading agent's clock offset error


@dataclass
class _Track:
    """One rank in one group: the window as bit masks (bit 0 = the newest tick it was seen)."""

    seen: int = 0
    behind: int = 0
    ahead: int = 0
    started_seen: int = 0
    started_behind: int = 0
    started_ahead: int = 0
    # Lateness in seconds, averaged over about LATE_TICKS ticks (exponentially).
    late_s: float = 0.0
    n: int = 0
    cusum: float = 0.0
    flagged_at: float | None = None
    err_s: float = 0.0  # its agent's latest clock error bound

    def push(self, gap: float, late_s: float, started_gap: float | None) -> None:
        """One tick: the gap to the median member, in collectives (> 0: behind)."""
        behind, ahead = gap >= GAP, gap <= -GAP
        started_behind = None if started_gap is None else started_gap >= GAP
        started_ahead = started_gap is not None and started_gap <= -GAP
        mask = (1 << WINDOW_TICKS) - 1
        self.seen = ((self.seen << 1) | 1) & mask
        self.behind = ((self.behind << 1) | behind) & mask
        self.ahead = ((self.ahead << 1) | ahead) & mask
        self.started_seen = ((self.started_seen << 1) | (started_behind is not None)) & mask
        self.started_behind = ((self.started_behind << 1) | bool(started_behind)) & mask
        self.started_ahead = ((self.started_ahead << 1) | started_ahead) & mask
        self.n += 1
        self.late_s += (late_s - self.late_s) / min(self.n, LATE_TICKS)
        step = LLR_BEHIND if behind or started_behind else LLR_AHEAD if ahead else LLR_LEVEL
        self.cusum = min(2 * CUSUM_H, max(0.0, self.cusum + step))

    def score(self, last: int = WINDOW_TICKS) -> float:
        """Share of instants behind the median member less the share ahead of it:
        about 0 for a healthy rank whatever the noise, lateness / step for a straggler."""
        m = (1 << last) - 1
        n = (self.seen & m).bit_count()
        if not n:
            return 0.0
        return max(0.0, ((self.behind & m).bit_count() - (self.ahead & m).bit_count()) / n)

    def noise(self) -> float:
        """Per-tick variance of behind-less-ahead for a rank like this with no lateness."""
        n = self.seen.bit_count()
        return (self.behind.bit_count() + self.ahead.bit_count()) / n if n else 0.0

    def started_score(self) -> float | None:
        n = self.started_seen.bit_count()
        if not n:
            return None
        return max(0.0, (self.started_behind.bit_count() - self.started_ahead.bit_count()) / n)

    def episodes(self) -> int:
        hits = self.behind | self.started_behind
        return (hits & ~(hits >> 1)).bit_count()

    def late_ms(self) -> float:
        return max(0.0, self.late_s * 1e3)


@dataclass
class _Group:
    members: set[int] = field(default_factory=set)
    # (tick, median instant ns, median enqueued counter) of recent scored ticks
    history: deque[tuple[int, float, float]] = field(
        default_factory=lambda: deque(maxlen=RATE_TICKS + 1)
    )
    tracks: dict[int, _Track] = field(default_factory=dict)
    rate: float = 0.0  # collectives per second, as last measured


@dataclass
class _Job:
    groups: dict[str, _Group] = field(default_factory=dict)
    pending: dict[int, dict[str, dict[int, _Reading]]] = field(default_factory=dict)
    last: dict[tuple[int, str], tuple[int, _Reading]] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    group_tables: dict[str, tuple[str, ...]] = field(default_factory=dict)  # agent -> its table
    scored_through: int = -1
    newest_tick: int = -1
    dropped_late: int = 0


class StragglerMonitor:
    """Per job, the lateness of every rank and the stragglers; thread-safe.

    Fed by ReportProgress (`observe`), read by the API, the page and /metrics
    (`view`). `on_flag(job, straggler)` is called, outside the lock, once per
    rank each time it becomes a straggler.
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
            for ri in req.ranks:
                job.hosts[ri.rank] = req.host
            # ProgressColumns.cell_group indexes the agent's newest session's table.
            job.group_tables[req.agent_id] = tuple(progress_columns.group_table(req.ranks))

    def observe(
        self, req: pb.ProgressReport, columns: progress_columns.Columns | None = None
    ) -> None:
        """One agent's report: each carried rank's counters at its instant (its
        `ranks`, and `columns`: req.columns unpacked). Only files them (the gRPC
        handler calls this); `score_ready` does the work."""
        if req.clock_error_ns <= 0 or req.clock_error_ns > MAX_CLOCK_ERROR_NS:
            return  # instants not comparable with other hosts'
        now = self._clock_ns()
        with self._lock:
            job = self._job(req.job_id)
            near = pollgrid.NearestTick(self.tick_ns)
            for rp in req.ranks:
                tick = self._tick(job, near, rp.status_at_ns, rp.state, req.clock_offset_ns, now)
                if tick is None:
                    continue
                at = rp.status_at_ns + req.clock_offset_ns
                for gp in rp.groups:
                    self._file(
                        job,
                        tick,
                        gp.group,
                        rp.rank,
                        at,
                        gp.last_enqueued,
                        gp.last_started,
                        req.clock_error_ns,
                    )
            if columns is None or not columns.cell_rank:
                return
            c = columns
            table = job.group_tables.get(req.agent_id, ())
            ticks = [
                self._tick(job, near, at, state, req.clock_offset_ns, now)
                for at, state in zip(c.status_at_ns, c.state, strict=True)
            ]
            for i, g, enq, started in zip(
                c.cell_rank, c.cell_group, c.last_enqueued, c.last_started, strict=True
            ):
                tick = ticks[i]
                if tick is None or g >= len(table):
                    continue
                at = c.status_at_ns[i] + req.clock_offset_ns
                self._file(job, tick, table[g], c.rank[i], at, enq, started, req.clock_error_ns)

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

    @staticmethod
    def _file(
        job: _Job,
        tick: int,
        group: str,
        rank: int,
        at: int,
        enqueued: int,
        started: int,
        clock_error_ns: int,
    ) -> None:
        if enqueued < 0:
            return
        reading = _Reading(at, enqueued, started, clock_error_ns)
        job.pending.setdefault(tick, {}).setdefault(group, {})[rank] = reading
        g = job.groups.get(group)
        if g is None:
            g = job.groups[group] = _Group()
        g.members.add(rank)

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
            readings = job.pending.pop(tick)
            for name, g in job.groups.items():
                flagged.extend(self._score_tick(job, name, g, tick, readings.get(name, {})))
            job.scored_through = tick
        return len(ticks), flagged

    def _score_tick(
        self, job: _Job, name: str, g: _Group, tick: int, got: dict[int, _Reading]
    ) -> list[Straggler]:
        readings = dict(got)
        for rank, r in got.items():
            job.last[(rank, name)] = (tick, r)  # ticks are scored in order: never a later one
        for rank in g.members - readings.keys():
            prev = job.last.get((rank, name))
            # Agents report only ranks whose numbers changed: an unreported
            # rank still has its last counters, read at about this tick.
            if prev is not None and tick - prev[0] <= CARRY_TICKS:
                r = prev[1]
                readings[rank] = _Reading(
                    pollgrid.instant_ns(tick, self.tick_ns), r.enqueued, r.started, r.err_ns
                )
        if len(readings) < 2:
            return []
        ref_at = statistics.median(r.at_ns for r in readings.values())
        med = statistics.median(r.enqueued for r in readings.values())
        hist = g.history
        # The rate over RATE_TICKS scored ticks: steps longer than a tick
        # still give a rate, not a run of zeros.
        rate = 0.0
        if hist:
            _, at0, e0 = hist[0]
            if ref_at > at0:
                rate = (med - e0) / ((ref_at - at0) / 1e9)
        idle = len(hist) >= IDLE_TICKS and hist[-IDLE_TICKS][2] == med
        hist.append((tick, ref_at, med))
        if rate <= 0 or idle:
            return []
        g.rate = rate
        adj = {rank: r.enqueued - rate * (r.at_ns - ref_at) / 1e9 for rank, r in readings.items()}
        ref = statistics.median(adj.values())
        with_started = all(r.started >= 0 for r in readings.values())
        started_ref = 0.0
        if with_started:
            sadj = {
                rank: r.started - rate * (r.at_ns - ref_at) / 1e9 for rank, r in readings.items()
            }
            started_ref = statistics.median(sadj.values())
        for rank in readings:
            gap = ref - adj[rank]
            track = g.tracks.setdefault(rank, _Track())
            track.err_s = readings[rank].err_ns / 1e9
            track.push(gap, gap / rate, (started_ref - sadj[rank]) if with_started else None)
        return self._decide(job, name, g)

    def _decide(self, job: _Job, name: str, g: _Group) -> list[Straggler]:
        out: list[Straggler] = []
        todo = [
            (rank, t)
            for rank, t in g.tracks.items()
            if t.flagged_at is not None or t.cusum >= CUSUM_H
        ]
        if not todo:
            return out
        scores = {rank: t.score() for rank, t in g.tracks.items()}
        # The peers' medians for each candidate, from one sort per group and
        # tick: a median over the others per candidate was O(members²) per
        # tick once noise lifted many CUSUMs at thousands of ranks.
        by_score = sorted(scores.values())
        by_err = sorted(t.err_s for t in g.tracks.values())
        by_noise = sorted(t.noise() for t in g.tracks.values())
        for rank, t in todo:
            if t.flagged_at is not None:
                if t.score(CLEAR_TICKS) < P_CLEAR and (t.started_score() or 0.0) < P_CLEAR:
                    log.info("group %s: rank %d is no longer a straggler", name, rank)
                    t.flagged_at, t.cusum = None, 0.0
                continue
            if t.cusum < CUSUM_H or t.seen.bit_count() < MIN_TICKS:
                continue
            p = max(scores[rank], t.started_score() or 0.0)
            if len(g.tracks) < 2:
                continue
            # A clock error of e shifts a rank's share behind by up to rate * e:
            # that much of the excess proves nothing (NTP's bound is half the round trip).
            err = t.err_s + median_without(by_err, t.err_s)
            excess = p - median_without(by_score, scores[rank]) - g.rate * err
            # The peers' own behind-or-ahead share is the noise a healthy rank shows.
            var = max(NOISE_FLOOR, median_without(by_noise, t.noise()))
            n = t.seen.bit_count()
            if (
                excess >= P_FLAG
                and excess * math.sqrt(n / var) >= Z_FLAG
                and t.episodes() >= MIN_EPISODES
            ):
                t.flagged_at = self._clock_ns() / 1e9
                out.append(self._straggler(job, name, rank, t))
        return out

    def _straggler(self, job: _Job, name: str, rank: int, t: _Track) -> Straggler:
        started = t.started_score()
        # Late to start because late to enqueue: the host. Started late though
        # enqueued on time: the device or the link.
        host_side = started is None or t.score() >= 0.5 * started
        return Straggler(
            rank=rank,
            host=job.hosts.get(rank, ""),
            score=max(t.score(), t.started_score() or 0.0),
            late_ms=t.late_ms(),
            since=t.flagged_at or 0.0,
            kind=KIND_HOST if host_side else KIND_DEVICE,
            group=name,
        )

    # ---- output -------------------------------------------------------------

    def view(self, job_id: str) -> JobStragglers | None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            best: dict[int, tuple[str, _Track]] = {}
            for name, g in job.groups.items():
                for rank, t in g.tracks.items():
                    cur = best.get(rank)
                    if cur is None or (t.flagged_at is not None, t.score()) > (
                        cur[1].flagged_at is not None,
                        cur[1].score(),
                    ):
                        best[rank] = (name, t)
            ranks = [
                RankLateness(
                    rank=rank,
                    host=job.hosts.get(rank, ""),
                    score=t.score(),
                    late_ms=t.late_ms(),
                    group=name,
                    ticks=t.seen.bit_count(),
                    started_score=t.started_score(),
                    straggler=t.flagged_at is not None,
                )
                for rank, (name, t) in sorted(best.items())
            ]
            stragglers = [
                self._straggler(job, name, rank, t)
                for rank, (name, t) in sorted(best.items())
                if t.flagged_at is not None
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


def median_without(ordered: list[float], value: float) -> float:
    """The median of `ordered` (sorted, holding `value`) with one `value` left
    out: statistics.median of the rest, in O(log n)."""
    k = bisect.bisect_left(ordered, value)
    m = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j] if j < k else ordered[j + 1]

    if m % 2:
        return at(m // 2)
    return (at(m // 2 - 1) + at(m // 2)) / 2
