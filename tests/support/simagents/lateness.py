"""A simulated job whose ranks run at different speeds, read the way agents read it.

For the straggler detector's tests and benchmark: what matters there is not
the wire (the coordinator's real `StragglerMonitor.observe` takes the real
`ProgressReport`s built here) but many minutes of a job's timing, which a
fake clock replays in well under a second.

The job: every step, each rank computes, in `collectives` chunks, and enters
a synchronous collective after each chunk; a collective ends `comm_s` after
its last member entered it, and everyone then computes the next chunk. A
rank's compute per chunk is the healthy time times (1 + its slowdown) times
a random factor (`jitter`, relative standard deviation). A device-side slow
rank enqueues on time but starts its collectives late (NCCL's started
counter). A pause holds one rank once (a checkpoint); a hang stops one rank
for good, and its peers wait in the next collective.

The reading: agents of `per_agent` ranks poll on a grid of `tick_s` on the
coordinator's clock, each agent off by its own clock error (uniform within
`clock_error_s`), each rank read up to `read_spread_s` after the tick (the
agent's thread pool); a report carries only the ranks whose numbers changed,
plus all of them every heartbeat (the real `DeltaReporter`).
"""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hangwatch.agent.delta import DeltaReporter
from hangwatch.server.live.stragglers import JobStragglers, Straggler, StragglerMonitor

from hangwatch import pollgrid, progress_columns
from hangwatch.wire import pb

GROUP = "0"


@dataclass(frozen=True, kw_only=True)
class SimJob:
    ranks: int
    chunk_s: float = 0.05  # a healthy rank's compute before each collective
    collectives: int = 4  # per step
    comm_s: float = 0.004
    jitter: float = 0.05
    slow: dict[int, float] = field(default_factory=dict)  # rank -> extra share of compute (host)
    slow_until_s: float = float("inf")  # the slowdowns end here (a recovered rank)
    device_slow: dict[int, float] = field(default_factory=dict)  # rank -> extra, GPU side
    pauses: tuple[tuple[int, float, float], ...] = ()  # (rank, at_s, seconds), once each
    hang: tuple[int, float] | None = None  # (rank, at_s)
    started: bool = False  # the backend records starts (NCCL); gloo does not
    seed: int = 0


@dataclass
class Timeline:
    """Per rank, when it entered (and started) each collective, seconds from 0."""

    enq: list[list[float]]
    start: list[list[float]]
    step_s: float  # mean step time

    def counter(self, times: list[float], t: float) -> int:
        return bisect.bisect_right(times, t) - 1  # last seq entered; -1 before the first


def simulate(job: SimJob, duration_s: float) -> Timeline:
    rng = random.Random(job.seed)
    n = job.ranks
    enq: list[list[float]] = [[] for _ in range(n)]
    start: list[list[float]] = [[] for _ in range(n)]
    pauses = {r: (at, d) for r, at, d in job.pauses}
    t = 0.0
    steps = 0
    hung_at: float | None = None
    while t < duration_s and hung_at is None:
        for _ in range(job.collectives):
            last = 0.0
            entries = []
            for r in range(n):
                extra = job.slow.get(r, 0.0) if t < job.slow_until_s else 0.0
                c = job.chunk_s * (1 + extra) * max(0.1, rng.gauss(1, job.jitter))
                p = pauses.get(r)
                if p is not None and t <= p[0] < t + c + job.comm_s:
                    c += p[1]
                    del pauses[r]
                e = t + c
                s = e + job.chunk_s * job.device_slow.get(r, 0.0)
                if job.hang is not None and r == job.hang[0] and e >= job.hang[1]:
                    hung_at = e
                    continue  # never enters: the others wait in this one forever
                entries.append((r, e, s))
                last = max(last, s)
            for r, e, s in entries:
                enq[r].append(e)
                start[r].append(s)
            if hung_at is not None:
                break
            t = last + job.comm_s
        steps += 1
    return Timeline(enq=enq, start=start, step_s=t / max(1, steps))


@dataclass
class _Agent:
    agent_id: str
    ranks: list[int]
    clock_error_ns: int
    delta: DeltaReporter = field(default_factory=DeltaReporter)
    seq: int = 0


