"""Every (rank, group) cell of one job, its numbers in fixed-width columns.

A 4,096-rank job in 5 groups has 20,480 cells, and each report rewrites up to
40 of them. As one slotted object per cell, with each number a Python int or
float of its own, a cell cost 127 bytes and 28-30 more for each number past
256 or not a shared float (benchmarks/ingest_path.py's
"registry" line). Here a cell is 73 bytes in eleven `array.array` columns
(8 numbers of 8 bytes, a group id and an op id of 4 bytes each, a byte of
flags), and a rank's cells are one contiguous span: its record keeps only
where the span starts and how long it is.

`array.array` rather than numpy: the per-report path reads and writes single
cells from Python, where an array item is a plain int or float (numpy's
scalars are 3-4x slower to read one at a time and would leak into views).

None is stored as a sentinel: NONE for an in-flight sequence number, NaN for
an age or a time, and COLLECTIVES_UNKNOWN as the agent sends it. Only the registry writes, under its lock; readers get `Cell`
views, made on demand, and never keep them past the lock.
"""

from __future__ import annotations

import math
from array import array
from typing import Any, Final

from hangwatch.wire import COLLECTIVES_UNKNOWN

NONE: Final = -(1 << 63)  # in_flight_seq's None
_NAN: Final = math.nan

# Cell flags (the `bits` column).
COMPLETION_UNKNOWN: Final = 1  # its recorder does not record completion
REPORTED: Final = 2  # numbers arrived: a rank's first numbers are where it starts, not a move
COUNTS_P2P: Final = 4  # the group's pg_status counts p2p ops too

MAX_OPS: Final = 1024  # distinct in-flight op names a job keeps

# Spans no rank holds any more are reclaimed by compacting once they are
# more than half the table and at least this many cells (a job whose agents
# re-register with other groups, or drop ranks, leaves them behind).
COMPACT_MIN_CELLS: Final = 4096


class CellTable:
    """The cells' columns; a cell is an index into every one of them."""

    __slots__ = (
        "_name_ids",
        "_op_ids",
        "bits",
        "coll_completed",
        "coll_enqueued",
        "dead",
        "group",
        "in_flight_age_s",
        "in_flight_op",
        "in_flight_seq",
        "in_flight_since",
        "last_completed",
        "last_enqueued",
        "names",
        "ops",
        "reported_at",
    )

    def __init__(self) -> None:
        self.last_enqueued = array("q")
        self.last_completed = array("q")
        # GroupProgress.collectives_* as sent, read only where the group's
        # pg_status also counts p2p ops (COUNTS_P2P): else they are the two
        # above (`Cell.collectives`). Lag and stalls compare these.
        self.coll_enqueued = array("q")
        self.coll_completed = array("q")
        self.in_flight_seq = array("q")
        self.in_flight_age_s = array("d")  # as the agent measured it at its report
        # Coordinator time it was first seen in flight in in_flight_seq, less
        # the age its agent gave then: how long it has waited there.
        self.in_flight_since = array("d")
        self.reported_at = array("d")
        self.in_flight_op = array("i")  # an index into `ops`
        self.bits = array("B")
        # Each cell's group, an index into `names`: a rank's cells are found
        # by scanning its span for one (`find`, in C), so a rank keeps no map
        # of its own (a dict of its 5 groups was 180 bytes a rank; group
        # names differ from rank to rank, so maps could not be shared).
        self.group = array("i")
        self.names: list[str] = []
        self._name_ids: dict[str, int] = {}
        # The job's in-flight op names, each stored once ("" is 0: none known).
        self.ops: list[str] = [""]
        self._op_ids: dict[str, int] = {"": 0}
        self.dead = 0  # cells in spans no rank holds

    def __len__(self) -> int:
        return len(self.bits)

    def op_id(self, op: str) -> int:
        """The id of op name `op`; past MAX_OPS names, 0 (none known): a
        job's ops are a few dozen, and an agent sending endless distinct
        names must not grow the job's table for ever."""
        i = self._op_ids.get(op)
        if i is None:
            if len(self.ops) >= MAX_OPS:
                return 0
            i = self._op_ids[op] = len(self.ops)
            self.ops.append(op)
        return i

    def group_id(self, name: str) -> int:
        """The id of group `name`, given one on first sight."""
        i = self._name_ids.get(name)
        if i is None:
            i = self._name_ids[name] = len(self.names)
            self.names.append(name)
        return i

    def known_group(self, name: str) -> int | None:
        return self._name_ids.get(name)

    def find(self, first: int, n: int, gid: int | None) -> int:
        """The cell of group `gid` in the span of `n` cells at `first`, or -1."""
        if gid is None or n == 0:
            return -1
        try:
            return self.group.index(gid, first, first + n)
        except ValueError:
            return -1

    def span_groups(self, first: int, n: int) -> array[int]:
        return self.group[first : first + n]

    def allocate(self, groups: array[int], now: float) -> int:
        """Cells for `groups` (ids) as a rank's registration leaves them; the first one's index."""
        start = len(self.bits)
        n = len(groups)
        self.group.extend(groups)
        ints = array("q", [-1]) * n
        for col in (self.last_enqueued, self.last_completed, self.coll_enqueued):
            col.extend(ints)
        self.coll_completed.extend(ints)
        self.in_flight_seq.extend(array("q", [NONE]) * n)
        nan = array("d", [_NAN]) * n
        self.in_flight_age_s.extend(nan)
        self.in_flight_since.extend(nan)
        self.reported_at.extend(array("d", [now]) * n)
        self.in_flight_op.extend(array("i", [0]) * n)
        self.bits.extend(array("B", [0]) * n)
        return start

    def reset(self, start: int, n: int, now: float) -> None:
        """Cells `start` to `start + n` as freshly allocated (a new process on a rank)."""
        for i in range(start, start + n):
            self.last_enqueued[i] = self.last_completed[i] = -1
            self.coll_enqueued[i] = self.coll_completed[i] = -1
            self.in_flight_seq[i] = NONE
            self.in_flight_age_s[i] = self.in_flight_since[i] = _NAN
            self.reported_at[i] = now
            self.in_flight_op[i] = 0
            self.bits[i] = 0

    def copy(self, src: int, dst: int) -> None:
        """Cell `src`'s numbers into cell `dst` (of the same group)."""
        for col in self._columns()[:-1]:
            col[dst] = col[src]

    def release(self, n: int) -> None:
        """A span of `n` cells that no rank holds any more."""
        self.dead += n

    def wants_compacting(self) -> bool:
        return self.dead >= COMPACT_MIN_CELLS and self.dead * 2 > len(self.bits)

    def compacted(self, spans: list[tuple[int, int]]) -> tuple[CellTable, list[int]]:
        """A table of only `spans` (start, length), in that order, and where each starts in it."""
        out = CellTable()
        out.ops, out._op_ids = self.ops, self._op_ids
        out.names, out._name_ids = self.names, self._name_ids
        starts: list[int] = []
        for start, n in spans:
            starts.append(len(out.bits))
            for new, old in zip(out._columns(), self._columns(), strict=True):
                new.extend(old[start : start + n])
        return out, starts

    def _columns(self) -> tuple[array[Any], ...]:
        return (
            self.last_enqueued,
            self.last_completed,
            self.coll_enqueued,
            self.coll_completed,
            self.in_flight_seq,
            self.in_flight_age_s,
            self.in_flight_since,
            self.reported_at,
            self.in_flight_op,
            self.bits,
            self.group,
        )


