"""Decode one flight-recorder dump (pickle or JSON, FR format 2.0 .. 2.10+) into columns.

torch writes the same logical record in several shapes: pickle with ints and
`None` timestamps, JSON with string `pg_status` values, string seq ids and `0`
timestamps; older versions lack `is_p2p`, `retired`, `thread_*`, `p2p_seq_id`
and name the library version `nccl_version` instead of `comm_lib_version`.
Everything is normalized here, once, into per-field column arrays, so that
diagnosis works on one shape only.
"""

from __future__ import annotations

import functools
import itertools
import json
import marshal
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hangwatch.frtail import is_tail
from hangwatch.safepickle import UnsafePickleError, safe_loads

MAX_ENTRIES_PER_FILE = 5_000_000
# Frames are big; keep them only for the entries evidence can point at.
MAX_FRAMED_ENTRIES_PER_FILE = 64


class DumpFormatError(ValueError):
    """The bytes are not a usable flight-recorder dump; the message says why."""


INT_COLUMNS = (
    "record_id",
    "pg_id",
    "collective_seq_id",
    "p2p_seq_id",
    "op_id",
    "time_created_ns",
    "time_discovered_started_ns",
    "time_discovered_completed_ns",
    "timeout_ms",
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

_P2P_RE = re.compile(r"^(send|recv)\s+(-?\d+)\s*(->|<-)\s*(-?\d+)$")
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


@dataclass(frozen=True, kw_only=True)
class Coded:
    """A string column of one file: codes into distinct strings.

    Workers ship these (a small int array and a short list) instead of a
    pandas Categorical per column per file; the loader merges the distinct
    strings once for all files.
    """

    codes: np.ndarray  # int32, one per entry
    cats: list[str]  # distinct values, in order of first appearance
    reps: np.ndarray  # row of each value's first appearance

    def strings(self) -> list[str]:
        return [self.cats[c] for c in self.codes.tolist()]

    def compose(self, inner: Coded) -> Coded:
        """This encodes one value per distinct value of `inner`; re-index it per row."""
        codes = self.codes[inner.codes] if len(inner.codes) else inner.codes
        return Coded(codes=codes, cats=self.cats, reps=inner.reps[self.reps])


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


def sniff_and_decode(data: bytes) -> Any:
    """Decode by content: JSON text or a pickle stream; anything else is refused."""
    head = data[:64].lstrip()
    if not head:
        raise DumpFormatError("empty file")
    if head[:1] in (b"{", b"["):
        try:
            return json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise DumpFormatError(f"invalid JSON: {_short(e)}") from e
    if data[:1] == b"\x80" or data[:1] in (b"(", b"}", b"]"):
        try:
            return safe_loads(data)
        except UnsafePickleError as e:
            raise DumpFormatError(f"unsafe pickle: {e}") from e
        except ValueError as e:
            raise DumpFormatError(str(e)) from e
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        raise DumpFormatError("a PNG image, not a flight-recorder dump")
    raise DumpFormatError("neither pickle nor JSON: not a flight-recorder dump")


def _short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:200]


def _as_int(v: Any, what: str) -> int:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            raise DumpFormatError(f"{what} is not an integer: {v[:40]!r}") from None
    if isinstance(v, float) and v.is_integer():
        return int(v)
    raise DumpFormatError(f"{what} has type {type(v).__name__}, expected an integer")


def _opt_int(v: Any, default: int, what: str) -> int:
    if v is None:
        return default
    return _as_int(v, what)


def _int_column(values: list[Any], default: int, what: str) -> np.ndarray:
    try:
        if all(type(v) is int for v in values):
            return np.array(values, dtype=np.int64)
        filled = [default if v is None else v for v in values]  # pickle's None timestamps
        if all(type(v) is int for v in filled):
            return np.array(filled, dtype=np.int64)
        return np.array([_opt_int(v, default, what) for v in values], dtype=np.int64)
    except OverflowError:
        raise DumpFormatError(f"{what} does not fit in 64 bits") from None


def _sizes_str(v: Any) -> str:
    if v is None:
        return "[]"
    if isinstance(v, list | tuple):
        return str([list(x) if isinstance(x, list | tuple) else x for x in v])
    return str(v)


