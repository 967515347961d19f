"""Decode one flight-recorder dump object (FR format 2.0 .. 2.10+) into columns.

torch writes the same logical record in several shapes: pickle with ints and
`None` timestamps, JSON with string `pg_status` values, string seq ids and `0`
timestamps; older versions lack `is_p2p`, `retired`, `thread_*`, `p2p_seq_id`
and name the library version `nccl_version` instead of `comm_lib_version`.
Everything is normalized here, once, into per-field column arrays, so that
diagnosis works on one shape only.
"""

from __future__ import annotations

import itertools
import marshal
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hangwatch.analyzer.coded import (
    Coded,
    coded_by_key,
    encode,
    first_of_each,
    intern_values,
    is_str_or_none,
    marshal_keys,
    only_str,
    only_str_or_none,
    split_coded,
    str_or,
    tuple_keys,
)
from hangwatch.analyzer.fields import (
    as_int,
    dtypes_norm,
    durations,
    fast_int_column,
    frames_of,
    numel,
    pg_config_of,
    pg_status_of,
    sizes_str,
    split_profiling_name,
)
from hangwatch.analyzer.sniff import DumpFormatError

from hangwatch.frtail import is_tail

MAX_ENTRIES_PER_FILE = 5_000_000
# Frames are big; keep them only for the entries evidence can point at.
MAX_FRAMED_ENTRIES_PER_FILE = 64


# The integer columns read as they are from an entry's key of the same name,
# each with the value an entry without it (or with null) takes.
_READ_INTS: dict[str, int] = {
    "record_id": -1,
    "pg_id": -1,
    "collective_seq_id": -1,
    "p2p_seq_id": 0,
    "op_id": -1,
    "time_created_ns": 0,
    "time_discovered_started_ns": 0,
    "time_discovered_completed_ns": 0,
    "timeout_ms": 0,
}
INT_COLUMNS = (
    *_READ_INTS,
    "peer_src",  # group-local peer ranks parsed from "send 0->1"/"recv 1<-0"; -1 if none
    "peer_dst",
    "in_numel",  # total elements over all input tensors; -1 when sizes are absent
    "out_numel",
)
STR_COLUMNS = (
    "group",
    "group_desc",
    "profiling_name",
    "op",
    "state",
    "thread_name",
    "thread_id",
    "input_sizes",
    "output_sizes",
    "input_dtypes",
    "output_dtypes",
)
BOOL_COLUMNS = ("retired", "is_p2p")
FLOAT_COLUMNS = ("duration_ms",)
ENTRY_COLUMNS = INT_COLUMNS + STR_COLUMNS + BOOL_COLUMNS + FLOAT_COLUMNS

P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


@dataclass(kw_only=True)
class ParsedDump:
    """One file, normalized. Columns are numpy arrays, string columns `Coded`."""

    version: str
    comm_lib_version: str
    backend: str  # "nccl", "gloo", ... from the profiling names; "" when no entries
    pg_config: dict[str, dict[str, Any]]  # name -> {"name", "desc", "ranks": list[int] | None}
    # local pg_id (as str) -> (last_enqueued, last_started, last_completed); -1 = unknown
    pg_status: dict[str, tuple[int, int, int]]
    columns: dict[str, Any]
    n_entries: int
    frames: dict[int, tuple[tuple[str, str, int], ...]] = field(default_factory=dict)
    # Cut by hangwatch.frtail: a full dump of the same rank supersedes it.
    tail: bool = False
    # Recorded by torch's FlightRecorderHook (2.15+), not by the backend itself.
    hooked: bool = False
    # False when nothing in the dump says whether any collective completed:
    # a hook-recorded asynchronous backend (see recorder_semantics).
    completion_known: bool = True


# Backends that feed a flight recorder themselves, as torch 2.15 lists them
# (distributed_c10d._FR_SELF_RECORDING_BACKENDS, by the names their entries
# carry: legacy NCCL calls itself "nccl"). Every other backend's entries come
# from FlightRecorderHook. Before 2.15 only gloo and NCCL recorded at all.
SELF_RECORDING_BACKENDS = frozenset({"gloo", "nccl", "xccl", "fake", ""})


