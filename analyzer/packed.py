"""A node's FR tails decoded on the node: one archive member read instead of every tail decoded.

Why: the analyzer spent about 1.3 ms a rank reading, unpickling and decoding
FR tails (23-26 s at 16,384 ranks on one core), work that grows with the job
while the coordinator does not. Each agent decoding its own node's ~8 tails
costs that node ~8 ms (57 ms with its child process, started ahead); the
analyzer then reads one member per node (11-15 s at 16,384 ranks,
docs/benchmarks.md).

The member, `rank_<R>/fr_columns` of a node archive (R: the archive's lowest
rank; `formats.FR_COLUMNS_FILE`), holds the `ParsedDump` of each tail of the
archive, exactly as `decode.decode_dumps` built it:

    MAGIC | header length (uint32, little-endian) | header (JSON) | arrays

- header: the decoder's identity; node-level tables of the distinct frames,
  stacks (lists of frames), value lists and groups (a node's ranks share most
  of them, so each is written and checked once); and per dump its member
  name, the tail's CRC-32 and size, row count, the normalized scalars
  (`ParsedDump`'s fields), and indices into those tables for its string
  columns' values, its groups and its entries' stacks;
- arrays: each of `decode.ENTRY_COLUMNS` in order, every dump's rows one
  after the other; string columns as int32 codes into that dump's values.
  Offsets follow from the row count, so nothing in the header can point
  outside the member.

It is a cache, never the evidence: the tails stay in the archive, and a dump
is taken from here only when the decoder is this one (`decoder_id`: a digest
of the decoding code, so a coordinator and an agent of different versions
fall back on their own) and the tail member's CRC-32 and size are those
recorded. Anything else, and the analyzer decodes the tail itself: nothing
is lost, only time. A member that fails its checks is one FileError.

Agents build it in a short-lived child process (`python -m
hangwatch.analyzer.packed`, see `agent.uploader`): decoding needs numpy, which
the sidecar does not load.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
from hangwatch.analyzer.coded import Coded, first_of_each
from hangwatch.analyzer.decode import (
    BOOL_COLUMNS,
    DECODE_ERRORS,
    ENTRY_COLUMNS,
    FLOAT_COLUMNS,
    INT_COLUMNS,
    MAX_ENTRIES_PER_FILE,
    MAX_FRAMED_ENTRIES_PER_FILE,
    STR_COLUMNS,
    ParsedDump,
    check_dump,
    decode_each,
)
from hangwatch.analyzer.sniff import sniff_and_decode

from hangwatch import formats
from hangwatch.formats import nodearchive

MAGIC: Final = b"HWCOLS1\n"
_LEN: Final = struct.Struct("<I")
# A node's header is ~10-40 KB (eight ranks' distinct strings and frame
# indices); far above that is not a node's.
MAX_HEADER_BYTES: Final = 16 * 1024 * 1024
MAX_DUMPS: Final = nodearchive.MAX_MEMBERS
# A node's member is ~50-100 KB (eight tails of ~34 entries).
MAX_BYTES: Final = 256 * 1024 * 1024
# A tail is ~15 KB; one far bigger is left to the analyzer to decode.
MAX_TAIL_BYTES: Final = 64 * 1024 * 1024
MAX_FRAMES_PER_ENTRY: Final = 64  # fields.frames_of keeps at most 64

# One dtype per column kind; the writer and the reader agree by construction.
_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    **{k: np.dtype("<i8") for k in INT_COLUMNS},
    **{k: np.dtype("<i4") for k in STR_COLUMNS},
    **{k: np.dtype("|b1") for k in BOOL_COLUMNS},
    **{k: np.dtype("<f8") for k in FLOAT_COLUMNS},
}
_ROW_BYTES: Final = sum(_DTYPES[k].itemsize for k in ENTRY_COLUMNS)

# The code whose output this member caches: a change to any of them is a
# different decoder, and its columns are not taken.
_DECODER_MODULES: Final = (
    "hangwatch.analyzer.packed",
    "hangwatch.analyzer.decode",
    "hangwatch.analyzer.fields",
    "hangwatch.analyzer.coded",
    "hangwatch.analyzer.sniff",
    "hangwatch.safepickle",
    "hangwatch.frtail",
)


class PackError(ValueError):
    """A columns member that cannot be used; the message is one line."""


class StaleDecoder(PackError):
    """Columns built by another decoder: not damage, the tails are decoded instead."""


@functools.cache
def decoder_id() -> str:
    """A digest of the decoding code's sources; "" (never matching) when any is unreadable."""
    h = hashlib.sha256()
    for name in _DECODER_MODULES:
        path = getattr(importlib.import_module(name), "__file__", None)
        try:
            with open(str(path), "rb") as f:
                h.update(f.read())
        except OSError:
            return ""
    return h.hexdigest()[:24]


