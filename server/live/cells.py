"""One rank's numbers for each process group it reported, stored as a report gives them.

The registry's innermost step, run for every (rank, group) cell of every
progress report: 32 cells a report for an 8-rank node in 4 groups, 131,072 a
second for a 4,096-rank job at 1 Hz. One loop stores them for both wire forms
(`store_cells`): the columns as they were unpacked, and the per-rank messages
of older agents turned into the same columns first (`message_cells`). Only
the registry calls these, under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from hangwatch.server.live.records import GroupRecord, JobRecord, RankGroupRecord, RankRecord

from hangwatch import progress_columns
from hangwatch.progress_columns import COMPLETION_UNKNOWN, HAS_COLLECTIVES, HAS_IN_FLIGHT
from hangwatch.wire import COLLECTIVES_UNKNOWN, pb


def message_cells(
    job: JobRecord, rows: Sequence[RankRecord], ranks: Sequence[pb.RankProgress]
) -> tuple[list[RankGroupRecord | None], list[GroupRecord | None], progress_columns.Columns]:
    """The per-rank form's cells (ProgressReport.ranks, each rank with its
    record in `rows`) as `store_cells` takes them: each cell's two records
    (None for a group the rank never registered: membership unknown, not
    applied) and its numbers as columns. Only the cell columns are filled."""
    rank_groups: list[RankGroupRecord | None] = []
    groups: list[GroupRecord | None] = []
    numbers: list[tuple[int, int, int, int, int, int, float, int]] = []
    ops: dict[str, int] = {}
    for r, rp in zip(rows, ranks, strict=True):
        for gp in rp.groups:
            name = gp.group  # each read of a string field makes a new str
            rg, g = r.groups.get(name), job.groups.get(name)
            known = rg is not None and g is not None
            rank_groups.append(rg if known else None)
            groups.append(g if known else None)
            coll = gp.HasField("collectives_enqueued")
            # Reading the submessage builds its wrapper: only where it is set.
            f = gp.oldest_in_flight if gp.HasField("oldest_in_flight") else None
            numbers.append(
                (
                    (COMPLETION_UNKNOWN if gp.completion_unknown else 0)
                    | (HAS_COLLECTIVES if coll else 0)
                    | (HAS_IN_FLIGHT if f is not None else 0),
                    gp.last_enqueued,
                    gp.last_completed,
                    gp.collectives_enqueued if coll else 0,
                    gp.collectives_completed if coll else 0,
                    0 if f is None else f.seq,
                    0.0 if f is None else f.age_s,
                    0 if f is None else ops.setdefault(f.op, len(ops)),
                )
            )
    no: tuple[int, ...] = ()
    flags, enq, comp, cenq, ccomp, fseq, fage, fop = tuple(zip(*numbers, strict=True)) or (no,) * 8
    cells = progress_columns.Columns(
        *(no,) * 8,  # the rank columns: the registry reads the messages' own
        no,
        no,
        flags,
        enq,
        comp,
        no,
        cenq,
        ccomp,
        fseq,
        fage,
        fop,
        tuple(ops),
    )
    return rank_groups, groups, cells


def store_cells(
    job: JobRecord,
    rank_groups: Sequence[RankGroupRecord | None],
    groups: Sequence[GroupRecord | None],
    c: progress_columns.Columns,
    now: float,
) -> bool:
    """Store each cell's numbers (the cell columns of `c`, GroupProgress's
    fields) in its rank's record of the group; True when they moved the job.
    Cells whose records are None are skipped. One loop, nothing built per
    cell: a call per cell with its numbers as arguments was half of the
    registry's work per report (benchmarks/ingest_path.py).

    A rank's first numbers (a new process, or a coordinator that never saw
    it) are where it starts, not progress. Where completion is not recorded,
    entering collectives is the only progress there is to see. A collective
    is in flight from the earliest moment any report implied (its arrival
    less the agent's age) for as long as the same one stays open."""
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