def recorder_semantics(
    backend: str, state: Coded, completed_ns: np.ndarray, pg_status: dict[str, tuple[int, int, int]]
) -> tuple[bool, bool]:
    """(hooked, completion_known) for one dump.

    Measured on torch 2.15 with an asynchronous CPU backend: the hook marks an
    entry `retired` when the call returns, leaves `state` at "scheduled", and
    `pg_status.last_completed_collective` at -1 however the work ends. So a
    hooked dump's `retired` says nothing about completion; only a completed
    state, a completion timestamp or a completed counter does.
    """
    hooked = backend not in SELF_RECORDING_BACKENDS
    if not hooked:
        return False, True
    known = (
        "completed" in state.cats
        or bool(np.any(completed_ns > 0))
        or any(c >= 0 for _, _, c in pg_status.values())
    )
    return True, known


# The keys every FR 2.x entry of torch >= 2.4 carries. When all are present
# one itemgetter per entry reads them; older dumps take the .get path.
# Low-cardinality keys are read as one tuple per entry and interned whole:
# a file has a few dozen distinct (group, op, state, thread, flags) tuples.
_META_KEYS = (
    "process_group",
    "profiling_name",
    "state",
    "thread_name",
    "thread_id",
    "is_p2p",
    "retired",
)
_VALUE_KEYS = (*_READ_INTS, "input_sizes", "input_dtypes", "output_sizes", "output_dtypes")
_META_GET = operator.itemgetter(*_META_KEYS)
_DEFAULTS: dict[str, Any] = {"p2p_seq_id": 0, "retired": False, "state": "scheduled"}


def _raw_columns(entries: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Sequence[Any]]:
    """Per-key value sequences, reading each entry once when it has every key."""
    if entries:
        try:
            rows = map(operator.itemgetter(*keys), entries)
            return dict(zip(keys, zip(*rows, strict=True), strict=True))
        except KeyError:
            pass
    out: dict[str, Sequence[Any]] = {}
    for k in keys:
        out[k] = [e.get(k, _DEFAULTS.get(k)) for e in entries]
    if "collective_seq_id" in out and None in out["collective_seq_id"]:
        # v1.x called it seq_id
        out["collective_seq_id"] = [e.get("collective_seq_id", e.get("seq_id")) for e in entries]
    return out


def group_columns(pgs: Sequence[Any], pg_ids: Sequence[Any]) -> tuple[Coded, Coded]:
    """Group name and desc per entry from process_group = (name, desc)."""
    types = set(map(type, pgs))
    keys: Sequence[Any] | None = None
    if types == {tuple}:
        keys = pgs
    elif types == {list}:
        keys = list(map(tuple, pgs))
    if keys is not None:
        pg = encode(keys, repr, types=frozenset({tuple}), exact=only_str_or_none)
        if all(len(k) >= 1 for k in (keys[i] for i in pg.reps)):
            # `exact` here too: the distinct reprs may still hash equal
            # ((0, False) == (0, 0)), and then str() of each differs.
            g = encode(
                [keys[i] for i in pg.reps],
                lambda k: str(k[0]),
                types=frozenset({tuple}),
                exact=only_str_or_none,
            )
            d = encode(
                [keys[i] for i in pg.reps],
                lambda k: str(k[1]) if len(k) > 1 and k[1] is not None else "",
                types=frozenset({tuple}),
                exact=only_str_or_none,
            )
            return g.compose(pg), d.compose(pg)
    groups: list[str] = []
    descs: list[str] = []
    for i, p in enumerate(pgs):
        if isinstance(p, list | tuple) and len(p) >= 1:
            groups.append(str(p[0]))
            descs.append(str(p[1]) if len(p) > 1 and p[1] is not None else "")
        elif p is None and pg_ids[i] is not None:
            groups.append(str(as_int(pg_ids[i], f"entry {i} pg_id")))
            descs.append("")
        else:
            raise DumpFormatError(f"entry {i} has no usable process_group")
    return encode(groups, str, types=frozenset({str})), encode(descs, str, types=frozenset({str}))


@dataclass(frozen=True, kw_only=True)
class _Meta:
    group: Coded
    group_desc: Coded
    name: Coded
    op: Coded
    state: Coded
    thread_name: Coded
    thread_id: Coded
    peer_src: np.ndarray
    peer_dst: np.ndarray
    is_p2p: np.ndarray
    retired: np.ndarray


def _from_names(name_c: Coded) -> tuple[Coded, np.ndarray, np.ndarray]:
    """op and peers, parsed once per distinct profiling name."""
    splits = [split_profiling_name(nm) for nm in name_c.cats]
    op_c = encode([sp[1] for sp in splits], str, types=frozenset({str})).compose(name_c)
    src = np.array([sp[2] for sp in splits], dtype=np.int64)[name_c.codes]
    dst = np.array([sp[3] for sp in splits], dtype=np.int64)[name_c.codes]
    return op_c, src, dst


