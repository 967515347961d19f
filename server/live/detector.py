"""Stall detection over one group's live progress: pure functions, no clocks of their own.

A group is stalled at collective `s` when some members are inside `s`
(last_enqueued >= s > last_completed) while others have not entered it
(last_enqueued < s), and no member's last_completed has changed for the
stall timeout. Ordering across ranks comes only from sequence numbers and the
coordinator's own monotonic clock: agents' wall clocks are never compared.

A long collective that every member has entered is healthy, however long it
runs, unless the members entered different ops at that seq (a mismatch: gloo
and NCCL both wait forever on it), a member's process is stopped or gone (it
can never finish) or a member cannot be observed at all (its agent is lost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from hangwatch.formats import StallKind
from hangwatch.wire import DEAD_PROCESS_STATES, EXITED_PROCESS_STATES

# One definition for the whole project (hangwatch.wire), under the names used here.
DEAD_STATES: Final = DEAD_PROCESS_STATES
EXITED_STATES: Final = EXITED_PROCESS_STATES


@dataclass(kw_only=True, frozen=True)
class MemberProgress:
    rank: int
    last_enqueued: int  # -1 = none
    last_completed: int  # -1 = none
    in_flight_op: str = ""
    observed: bool = True  # False: its agent is lost, the numbers are stale
    process_state: str = "running"
    # Reached Python's exit (RankProgress.finished): gone or going, but not lost.
    finished: bool = False


@dataclass(kw_only=True, frozen=True)
class GroupStall:
    group: str
    seq: int
    op: str
    # "stall": members not entered; "mismatch": members entered different ops
    # at the same seq; "rank-lost": a member's process is dead;
    # "agent-lost": the only missing members are ones nobody can observe.
    kind: StallKind
    waiting_ranks: list[int]
    not_entered_ranks: list[int]
    dead_ranks: list[int] = field(default_factory=list)
    unobserved_ranks: list[int] = field(default_factory=list)
    # For a mismatch: each op entered at `seq`, with the ranks that entered it
    # (what the trigger line names, so it agrees with the verdict).
    ops_entered: dict[str, list[int]] = field(default_factory=dict)
    stalled_for_s: float = 0.0


def find_group_stall(
    *,
    group: str,
    members: Sequence[int],
    progress: dict[int, MemberProgress],
    no_progress_for_s: float,
) -> GroupStall | None:
    """The stall pattern in one group, or None. The caller compares `stalled_for_s`
    with its timeout; returning the pattern early lets the dashboard show it growing."""
    observed = {r: p for r, p in progress.items() if p.observed}
    # Members with no numbers at all (never registered) count as unobserved.
    unobserved = sorted(r for r in members if r not in observed)
    in_flight = [p for p in observed.values() if p.last_enqueued > p.last_completed]
    if not in_flight:
        return None
    seq = min(p.last_completed + 1 for p in in_flight)
    # A rank whose process is gone is not waiting, whatever its last numbers
    # said: at a normal job end every rank exits with its last report stale.
    waiting = sorted(
        p.rank
        for p in observed.values()
        if p.last_enqueued >= seq > p.last_completed and p.process_state not in EXITED_STATES
    )
    not_entered = sorted(p.rank for p in observed.values() if p.last_enqueued < seq)
    # A rank that finished returned from every collective it entered: peers
    # still inside one it entered are not waiting on a lost rank.
    dead = sorted(
        p.rank for p in observed.values() if p.process_state in DEAD_STATES and not p.finished
    )
    op = next(
        (p.in_flight_op for p in in_flight if p.last_completed + 1 == seq and p.in_flight_op), ""
    )
    if not waiting:
        return None
    # Agents learn a rank's in-flight op only once it has been in flight a
    # while, so compare just the ops that are known.
    ops_at_seq: dict[str, list[int]] = {}
    for p in sorted(observed.values(), key=lambda p: p.rank):
        if p.last_completed + 1 == seq and p.last_enqueued >= seq and p.in_flight_op:
            ops_at_seq.setdefault(p.in_flight_op, []).append(p.rank)
    if not_entered:
        kind = StallKind.STALL
    elif len(ops_at_seq) > 1:
        kind = StallKind.MISMATCH
    elif dead:
        kind = StallKind.RANK_LOST
    elif unobserved:
        kind = StallKind.AGENT_LOST
    else:
        return None  # every member is inside: a long but healthy collective
    return GroupStall(
        group=group,
        seq=seq,
        op=op,
        kind=kind,
        waiting_ranks=waiting,
        not_entered_ranks=not_entered,
        dead_ranks=dead,
        unobserved_ranks=unobserved,
        ops_entered=ops_at_seq if kind == StallKind.MISMATCH else {},
        stalled_for_s=max(0.0, no_progress_for_s),
    )


# --- hangs FR cannot see --------------------------------------------------------
#
# Gloo records no send/recv, and a rank stuck in Python before its next
# collective leaves every counter where it was: no group ever shows a member
# in flight, so `find_group_stall` sees nothing. What is left is the job as a
# whole going quiet. Two rules read it:
#
# * the rhythm rule, for a job that was making steady progress: its counters
#   moved at STEADY_MOVES moments at least MOVE_SPACING_S apart (a rank's
#   first numbers are its baseline, not a move), and the quiet period outlasts
#   both the stall timeout and QUIET_GAP_FACTOR times the longest gap between
#   two moves since it became steady (a job with a long periodic pause, an
#   evaluation or a checkpoint, is not paged for its own rhythm once it has
#   shown it; its start-up, before it was steady, sets no rhythm);
# * the bound, for every job however early or however long its rhythm: quiet
#   for `quiet_bound` (the longer of the start-up grace and QUIET_BOUND_FACTOR
#   stall timeouts) with at least one live rank idle. A job that is working
#   (every rank busy on a CPU: a torch.compile, a checkpoint being serialized,
#   an evaluation) is not hung, however long it works; a hang has somebody
#   blocked, and blocked ranks burn no CPU. Where a rank's CPU is unknown (an
#   agent older than the field) it counts as idle: the bound is a promise, and
#   only evidence of work suspends it.

STEADY_MOVES: Final = 5
# Moves closer together than this are one: every node reports the same step.
MOVE_SPACING_S: Final = 0.2
QUIET_GAP_FACTOR: Final = 2.0
# The bound is this many stall timeouts (or the start-up grace, if longer):
# 3x leaves a job whose step is under a stall timeout two whole steps of
# slack, and keeps an early hang under a minute at the default 10 s timeout.
QUIET_BOUND_FACTOR: Final = 3.0
# A rank using at least this much of a core is working, not blocked: a thread
# waiting in gloo or on a lock uses well under 1%; the Python interpreter doing
# anything at all (compiling, pickling, a Python loop) uses most of one.
BUSY_CORES: Final = 0.25
# A rank moving at least this much to or from storage is working too: a
# process waiting on a disk or a network filesystem uses no CPU (measured:
# ranks hashing torch's source tree at the start of torch.compile, the disk
# shared with a database's syncfs, read 0.035-0.04 cores for 12 s), and a
# checkpoint written to a slow filesystem looks the same. A hung rank's
# logging thread writes kilobytes a second; a checkpoint or a cold read,
# tens to thousands of MiB.
BUSY_IO_BYTES_S: Final = 1 << 20


def quiet_bound(stall_timeout: float, startup_grace: float) -> float:
    """The longest any hang may go without an incident (docs/operations.md)."""
    return max(startup_grace, QUIET_BOUND_FACTOR * stall_timeout)


@dataclass(kw_only=True, frozen=True)
class QuietRank:
    rank: int
    observed: bool = True
    process_state: str = "running"
    in_flight: bool = False  # inside a collective of some group, as far as its numbers tell
    # CPU cores it used lately (records.RateWindow); None = unknown.
    cores: float | None = None
    # Storage bytes a second it read and wrote lately; None = unknown.
    io_bytes_s: float | None = None
    # Inside torch.compile while some rank of the job is busy on a CPU
    # (stalls.busy_laggards): waiting on that rank's compile, which is work.
    compiling: bool = False

    @property
    def busy(self) -> bool:
        return (
            self.compiling
            or (self.cores is not None and self.cores >= BUSY_CORES)
            or (self.io_bytes_s is not None and self.io_bytes_s >= BUSY_IO_BYTES_S)
        )


@dataclass(kw_only=True, frozen=True)
class JobQuiet:
    """No counter moved anywhere for `quiet_for_s`, every rank alive, none in a collective."""

    quiet_for_s: float
    threshold_s: float  # what quiet_for_s had to reach
    moves: int  # reports that moved a counter before it went quiet
    longest_gap_s: float  # the longest gap between two of them
    ranks: list[int]
    # "rhythm": a steady job went quiet past its own rhythm; "bound": any job
    # quiet past quiet_bound with someone idle (early hangs, long rhythms).
    rule: str = "rhythm"
    idle_ranks: list[int] = field(default_factory=list)  # under BUSY_CORES and BUSY_IO_BYTES_S
    busy_ranks: list[int] = field(default_factory=list)
    compiling_ranks: list[int] = field(default_factory=list)  # of busy_ranks: in torch.compile
    # The CPU cores each rank used lately as the rule read them (None:
    # unknown), for the first CORES_SHOWN ranks: what made a rank idle.
    cores: dict[int, float | None] = field(default_factory=dict)
    # Likewise their storage I/O, MiB a second.
    io_mib_s: dict[int, float | None] = field(default_factory=dict)


# Ranks whose CPU reading a no-progress trigger records: enough for a node or
# a pipeline; a 16,384-rank job's whole table would not fit an incident.json.
CORES_SHOWN: Final = 64


def steady(moves: int) -> bool:
    """The job has shown a rhythm: the rhythm rule can page it (else only the bound)."""
    return moves >= STEADY_MOVES


def quiet_threshold(stall_timeout: float, longest_gap_s: float) -> float:
    return max(stall_timeout, QUIET_GAP_FACTOR * longest_gap_s)


def find_job_quiet(
    *,
    ranks: Sequence[QuietRank],
    moves: int,
    longest_gap_s: float,
    quiet_for_s: float,
    stall_timeout: float,
    bound_s: float | None = None,
    compile_running: bool = False,
) -> JobQuiet | None:
    """The no-progress pattern over a whole job, or None. Unlike a group stall
    it is returned only once over its threshold: there is nothing to watch grow.
    `bound_s` None leaves only the rhythm rule. `compile_running`: some rank is
    inside torch.compile and itself working (on a CPU, on storage, or with a
    compiler process under it)."""
    if not ranks:
        return None
    rhythm = quiet_threshold(stall_timeout, longest_gap_s)
    by_rhythm = steady(moves) and quiet_for_s >= rhythm
    by_bound = bound_s is not None and quiet_for_s >= bound_s
    if not (by_rhythm or by_bound):
        return None
    # A lost agent, a dead rank or a collective in flight is another rule's
    # (the group stall, rank-lost, agent-lost, crash): this one is for the rest.
    for r in ranks:
        if not r.observed or r.process_state in EXITED_STATES or r.in_flight:
            return None
    idle = sorted(r.rank for r in ranks if not r.busy)
    busy = sorted(r.rank for r in ranks if r.busy)
    if not by_rhythm and not idle:
        return None  # every rank is working: a compile, a checkpoint, not a hang
    if not by_rhythm and compile_running:
        # With no collective in flight, the idle ranks wait on that compile: a
        # pipeline stage that compiled first waits in send/recv (which no
        # counter shows) for the next stage's (measured live, 3 stages on one
        # cold cache: stage 0 done at 21.0 s, stage 1 at 24.0 s, past a 20 s
        # bound, and paged). The bound waits for the compile; once nobody
        # works inside torch.compile it pages within a window. The rhythm rule
        # (a job that ran steps) is not suspended.
        return None
    return JobQuiet(
        quiet_for_s=quiet_for_s,
        threshold_s=rhythm if by_rhythm else float(bound_s or 0.0),
        moves=moves,
        longest_gap_s=longest_gap_s,
        ranks=sorted(r.rank for r in ranks),
        rule="rhythm" if by_rhythm else "bound",
        idle_ranks=idle,
        busy_ranks=busy,
        compiling_ranks=sorted(r.rank for r in ranks if r.compiling),
        cores={
            r.rank: None if r.cores is None else round(r.cores, 3)
            for r in sorted(ranks, key=lambda r: r.rank)[:CORES_SHOWN]
        },
        io_mib_s={
            r.rank: None if r.io_bytes_s is None else round(r.io_bytes_s / (1 << 20), 3)
            for r in sorted(ranks, key=lambda r: r.rank)[:CORES_SHOWN]
        },
    )
