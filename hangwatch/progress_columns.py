"""ProgressReport.columns: an agent's ranks as fixed-width columns, both ways.

The agent encodes the RankProgress messages its poller builds (`encode`); the
coordinator unpacks each column in one `struct.unpack` call (`decode`) and
checks shapes and ranges over whole columns with C builtins (min, max, len),
not field by field. The layout is defined once, here, for both sides; the
wire contract is ProgressColumns in proto/hangwatch/v1/hangwatch.proto.

Why columns: the coordinator's cost per rank report was dominated by walking
one protobuf message per rank and one per (rank, group), and reading each
field through the message (benchmarks/ingest_path.py: 2.7 µs a rank to
validate and 9.6 to apply, against 0.36 to parse). An unpacked column is a
tuple of Python ints, read as fast as anything Python reads.

Only the standard library: the agent imports this, and it must stay light.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from hangwatch.wire import pb

# ProgressColumns.rank_flags bits.
FINISHED: Final = 1
IN_COMPILE: Final = 2
COMPILER_RUNNING: Final = 4
# ProgressColumns.cell_flags bits.
COMPLETION_UNKNOWN: Final = 1
HAS_COLLECTIVES: Final = 2
HAS_IN_FLIGHT: Final = 4

MAX_CELL_RANKS: Final = 1 << 16  # cell_rank is a uint16
MAX_OPS: Final = 1 << 16  # in_flight_op is a uint16
_MAX_COUNT: Final = (1 << 63) - 1
RANK_COUNTS: Final = 3  # rank_counts: status_at_ns, cpu_time_ns, runqueue_wait_ns
CELL_COUNTS: Final = 6  # cell_counts: see ProgressColumns
# Columns of those fields read as bytes (count_column), by position.
STATUS_AT: Final = 0  # rank_counts' status_at_ns
LAST_ENQUEUED: Final = 0  # cell_counts' last_enqueued
LAST_STARTED: Final = 2  # cell_counts' last_started


def count_column(raw: bytes, k: int, n: int) -> bytes:
    """Column `k` of a rank_counts or cell_counts field holding `n` values a
    column (int64, one column after the other), as bytes: for a field whose
    length `decode` checked."""
    return raw[8 * k * n : 8 * (k + 1) * n]


class ColumnsError(ValueError):
    """ProgressColumns whose arrays do not fit together."""


def group_table(ranks: Iterable[pb.RankInfo]) -> dict[str, int]:
    """The session's group table (name -> index): every group of a
    RegisterRequest's ranks, in order of first appearance. Agent and
    coordinator derive it from the same request."""
    table: dict[str, int] = {}
    for ri in ranks:
        for gi in ri.groups:
            table.setdefault(gi.name, len(table))
    return table


def _pack(code: str, values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}{code}", *values)


def encode(
    ranks: Sequence[pb.RankProgress], table: Mapping[str, int]
) -> tuple[pb.ProgressColumns | None, list[pb.RankProgress]]:
    """The ranks as columns, and those that must stay messages (a group
    outside `table`, made after the agent registered)."""
    rows: list[pb.RankProgress] = []
    rest: list[pb.RankProgress] = []
    for rp in ranks:
        if all(gp.group in table for gp in rp.groups) and len(rows) < MAX_CELL_RANKS:
            rows.append(rp)
        else:
            rest.append(rp)
    if not rows:
        return None, rest
    states: list[int] = []
    rank_flags: list[int] = []
    status_at: list[int] = []
    cpu: list[int] = []
    wait: list[int] = []
    io: list[int] = []
    cell_rank: list[int] = []
    cell_group: list[int] = []
    cell_flags: list[int] = []
    ages: list[float] = []
    op_index: list[int] = []
    counts: list[list[int]] = [[] for _ in range(CELL_COUNTS)]
    enq, comp, started, cenq, ccomp, fseq = counts
    ops: dict[str, int] = {}
    for i, rp in enumerate(rows):
        states.append(rp.state)
        rank_flags.append(
            (FINISHED if rp.finished else 0)
            | (IN_COMPILE if rp.in_compile else 0)
            | (COMPILER_RUNNING if rp.compiler_running else 0)
        )
        status_at.append(rp.status_at_ns)
        cpu.append(min(rp.cpu_time_ns, _MAX_COUNT))
        wait.append(min(rp.runqueue_wait_ns, _MAX_COUNT))
        io.append(min(rp.io_bytes, _MAX_COUNT))
        for gp in rp.groups:
            coll = gp.HasField("collectives_enqueued")
            flight = gp.HasField("oldest_in_flight")
            cell_rank.append(i)
            cell_group.append(table[gp.group])
            cell_flags.append(
                (COMPLETION_UNKNOWN if gp.completion_unknown else 0)
                | (HAS_COLLECTIVES if coll else 0)
                | (HAS_IN_FLIGHT if flight else 0)
            )
            enq.append(gp.last_enqueued)
            comp.append(gp.last_completed)
            started.append(gp.last_started)
            cenq.append(gp.collectives_enqueued if coll else 0)
            ccomp.append(gp.collectives_completed if coll else 0)
            f = gp.oldest_in_flight
            fseq.append(f.seq if flight else 0)
            ages.append(f.age_s if flight else 0.0)
            op_index.append(ops.setdefault(f.op, len(ops)) if flight else 0)
    if len(ops) > MAX_OPS:
        return None, list(ranks)  # never seen: an op name per collective kind
    return (
        pb.ProgressColumns(
            rank=_pack("i", [rp.rank for rp in rows]),
            rank_codes=_pack("B", states + rank_flags),
            rank_counts=_pack("q", status_at + cpu + wait),
            fr_age_s=_pack("d", [rp.fr_age_s for rp in rows]),
            cell_rank=_pack("H", cell_rank),
            cell_group=_pack("I", cell_group),
            cell_flags=_pack("B", cell_flags),
            cell_counts=_pack("q", [x for col in counts for x in col]),
            in_flight_age_s=_pack("d", ages),
            in_flight_op=_pack("H", op_index),
            ops=list(ops),
            rank_io=_pack("q", io),
        ),
        rest,
    )


class Columns(NamedTuple):
    """ProgressColumns unpacked: one tuple per column, shapes checked. (A
    NamedTuple: built once per report, and a frozen dataclass's 19 setattrs
    cost 3 µs more.)"""

    rank: tuple[int, ...]
    state: tuple[int, ...]
    rank_flags: tuple[int, ...]
    status_at_ns: tuple[int, ...]
    cpu_time_ns: tuple[int, ...]
    runqueue_wait_ns: tuple[int, ...]
    io_bytes: tuple[int, ...]  # all 0 (unknown) from an agent older than the column
    fr_age_s: tuple[float, ...]
    cell_rank: tuple[int, ...]
    cell_group: tuple[int, ...]
    cell_flags: tuple[int, ...]
    last_enqueued: tuple[int, ...]
    last_completed: tuple[int, ...]
    last_started: tuple[int, ...]
    collectives_enqueued: tuple[int, ...]
    collectives_completed: tuple[int, ...]
    in_flight_seq: tuple[int, ...]
    in_flight_age_s: tuple[float, ...]
    in_flight_op: tuple[int, ...]
    ops: tuple[str, ...]
    # rank, cell_rank and cell_group as sent (fixed widths: the same bytes are
    # the same values): what the registry keys an agent's resolved layout on,
    # kept from the reads above rather than copied out of the message again.
    packed_layout: tuple[bytes, bytes, bytes]


# Compiled layouts by (code, count): an agent sends the same shapes report
# after report, and formatting and looking up the format string was a third
# of decode's time (benchmarks/ingest_path.py). Bounded: a hostile peer
# varying its counts would otherwise grow it for ever.
_STRUCTS: dict[tuple[str, int], struct.Struct] = {}
_MAX_STRUCTS: Final = 4096


def _unpack(raw: bytes, name: str, code: str, width: int, n: int) -> tuple[Any, ...]:
    """`n` values of struct `code` (`width` bytes each) from field `name`."""
    if len(raw) != n * width:
        raise ColumnsError(f"columns.{name}: {len(raw)} bytes, expected {n} x {width}")
    s = _STRUCTS.get((code, n))
    if s is None:
        if len(_STRUCTS) >= _MAX_STRUCTS:
            _STRUCTS.clear()
        s = _STRUCTS[code, n] = struct.Struct(f"<{n}{code}")
    out: tuple[Any, ...] = s.unpack(raw)
    return out


def decode(msg: pb.ProgressColumns) -> Columns:
    """Unpack and check that the arrays fit together: every array as long as
    the number of ranks (or cells) says, each cell naming a rank of the report
    and, where it has one in flight, an op of `ops`. Group indices are checked
    against the session's table by the registry, which holds it. A rank or a
    cell given twice is applied twice, the later numbers standing, as in
    ProgressReport.ranks."""
    raw_rank = msg.rank
    if len(raw_rank) % 4:
        raise ColumnsError(f"columns.rank: {len(raw_rank)} bytes, not a multiple of 4")
    r = len(raw_rank) // 4
    rank = _unpack(raw_rank, "rank", "i", 4, r)
    codes = _unpack(msg.rank_codes, "rank_codes", "B", 1, 2 * r)
    rc = _unpack(msg.rank_counts, "rank_counts", "q", 8, RANK_COUNTS * r)
    fr_age = _unpack(msg.fr_age_s, "fr_age_s", "d", 8, r)
    io = _unpack(msg.rank_io, "rank_io", "q", 8, r) if msg.rank_io else (0,) * r
    raw_cell_rank, raw_cell_group = msg.cell_rank, msg.cell_group
    if len(raw_cell_rank) % 2:
        raise ColumnsError(f"columns.cell_rank: {len(raw_cell_rank)} bytes, not a multiple of 2")
    c = len(raw_cell_rank) // 2
    cell_rank = _unpack(raw_cell_rank, "cell_rank", "H", 2, c)
    cell_group = _unpack(raw_cell_group, "cell_group", "I", 4, c)
    flags = _unpack(msg.cell_flags, "cell_flags", "B", 1, c)
    cc = _unpack(msg.cell_counts, "cell_counts", "q", 8, CELL_COUNTS * c)
    ages = _unpack(msg.in_flight_age_s, "in_flight_age_s", "d", 8, c)
    op = _unpack(msg.in_flight_op, "in_flight_op", "H", 2, c)
    ops = tuple(msg.ops)
    if c:
        if max(cell_rank) >= r:
            raise ColumnsError(f"columns.cell_rank: {max(cell_rank)} is not one of {r} ranks")
        # Cells with nothing in flight carry op 0: look closer only past the table.
        if max(op) >= len(ops) and any(
            f & HAS_IN_FLIGHT and o >= len(ops) for f, o in zip(flags, op, strict=True)
        ):
            raise ColumnsError(f"columns.in_flight_op: {max(op)} is not one of {len(ops)} ops")
    # Positional: keyword construction of a 20-field NamedTuple cost 2 µs a report.
    return Columns(
        rank,
        codes[:r],
        codes[r:],
        rc[:r],
        rc[r : 2 * r],
        rc[2 * r :],
        io,
        fr_age,
        cell_rank,
        cell_group,
        flags,
        cc[:c],
        cc[c : 2 * c],
        cc[2 * c : 3 * c],
        cc[3 * c : 4 * c],
        cc[4 * c : 5 * c],
        cc[5 * c :],
        ages,
        op,
        ops,
        (raw_rank, raw_cell_rank, raw_cell_group),
    )