def backend_of(name_c: Coded) -> str:
    """The backend most of one file's entries name ("" when it has none)."""
    per_name = np.bincount(name_c.codes, minlength=len(name_c.cats))
    backends: dict[str, int] = {}
    for nm, cnt in zip(name_c.cats, per_name.tolist(), strict=True):
        b = nm.partition(":")[0] if ":" in nm else ""
        backends[b] = backends.get(b, 0) + cnt
    return max(backends, key=lambda k: backends[k]) if backends else ""


def _meta_by_distinct_tuple(entries: list[dict[str, Any]]) -> _Meta | None:
    """The _META_KEYS columns, normalized once per distinct tuple of them.

    Exact when every distinct tuple holds only str/None/bool of the shapes
    torch writes: tuples merged by equality are then identical, except True
    merging with 1 (or False with 0) in the flags, which bool() maps alike.
    None (use the per-column path) for anything else, e.g. JSON's lists.
    """
    if not entries:
        return None
    try:
        codes, uniq = intern_values(list(map(_META_GET, entries)))
    except (KeyError, TypeError):
        return None
    for pg, name, state, tname, tid, p2p, ret in uniq:
        if not (
            type(pg) is tuple
            and len(pg) >= 1
            and only_str_or_none(pg)
            and type(name) is str
            and is_str_or_none(state)
            and is_str_or_none(tname)
            and is_str_or_none(tid)
            and type(p2p) is bool
            and type(ret) is bool
        ):
            return None
    rows = Coded(codes=codes, cats=[], reps=first_of_each(codes))

    def per_tuple(i: int, norm: Callable[[Any], str]) -> Coded:
        return encode(
            [u[i] for u in uniq], norm, types=frozenset({str, tuple, type(None)})
        ).compose(rows)

    name_c = per_tuple(1, str)
    op_c, src, dst = _from_names(name_c)
    return _Meta(
        group=per_tuple(0, lambda pg: str(pg[0])),
        group_desc=per_tuple(0, lambda pg: str(pg[1]) if len(pg) > 1 and pg[1] is not None else ""),
        name=name_c,
        op=op_c,
        state=per_tuple(2, str_or("scheduled")),
        thread_name=per_tuple(3, str_or("")),
        thread_id=per_tuple(4, str_or("")),
        peer_src=src,
        peer_dst=dst,
        is_p2p=np.array([u[5] for u in uniq], dtype=bool)[codes],
        retired=np.array([u[6] for u in uniq], dtype=bool)[codes],
    )


def _meta_per_column(col: dict[str, Sequence[Any]], pg_ids: Sequence[Any]) -> _Meta:
    group, group_desc = group_columns(col["process_group"], pg_ids)
    names = col["profiling_name"]
    if not set(map(type, names)) <= {str}:
        for i, nm in enumerate(names):
            if not isinstance(nm, str):
                raise DumpFormatError(f"entry {i} profiling_name is not a string")
    name_c = encode(names, str, types=frozenset({str}))
    op_c, src, dst = _from_names(name_c)
    is_p2p_raw = col["is_p2p"]
    if set(map(type, is_p2p_raw)) <= {bool}:
        is_p2p = np.array(is_p2p_raw, dtype=bool)
    else:
        ops = op_c.strings()
        is_p2p = np.array(
            [
                bool(v) if v is not None else (op in P2P_OPS)
                for v, op in zip(is_p2p_raw, ops, strict=True)
            ],
            dtype=bool,
        )
    retired_raw = col["retired"]
    if set(map(type, retired_raw)) <= {bool}:
        retired = np.array(retired_raw, dtype=bool)
    else:
        retired = np.array([bool(v) for v in retired_raw], dtype=bool)
    str_t = frozenset({str})
    return _Meta(
        group=group,
        group_desc=group_desc,
        name=name_c,
        op=op_c,
        state=encode(col["state"], str_or("scheduled"), types=str_t),
        thread_name=encode(col["thread_name"], str_or(""), types=str_t),
        thread_id=encode(col["thread_id"], str_or(""), types=str_t),
        peer_src=src,
        peer_dst=dst,
        is_p2p=is_p2p,
        retired=retired,
    )