# -- writing (the agent's child process) -------------------------------------


def pack(tails: Sequence[tuple[int, str, bytes]]) -> bytes | None:
    """(rank, file name, bytes) of a node's FR tails, decoded into one member.

    A tail that does not decode is left out: the analyzer decodes it and
    reports its error itself. None when nothing decoded or the decoding
    code cannot be identified.
    """
    did = decoder_id()
    if not did:
        return None
    ok: list[tuple[int, str, bytes]] = []
    raws: list[tuple[Any, list[Any]]] = []
    for rank, name, data in tails:
        try:
            raw = sniff_and_decode(data)
            raws.append((raw, check_dump(raw, max_entries=MAX_ENTRIES_PER_FILE)))
        except DECODE_ERRORS:
            continue
        ok.append((rank, name, data))
    got = [(t, p) for t, p in zip(ok, decode_each(raws), strict=True) if isinstance(p, ParsedDump)]
    if not got:
        return None
    # The ranks of a node share most of their groups, values and stacks:
    # each distinct one is written (and checked on reading) once.
    frames: dict[tuple[str, str, int], int] = {}
    stacks: dict[tuple[int, ...], int] = {}
    values: dict[tuple[str, ...], int] = {}
    groups: dict[tuple[str, str, tuple[int, ...] | None], int] = {}

    def ref(table: dict[Any, int], key: Any) -> int:
        return table.setdefault(key, len(table))

    dumps = []
    for (rank, name, data), p in got:
        dumps.append(
            {
                "member": f"rank_{rank}/{name}",
                "crc": nodearchive.crc32(data),
                "size": len(data),
                "n": p.n_entries,
                "version": p.version,
                "comm": p.comm_lib_version,
                "backend": p.backend,
                "groups": [
                    ref(
                        groups,
                        (c["name"], c["desc"], None if c["ranks"] is None else tuple(c["ranks"])),
                    )
                    for c in p.pg_config.values()
                ],
                "pg_status": p.pg_status,
                "values": [ref(values, tuple(p.columns[k].cats)) for k in STR_COLUMNS],
                "frames": [
                    [rec, ref(stacks, tuple(ref(frames, f) for f in fr))]
                    for rec, fr in p.frames.items()
                ],
                "tail": p.tail,
                "hooked": p.hooked,
                "completion_known": p.completion_known,
            }
        )
    header = json.dumps(
        {
            "decoder": did,
            "columns": list(ENTRY_COLUMNS),
            "frames": list(frames),
            "stacks": list(stacks),
            "values": list(values),
            "groups": list(groups),
            "dumps": dumps,
        },
        separators=(",", ":"),
    ).encode()
    arrays = []
    for k in ENTRY_COLUMNS:
        cols = [p.columns[k].codes if k in STR_COLUMNS else p.columns[k] for _, p in got]
        arrays.append(np.concatenate(cols).astype(_DTYPES[k], copy=False).tobytes())
    return b"".join([MAGIC, _LEN.pack(len(header)), header, *arrays])