class Readings:
    """The job's ProgressReports, tick by tick, as agents on the coordinator's grid send them."""

    def __init__(
        self,
        job: SimJob,
        timeline: Timeline,
        *,
        job_id: str = "sim",
        per_agent: int = 8,
        tick_s: float = 1.0,
        clock_error_s: float = 0.002,
        read_spread_s: float = 0.003,
        heartbeat_s: float = 3.0,
        seed: int = 1,
        columns: bool = False,
        subgroup: int = 0,
    ) -> None:
        """`columns`: the reports carry ProgressReport.columns, as current agents
        send them, instead of one message per rank. `subgroup`: every rank is
        also in a group of this many consecutive ranks ("sub<k>")."""
        self.job, self.timeline, self.job_id = job, timeline, job_id
        self.columns, self.subgroup = columns, subgroup
        self.tick_s, self.read_spread_s = tick_s, read_spread_s
        self._rng = random.Random(seed)
        self.agents = [
            _Agent(
                agent_id=f"sim-{i // per_agent}",
                ranks=list(range(i, min(i + per_agent, job.ranks))),
                clock_error_ns=int(self._rng.uniform(-clock_error_s, clock_error_s) * 1e9),
            )
            for i in range(0, job.ranks, per_agent)
        ]
        for a in self.agents:
            a.delta.reset(heartbeat_s)

    def _groups(self, rank: int) -> list[str]:
        if not self.subgroup:
            return [GROUP]
        return [GROUP, f"sub{rank // self.subgroup}"]

    @staticmethod
    def _scaled(group: str, counter: int) -> int:
        """A subgroup's counter: three of its collectives to one of the world's
        (a tensor-parallel group's share), so the groups' counters differ."""
        return counter if group == GROUP or counter < 0 else 3 * counter + 1

    def register_requests(self) -> list[pb.RegisterRequest]:
        n, k = self.job.ranks, self.subgroup
        return [
            pb.RegisterRequest(
                job_id=self.job_id,
                agent_id=a.agent_id,
                host=f"host-{a.agent_id}",
                ranks=[
                    pb.RankInfo(
                        rank=r,
                        world_size=self.job.ranks,
                        groups=[
                            pb.GroupInfo(
                                name=name,
                                ranks=range(n)
                                if name == GROUP
                                else range(r - r % k, r - r % k + k),
                            )
                            for name in self._groups(r)
                        ],
                    )
                    for r in a.ranks
                ],
            )
            for a in self.agents
        ]

    def reports(self, tick: int) -> Iterator[pb.ProgressReport]:
        tl = self.timeline
        nominal = pollgrid.instant_ns(tick, int(self.tick_s * 1e9)) / 1e9
        for a in self.agents:
            ranks = []
            for r in a.ranks:
                # The agent believes it polls at `nominal`; its clock is off by its error.
                true_t = nominal - a.clock_error_ns / 1e9 + self._rng.uniform(0, self.read_spread_s)
                started = tl.counter(tl.start[r], true_t) if self.job.started else -1
                ranks.append(
                    pb.RankProgress(
                        rank=r,
                        state=pb.PROCESS_STATE_RUNNING,
                        groups=[
                            pb.GroupProgress(
                                group=name,
                                last_enqueued=self._scaled(name, tl.counter(tl.enq[r], true_t)),
                                last_started=self._scaled(name, started),
                            )
                            for name in self._groups(r)
                        ],
                        # on the agent's clock, which the offset then maps back
                        status_at_ns=int(true_t * 1e9) + a.clock_error_ns,
                    )
                )
            pick = a.delta.select(ranks, nominal)
            if pick is None:
                continue
            a.delta.commit(pick[0], pick[1], nominal)
            a.seq += 1
            carried, columns = pick[0], None
            if self.columns:
                names = [g for r in a.ranks for g in self._groups(r)]
                table = {g: i for i, g in enumerate(dict.fromkeys(names))}
                columns, carried = progress_columns.encode(carried, table)
            yield pb.ProgressReport(
                job_id=self.job_id,
                agent_id=a.agent_id,
                session_id="s",
                report_seq=a.seq,
                ranks=carried,
                columns=columns,
                clock_offset_ns=0,
                clock_error_ns=max(1, abs(a.clock_error_ns)),
            )


@dataclass
class Replay:
    """What the coordinator's monitor concluded over a replayed job."""

    step_s: float
    flags: list[tuple[float, Straggler]]  # (seconds into the job, who), in order
    view: JobStragglers | None
    score_s: float  # CPU seconds spent in observe + score_ready, all ticks together
    ticks: int
    monitor: StragglerMonitor

    def first_flag(self, rank: int) -> float | None:
        return next((t for t, s in self.flags if s.rank == rank), None)

    def others(self, ranks: set[int]) -> list[tuple[float, Straggler]]:
        return [(t, s) for t, s in self.flags if s.rank not in ranks]


def replay(
    job: SimJob,
    duration_s: float,
    *,
    on_flag: Callable[[str, Straggler], None] | None = None,
    **readings: Any,
) -> Replay:
    """Run the job for `duration_s` of simulated time through a real StragglerMonitor
    on a fake clock: every tick, every agent's report, then the monitor's scoring.
    `on_flag` is called too, as a coordinator's would be."""
    timeline = simulate(job, duration_s)
    now = [0]
    flags: list[tuple[float, Straggler]] = []

    def flagged(job_id: str, s: Straggler) -> None:
        flags.append((now[0] / 1e9, s))
        if on_flag is not None:
            on_flag(job_id, s)

    monitor = StragglerMonitor(clock_ns=lambda: now[0], on_flag=flagged)
    rd = Readings(job, timeline, **readings)
    for req in rd.register_requests():
        monitor.register(req)
    spent = 0.0
    ticks = int(duration_s / rd.tick_s)
    for tick in range(1, ticks):
        now[0] = int(tick * rd.tick_s * 1e9)
        reports = list(rd.reports(tick))
        t0 = time.process_time()
        for rep in reports:
            monitor.observe(rep, progress_columns.decode(rep.columns) if rd.columns else None)
        monitor.score_ready()
        spent += time.process_time() - t0
    return Replay(
        step_s=timeline.step_s,
        flags=flags,
        view=monitor.view(rd.job_id),
        score_s=spent,
        ticks=ticks,
        monitor=monitor,
    )