def check_dump(raw: Any, *, max_entries: int = MAX_ENTRIES_PER_FILE) -> list[dict[str, Any]]:
    """The entries of a decoded dump object, after the checks of its shape."""
    if not isinstance(raw, dict):
        raise DumpFormatError(f"top level is {type(raw).__name__}, expected a mapping")
    if "version" not in raw:
        raise DumpFormatError("no 'version' key: not a flight-recorder dump")
    if "entries" not in raw and "pg_status" not in raw:
        raise DumpFormatError("neither 'entries' nor 'pg_status': not a flight-recorder dump")
    entries = raw.get("entries", [])
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise DumpFormatError(f"'entries' has type {type(entries).__name__}, expected a list")
    if len(entries) > max_entries:
        raise DumpFormatError(f"{len(entries)} entries exceeds the limit of {max_entries}")
    if not set(map(type, entries)) <= {dict}:
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                raise DumpFormatError(f"entry {i} has type {type(e).__name__}, expected a mapping")
    return entries


def decode_dump(raw: Any, *, max_entries: int = MAX_ENTRIES_PER_FILE) -> ParsedDump:
    """Validate a decoded dump object and build its columns.

    Work per entry is done by C-level calls (one itemgetter, zip, map, numpy)
    wherever the values have the shapes torch writes; Python-level
    normalization then runs once per *distinct* value (a few dozen per file),
    and odd shapes fall back to per-value normalization with the same result.
    """
    entries = check_dump(raw, max_entries=max_entries)
    return _finish(raw, entries, _columns(entries))


def decode_dumps(dumps: list[tuple[Any, list[dict[str, Any]]]]) -> list[ParsedDump]:
    """Several checked dumps (object, check_dump's entries) decoded as one.

    Every value is normalized on its own merits (see decode_dump), so the
    columns of the concatenated entries, cut back at the file boundaries,
    are those each file would decode to alone, string columns included
    (split_coded). A tail holds ~34 entries: decoding 4,096 of them one by
    one cost 2.3 s in numpy calls per column per file, together 0.3 s. Any
    error is raised for the whole batch; the caller decodes its files one
    by one to tell which one is bad.
    """
    if len(dumps) == 1:
        raw, entries = dumps[0]
        return [_finish(raw, entries, _columns(entries))]
    sizes = [len(entries) for _, entries in dumps]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    columns = _columns([e for _, entries in dumps for e in entries])
    per_file: list[dict[str, Any]] = [{} for _ in dumps]
    for k, col in columns.items():
        parts = (
            split_coded(col, bounds)
            if isinstance(col, Coded)
            else [col[lo:hi] for lo, hi in itertools.pairwise(bounds.tolist())]
        )
        for d, part in zip(per_file, parts, strict=True):
            d[k] = part
    return [
        _finish(raw, entries, cols) for (raw, entries), cols in zip(dumps, per_file, strict=True)
    ]


# What decoding a bad dump raises: a format problem, or a structure too deep
# or too big for this process.
DECODE_ERRORS = (DumpFormatError, RecursionError, MemoryError)


def decode_each(dumps: list[tuple[Any, list[dict[str, Any]]]]) -> list[ParsedDump | BaseException]:
    """decode_dumps, or where the batch fails, each dump alone: a bad dump
    becomes its own error and never costs the others theirs."""
    try:
        return list(decode_dumps(dumps))
    except DECODE_ERRORS as e:
        if len(dumps) == 1:
            return [e]
    return [r for d in dumps for r in decode_each([d])]