def _numel(v: Any) -> int:
    if not isinstance(v, list | tuple) or not v:
        return -1
    total = 0
    for t in v:
        if not isinstance(t, list | tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in t
        ):
            return -1
        total += math.prod(t)
    return total


def _dtypes_str(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, list | tuple):
        return ",".join(str(x) for x in v)
    return str(v)


def split_profiling_name(name: str) -> tuple[str, str, int, int]:
    """'nccl:send 0->1' -> ('nccl', 'send', src 0, dst 1). Peers are group-local."""
    backend, _, rest = name.partition(":") if ":" in name else ("", "", name)
    rest = rest.strip()
    m = _P2P_RE.match(rest)
    if m:
        op, a, arrow, b = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
        return (backend, op, a, b) if arrow == "->" else (backend, op, b, a)
    op = rest.split(" ", 1)[0] if rest else ""
    return backend, op, -1, -1


def _parse_ranks(v: Any) -> list[int] | None:
    if isinstance(v, str):
        got = _parse_ranks_text(v)
        return list(got) if got is not None else None
    if isinstance(v, list | tuple):
        return _rank_list(v)
    return None


@functools.lru_cache(maxsize=256)
def _parse_ranks_text(v: str) -> tuple[int, ...] | None:
    # Every rank of a 4,096-rank job carries the same 24 KB world member list:
    # parse each distinct text once per process, not once per rank.
    try:
        out = json.loads(v)
    except (ValueError, RecursionError):
        return None
    got = _rank_list(out)
    return tuple(got) if got is not None else None


def _rank_list(out: Any) -> list[int] | None:
    if not isinstance(out, list) or not out:
        return None
    try:
        return sorted({_as_int(r, "rank") for r in out})
    except DumpFormatError:
        return None