class Cell:
    """One cell's numbers, read through from the table (None where unknown)."""

    __slots__ = ("_i", "_t")

    def __init__(self, table: CellTable, i: int) -> None:
        self._t = table
        self._i = i

    @property
    def last_enqueued(self) -> int:
        return self._t.last_enqueued[self._i]

    @property
    def last_completed(self) -> int:
        return self._t.last_completed[self._i]

    @property
    def coll_enqueued(self) -> int | None:
        c = self.collectives()
        return None if c is None else c[0]

    @property
    def coll_completed(self) -> int | None:
        c = self.collectives()
        return None if c is None else c[1]

    @property
    def in_flight_seq(self) -> int | None:
        v = self._t.in_flight_seq[self._i]
        return None if v == NONE else v

    @property
    def in_flight_op(self) -> str:
        return self._t.ops[self._t.in_flight_op[self._i]]

    @property
    def in_flight_age_s(self) -> float | None:
        v = self._t.in_flight_age_s[self._i]
        return None if math.isnan(v) else v

    @property
    def in_flight_since(self) -> float | None:
        v = self._t.in_flight_since[self._i]
        return None if math.isnan(v) else v

    @property
    def reported_at(self) -> float:
        return self._t.reported_at[self._i]

    @property
    def reported(self) -> bool:
        return self._t.bits[self._i] & REPORTED != 0

    @property
    def completion_unknown(self) -> bool:
        return self._t.bits[self._i] & COMPLETION_UNKNOWN != 0

    @property
    def counts_p2p(self) -> bool:
        return self._t.bits[self._i] & COUNTS_P2P != 0

    def collectives(self) -> tuple[int, int] | None:
        """The two counts in collective numbering: pg_status's own unless it
        counts p2p too, None there while the agent cannot tell."""
        t, i = self._t, self._i
        if not t.bits[i] & COUNTS_P2P:
            return t.last_enqueued[i], t.last_completed[i]
        enq, comp = t.coll_enqueued[i], t.coll_completed[i]
        return None if enq == COLLECTIVES_UNKNOWN or comp == COLLECTIVES_UNKNOWN else (enq, comp)

    def counts(self) -> tuple[int, int]:
        """(enqueued, completed) as the stall scan compares them: in collective
        numbering where known, else pg_status's own."""
        return self.collectives() or (self.last_enqueued, self.last_completed)

    def in_flight_age(self, now: float) -> float | None:
        """The agent-measured age plus the time since its report arrived."""
        if self._t.in_flight_seq[self._i] == NONE:
            return None
        age = self._t.in_flight_age_s[self._i]
        return None if math.isnan(age) else age + (now - self._t.reported_at[self._i])