def _columns(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The ENTRY_COLUMNS of checked entries (`retired` as recorded)."""
    raw_cols = _raw_columns(entries, _VALUE_KEYS)
    col = raw_cols.__getitem__
    meta = _meta_by_distinct_tuple(entries)
    if meta is None:
        meta = _meta_per_column(_raw_columns(entries, _META_KEYS), col("pg_id"))

    coll_seq = col("collective_seq_id")
    if None in coll_seq:
        raise DumpFormatError("an entry has no collective_seq_id")

    # Sizes are compared across ranks by their exact text and checked by
    # element count; both are computed once per distinct shape list.
    in_raw, out_raw = col("input_sizes"), col("output_sizes")
    in_s, out_s, in_dt, out_dt = _shape_columns(
        in_raw, out_raw, col("input_dtypes"), col("output_dtypes")
    )
    in_n = np.array([numel(in_raw[i]) for i in in_s.reps], dtype=np.int64)[in_s.codes]
    out_n = np.array([numel(out_raw[i]) for i in out_s.reps], dtype=np.int64)[out_s.codes]

    return {
        **{k: fast_int_column(col(k), default, k) for k, default in _READ_INTS.items()},
        "peer_src": meta.peer_src,
        "peer_dst": meta.peer_dst,
        "in_numel": in_n,
        "out_numel": out_n,
        "group": meta.group,
        "group_desc": meta.group_desc,
        "profiling_name": meta.name,
        "op": meta.op,
        "state": meta.state,
        "thread_name": meta.thread_name,
        "thread_id": meta.thread_id,
        "input_sizes": in_s,
        "output_sizes": out_s,
        "input_dtypes": in_dt,
        "output_dtypes": out_dt,
        "retired": meta.retired,
        "is_p2p": meta.is_p2p,
        "duration_ms": durations(entries),
    }


def _shape_columns(
    in_sizes: Sequence[Any],
    out_sizes: Sequence[Any],
    in_dtypes: Sequence[Any],
    out_dtypes: Sequence[Any],
) -> tuple[Coded, Coded, Coded, Coded]:
    """Input/output sizes and dtypes, normalized once per distinct
    combination of the four: one marshal key per entry instead of a key and
    an interning per column (44 -> 20-30 ms per 16,000 entries). Equal
    marshal bytes are equal values, types included, and each column's Coded
    depends only on its rows' strings, so each is what encode gives it
    alone. Anything but lists takes encode's own per-column path."""
    list_t = frozenset({list})
    cols = (in_sizes, out_sizes, in_dtypes, out_dtypes)
    if all(set(map(type, c)) <= list_t for c in cols):
        try:
            raw_codes, _ = intern_values(
                list(map(marshal.dumps, zip(*cols, strict=True), itertools.repeat(2)))
            )
        except (TypeError, ValueError):  # unmarshallable, or too deep
            raw_codes = None
        if raw_codes is not None:
            first = first_of_each(raw_codes)
            return (
                coded_by_key(raw_codes, first, (sizes_str(in_sizes[i]) for i in first)),
                coded_by_key(raw_codes, first, (sizes_str(out_sizes[i]) for i in first)),
                coded_by_key(raw_codes, first, (dtypes_norm(in_dtypes[i]) for i in first)),
                coded_by_key(raw_codes, first, (dtypes_norm(out_dtypes[i]) for i in first)),
            )
    return (
        encode(in_sizes, sizes_str, types=list_t, keys=marshal_keys),
        encode(out_sizes, sizes_str, types=list_t, keys=marshal_keys),
        encode(in_dtypes, dtypes_norm, types=list_t, keys=tuple_keys, exact=only_str),
        encode(out_dtypes, dtypes_norm, types=list_t, keys=tuple_keys, exact=only_str),
    )


def _finish(
    raw: dict[str, Any], entries: list[dict[str, Any]], columns: dict[str, Any]
) -> ParsedDump:
    """One file's dump from its columns: frames, pg_status and what its recorder means."""
    n = len(entries)
    backend = backend_of(columns["profiling_name"])
    state: Coded = columns["state"]
    retired: np.ndarray = columns["retired"]
    group: Coded = columns["group"]
    # Frames: only for entries still in flight and each group's newest entry,
    # newest first, capped: that is what evidence can point at.
    frames: dict[int, tuple[tuple[str, str, int], ...]] = {}
    if n:
        rec = columns["record_id"]
        # A hooked recorder's `retired` is not completion (recorder_semantics).
        done = retired.copy() if backend in SELF_RECORDING_BACKENDS else np.zeros(n, bool)
        if "completed" in state.cats:
            done |= state.codes == state.cats.index("completed")
        want = ~done
        _, last_rev = np.unique(group.codes[::-1], return_index=True)
        want[n - 1 - last_rev] = True
        for i in np.flatnonzero(want)[::-1]:
            if len(frames) >= MAX_FRAMED_ENTRIES_PER_FILE:
                break
            fr = entries[i].get("frames")
            if fr:
                frames[int(rec[i])] = frames_of(fr)

    pg_status = pg_status_of(raw.get("pg_status"))
    hooked, completion_known = recorder_semantics(
        backend, state, columns["time_discovered_completed_ns"], pg_status
    )
    if hooked:
        # Not completion there (see recorder_semantics); and the hook's
        # pg_status counts op_id from 0 where gloo and NCCL count from 1.
        columns["retired"] = np.zeros(n, dtype=bool)
        pg_status = {k: tuple(v + 1 if v >= 0 else v for v in t) for k, t in pg_status.items()}  # type: ignore[misc]
    comm = raw.get("comm_lib_version", raw.get("nccl_version", ""))
    return ParsedDump(
        version=str(raw.get("version")),
        comm_lib_version=str(comm or ""),
        backend=backend,
        pg_config=pg_config_of(raw.get("pg_config")),
        pg_status=pg_status,
        columns=columns,
        n_entries=n,
        frames=frames,
        tail=is_tail(raw),
        hooked=hooked,
        completion_known=completion_known,
    )
