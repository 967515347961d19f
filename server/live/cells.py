"""One rank's numbers for each process group it reported, stored as a report gives them.

The registry's innermost step, run for every (rank, group) cell of every
progress report: 32 cells a report for an 8-rank node in 4 groups, 131,072 a
second for a 4,096-rank job at 1 Hz. One loop stores them for both wire forms
(`store_cells`) into the job's CellTable: the columns as they were unpacked,
and the per-rank messages of older agents turned into the same columns first
(`message_cells`). Only the registry calls these, under its lock.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from hangwatch.server.live.celltable import COMPLETION_UNKNOWN as CELL_COMPLETION_UNKNOWN
from hangwatch.server.live.celltable import COUNTS_P2P, NONE, REPORTED
from hangwatch.server.live.records import GroupRecord, JobRecord, RankRecord

from hangwatch import progress_columns
from hangwatch.progress_columns import COMPLETION_UNKNOWN, HAS_COLLECTIVES, HAS_IN_FLIGHT
from hangwatch.wire import COLLECTIVES_UNKNOWN, next_seq, pb


def message_cells(
    job: JobRecord, rows: Sequence[RankRecord], ranks: Sequence[pb.RankProgress]
) -> tuple[list[int], list[GroupRecord | None], progress_columns.Columns]:
    """The per-rank form's cells (ProgressReport.ranks, each rank with its
    record in `rows`) as `store_cells` takes them: each cell's index in the
    job's CellTable and its group's record (-1 and None for a group the rank
    never registered: membership unknown, not applied) and its numbers as
    columns. Only the cell columns are filled."""
    cells: list[int] = []
    groups: list[GroupRecord | None] = []
    numbers: list[tuple[int, int, int, int, int, int, float, int]] = []
    ops: dict[str, int] = {}
    t = job.cells
    for r, rp in zip(rows, ranks, strict=True):
        for gp in rp.groups:
            name = gp.group  # each read of a string field makes a new str
            k = t.find(r.first_cell, r.cell_count, t.known_group(name))
            g = job.groups.get(name)
            known = k >= 0 and g is not None
            cells.append(k if known else -1)
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
    columns = progress_columns.Columns(
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
        (b"", b"", b""),  # no plan is made for the messages form
    )
    return cells, groups, columns


def store_cells(
    job: JobRecord,
    cells: Sequence[int],
    groups: Sequence[GroupRecord | None],
    c: progress_columns.Columns,
    now: float,
    run: int = -1,
) -> bool:
    """Store each cell's numbers (the cell columns of `c`, GroupProgress's
    fields) at its index in the job's CellTable; True when they moved the
    job. Cells whose group is None are skipped. `run`: the first index when
    `cells` are one contiguous ascending run, all known (CellPlan.run).

    In three steps: the cells' old numbers read out, the new ones worked out
    in one loop over plain lists, and written back, a whole column at a time
    (a slice) for a run. An array item read or written from Python costs 2-3x
    an attribute of a slotted object (21-28 ns against 8), and doing the
    per-cell work item by item made the registry's apply 1.5x slower than
    the objects it replaced (benchmarks/ingest_path.py).

    A rank's first numbers (a new process, or a coordinator that never saw
    it) are where it starts, not progress. Where completion is not recorded,
    entering collectives is the only progress there is to see. A collective
    is in flight from the earliest moment any report implied (its arrival
    less the agent's age) for as long as the same one stays open."""
    t = job.cells
    cols: Sequence[Sequence[int] | Sequence[float]] = (
        c.cell_flags,
        c.last_enqueued,
        c.last_completed,
        c.collectives_enqueued,
        c.collectives_completed,
        c.in_flight_seq,
        c.in_flight_age_s,
        c.in_flight_op,
    )
    idx: Sequence[int]
    if run >= 0:
        idx = range(run, run + len(cells))
        take: Callable[[array[Any]], Sequence[Any]] = lambda a: a[run : run + len(cells)]  # noqa: E731
    else:
        keep = [k for k, g in enumerate(groups) if g is not None]
        if len(keep) < len(groups):
            groups = [groups[k] for k in keep]
            cols = [[col[k] for k in keep] for col in cols]
        idx = [cells[k] for k in keep]
        take = lambda a: [a[i] for i in idx]  # noqa: E731
    if not idx:
        return False
    flags_c, enq_c, comp_c, cenq_c, ccomp_c, fseq_c, fage_c, fop_c = cols
    old_bits = take(t.bits)
    ops = [t.op_id(op) for op in c.ops]
    nan = math.nan
    bits_o: list[int] = []
    seq_o: list[int] = []
    since_o: list[float] = []
    op_o: list[int] = []
    age_o: list[float] = []
    moved_job = coll = False
    for g, flags, enq, comp, cenq, ccomp, fseq, fage, fop, oenq, ocomp, obits, oseq, osince in zip(
        groups,
        flags_c,
        enq_c,
        comp_c,
        cenq_c,
        ccomp_c,
        fseq_c,
        fage_c,
        fop_c,
        take(t.last_enqueued),
        take(t.last_completed),
        old_bits,
        take(t.in_flight_seq),
        take(t.in_flight_since),
        strict=True,
    ):
        unknown = flags & COMPLETION_UNKNOWN
        if (enq != oenq if unknown else comp != ocomp) and obits & REPORTED:
            g.last_progress = now  # type: ignore[union-attr]  # None only where idx skips it
            moved_job = True
        if flags & HAS_COLLECTIVES:
            # The coll columns hold what was sent; CellTable reads them only here.
            coll = True
            bits = REPORTED | COUNTS_P2P
            if cenq != COLLECTIVES_UNKNOWN and ccomp != COLLECTIVES_UNKNOWN:
                enq, comp = cenq, ccomp
        else:
            bits = REPORTED
        bits_o.append(bits | CELL_COMPLETION_UNKNOWN if unknown else bits)
        # A NaN `since` (none yet) compares False: the new time is taken.
        if flags & HAS_IN_FLIGHT and (unknown or enq > comp):
            entered = now - (fage or 0.0)
            since_o.append(osince if osince <= entered and oseq == fseq else entered)
            seq_o.append(fseq)
            op_o.append(ops[fop])
            age_o.append(fage)
        elif enq > comp:
            seq = next_seq(comp)
            since_o.append(osince if osince <= now and oseq == seq else now)
            seq_o.append(seq)
            op_o.append(0)
            age_o.append(nan)
        else:
            seq_o.append(NONE)
            since_o.append(nan)
            op_o.append(0)
            age_o.append(nan)
    n = len(idx)
    writes = [
        (t.last_enqueued, "q", enq_c),
        (t.last_completed, "q", comp_c),
        (t.bits, "B", bits_o),
        (t.in_flight_seq, "q", seq_o),
        (t.in_flight_since, "d", since_o),
        (t.in_flight_op, "i", op_o),
        (t.in_flight_age_s, "d", age_o),
        (t.reported_at, "d", [now] * n),
    ]
    if coll:
        # Read only for a cell that counts p2p (COUNTS_P2P): no cell has
        # them in most reports, and each column written is 0.7 µs a report.
        writes += [(t.coll_enqueued, "q", cenq_c), (t.coll_completed, "q", ccomp_c)]
    for col, code, values in writes:
        if run >= 0:
            col[run : run + n] = array(code, values)
        else:
            for i, v in zip(idx, values, strict=True):
                col[i] = v
    if moved_job:
        job.last_progress = now
    return moved_job