# -- reading (the analyzer) ---------------------------------------------------


def unpack(data: bytes, members: Mapping[str, nodearchive.Member]) -> dict[str, ParsedDump]:
    """Member name ("rank_R/fr_tail_rank_R") -> its ParsedDump, for each dump
    whose tail is in `members` (the same archive's) with the recorded CRC-32
    and size. StaleDecoder when another decoder wrote it; PackError when it
    is damaged."""
    if data[: len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + _LEN.size:
        raise PackError("not a columns member (bad magic)")
    (hlen,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if hlen > MAX_HEADER_BYTES or start + hlen > len(data):
        raise PackError(f"header of {hlen} bytes does not fit")
    try:
        head = json.loads(data[start : start + hlen])
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise PackError(f"header is not JSON: {str(e)[:100]}") from None
    if not isinstance(head, dict):
        raise PackError("header is not a mapping")
    if head.get("decoder") != decoder_id() or head.get("columns") != list(ENTRY_COLUMNS):
        raise StaleDecoder("written by another decoder")
    stacks = _stacks(_frame_table(head.get("frames")), head.get("stacks"))
    values = _values(head.get("values"))
    groups = _groups(head.get("groups"))
    dumps = head.get("dumps")
    if not isinstance(dumps, list) or len(dumps) > MAX_DUMPS:
        raise PackError(f"'dumps' is not a list of at most {MAX_DUMPS}")
    if not all(isinstance(d, dict) for d in dumps):
        raise PackError("a dump is not a mapping")
    sizes = [_int(d.get("n"), "n") for d in dumps]
    total = sum(sizes)
    if total > MAX_ENTRIES_PER_FILE * max(1, len(dumps)):
        raise PackError(f"{total} rows is over the limit")
    off = start + hlen
    if len(data) - off != total * _ROW_BYTES:
        raise PackError(f"{len(data) - off} bytes of arrays, expected {total * _ROW_BYTES}")
    cats = [_refs(d.get("values"), values, len(STR_COLUMNS), "values") for d in dumps]
    cols: dict[str, np.ndarray] = {}
    for k in ENTRY_COLUMNS:
        # A copy: a view would keep the whole member alive until the merge.
        cols[k] = np.frombuffer(data, dtype=_DTYPES[k], count=total, offset=off).copy()
        off += total * _DTYPES[k].itemsize
    first, cat_starts = _check_codes(
        [cols[k] for k in STR_COLUMNS],
        [[len(c[j]) for c in cats] for j in range(len(STR_COLUMNS))],
        sizes,
    )
    bounds = np.cumsum([0, *sizes]).tolist()
    out: dict[str, ParsedDump] = {}
    for i, d in enumerate(dumps):
        name = d.get("member")
        m = members.get(name) if isinstance(name, str) else None
        if m is None or m.crc != d.get("crc") or m.size != d.get("size"):
            continue  # not this archive's tail (any more): decode it instead
        lo, hi = bounds[i], bounds[i + 1]
        columns: dict[str, Any] = {k: cols[k][lo:hi] for k in ENTRY_COLUMNS}
        for j, k in enumerate(STR_COLUMNS):
            a = cat_starts[j][i]
            reps = first[a : a + len(cats[i][j])] - lo
            columns[k] = Coded(codes=columns[k], cats=cats[i][j], reps=reps)
        pg_config = {}
        for group, desc, ranks in _refs(d.get("groups"), groups, None, "groups"):
            # A list of its own per dump, as decoding gives (the ints shared).
            pg_config[group] = {
                "name": group,
                "desc": desc,
                "ranks": None if ranks is None else list(ranks),
            }
        out[name] = ParsedDump(
            version=_str(d.get("version"), "version"),
            comm_lib_version=_str(d.get("comm"), "comm"),
            backend=_str(d.get("backend"), "backend"),
            pg_config=pg_config,
            pg_status=_pg_status(d.get("pg_status")),
            columns=columns,
            n_entries=sizes[i],
            frames=_frames(d.get("frames"), stacks),
            tail=_bool(d.get("tail"), "tail"),
            hooked=_bool(d.get("hooked"), "hooked"),
            completion_known=_bool(d.get("completion_known"), "completion_known"),
        )
    return out


def _check_codes(
    codes: list[np.ndarray], n_cats: list[list[int]], sizes: list[int]
) -> tuple[np.ndarray, list[list[int]]]:
    """Every dump's codes index its own values, in order of first appearance,
    using each one (what decoding gives). All string columns at once: each
    code numbered across columns and dumps (its column's values, then its
    dump's, before it), which must then count 0, 1, 2, ... without a gap.

    Returns the row where each numbered value first appears (Coded.reps,
    before the shift to its dump's rows) and, per column, where each dump's
    values start in that list."""
    starts: list[list[int]] = []
    base = 0
    glob_parts = []
    limits = []
    for col, per_dump in zip(codes, n_cats, strict=True):
        offs = np.cumsum([base, *per_dump]).tolist()
        starts.append(offs[:-1])
        glob_parts.append(col.astype(np.int64) + np.repeat(np.asarray(offs[:-1], np.int64), sizes))
        limits.append(np.repeat(np.asarray(per_dump, np.int64), sizes))
        base = offs[-1]
    flat = np.concatenate(codes) if codes else np.zeros(0, np.int32)
    glob = np.concatenate(glob_parts) if glob_parts else np.zeros(0, np.int64)
    if len(flat) and (flat.min() < 0 or bool(np.any(flat >= np.concatenate(limits)))):
        raise PackError("a string code is out of its dump's range")
    if not len(glob):
        ordered = base == 0
    else:
        hi = np.maximum.accumulate(glob)
        ordered = glob[0] == 0 and int(hi[-1]) == base - 1 and not np.any(np.diff(hi) > 1)
    if not ordered:
        raise PackError("string values are not numbered in order of first appearance")
    # first_of_each numbers rows across the columns laid end to end; each
    # column's rows start at a multiple of the row count.
    total = sum(sizes)
    return first_of_each(glob) % max(total, 1), starts


def _frame_table(v: Any) -> list[tuple[str, str, int]]:
    if not isinstance(v, list):
        raise PackError("'frames' is not a list")
    out = []
    for f in v:
        if not (
            isinstance(f, list)
            and len(f) == 3
            and isinstance(f[0], str)
            and isinstance(f[1], str)
            and type(f[2]) is int
        ):
            raise PackError("a frame is not [name, file, line]")
        out.append((f[0], f[1], f[2]))
    return out


def _stacks(table: list[tuple[str, str, int]], v: Any) -> list[tuple[tuple[str, str, int], ...]]:
    if not isinstance(v, list):
        raise PackError("'stacks' is not a list")
    out = []
    for idx in v:
        if not isinstance(idx, list) or len(idx) > MAX_FRAMES_PER_ENTRY:
            raise PackError("a stack is not a short list of frame indices")
        out.append(tuple(_refs(idx, table, None, "stack")))
    return out


def _values(v: Any) -> list[list[str]]:
    if not isinstance(v, list):
        raise PackError("'values' is not a list")
    for c in v:
        if not isinstance(c, list) or not all(type(s) is str for s in c) or len(set(c)) != len(c):
            raise PackError("a value list is not distinct strings")
    return v


def _groups(v: Any) -> list[tuple[str, str, tuple[int, ...] | None]]:
    if not isinstance(v, list):
        raise PackError("'groups' is not a list")
    out = []
    for g in v:
        ranks = g[2] if isinstance(g, list) and len(g) == 3 else 0
        if not (
            isinstance(g, list)
            and len(g) == 3
            and isinstance(g[0], str)
            and isinstance(g[1], str)
            # set(map(type)): C-level, where a generator over ~4,000
            # members a node cost 0.9 ms (1.9 s at 16,384 ranks).
            and (ranks is None or (isinstance(ranks, list) and set(map(type, ranks)) <= {int}))
        ):
            raise PackError("a group is not [name, desc, ranks]")
        out.append((g[0], g[1], None if ranks is None else _shared_ranks(tuple(ranks))))
    return out


@functools.lru_cache(maxsize=8192)
def _shared_ranks(ranks: tuple[int, ...]) -> tuple[int, ...]:
    """One copy of each member list across the nodes: a 16,384-rank bundle
    names ~8.5 million members in all, 359 MB as separate ints (the decoder
    shares them the same way, fields.parse_rank_list)."""
    return ranks


def _refs(v: Any, table: Sequence[Any], n: int | None, what: str) -> list[Any]:
    """The table's items at the indices in `v` (exactly `n` of them, if given)."""
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise PackError(f"a dump's {what} is not a list of {n or 'some'} indices")
    size = len(table)
    if not all(type(i) is int and 0 <= i < size for i in v):
        raise PackError(f"a {what} index is out of its table")
    return [table[i] for i in v]


def _frames(
    v: Any, stacks: list[tuple[tuple[str, str, int], ...]]
) -> dict[int, tuple[tuple[str, str, int], ...]]:
    if not isinstance(v, list) or len(v) > MAX_FRAMED_ENTRIES_PER_FILE:
        raise PackError("a dump's 'frames' is not a short list")
    out: dict[int, tuple[tuple[str, str, int], ...]] = {}
    for item in v:
        if not (isinstance(item, list) and len(item) == 2):
            raise PackError("a dump's frame list is not [record_id, stack]")
        out[_int(item[0], "record_id", lo=-(1 << 62))] = _refs([item[1]], stacks, 1, "stack")[0]
    return out


def _pg_status(v: Any) -> dict[str, tuple[int, int, int]]:
    if not isinstance(v, dict):
        raise PackError("'pg_status' is not a mapping")
    out: dict[str, tuple[int, int, int]] = {}
    for k, t in v.items():
        if not (isinstance(t, list) and len(t) == 3 and all(type(x) is int for x in t)):
            raise PackError(f"pg_status of {str(k)[:40]!r} is not three integers")
        out[k] = (t[0], t[1], t[2])
    return out


def _int(v: Any, what: str, lo: int = 0) -> int:
    if type(v) is not int or not lo <= v < (1 << 62):
        raise PackError(f"{what} is not an integer in range")
    return v


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise PackError(f"{what} is not a string")
    return v


def _bool(v: Any, what: str) -> bool:
    if not isinstance(v, bool):
        raise PackError(f"{what} is not true or false")
    return v


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hangwatch.analyzer.packed RANK:PATH ...` (or `-`: those
    lines on stdin, the agent's way): the columns member of those tails on
    stdout, nothing when none decoded. Run by the agent, which never loads
    numpy itself."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["-"]:
        args = sys.stdin.read().split("\n")
    tails: list[tuple[int, str, bytes]] = []
    for arg in filter(None, args):
        rank, _, path = arg.partition(":")
        if not rank.isdigit() or not path:
            print(f"hangwatch.analyzer.packed: {arg[:200]!r} is not RANK:PATH", file=sys.stderr)
            return 2
        try:
            with open(path, "rb") as f:
                tails.append((int(rank), os.path.basename(path), f.read(MAX_TAIL_BYTES + 1)))
        except OSError as e:
            print(f"hangwatch.analyzer.packed: cannot read {path}: {e}", file=sys.stderr)
            return 2
    ok = [t for t in tails if formats.is_tail_fr_name(t[1]) and len(t[2]) <= MAX_TAIL_BYTES]
    sys.stdout.buffer.write(pack(ok) or b"")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
