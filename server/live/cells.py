"""One rank's numbers for one process group, stored as a report gives them.

The registry's innermost step, run for every (rank, group) cell of every
progress report: 32 cells a report for an 8-rank node in 4 groups, 131,072 a
second for a 4,096-rank job at 1 Hz. Only the registry calls these, under its lock.
"""

from __future__ import annotations

from hangwatch.server.live.records import GroupRecord, JobRecord, RankGroupRecord, RankRecord

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