def _pg_config(raw: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(raw, dict):
        return out
    for key, cfg in raw.items():
        if not isinstance(cfg, dict):
            continue
        name = str(cfg.get("name", key))
        if key == "" or name == "":
            continue  # gloo's placeholder entry: carries no group identity
        out[name] = {
            "name": name,
            "desc": str(cfg.get("desc", "") or ""),
            "ranks": _parse_ranks(cfg.get("ranks")),
        }
    return out


def _pg_status(raw: Any) -> dict[str, tuple[int, int, int]]:
    out: dict[str, tuple[int, int, int]] = {}
    if raw is None:
        return out
    if not isinstance(raw, dict):
        raise DumpFormatError(f"pg_status has type {type(raw).__name__}, expected a mapping")
    for key, st in raw.items():
        if not isinstance(st, dict):
            raise DumpFormatError(f"pg_status[{key!r}] is not a mapping")
        pid = str(_as_int(key, "pg_status key"))
        out[pid] = (
            _opt_int(st.get("last_enqueued_collective"), -1, "last_enqueued_collective"),
            _opt_int(st.get("last_started_collective"), -1, "last_started_collective"),
            _opt_int(st.get("last_completed_collective"), -1, "last_completed_collective"),
        )
    return out


def _frames(v: Any) -> tuple[tuple[str, str, int], ...]:
    if not isinstance(v, list):
        return ()
    out = []
    for fr in v[:64]:
        if isinstance(fr, dict):
            line = fr.get("line", 0)
            out.append(
                (
                    str(fr.get("name", "")),
                    str(fr.get("filename", "")),
                    line if isinstance(line, int) and not isinstance(line, bool) else 0,
                )
            )
    return tuple(out)


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
_VALUE_KEYS = (
    "record_id",
    "pg_id",
    "collective_seq_id",
    "p2p_seq_id",
    "op_id",
    "time_created_ns",
    "input_sizes",
    "input_dtypes",
    "output_sizes",
    "output_dtypes",
    "time_discovered_started_ns",
    "time_discovered_completed_ns",
    "timeout_ms",
)
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


def _intern(values: Sequence[Any]) -> tuple[np.ndarray, list[Any]]:
    """Codes (order of first appearance) and the distinct values; values must be hashable."""
    idx = {v: i for i, v in enumerate(dict.fromkeys(values))}
    codes = np.fromiter(map(idx.__getitem__, values), dtype=np.int32, count=len(values))
    return codes, list(idx)


def _first_of_each(codes: np.ndarray) -> np.ndarray:
    """Row of each code's first appearance, for codes numbered in that order."""
    if not len(codes):
        return np.zeros(0, dtype=np.int64)
    hi = np.maximum.accumulate(codes)
    new = np.ones(len(codes), dtype=bool)
    new[1:] = hi[1:] > hi[:-1]
    return np.flatnonzero(new)


def _coded(
    values: Sequence[Any],
    norm: Callable[[Any], str],
    *,
    types: frozenset[type],
    keys: Callable[[Sequence[Any]], Sequence[Any]] | None = None,
    exact: Callable[[Any], bool] | None = None,
) -> Coded:
    """Encode norm(v) for every value as (codes, distinct strings, first row of each).

    When every value's type is in `types`, values are grouped by a hashable
    key per value (`keys(values)`, built by C-level calls; None: the value
    itself) and `norm` runs once per distinct key. That is exact only where
    equal keys mean equal values of the same type: marshal bytes do (they
    decode back to the value, types included); for plain hashing, `exact`
    confirms it on each distinct value (str never equals a non-str, nor do
    tuples of str/None). Otherwise every value is normalized on its own.
    """
    if set(map(type, values)) <= types:
        try:
            raw_codes, _ = _intern(values if keys is None else keys(values))
        except (TypeError, ValueError):  # unhashable, or too deep to marshal
            raw_codes = None
        if raw_codes is not None:
            first = _first_of_each(raw_codes)
            if exact is None or all(exact(values[i]) for i in first):
                seen: dict[str, int] = {}
                remap = np.fromiter(
                    (seen.setdefault(norm(values[i]), len(seen)) for i in first),
                    dtype=np.int32,
                    count=len(first),
                )
                codes = remap[raw_codes] if len(raw_codes) else raw_codes
                return Coded(codes=codes, cats=list(seen), reps=first[_first_of_each(remap)])
    strs = [norm(v) for v in values]
    codes, cats = _intern(strs)
    return Coded(codes=codes, cats=cats, reps=_first_of_each(codes))


def _marshal_keys(values: Sequence[Any]) -> list[bytes]:
    # Format 2 writes no back-references, so equal values give equal bytes.
    return list(map(marshal.dumps, values, itertools.repeat(2)))


def _tuple_keys(values: Sequence[Any]) -> list[tuple[Any, ...]]:
    return list(map(tuple, values))


def _str_or(default: str) -> Callable[[Any], str]:
    def norm(v: Any) -> str:
        return str(v) if v is not None else default

    return norm


def _only_str_or_none(v: Any) -> bool:
    return all(x is None or type(x) is str for x in v)


def _only_str(v: Any) -> bool:
    return all(type(x) is str for x in v)


def _dtypes_norm(v: Any) -> str:
    if isinstance(v, list | tuple) and all(type(x) is str for x in v):
        return ",".join(v)
    return _dtypes_str(v)


def _fast_int_column(values: Sequence[Any], default: int, what: str) -> np.ndarray:
    try:
        a = np.array(values)
    except (ValueError, TypeError, OverflowError):
        a = None
    if a is not None and a.ndim == 1 and a.dtype.kind == "i" and len(a):
        return a.astype(np.int64, copy=False)
    if a is not None and a.dtype == object and set(map(type, values)) == {int, type(None)}:
        # pickle's None timestamps among ints
        a[a == None] = default  # noqa: E711 (elementwise comparison)
        try:
            return a.astype(np.int64)
        except OverflowError:
            raise DumpFormatError(f"{what} does not fit in 64 bits") from None
    return _int_column(list(values), default, what)


def _float_or_nan(v: Any) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:
            return math.nan
    return math.nan


def _durations(entries: list[dict[str, Any]]) -> np.ndarray:
    vals = [e.get("duration_ms") for e in entries]
    if set(map(type, vals)) <= {float, int, type(None)}:
        try:
            return np.array(vals, dtype=np.float64)
        except OverflowError:
            pass
    return np.array([_float_or_nan(v) for v in vals], dtype=np.float64)


def _groups(pgs: Sequence[Any], pg_ids: Sequence[Any]) -> tuple[Coded, Coded]:
    """Group name and desc per entry from process_group = (name, desc)."""
    types = set(map(type, pgs))
    keys: Sequence[Any] | None = None
    if types == {tuple}:
        keys = pgs
    elif types == {list}:
        keys = list(map(tuple, pgs))
    if keys is not None:
        pg = _coded(keys, repr, types=frozenset({tuple}), exact=_only_str_or_none)
        if all(len(k) >= 1 for k in (keys[i] for i in pg.reps)):
            # `exact` here too: the distinct reprs may still hash equal
            # ((0, False) == (0, 0)), and then str() of each differs.
            g = _coded(
                [keys[i] for i in pg.reps],
                lambda k: str(k[0]),
                types=frozenset({tuple}),
                exact=_only_str_or_none,
            )
            d = _coded(
                [keys[i] for i in pg.reps],
                lambda k: str(k[1]) if len(k) > 1 and k[1] is not None else "",
                types=frozenset({tuple}),
                exact=_only_str_or_none,
            )
            return g.compose(pg), d.compose(pg)
    groups: list[str] = []
    descs: list[str] = []
    for i, p in enumerate(pgs):
        if isinstance(p, list | tuple) and len(p) >= 1:
            groups.append(str(p[0]))
            descs.append(str(p[1]) if len(p) > 1 and p[1] is not None else "")
        elif p is None and pg_ids[i] is not None:
            groups.append(str(_as_int(pg_ids[i], f"entry {i} pg_id")))
            descs.append("")
        else:
            raise DumpFormatError(f"entry {i} has no usable process_group")
    return _coded(groups, str, types=frozenset({str})), _coded(descs, str, types=frozenset({str}))


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
    backend: str


def _from_names(name_c: Coded) -> tuple[Coded, np.ndarray, np.ndarray, str]:
    """op, peers and the dominant backend, parsed once per distinct profiling name."""
    splits = [split_profiling_name(nm) for nm in name_c.cats]
    op_c = _coded([sp[1] for sp in splits], str, types=frozenset({str})).compose(name_c)
    src = np.array([sp[2] for sp in splits], dtype=np.int64)[name_c.codes]
    dst = np.array([sp[3] for sp in splits], dtype=np.int64)[name_c.codes]
    per_name = np.bincount(name_c.codes, minlength=len(splits))
    backends: dict[str, int] = {}
    for sp, cnt in zip(splits, per_name, strict=True):
        backends[sp[0]] = backends.get(sp[0], 0) + int(cnt)
    backend = max(backends, key=lambda k: backends[k]) if backends else ""
    return op_c, src, dst, backend


def _is_str_or_none(v: Any) -> bool:
    return v is None or type(v) is str


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
        codes, uniq = _intern(list(map(_META_GET, entries)))
    except (KeyError, TypeError):
        return None
    for pg, name, state, tname, tid, p2p, ret in uniq:
        if not (
            type(pg) is tuple
            and len(pg) >= 1
            and _only_str_or_none(pg)
            and type(name) is str
            and _is_str_or_none(state)
            and _is_str_or_none(tname)
            and _is_str_or_none(tid)
            and type(p2p) is bool
            and type(ret) is bool
        ):
            return None
    rows = Coded(codes=codes, cats=[], reps=_first_of_each(codes))

    def per_tuple(i: int, norm: Callable[[Any], str]) -> Coded:
        return _coded(
            [u[i] for u in uniq], norm, types=frozenset({str, tuple, type(None)})
        ).compose(rows)

    name_c = per_tuple(1, str)
    op_c, src, dst, backend = _from_names(name_c)
    return _Meta(
        group=per_tuple(0, lambda pg: str(pg[0])),
        group_desc=per_tuple(0, lambda pg: str(pg[1]) if len(pg) > 1 and pg[1] is not None else ""),
        name=name_c,
        op=op_c,
        state=per_tuple(2, _str_or("scheduled")),
        thread_name=per_tuple(3, _str_or("")),
        thread_id=per_tuple(4, _str_or("")),
        peer_src=src,
        peer_dst=dst,
        is_p2p=np.array([u[5] for u in uniq], dtype=bool)[codes],
        retired=np.array([u[6] for u in uniq], dtype=bool)[codes],
        backend=backend,
    )


def _meta_per_column(col: dict[str, Sequence[Any]], pg_ids: Sequence[Any]) -> _Meta:
    group, group_desc = _groups(col["process_group"], pg_ids)
    names = col["profiling_name"]
    if not set(map(type, names)) <= {str}:
        for i, nm in enumerate(names):
            if not isinstance(nm, str):
                raise DumpFormatError(f"entry {i} profiling_name is not a string")
    name_c = _coded(names, str, types=frozenset({str}))
    op_c, src, dst, backend = _from_names(name_c)
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
        state=_coded(col["state"], _str_or("scheduled"), types=str_t),
        thread_name=_coded(col["thread_name"], _str_or(""), types=str_t),
        thread_id=_coded(col["thread_id"], _str_or(""), types=str_t),
        peer_src=src,
        peer_dst=dst,
        is_p2p=is_p2p,
        retired=retired,
        backend=backend,
    )


