"""Find and load every rank's flight-recorder dump under a directory (or an incident bundle).

A file is a dump candidate when its name ends in a rank number
(`nccl_trace_rank_3`, `rank_7.json`, `_dump_5`, `<prefix>host-a_3`); content,
not the extension, decides pickle vs JSON. Bundle `meta.json` files (schema
`hangwatch.rankmeta/1`) add metadata for their rank, `incident.json` says an
incident was triggered. A bad file never stops the load: it becomes one
`FileError` and the rest are analyzed.

Large directories are read by a process pool (each worker returns compact
column arrays, not Python objects per entry) and concatenated once.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import multiprocessing
import os
import re
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hangwatch.analyzer.parse import (
    BOOL_COLUMNS,
    ENTRY_COLUMNS,
    FLOAT_COLUMNS,
    INT_COLUMNS,
    MAX_ENTRIES_PER_FILE,
    STR_COLUMNS,
    Coded,
    DumpFormatError,
    ParsedDump,
    decode_dump,
    parse_dump_bytes,
    sniff_and_decode,
)
from hangwatch.analyzer.report import FileError

from hangwatch import formats

MAX_FILE_BYTES = 2 * 1024**3
MAX_META_BYTES = 16 * 1024**2
MAX_STACKS_BYTES = 4 * 1024**2
# Below this much input a process pool costs more than it saves.
PARALLEL_MIN_BYTES = 24 * 1024**2
PARALLEL_MIN_FILES = 64
# Below this mean size (FR tails are ~15 KB) shipping each parsed dump back
# from a worker costs more than decoding it: 4,096 tails load in 7.1 s in one
# process and 8.2 s with two.
PARALLEL_MIN_MEAN_BYTES = 128 * 1024

_RANK_RE = re.compile(r"^(?P<stem>.*?)(?P<rank>\d+)(?:\.(?:json|pkl|pickle|bin|dump))?$")
_SKIP_NAMES = frozenset({formats.META_FILE, formats.INCIDENT_FILE, formats.STACKS_FILE})

__all__ = [
    "DumpFormatError",
    "GroupMeta",
    "LoadedDumps",
    "PgStatus",
    "build_groups",
    "load_dumps",
    "parse_dump_bytes",
    "parse_ranks",
]


@dataclass(frozen=True, kw_only=True)
class PgStatus:
    last_enqueued: int
    last_started: int
    last_completed: int
    pg_id: int
    # How the local pg_id was tied to a group name: "entries", "bundle",
    # "creation-order" (see _map_pg_ids) or "default" (pg 0 is group "0").
    mapped_by: str


@dataclass(frozen=True, kw_only=True)
class GroupMeta:
    name: str
    desc: str
    ranks: list[int]
    membership_source: str  # "pg_config" | "bundle" | "dumps" | "world_size"


@dataclass(kw_only=True)
class LoadedDumps:
    """Everything read from a dump directory, normalized; diagnosis reads only this."""

    root: str
    # One row per FR entry of every rank; columns are parse.ENTRY_COLUMNS + "rank".
    # Missing timestamps are 0; peer_src/peer_dst are group-local (-1 for collectives).
    entries: pd.DataFrame
    pg_status: dict[int, dict[str, PgStatus]]  # rank -> group name -> status
    groups: dict[str, GroupMeta]
    ranks_loaded: list[int]
    errors: list[FileError]
    rank_meta: dict[int, dict[str, Any]]  # bundle meta.json per rank (+ "stacks" text)
    frames: dict[tuple[int, int], tuple[tuple[str, str, int], ...]]  # (rank, record_id)
    versions: dict[int, str]  # rank -> FR format version
    comm_lib_versions: dict[int, str] = field(default_factory=dict)
    backends: dict[int, str] = field(default_factory=dict)  # rank -> "nccl" | "gloo" | ...
    pg_config: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    unmapped_pg_ids: dict[int, list[int]] = field(default_factory=dict)
    incident: dict[str, Any] | None = None
    files: dict[int, str] = field(default_factory=dict)  # rank -> relative path loaded
    world_size: int | None = None
    selected_ranks: set[int] | None = None  # None: every rank found was loaded
    # Ranks read from a tail (hangwatch.frtail) because no full dump of theirs
    # was there: their older history is absent by design, not lost.
    tail_ranks: list[int] = field(default_factory=list)
    # Groups recorded only by torch's FlightRecorderHook on a backend whose
    # completion is never recorded: what ranks entered is known, not what finished.
    completion_unknown_groups: set[str] = field(default_factory=set)

    @property
    def backend(self) -> str:
        vals = [b for v in self.backends.values() for b in v.split(",") if b]
        return max(set(vals), key=vals.count) if vals else ""

    def pg_status_frame(self) -> pd.DataFrame:
        rows = [
            (r, g, s.pg_id, s.last_enqueued, s.last_started, s.last_completed)
            for r, d in self.pg_status.items()
            for g, s in d.items()
        ]
        return pd.DataFrame(
            rows,
            columns=["rank", "group", "pg_id", "last_enqueued", "last_started", "last_completed"],
        ).astype(
            {
                "rank": np.int64,
                "pg_id": np.int64,
                "last_enqueued": np.int64,
                "last_started": np.int64,
                "last_completed": np.int64,
            }
        )


def parse_ranks(spec: str | Iterable[int] | None) -> set[int] | None:
    """'0,3,5-7' -> {0,3,5,6,7}; None stays None."""
    if spec is None:
        return None
    if not isinstance(spec, str):
        return {int(r) for r in spec}
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            lo, hi = int(a), int(b)
            if hi < lo:
                raise ValueError(f"bad rank range {part!r}")
            out.update(range(lo, hi + 1))
        else:
            out.add(int(part))
    return out


@dataclass(frozen=True)
class _Candidate:
    path: str
    rel: str
    rank: int
    size: int
    mtime: float


def _discover(
    root: Path, prefix: str | None
) -> tuple[list[_Candidate], list[Path], list[Path], list[FileError]]:
    dumps: list[_Candidate] = []
    metas: list[Path] = []
    incidents: list[Path] = []
    errors: list[FileError] = []
    if root.is_file():
        walk: Iterator[tuple[str, list[str], list[str]]] = iter(
            [(str(root.parent), [], [root.name])]
        )
        base = root.parent
    else:
        walk = os.walk(root, followlinks=False)
        base = root
    for dirpath, dirnames, filenames in walk:
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(base))
            if name == formats.META_FILE:
                metas.append(p)
                continue
            if name == formats.INCIDENT_FILE:
                incidents.append(p)
                continue
            if name in _SKIP_NAMES or name.startswith("."):
                continue
            if prefix is not None and not name.startswith(prefix):
                continue
            m = _RANK_RE.match(name)
            if not m:
                continue
            try:
                st = p.stat()
            except OSError as e:
                errors.append(FileError(file=rel, error=f"cannot stat: {e.strerror}"))
                continue
            if not p.is_file():
                continue
            dumps.append(_Candidate(str(p), rel, int(m.group("rank")), st.st_size, st.st_mtime))
    return dumps, metas, incidents, errors


def _read_one(
    cand: _Candidate, max_bytes: int, max_entries: int
) -> tuple[_Candidate, ParsedDump | None, str | None]:
    if cand.size > max_bytes:
        return cand, None, f"file is {cand.size} bytes, over the {max_bytes}-byte limit"
    try:
        with open(cand.path, "rb") as f:
            # read(n) allocates n bytes up front: ask for what stat saw (+1
            # to notice growth), then the rest only if the file did grow.
            data = f.read(cand.size + 1)
            if len(data) > cand.size:
                data += f.read(max_bytes + 1 - len(data))
    except OSError as e:
        return cand, None, f"cannot read: {e.strerror or e}"
    if len(data) > max_bytes:
        return cand, None, f"file grew past the {max_bytes}-byte limit"
    try:
        return cand, decode_dump(sniff_and_decode(data), max_entries=max_entries), None
    except DumpFormatError as e:
        return cand, None, _one_line(str(e))
    except RecursionError:
        return cand, None, "structure nests too deeply"
    except MemoryError:
        return cand, None, "not enough memory to decode"


def _read_chunk(
    cands: list[_Candidate], max_bytes: int, max_entries: int
) -> list[tuple[_Candidate, ParsedDump | None, str | None]]:
    with _gc_paused():
        return [_read_one(c, max_bytes, max_entries) for c in cands]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Unpickling builds millions of containers, and each generation-0
    threshold crossing makes the collector walk the young ones: 3-4x the
    unpickling time. A dump holds no reference cycles (pickle and JSON build
    trees), so reference counting frees everything; torch's own reader does
    the same."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _one_line(s: str) -> str:
    s = s.strip().splitlines()[0] if s.strip() else "unknown error"
    return s[:300]


def _pool_context() -> Any:
    # fork shares the already-imported pandas/numpy for free; elsewhere spawn.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context(
        "fork" if "fork" in methods and sys.platform == "linux" else "spawn"
    )


def _progress_bar(enabled: bool, total: int) -> Any:
    if not enabled or not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    prog = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
    )
    prog.start()
    prog.add_task("loading dumps", total=total)
    return prog


def _read_all(
    cands: list[_Candidate],
    *,
    workers: int | None,
    progress: bool,
    max_bytes: int,
    max_entries: int,
) -> list[tuple[_Candidate, ParsedDump | None, str | None]]:
    total_bytes = sum(c.size for c in cands)
    n_workers = workers if workers is not None else min(os.cpu_count() or 1, 8)
    parallel = n_workers > 1 and (
        (workers is not None and len(cands) > 1)
        or (
            total_bytes >= PARALLEL_MIN_BYTES
            and len(cands) >= PARALLEL_MIN_FILES
            and total_bytes >= PARALLEL_MIN_MEAN_BYTES * len(cands)
        )
    )
    bar = _progress_bar(progress, len(cands))
    out: list[tuple[_Candidate, ParsedDump | None, str | None]] = []
    try:
        if not parallel:
            with _gc_paused():
                for c in cands:
                    out.append(_read_one(c, max_bytes, max_entries))
                    if bar is not None:
                        bar.advance(0)
            return out
        # Chunks amortize the per-task cost; several per worker keep both busy.
        n_chunks = max(n_workers * 4, 1)
        chunk = max(1, (len(cands) + n_chunks - 1) // n_chunks)
        chunks = [cands[i : i + chunk] for i in range(0, len(cands), chunk)]
        with ProcessPoolExecutor(max_workers=n_workers, mp_context=_pool_context()) as ex:
            for res in ex.map(
                _read_chunk, chunks, [max_bytes] * len(chunks), [max_entries] * len(chunks)
            ):
                out.extend(res)
                if bar is not None:
                    bar.advance(0, len(res))
        return out
    finally:
        if bar is not None:
            bar.stop()


def _concat_columns(parts: list[tuple[int, ParsedDump]]) -> pd.DataFrame:
    """One frame for all ranks; string columns become one Categorical each.
    Consumes the parts' columns.

    Each file's distinct strings are merged into one table per column (a few
    dozen per file), so the per-row work is one integer take per column.
    Categories keep the order union_categoricals gave per-file sorted ones.
    """
    parts = [(r, p) for r, p in parts if p.n_entries]
    data: dict[str, Any] = {}
    if not parts:
        empty: dict[str, Any] = {k: np.array([], dtype=np.int64) for k in INT_COLUMNS}
        empty.update({k: pd.Categorical([]) for k in STR_COLUMNS})
        empty.update({k: np.array([], dtype=bool) for k in BOOL_COLUMNS})
        empty.update({k: np.array([], dtype=np.float64) for k in FLOAT_COLUMNS})
        empty["rank"] = np.array([], dtype=np.int64)
        return pd.DataFrame(empty)[["rank", *ENTRY_COLUMNS]]
    data["rank"] = np.concatenate([np.full(p.n_entries, r, dtype=np.int64) for r, p in parts])
    # Column by column, dropping each file's copy once merged (the parts are
    # spent): peak memory is the merged frame plus one column, not twice all.
    for k in ENTRY_COLUMNS:
        if k not in STR_COLUMNS:
            data[k] = np.concatenate([p.columns.pop(k) for _, p in parts])
            continue
        table: dict[str, int] = {}
        coded = []
        for _, p in parts:
            c: Coded = p.columns.pop(k)
            for s in sorted(c.cats):
                table.setdefault(s, len(table))
            remap = np.array([table[s] for s in c.cats], dtype=np.int32)
            coded.append(remap[c.codes])
        data[k] = pd.Categorical.from_codes(np.concatenate(coded), categories=pd.Index(list(table)))
    return pd.DataFrame(data, copy=False)


# Record ids restart in every recorder instance; a rank's k-th instance is
# shifted by k strides (far above any ring buffer's ids) to stay unique.
RECORD_ID_STRIDE = 1 << 40


def _shift_record_ids(p: ParsedDump, by: int) -> None:
    p.columns["record_id"] = p.columns["record_id"] + by
    p.frames = {rec + by: fr for rec, fr in p.frames.items()}


def _read_json_file(p: Path, limit: int) -> Any:
    if p.stat().st_size > limit:
        raise ValueError(f"over the {limit}-byte limit")
    with open(p, "rb") as f:
        return json.loads(f.read())


def _map_pg_ids(
    rank: int,
    parsed: ParsedDump,
    entry_map: dict[int, str],
    meta: dict[str, Any] | None,
    digit_names: set[str],
    *,
    instance: str = "",
) -> tuple[dict[str, PgStatus], list[int]]:
    """Tie each local pg_id in pg_status to a group name.

    Evidence, strongest first: the rank's own entries (pg_id next to
    process_group), the agent's bundle metadata, then creation order. Every
    rank calls new_group for every group, so default group names ("0", "1",
    ...) are a global creation counter, while a rank's local pg_ids count only
    the groups it is a member of: the map is order-preserving. Between two
    known (pg_id, name) anchors, unmapped pg_ids are assigned only when
    exactly as many candidate names fall in between: first the rank's own
    pg_config names (NCCL lists the groups it belongs to), then every group
    name any dump mentions (gloo's pg_config is empty).
    """
    mapping: dict[int, tuple[str, str]] = {pid: (g, "entries") for pid, g in entry_map.items()}
    recs = (meta or {}).get("recorders")
    rec = (
        next(
            (x for x in recs if isinstance(x, dict) and x.get("instance") == instance),
            None,
        )
        if isinstance(recs, list) and instance
        else None
    )
    if rec is not None and isinstance(rec.get("groups"), list):
        # The agent recorded this instance's own numbering: pg_id == index.
        for pid, name in enumerate(rec["groups"]):
            mapping.setdefault(pid, (str(name), "bundle"))
    elif meta and (not instance or instance == formats.GENERIC_INSTANCE or not recs):
        for g in meta.get("groups") or []:
            if isinstance(g, dict) and g.get("pg_id") is not None and g.get("name") is not None:
                try:
                    pid = int(g["pg_id"])
                except (TypeError, ValueError):
                    continue
                mapping.setdefault(pid, (str(g["name"]), "bundle"))
    ids = sorted(int(k) for k in parsed.pg_status)
    if 0 in ids and 0 not in mapping and "0" not in {g for g, _ in mapping.values()}:
        mapping[0] = ("0", "default")  # the default group is always local pg 0, named "0"
    own = {n for n in parsed.pg_config if n.isdigit()}
    for names in (own, digit_names):
        if any(pid not in mapping for pid in ids) and names:
            _order_fill(ids, mapping, names)
    out: dict[str, PgStatus] = {}
    unmapped: list[int] = []
    for pid in ids:
        enq, started, comp = parsed.pg_status[str(pid)]
        if pid not in mapping:
            unmapped.append(pid)
            continue
        g, how = mapping[pid]
        out[g] = PgStatus(
            last_enqueued=enq, last_started=started, last_completed=comp, pg_id=pid, mapped_by=how
        )
    return out, unmapped


def _order_fill(ids: list[int], mapping: dict[int, tuple[str, str]], names: set[str]) -> None:
    anchors = sorted((pid, int(g)) for pid, (g, _) in mapping.items() if g.isdigit())
    if any(b[1] <= a[1] for a, b in itertools.pairwise(anchors)):
        return  # names not in creation order: the assumption does not hold here
    used = {int(g) for g, _ in mapping.values() if g.isdigit()}
    cand = sorted(int(n) for n in names if int(n) not in used)
    bounds = [(-1, -1), *anchors, (1 << 62, 1 << 62)]
    for (p_lo, n_lo), (p_hi, n_hi) in itertools.pairwise(bounds):
        todo = [pid for pid in ids if p_lo < pid < p_hi and pid not in mapping]
        fit = [n for n in cand if n_lo < n < n_hi]
        if todo and len(todo) == len(fit):
            for pid, n in zip(todo, fit, strict=True):
                mapping[pid] = (str(n), "creation-order")


def build_groups(
    *,
    entries: pd.DataFrame,
    pg_status: dict[int, dict[str, PgStatus]],
    pg_config: dict[int, dict[str, dict[str, Any]]],
    rank_meta: dict[int, dict[str, Any]],
    world_size: int | None,
) -> dict[str, GroupMeta]:
    """Group membership by name: pg_config, else bundle metadata, else the
    dumps that mention the group, else (default group only) --world-size."""
    desc: dict[str, str] = {}
    from_cfg: dict[str, list[int]] = {}
    for cfg in pg_config.values():
        for name, c in cfg.items():
            if c.get("desc"):
                desc.setdefault(name, c["desc"])
            if c.get("ranks"):
                from_cfg.setdefault(name, c["ranks"])
    from_meta: dict[str, set[int]] = {}
    # The same member list arrives from every member's meta.json: fold each
    # distinct list in once (list == list runs in C; set.update per int does not).
    seen_lists: dict[str, list[Any] | dict[str, Any]] = {}
    for r, meta in rank_meta.items():
        for g in meta.get("groups") or []:
            if not isinstance(g, dict) or g.get("name") is None:
                continue
            name = str(g["name"])
            if g.get("desc"):
                desc.setdefault(name, str(g["desc"]))
            ranks = g.get("ranks")
            s = from_meta.setdefault(name, set())
            s.add(r)
            if isinstance(ranks, list | dict) and seen_lists.get(name) != ranks:
                seen_lists[name] = ranks
                s.update(formats.expand_ranks(ranks) or ())
    from_dumps: dict[str, set[int]] = {}
    if len(entries):
        pairs = entries[["group", "rank"]].drop_duplicates()
        for g, sub in pairs.groupby("group", observed=True):
            from_dumps.setdefault(str(g), set()).update(int(x) for x in sub["rank"])
        dpairs = entries[["group", "group_desc"]].drop_duplicates()
        for g, d in zip(dpairs["group"], dpairs["group_desc"], strict=True):
            if d:
                desc.setdefault(str(g), str(d))
    for r, d in pg_status.items():
        for g in d:
            from_dumps.setdefault(g, set()).add(r)
    out: dict[str, GroupMeta] = {}
    names = set(from_cfg) | set(from_meta) | set(from_dumps)
    if world_size:
        names.add("0")
    for name in sorted(names, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n)):
        if name in from_cfg:
            ranks, src = from_cfg[name], "pg_config"
        elif name in from_meta:
            ranks, src = sorted(from_meta[name]), "bundle"
        elif name == "0" and world_size:
            ranks, src = list(range(world_size)), "world_size"
        else:
            ranks, src = sorted(from_dumps.get(name, set())), "dumps"
        if name == "0" and world_size and src == "dumps":
            ranks, src = list(range(world_size)), "world_size"
        out[name] = GroupMeta(
            name=name,
            desc=desc.get(name, "default_pg" if name == "0" else ""),
            ranks=list(ranks),
            membership_source=src,
        )
    return out


def load_dumps(
    path: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    world_size: int | None = None,
    selected_ranks: Iterable[int] | str | None = None,
    progress: bool = False,
    workers: int | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_entries: int = MAX_ENTRIES_PER_FILE,
) -> LoadedDumps:
    """Load every dump under `path`. Raises FileNotFoundError only when `path`
    itself does not exist; every per-file problem lands in `errors`."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no such file or directory: {root}")
    selected = parse_ranks(selected_ranks) if selected_ranks is not None else None
    cands, meta_paths, incident_paths, errors = _discover(root, prefix)
    base = root.parent if root.is_file() else root

    rank_meta: dict[int, dict[str, Any]] = {}
    for mp in meta_paths:
        rel = str(mp.relative_to(base))
        try:
            meta = _read_json_file(mp, MAX_META_BYTES)
            if not isinstance(meta, dict) or meta.get("schema") != formats.RANKMETA:
                errors.append(
                    FileError(file=rel, error=f"meta.json without schema {formats.RANKMETA}")
                )
                continue
            r = meta.get("rank")
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                errors.append(FileError(file=rel, error="meta.json has no integer rank"))
                continue
        except (OSError, ValueError, RecursionError) as e:
            errors.append(FileError(file=rel, error=f"unreadable meta.json: {_one_line(str(e))}"))
            continue
        if selected is not None and r not in selected:
            continue
        embedded = meta.pop("stacks", None)
        if isinstance(embedded, str):  # tails-first bundles carry them in meta.json
            meta["stacks"] = embedded[:MAX_STACKS_BYTES]
        elif embedded is not None:
            errors.append(FileError(file=rel, error="meta.json 'stacks' is not text; ignored"))
        sp = mp.parent / formats.STACKS_FILE
        if sp.is_file():
            try:
                with open(sp, "rb") as f:
                    meta["stacks"] = f.read(MAX_STACKS_BYTES).decode("utf-8", "replace")
            except OSError as e:
                errors.append(
                    FileError(file=str(sp.relative_to(base)), error=f"cannot read: {e.strerror}")
                )
        meta["_dir"] = str(mp.parent.relative_to(base))
        rank_meta[r] = meta

    incident: dict[str, Any] | None = None
    for ip in incident_paths:
        try:
            doc = _read_json_file(ip, MAX_META_BYTES)
            if isinstance(doc, dict) and doc.get("schema") == formats.INCIDENT:
                incident = doc
            else:
                errors.append(
                    FileError(
                        file=str(ip.relative_to(base)),
                        error=f"incident.json without schema {formats.INCIDENT}",
                    )
                )
        except (OSError, ValueError, RecursionError) as e:
            errors.append(
                FileError(
                    file=str(ip.relative_to(base)),
                    error=f"unreadable incident.json: {_one_line(str(e))}",
                )
            )

    if selected is not None:
        cands = [c for c in cands if c.rank in selected]
    results = _read_all(
        cands, workers=workers, progress=progress, max_bytes=max_file_bytes, max_entries=max_entries
    )

    # One dump per (rank, backend): a rank of a job with NCCL and gloo groups
    # has one recorder instance of each (hangwatch.recorders), and both count.
    by_key: dict[tuple[int, str], tuple[_Candidate, ParsedDump]] = {}
    # Full dumps first: phase two of a collection brings a rank's full dump
    # next to its tail (hangwatch.frtail), and the full one holds everything
    # the tail does. Only two dumps of the same kind are a conflict.
    for cand, parsed, err in sorted(results, key=lambda x: x[1] is not None and x[1].tail):
        if parsed is None:
            errors.append(FileError(file=cand.rel, error=err or "unreadable"))
            continue
        key = (cand.rank, parsed.backend)
        prev = by_key.get(key)
        if prev is None:
            by_key[key] = (cand, parsed)
            continue
        if parsed.tail and not prev[1].tail:
            continue
        keep_new = (parsed.n_entries, cand.mtime) > (prev[1].n_entries, prev[0].mtime)
        kept, dropped = ((cand, parsed), prev) if keep_new else (prev, (cand, parsed))
        by_key[key] = kept
        errors.append(
            FileError(
                file=dropped[0].rel,
                error=f"second dump for rank {cand.rank}; kept {kept[0].rel} (more entries or newer)",
            )
        )

    ranks = sorted({r for r, _ in by_key})
    # Ordered by rank, then backend; record ids restart in every recorder
    # instance, so a rank's second instance is shifted to keep (rank, record_id) unique.
    parts: list[tuple[int, ParsedDump]] = []
    files_of: dict[int, list[str]] = {}
    for (r, _b), (cand, p) in sorted(by_key.items()):
        k = len(files_of.setdefault(r, []))
        files_of[r].append(cand.rel)
        if k:
            _shift_record_ids(p, k * RECORD_ID_STRIDE)
        parts.append((r, p))
    entry_maps: dict[tuple[int, int], dict[int, str]] = {}
    all_names: set[str] = set()
    unknown_completion: set[str] = set()
    known_completion: set[str] = set()
    for i, (r, p) in enumerate(parts):
        all_names.update(p.pg_config)
        if p.n_entries:
            pids = p.columns["pg_id"]
            grp: Coded = p.columns["group"]
            _, first = np.unique(pids, return_index=True)
            entry_maps[(r, i)] = {int(pids[j]): grp.cats[grp.codes[j]] for j in first}
            all_names.update(entry_maps[(r, i)].values())
            done = known_completion if p.completion_known else unknown_completion
            done.update(str(c) for c in grp.cats)
    entries = _concat_columns(parts)

    pg_status: dict[int, dict[str, PgStatus]] = {}
    unmapped: dict[int, list[int]] = {}
    frames: dict[tuple[int, int], tuple[tuple[str, str, int], ...]] = {}
    for meta in rank_meta.values():
        all_names.update(
            str(g["name"])
            for g in meta.get("groups") or []
            if isinstance(g, dict) and g.get("name") is not None
        )
    # Once, not per rank: 1,665 names x 4,096 ranks of isdigit() cost 2 s.
    digit_names = {n for n in all_names if n.isdigit()}
    for i, (r, p) in enumerate(parts):
        st, um = _map_pg_ids(
            r, p, entry_maps.get((r, i), {}), rank_meta.get(r), digit_names, instance=p.backend
        )
        mine = pg_status.setdefault(r, {})
        for g, v in st.items():
            mine.setdefault(g, v)  # a group in two instances: its first (GPU) one
        if um:
            unmapped.setdefault(r, []).extend(um)
        for rec, fr in p.frames.items():
            frames[(r, rec)] = fr
    pg_config: dict[int, dict[str, dict[str, Any]]] = {}
    for r, p in parts:
        for name, c in p.pg_config.items():
            pg_config.setdefault(r, {}).setdefault(name, c)
    groups = build_groups(
        entries=entries,
        pg_status=pg_status,
        pg_config=pg_config,
        rank_meta=rank_meta,
        world_size=world_size,
    )
    return LoadedDumps(
        root=str(root),
        entries=entries,
        pg_status=pg_status,
        groups=groups,
        ranks_loaded=ranks,
        errors=errors,
        rank_meta=rank_meta,
        frames=frames,
        versions={r: p.version for r, p in reversed(parts)},
        comm_lib_versions={r: p.comm_lib_version for r, p in reversed(parts)},
        backends={
            r: ",".join(sorted({q.backend for s_, q in parts if s_ == r} - {""})) for r in ranks
        },
        pg_config=pg_config,
        unmapped_pg_ids=unmapped,
        incident=incident,
        files={r: ", ".join(files_of[r]) for r in ranks},
        world_size=world_size,
        selected_ranks=selected,
        tail_ranks=sorted({r for r, p in parts if p.tail}),
        completion_unknown_groups=unknown_completion - known_completion,
    )
