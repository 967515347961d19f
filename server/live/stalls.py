"""Stall scanning over one job's records: feeds `detector.find_group_stall`.

The detector is pure; this module decides what numbers it sees. The one
judgement made here is for groups whose recorder does not record completion:
their completed count is inferred from what every member has entered. The
same inference says whether a rank is in a collective for `scan_quiet`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hangwatch.server.live.celltable import Cell
from hangwatch.server.live.detector import (
    BUSY_CORES,
    BUSY_IO_BYTES_S,
    DEAD_STATES,
    QUIET_BOUND_FACTOR,
    GroupStall,
    JobQuiet,
    MemberProgress,
    QuietRank,
    find_group_stall,
    find_job_quiet,
)
from hangwatch.server.live.records import JobRecord, RankRecord, sorted_groups
from hangwatch.server.live.views import StalledGroup

from hangwatch.formats import StallKind
from hangwatch.wire import next_seq, seq_count


def scan_stalls(
    job: JobRecord,
    now: float,
    stall_timeout: float,
    over_timeout_only: bool = False,
    startup_grace: float = 0.0,
    first_report_s: float = 0.0,
) -> list[StalledGroup]:
    """Every group's stall pattern; with `over_timeout_only`, skip without a
    look at its members every group that progressed within the timeout (the
    detector's pass runs often and must stay cheap at thousands of ranks).

    A group with a member registered less than `first_report_s` ago whose
    first numbers have not arrived is not judged: that member has entered
    nothing as far as the coordinator knows, but it is unknown, not behind.
    Measured with 512 simulated agents: they registered over 5 s, the ranks
    that reported first waited in the world group's all_reduce for the rest,
    and the 3,648 ranks not yet heard from were called "not entered" in a
    false incident as soon as the stall timeout passed. Its agent sends every
    rank at least once per heartbeat, and is lost past `first_report_s` (the
    lost-agent timeout), so a rank that never reports is still judged.

    A stall in a group's first collective is over its timeout only after
    `startup_grace` too: its members that have entered nothing may just be
    slower to start (imports, a checkpoint load, a restarted attempt's
    processes spawned seconds apart), and --on-hang abort must not end a job
    for that.

    A stall whose every not-entered rank is busy on a CPU is over its timeout
    only at QUIET_BOUND_FACTOR stall timeouts (`busy_laggards`): rank 0
    evaluating or writing a checkpoint while its peers wait in a barrier is
    work, and blocked ranks burn no CPU. One that never comes back (a rank
    spinning for ever) is still paged within that bound."""
    out: list[StalledGroup] = []
    for g in sorted_groups(job.groups):
        if over_timeout_only and now - g.last_progress < stall_timeout:
            continue
        members = job.members(g)
        if first_report_s > 0 and any(
            not rg.reported and now - _registered(job, r) < first_report_s for r, rg in members
        ):
            continue
        if any(rg.collectives() is None for r, rg in members if job.observed(r)):
            # A member's pg_status counts p2p and its collective count is not
            # known yet: its agent reads FR entries as soon as it goes quiet.
            continue
        assumed = assumed_completed(members, job.observed)
        progress: dict[int, MemberProgress] = {}
        for r, rg in members:
            enq, comp = rg.counts()
            # A rank in the group's first collective waits in #1, not "#0".
            comp = seq_count(comp)
            op = rg.in_flight_op
            if rg.completion_unknown and assumed is not None:
                comp = seq_count(assumed)
                # The op the agent named is for the newest collective entered;
                # it is only the stalled one's op when that is the next one.
                op = op if rg.in_flight_seq == next_seq(assumed) else ""
            if r.finished:
                # It returned from all it entered (gloo's pg_status can leave
                # the last one uncounted; NCCL's exit need not wait for it).
                comp, op = max(comp, enq), ""
            progress[r.rank] = MemberProgress(
                rank=r.rank,
                last_enqueued=enq,
                last_completed=comp,
                in_flight_op=op,
                observed=job.observed(r),
                process_state=r.process_state,
                finished=r.finished,
            )
        st = find_group_stall(
            group=g.name,
            members=g.ranks,
            progress=progress,
            no_progress_for_s=now - g.last_progress,
        )
        if st is not None:
            # The detector's pattern, field for field, plus the timeout verdict.
            fields = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
            waited = waited_for(st, members, now)
            stalled = st.stalled_for_s if waited is None else min(st.stalled_for_s, waited)
            fields["stalled_for_s"] = stalled
            timeout = stall_timeout
            if st.kind == StallKind.STALL and st.seq == 1:
                timeout = max(stall_timeout, startup_grace)
            records = {r.rank: r for r, _ in members}
            busy = busy_laggards(st, records, job, stall_timeout)
            compiling = [b for b in busy if not working(job, records[b], stall_timeout)]
            if busy:
                timeout = max(timeout, QUIET_BOUND_FACTOR * stall_timeout)
            unheard = unheard_since(st.not_entered_ranks, records, g.last_progress)
            over = stalled >= timeout and not unheard
            if over or not over_timeout_only:
                out.append(
                    StalledGroup(
                        **fields,
                        over_timeout=over,
                        busy_ranks=busy,
                        compiling_ranks=compiling,
                        unheard_ranks=unheard,
                        timeout_s=timeout,
                    )
                )
    return out


def waited_for(st: GroupStall, members: list[tuple[RankRecord, Cell]], now: float) -> float | None:
    """How long the stall's waiting ranks have been inside its collective: the
    longest any of them has (None where none says: then the group's time
    without progress stands alone). A stall is members sitting in a collective
    others have not entered, and the group's last progress can be long before
    they sat down: a world-group all_reduce once a step, an evaluation's
    barrier every few minutes. Measured: a simulated 4,096-rank job, whose
    world group completes a collective every few seconds, opened a false
    incident for 1,952 ranks that had not yet reached its next one, seconds
    after the first ranks entered it; the group's clock alone said 5 s."""
    waiting = set(st.waiting_ranks)
    ages = [
        now - rg.in_flight_since
        for r, rg in members
        if r.rank in waiting and rg.in_flight_seq == st.seq and rg.in_flight_since is not None
    ]
    return max(ages) if ages else None


def unheard_since(ranks: list[int], records: dict[int, RankRecord], t: float) -> list[int]:
    """Those of `ranks` whose numbers last arrived before coordinator time `t`
    (the group's last progress): "not entered" is then what they said before
    their peers moved on, not evidence that they are behind. Their agent
    reports every rank at least once a heartbeat (a third of the lost-agent
    timeout), so a rank that is behind is soon heard from again, still behind;
    one whose agent went silent is unobserved once the agent is lost.
    Measured: a simulated 4,096-rank job on an overloaded machine (load 3 on 2
    cores) opened a false incident naming 2,408 of them in the world group's
    all_reduce, their reports queued behind the others'."""
    return [
        rank
        for rank in ranks
        if (r := records.get(rank)) is not None and (r.last_report is None or r.last_report < t)
    ]


def _registered(job: JobRecord, r: RankRecord) -> float:
    """When the agent that registered `r` did (coordinator clock)."""
    a = job.agents.get(r.agent_id)
    return a.registered if a is not None else float("-inf")


def busy_laggards(
    st: GroupStall, records: dict[int, RankRecord], job: JobRecord, stall_timeout: float
) -> list[int]:
    """The not-entered ranks of a stall when every one of them is observed,
    alive (not stopped or gone) and working: busy on a CPU, or inside
    torch.compile (its agent's stack sample) while some rank of the job is busy
    on a CPU (ranks that share a compile cache wait, idle, on the one whose
    compile workers run; a compile with nobody working anywhere is not excused:
    a compile can hang too). Else none: one rank idle, or its CPU unknown (an
    agent older than the field), and the stall is judged by its timeout; only
    evidence of work defers a page."""
    if st.kind != StallKind.STALL or not st.not_entered_ranks:
        return []
    # Looked at (every rank of the job) only for a laggard that needs it: at
    # 32,768 ranks a stall scan must not walk the job once per stalled group.
    anyone_busy: bool | None = None
    for rank in st.not_entered_ranks:
        r = records.get(rank)
        if r is None or not job.observed(r) or r.process_state in DEAD_STATES:
            return []
        if working(job, r, stall_timeout):
            continue
        if not r.in_compile:
            return []
        if anyone_busy is None:
            anyone_busy = job_working(job, stall_timeout)
        if not anyone_busy:
            return []
    return list(st.not_entered_ranks)


def cores(job: JobRecord, r: RankRecord, stall_timeout: float) -> float | None:
    """CPU cores used over the last half to one and a half stall timeouts."""
    rate = job.rates.cpu.rate(r.rate_slot, min_span_s=stall_timeout / 2)
    return None if rate is None else rate / 1e9


def io_bytes_s(job: JobRecord, r: RankRecord, stall_timeout: float) -> float | None:
    """Storage bytes a second over the same span."""
    return job.rates.io.rate(r.rate_slot, min_span_s=stall_timeout / 2)


def working(job: JobRecord, r: RankRecord, stall_timeout: float) -> bool:
    """At least BUSY_CORES on a CPU or BUSY_IO_BYTES_S to or from storage."""
    c = cores(job, r, stall_timeout)
    if c is not None and c >= BUSY_CORES:
        return True
    io = io_bytes_s(job, r, stall_timeout)
    return io is not None and io >= BUSY_IO_BYTES_S


def job_working(job: JobRecord, stall_timeout: float) -> bool:
    """Some rank of the job is busy on a CPU or on storage, or runs a compiler
    process: what makes a rank inside torch.compile count as waiting on work,
    not hung (ranks sharing a compile cache wait on its lock while the holder
    hashes, reads or compiles)."""
    return any(working(job, r, stall_timeout) or r.compiler_running for r in job.ranks.values())


def assumed_completed(
    members: list[tuple[RankRecord, Cell]], observed: Callable[[RankRecord], bool]
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
    assumed = lo if hi > lo else lo - 1
    # A member that finished (reached Python's exit, its final numbers
    # read) returned from every collective it entered, so each of them
    # finished: the job's last collective is not one its ranks hang in. A
    # member behind it is then "not entered" in what follows, and one that
    # exited before entering what its peers wait in still is.
    left = [rg.last_enqueued for r, rg in members if r.finished and observed(r)]
    return max(assumed, *left) if left else assumed


def scan_quiet(
    job: JobRecord, now: float, stall_timeout: float, bound_s: float | None = None
) -> JobQuiet | None:
    """The whole job gone quiet with no collective in flight (the detector's
    `find_job_quiet`), or None. Cheap when the job moved recently."""
    # Quiet since its last progress, or since its last new rank registered if
    # that is later (a pure-p2p gloo job moves no counter at all; a big job
    # launches over minutes).
    quiet_for = now - max(job.last_progress, job.last_new_rank)
    soonest = stall_timeout if bound_s is None else min(stall_timeout, bound_s)
    if quiet_for < soonest or (job.progress_moves == 0 and bound_s is None):
        return None
    in_flight: set[int] = set()
    for g in job.groups.values():
        members = job.members(g)
        assumed = assumed_completed(members, job.observed)
        for r, rg in members:
            comp = assumed if rg.completion_unknown and assumed is not None else rg.last_completed
            if rg.last_enqueued > comp and not r.finished:
                in_flight.add(r.rank)
    anyone_busy = any(r.in_compile for r in job.ranks.values()) and job_working(job, stall_timeout)
    ranks = [
        QuietRank(
            rank=r.rank,
            observed=job.observed(r),
            process_state=r.process_state,
            in_flight=r.rank in in_flight,
            cores=cores(job, r, stall_timeout),
            io_bytes_s=io_bytes_s(job, r, stall_timeout),
            compiling=r.in_compile and anyone_busy,
        )
        for r in job.ranks.values()
    ]
    return find_job_quiet(
        ranks=ranks,
        moves=job.progress_moves,
        longest_gap_s=job.longest_gap_s,
        quiet_for_s=quiet_for,
        stall_timeout=stall_timeout,
        bound_s=bound_s,
        compile_running=any(
            r.in_compile and (working(job, r, stall_timeout) or r.compiler_running)
            for r in job.ranks.values()
        ),
    )