def decode_dump(raw: Any, *, max_entries: int = MAX_ENTRIES_PER_FILE) -> ParsedDump:
    """Validate a decoded dump object and build its columns.

    Work per entry is done by C-level calls (one itemgetter, zip, map, numpy)
    wherever the values have the shapes torch writes; Python-level
    normalization then runs once per *distinct* value (a few dozen per file),
    and odd shapes fall back to per-value normalization with the same result.
    """
    if not isinstance(raw, dict):
        raise DumpFormatError(f"top level is {type(raw).__name__}, expected a mapping")
    if "version" not in raw:
        raise DumpFormatError("no 'version' key: not a flight-recorder dump")
    if "entries" not in raw and "pg_status" not in raw:
        raise DumpFormatError("neither 'entries' nor 'pg_status': not a flight-recorder dump")
    version = str(raw.get("version"))
    comm = raw.get("comm_lib_version", raw.get("nccl_version", ""))
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
    n = len(entries)
    raw_cols = _raw_columns(entries, _VALUE_KEYS)
    col = raw_cols.__getitem__
    meta = _meta_by_distinct_tuple(entries)
    if meta is None:
        meta = _meta_per_column(_raw_columns(entries, _META_KEYS), col("pg_id"))
    group, group_desc, name_c, op_c = meta.group, meta.group_desc, meta.name, meta.op
    state, retired, is_p2p = meta.state, meta.retired, meta.is_p2p

    coll_seq = col("collective_seq_id")
    if None in coll_seq:
        raise DumpFormatError("an entry has no collective_seq_id")

    # Sizes are compared across ranks by their exact text and checked by
    # element count; both are computed once per distinct shape list.
    list_t = frozenset({list})
    in_s = _coded(col("input_sizes"), _sizes_str, types=list_t, keys=_marshal_keys)
    out_s = _coded(col("output_sizes"), _sizes_str, types=list_t, keys=_marshal_keys)
    in_raw, out_raw = col("input_sizes"), col("output_sizes")
    in_n = np.array([_numel(in_raw[i]) for i in in_s.reps], dtype=np.int64)[in_s.codes]
    out_n = np.array([_numel(out_raw[i]) for i in out_s.reps], dtype=np.int64)[out_s.codes]

    columns: dict[str, Any] = {
        "record_id": _fast_int_column(col("record_id"), -1, "record_id"),
        "pg_id": _fast_int_column(col("pg_id"), -1, "pg_id"),
        "collective_seq_id": _fast_int_column(coll_seq, -1, "collective_seq_id"),
        "p2p_seq_id": _fast_int_column(col("p2p_seq_id"), 0, "p2p_seq_id"),
        "op_id": _fast_int_column(col("op_id"), -1, "op_id"),
        "time_created_ns": _fast_int_column(col("time_created_ns"), 0, "time_created_ns"),
        "time_discovered_started_ns": _fast_int_column(
            col("time_discovered_started_ns"), 0, "time_discovered_started_ns"
        ),
        "time_discovered_completed_ns": _fast_int_column(
            col("time_discovered_completed_ns"), 0, "time_discovered_completed_ns"
        ),
        "timeout_ms": _fast_int_column(col("timeout_ms"), 0, "timeout_ms"),
        "peer_src": meta.peer_src,
        "peer_dst": meta.peer_dst,
        "in_numel": in_n,
        "out_numel": out_n,
        "group": group,
        "group_desc": group_desc,
        "profiling_name": name_c,
        "op": op_c,
        "state": state,
        "thread_name": meta.thread_name,
        "thread_id": meta.thread_id,
        "input_sizes": in_s,
        "output_sizes": out_s,
        "input_dtypes": _coded(
            col("input_dtypes"), _dtypes_norm, types=list_t, keys=_tuple_keys, exact=_only_str
        ),
        "output_dtypes": _coded(
            col("output_dtypes"), _dtypes_norm, types=list_t, keys=_tuple_keys, exact=_only_str
        ),
        "retired": retired,
        "is_p2p": is_p2p,
        "duration_ms": _durations(entries),
    }

    # Frames: only for entries still in flight and each group's newest entry,
    # newest first, capped: that is what evidence can point at.
    frames: dict[int, tuple[tuple[str, str, int], ...]] = {}
    if n:
        rec = columns["record_id"]
        # A hooked recorder's `retired` is not completion (recorder_semantics).
        done = retired.copy() if meta.backend in SELF_RECORDING_BACKENDS else np.zeros(n, bool)
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
                frames[int(rec[i])] = _frames(fr)

    pg_status = _pg_status(raw.get("pg_status"))
    hooked, completion_known = recorder_semantics(
        meta.backend, state, columns["time_discovered_completed_ns"], pg_status
    )
    if hooked:
        # Not completion there (see recorder_semantics); and the hook's
        # pg_status counts op_id from 0 where gloo and NCCL count from 1.
        columns["retired"] = np.zeros(n, dtype=bool)
        pg_status = {k: tuple(v + 1 if v >= 0 else v for v in t) for k, t in pg_status.items()}  # type: ignore[misc]
    return ParsedDump(
        version=version,
        comm_lib_version=str(comm or ""),
        backend=meta.backend,
        pg_config=_pg_config(raw.get("pg_config")),
        pg_status=pg_status,
        columns=columns,
        n_entries=n,
        frames=frames,
        tail=is_tail(raw),
        hooked=hooked,
        completion_known=completion_known,
    )


