"""Decode one flight-recorder dump (pickle or JSON, FR format 2.0 .. 2.10+) into columns.

torch writes the same logical record in several shapes: pickle with ints and
`None` timestamps, JSON with string `pg_status` values, string seq ids and `0`
timestamps; older versions lack `is_p2p`, `retired`, `thread_*`, `p2p_seq_id`
and name the library version `nccl_version` instead of `comm_lib_version`.
Everything is normalized here, once, into per-field column arrays, so that
diagnosis works on one shape only.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from hangwatch.analyzer.safepickle import UnsafePickleError, safe_loads

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


@dataclass(kw_only=True)
class ParsedDump:
    """One file, normalized. Columns are numpy arrays or pandas Categoricals."""

    version: str
    comm_lib_version: str
    backend: str  # "nccl", "gloo", ... from the profiling names; "" when no entries
    pg_config: dict[str, dict[str, Any]]  # name -> {"name", "desc", "ranks": list[int] | None}
    # local pg_id (as str) -> (last_enqueued, last_started, last_completed); -1 = unknown
    pg_status: dict[str, tuple[int, int, int]]
    columns: dict[str, Any]
    n_entries: int
    frames: dict[int, tuple[tuple[str, str, int], ...]] = field(default_factory=dict)


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


def _dtypes_col(values: list[Any]) -> list[str]:
    try:
        return [",".join(v) for v in values]  # the common case: lists of dtype names
    except TypeError:
        return [_dtypes_str(v) for v in values]


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
    if isinstance(v, list | tuple):
        out = v
    elif isinstance(v, str):
        try:
            out = json.loads(v)
        except ValueError:
            return None
    else:
        return None
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


def decode_dump(raw: Any, *, max_entries: int = MAX_ENTRIES_PER_FILE) -> ParsedDump:
    """Validate a decoded dump object and build its columns."""
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
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise DumpFormatError(f"entry {i} has type {type(e).__name__}, expected a mapping")
    n = len(entries)

    def col(key: str, default: Any = None) -> list[Any]:
        return [e.get(key, default) for e in entries]

    # Group identity: process_group = (name, desc); very old dumps only carry pg_id.
    pgs = col("process_group")
    groups: list[str] = []
    descs: list[str] = []
    pg_ids_raw = col("pg_id")
    for i, pg in enumerate(pgs):
        if isinstance(pg, list | tuple) and len(pg) >= 1:
            groups.append(str(pg[0]))
            descs.append(str(pg[1]) if len(pg) > 1 and pg[1] is not None else "")
        elif pg is None and pg_ids_raw[i] is not None:
            groups.append(str(_as_int(pg_ids_raw[i], f"entry {i} pg_id")))
            descs.append("")
        else:
            raise DumpFormatError(f"entry {i} has no usable process_group")

    names = col("profiling_name", "")
    split_cache: dict[str, tuple[str, str, int, int]] = {}
    ops: list[str] = []
    src: list[int] = []
    dst: list[int] = []
    backends: dict[str, int] = {}
    for i, nm in enumerate(names):
        if not isinstance(nm, str):
            raise DumpFormatError(f"entry {i} profiling_name is not a string")
        sp = split_cache.get(nm)
        if sp is None:
            sp = split_cache[nm] = split_profiling_name(nm)
        ops.append(sp[1])
        src.append(sp[2])
        dst.append(sp[3])
        backends[sp[0]] = backends.get(sp[0], 0) + 1
    backend = max(backends, key=lambda k: backends[k]) if backends else ""

    coll_seq = [
        e.get("collective_seq_id", e.get("seq_id")) for e in entries
    ]  # v1.x called it seq_id
    if any(v is None for v in coll_seq):
        raise DumpFormatError("an entry has no collective_seq_id")

    is_p2p_raw = col("is_p2p")
    is_p2p = np.array(
        [
            bool(v) if v is not None else (op in P2P_OPS)
            for v, op in zip(is_p2p_raw, ops, strict=True)
        ],
        dtype=bool,
    )
    retired = np.array([bool(v) for v in col("retired", False)], dtype=bool)

    in_sizes_raw = col("input_sizes")
    out_sizes_raw = col("output_sizes")
    numel_cache: dict[str, int] = {}

    def sizes(raw_list: list[Any]) -> tuple[list[str], np.ndarray]:
        # str() of the list as torch stored it is one C call; numel is
        # computed once per distinct shape string.
        strs = [str(v) if v is not None else "[]" for v in raw_list]
        for st, v in zip(strs, raw_list, strict=True):
            if st not in numel_cache:
                numel_cache[st] = _numel(v)
        nums = np.fromiter((numel_cache[st] for st in strs), dtype=np.int64, count=len(strs))
        return strs, nums

    in_s, in_n = sizes(in_sizes_raw)
    out_s, out_n = sizes(out_sizes_raw)

    states = [str(v) if v is not None else "scheduled" for v in col("state", "scheduled")]
    durations = np.array(
        [
            float(v) if isinstance(v, int | float) and not isinstance(v, bool) else np.nan
            for v in col("duration_ms")
        ],
        dtype=np.float64,
    )

    columns: dict[str, Any] = {
        "record_id": _int_column(col("record_id"), -1, "record_id"),
        "pg_id": _int_column(pg_ids_raw, -1, "pg_id"),
        "collective_seq_id": _int_column(coll_seq, -1, "collective_seq_id"),
        "p2p_seq_id": _int_column(col("p2p_seq_id", 0), 0, "p2p_seq_id"),
        "op_id": _int_column(col("op_id"), -1, "op_id"),
        "time_created_ns": _int_column(col("time_created_ns"), 0, "time_created_ns"),
        "time_discovered_started_ns": _int_column(
            col("time_discovered_started_ns"), 0, "time_discovered_started_ns"
        ),
        "time_discovered_completed_ns": _int_column(
            col("time_discovered_completed_ns"), 0, "time_discovered_completed_ns"
        ),
        "timeout_ms": _int_column(col("timeout_ms"), 0, "timeout_ms"),
        "peer_src": np.array(src, dtype=np.int64),
        "peer_dst": np.array(dst, dtype=np.int64),
        "in_numel": in_n,
        "out_numel": out_n,
        "group": pd.Categorical(groups),
        "group_desc": pd.Categorical(descs),
        "profiling_name": pd.Categorical(names),
        "op": pd.Categorical(ops),
        "state": pd.Categorical(states),
        "thread_name": pd.Categorical(
            [str(v) if v is not None else "" for v in col("thread_name")]
        ),
        "thread_id": pd.Categorical([str(v) if v is not None else "" for v in col("thread_id")]),
        "input_sizes": pd.Categorical(in_s),
        "output_sizes": pd.Categorical(out_s),
        "input_dtypes": pd.Categorical(_dtypes_col(col("input_dtypes"))),
        "output_dtypes": pd.Categorical(_dtypes_col(col("output_dtypes"))),
        "retired": retired,
        "is_p2p": is_p2p,
        "duration_ms": durations,
    }

    # Frames: only for entries still in flight and each group's newest entry,
    # newest first, capped: that is what evidence can point at.
    frames: dict[int, tuple[tuple[str, str, int], ...]] = {}
    if n:
        rec = columns["record_id"]
        seen_pg: set[str] = set()
        for i in range(n - 1, -1, -1):
            if len(frames) >= MAX_FRAMED_ENTRIES_PER_FILE:
                break
            done = retired[i] or states[i] == "completed"
            newest_of_group = groups[i] not in seen_pg
            seen_pg.add(groups[i])
            if (not done or newest_of_group) and entries[i].get("frames"):
                frames[int(rec[i])] = _frames(entries[i]["frames"])

    return ParsedDump(
        version=version,
        comm_lib_version=str(comm or ""),
        backend=backend,
        pg_config=_pg_config(raw.get("pg_config")),
        pg_status=_pg_status(raw.get("pg_status")),
        columns=columns,
        n_entries=n,
        frames=frames,
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
        k: (list(np.asarray(v)) if not isinstance(v, pd.Categorical) else list(v.astype(object)))
        for k, v in cols.items()
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
