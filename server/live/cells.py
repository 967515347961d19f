"""One rank's numbers for one process group, stored as a report gives them.

The registry's innermost step, run for every (rank, group) cell of every
progress report: 32 cells a report for an 8-rank node in 4 groups, 131,072 a
second for a 4,096-rank job at 1 Hz. Only the registry calls these, under its lock.
"""

from __future__ import annotations

from hangwatch.server.live.records import GroupRecord, JobRecord, RankGroupRecord, RankRecord

from hangwatch import progress_columns
from hangwatch.progress_columns import COMPLETION_UNKNOWN, HAS_COLLECTIVES, HAS_IN_FLIGHT
from hangwatch.wire import COLLECTIVES_UNKNOWN


def apply_cell(
    job: JobRecord,
    r: RankRecord,
    group: str,
    now: float,
    enqueued: int,
    completed: int,
    completion_unknown: bool,
    collectives: tuple[int, int] | None,
    in_flight: tuple[int, str, float] | None,
) -> bool:
    """Store one rank's numbers for one group by name (`store_cell`); False,
    storing nothing, for a group it never registered: membership unknown."""
    rg = r.groups.get(group)
    g = job.groups.get(group)
    if rg is None or g is None:
        return False
    return store_cell(
        job, rg, g, now, enqueued, completed, completion_unknown, collectives, in_flight
    )


def store_cell(
    job: JobRecord,
    rg: RankGroupRecord,
    g: GroupRecord,
    now: float,
    enqueued: int,
    completed: int,
    completion_unknown: bool,
    collectives: tuple[int, int] | None,
    in_flight: tuple[int, str, float] | None,
) -> bool:
    """Store one rank's numbers for one group (GroupProgress's fields:
    `collectives` the collectives_* pair where present, `in_flight`
    oldest_in_flight's seq, op and age); True when they moved the job."""
    # A rank's first numbers (a new process, or a coordinator that never saw
    # it) are where it starts, not progress.
    baseline = not rg.reported
    # Where completion is not recorded, entering collectives is the only
    # progress there is to see.
    moved = enqueued != rg.last_enqueued if completion_unknown else completed != rg.last_completed
    rg.last_enqueued = enqueued
    rg.last_completed = completed
    # The two counts the stall scan compares (RankGroupRecord.counts), known
    # here without reading them back.
    enq, comp = enqueued, completed
    if collectives is None:
        rg.coll_enqueued, rg.coll_completed = enqueued, completed  # no p2p in the group
    elif COLLECTIVES_UNKNOWN in collectives:
        rg.coll_enqueued = rg.coll_completed = None
    else:
        rg.coll_enqueued, rg.coll_completed = enq, comp = collectives
    rg.counts_p2p = collectives is not None
    rg.completion_unknown = completion_unknown
    rg.reported_at = now
    rg.reported = True
    # A p2p op in flight is not a collective in flight; where the numbering
    # is unknown, the agent's in-flight seq is in pg_status's, like these.
    was, since = rg.in_flight_seq, rg.in_flight_since
    if in_flight is not None and (completion_unknown or enq > comp):
        # Where completion is unknown the agent names the op of the newest
        # collective entered.
        rg.in_flight_seq, rg.in_flight_op, rg.in_flight_age_s = in_flight
    elif enq > comp:
        rg.in_flight_seq = comp + 1
        rg.in_flight_op = ""
        rg.in_flight_age_s = None
    else:
        rg.in_flight_seq = None
        rg.in_flight_op = ""
        rg.in_flight_age_s = None
    if rg.in_flight_seq is None:
        rg.in_flight_since = None
    else:
        entered = now - (rg.in_flight_age_s or 0.0)
        same = was == rg.in_flight_seq and since is not None
        rg.in_flight_since = min(entered, since) if same and since is not None else entered
    if moved and not baseline:
        g.last_progress = now
        job.last_progress = now
        return True
    return False


def store_columns(
    job: JobRecord,
    rank_groups: tuple[RankGroupRecord | None, ...],
    groups: tuple[GroupRecord | None, ...],
    c: progress_columns.Columns,
    now: float,
) -> bool:
    """`store_cell` for every cell of a columnar report in one loop: the same
    steps, the cell's numbers read straight from the columns and nothing built
    per cell (a call, two tuples and nine arguments a cell were half of the
    registry's work per report, benchmarks/ingest_path.py). Cells whose
    records are None (a group the rank never registered) are skipped. True
    when they moved the job."""
    moved_job = False
    ops = c.ops
    for rg, g, flags, enq, comp, cenq, ccomp, fseq, fage, fop in zip(
        rank_groups,
        groups,
        c.cell_flags,
        c.last_enqueued,
        c.last_completed,
        c.collectives_enqueued,
        c.collectives_completed,
        c.in_flight_seq,
        c.in_flight_age_s,
        c.in_flight_op,
        strict=True,
    ):
        if rg is None or g is None:
            continue
        unknown = flags & COMPLETION_UNKNOWN != 0
        moved = (enq != rg.last_enqueued if unknown else comp != rg.last_completed) and rg.reported
        rg.last_enqueued = enq
        rg.last_completed = comp
        if not flags & HAS_COLLECTIVES:
            rg.coll_enqueued = enq
            rg.coll_completed = comp
            rg.counts_p2p = False
        elif cenq == COLLECTIVES_UNKNOWN or ccomp == COLLECTIVES_UNKNOWN:
            rg.coll_enqueued = rg.coll_completed = None
            rg.counts_p2p = True
        else:
            rg.coll_enqueued = enq = cenq
            rg.coll_completed = comp = ccomp
            rg.counts_p2p = True
        rg.completion_unknown = unknown
        rg.reported_at = now
        rg.reported = True
        if flags & HAS_IN_FLIGHT and (unknown or enq > comp):
            entered = now - (fage or 0.0)
            since = rg.in_flight_since
            rg.in_flight_since = (
                min(entered, since) if since is not None and rg.in_flight_seq == fseq else entered
            )
            rg.in_flight_seq = fseq
            rg.in_flight_op = ops[fop]
            rg.in_flight_age_s = fage
        elif enq > comp:
            since = rg.in_flight_since
            seq = comp + 1
            rg.in_flight_since = (
                min(now, since) if since is not None and rg.in_flight_seq == seq else now
            )
            rg.in_flight_seq = seq
            rg.in_flight_op = ""
            rg.in_flight_age_s = None
        else:
            rg.in_flight_seq = rg.in_flight_since = rg.in_flight_age_s = None
            rg.in_flight_op = ""
        if moved:
            g.last_progress = now
            moved_job = True
    if moved_job:
        job.last_progress = now
    return moved_job