def parse_dump_bytes(data: bytes) -> dict[str, Any]:
    """Sniff pickle vs JSON, validate the shape and normalize one dump.

    Returns {"version", "comm_lib_version", "backend", "pg_config",
    "pg_status": {pg_id: {"last_enqueued", "last_started", "last_completed"}},
    "entries": [normalized entry dicts with the loader's column names]}.
    Raises DumpFormatError (a ValueError) with a one-line reason.
    """
    parsed = decode_dump(sniff_and_decode(data))
    cols = parsed.columns
    as_lists = {
        k: (v.strings() if isinstance(v, Coded) else list(np.asarray(v))) for k, v in cols.items()
    }
    entries = []
    for i in range(parsed.n_entries):
        e: dict[str, Any] = {}
        for k in ENTRY_COLUMNS:
            v = as_lists[k][i]
            if isinstance(v, np.generic):
                v = v.item()
            e[k] = v
        if e["record_id"] in parsed.frames:
            e["frames"] = [
                {"name": a, "filename": b, "line": c} for a, b, c in parsed.frames[e["record_id"]]
            ]
        entries.append(e)
    return {
        "version": parsed.version,
        "comm_lib_version": parsed.comm_lib_version,
        "backend": parsed.backend,
        "pg_config": parsed.pg_config,
        "pg_status": {
            k: {"last_enqueued": a, "last_started": b, "last_completed": c}
            for k, (a, b, c) in parsed.pg_status.items()
        },
        "entries": entries,
    }
